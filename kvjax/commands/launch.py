"""`kvjax launch -n N -- COMMAND ...`: N local processes of one multi-process run on this machine, joined
by JAX's coordinator on the loopback (to try or test what a TPU slice or GPU cluster runs, one process
per host). Any process failing stops the others; the launcher exits with its status."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

from kvjax.errors import ConfigError

GRACE = 10  # seconds the others get to stop after one process failed, before they are killed


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def environments(n: int, port: int, devices: int | None) -> list[dict]:
    """Each process's environment: the coordinator variables (none for a single process: a plain run) and,
    for CPU runs, its device count."""
    from kvjax.training.distributed import ADDRESS, COUNT, INDEX

    envs = []
    for i in range(n):
        env = {k: v for k, v in os.environ.items() if k not in (ADDRESS, COUNT, INDEX)}
        if n > 1:
            env.update({ADDRESS: f"127.0.0.1:{port}", COUNT: str(n), INDEX: str(i)})
        if devices:
            env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}".strip()
        envs.append(env)
    return envs


def supervise(procs: list[subprocess.Popen]) -> int:
    """Wait for every process; when one fails, stop the others (SIGTERM, then SIGKILL after GRACE s) and
    return its status; a Ctrl-C here is passed on to all (they checkpoint at the same step)."""
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                i, code = failed[0]
                running = [p for p in procs if p.poll() is None]
                if running:
                    print(
                        f"kvjax launch: process {i} exited with status {code}; stopping the other {len(running)}",
                        file=sys.stderr,
                    )
                _stop(running)
                return code
            if all(c == 0 for c in codes):
                return 0
            time.sleep(0.1)
    except KeyboardInterrupt:  # a terminal's Ctrl-C reached them too; a kill -INT of the launcher did not
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        for p in procs:
            p.wait()
        return 130


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.terminate()
    deadline = time.monotonic() + GRACE
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def run(args) -> None:
    if args.n < 1:
        raise ConfigError(f"-n {args.n}: the number of processes must be >= 1")
    if args.devices is not None and args.devices < 1:
        raise ConfigError(f"--devices {args.devices} must be >= 1")
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        raise ConfigError("kvjax launch needs a kvjax command after --, e.g. kvjax launch -n 2 -- train gqa")
    port = args.port or free_port()
    procs = [
        subprocess.Popen([sys.executable, "-m", "kvjax.commands", *command], env=env)
        for env in environments(args.n, port, args.devices)
    ]
    code = supervise(procs)
    if code:
        sys.exit(code)


def register(sub) -> None:
    launch = sub.add_parser(
        "launch", help="run a kvjax command as N local processes of one multi-process run (JAX distributed)"
    )
    launch.add_argument("-n", type=int, default=2, help="processes (default 2)")
    launch.add_argument(
        "--devices", type=int, help="CPU devices per process (XLA's host device count; default: as XLA_FLAGS says)"
    )
    launch.add_argument("--port", type=int, help="the coordinator's port on 127.0.0.1 (default: a free one)")
    launch.add_argument("command", nargs="+", help="-- then the kvjax command and its arguments")
    launch.set_defaults(run=run)
