"""Several processes, one program: JAX's multi-controller runtime (one process per host of a TPU slice or
GPU cluster, or N processes on one machine to try it, `kvjax launch`).

Every process runs the same command. This module joins them (`initialize`), says which rows of each
global batch a process feeds (`local_rows`) and builds global arrays from them (`global_batch`), places
values every process holds alike (`replicated`, `from_host`), gathers a whole copy of sharded arrays into
each process (`whole_here`), agrees on a stop (`any_process`), adds up what each process computed
(`summed`), checks that the processes run the same config in one shared run
directory (`same_everywhere`, `shared_directory`), says who writes files (`is_primary`), and refuses what
runs in one process only (`refuse_several`).
Which commands run as several processes is the command line's business (`kvjax.commands.SEVERAL`).
"""

from __future__ import annotations

import hashlib
import os
import secrets
import socket
import time
from pathlib import Path

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

ADDRESS, COUNT, INDEX = "JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"
AUTO = "KVJAX_DISTRIBUTED"  # `auto`: JAX's cluster detection (SLURM, Open MPI, TPU VMs, Kubernetes)
# Seconds a process waits for the others: to join at the start, to answer (heartbeats) while running, and to
# leave at the end. A process that dies is noticed by the others (at once when it was the coordinator, after
# this long otherwise), and JAX ends them with a fatal log.
TIMEOUT = "KVJAX_DISTRIBUTED_TIMEOUT"
DEFAULT_TIMEOUT = 120


class DistributedError(RuntimeError):
    """A multi-process run that cannot start or go on; the message says which setting to change."""


def _int_env(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise DistributedError(f"{name}={value!r} must be an integer") from None


def _wait_for(address: str, timeout: float) -> None:
    """Returns once something listens at `host:port`, else DistributedError after `timeout` seconds (JAX
    itself would abort the process with a fatal log instead of raising)."""
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection((host, int(port)), timeout=2).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise DistributedError(
                    f"no coordinator answered at {ADDRESS}={address} within {timeout:g} s ({TIMEOUT}); is process 0 "
                    "running, and is the address reachable from this host?"
                ) from None
            time.sleep(0.2)


def initialize() -> bool:
    """Join the run this process belongs to, if any: from JAX_COORDINATOR_ADDRESS (with JAX_NUM_PROCESSES
    and JAX_PROCESS_ID, or the cluster's own variables where JAX detects them), or with KVJAX_DISTRIBUTED=auto
    from JAX's cluster detection alone. True when the process is part of a run of several (or joined one
    before); a no-op returning False otherwise."""
    if jax.distributed.is_initialized():
        return True
    address, auto = os.environ.get(ADDRESS), os.environ.get(AUTO)
    if auto not in (None, "", "auto"):
        raise DistributedError(f"{AUTO}={auto!r}: the only value is 'auto' (JAX's cluster detection)")
    if not address and not auto:
        return False
    count, index = _int_env(COUNT), _int_env(INDEX)
    if count is not None and count < 1:
        raise DistributedError(f"{COUNT}={count} must be >= 1")
    if count is not None and index is not None and not 0 <= index < count:
        raise DistributedError(f"{INDEX}={index} must be in 0..{count - 1} ({COUNT}={count})")
    timeout = _int_env(TIMEOUT)
    timeout = DEFAULT_TIMEOUT if timeout is None else timeout
    if timeout < 1:
        raise DistributedError(f"{TIMEOUT}={timeout} must be a number of seconds >= 1")
    if address and index not in (None, 0):
        _wait_for(address, timeout)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU devices' collectives across processes
    jax.distributed.initialize(
        address,
        count,
        index,
        initialization_timeout=timeout,
        heartbeat_timeout_seconds=timeout,
        shutdown_timeout_seconds=timeout,
    )
    return True


def is_primary() -> bool:
    """Whether this process writes the run's files and prints its logs: process 0."""
    return jax.process_index() == 0


def refuse_several(what: str) -> None:
    """DistributedError when this process is one of several: for what runs within one process only."""
    if jax.process_count() > 1:
        raise DistributedError(
            f"{what} runs in one process; this is process {jax.process_index()} of {jax.process_count()} "
            "(multi-process: kvjax train, uptrain, compare's training and eval's perplexity)"
        )


def local_rows(sharding: NamedSharding, rows: int) -> slice:
    """The rows of a global batch of `rows` (sharded on its first axis by `sharding`) that this process's
    devices hold: one contiguous block when the batch axes run over processes in order, as `make_mesh`'s do."""
    spans = sorted(
        {
            (s[0].start or 0, rows if s[0].stop is None else s[0].stop)
            for s in sharding.addressable_devices_indices_map((rows,)).values()
        }
    )
    if any(a[1] != b[0] for a, b in zip(spans, spans[1:])):
        raise DistributedError(f"process {jax.process_index()} would hold rows {spans} of the batch, not one block")
    return slice(spans[0][0], spans[-1][1])


def global_batch(local: np.ndarray, sharding: NamedSharding, rows: int) -> jax.Array:
    """The global array `[rows, ...]` whose block `local_rows(sharding, rows)` this process passes."""
    return jax.make_array_from_process_local_data(sharding, local, (rows, *local.shape[1:]))


def from_host(value, sharding: NamedSharding) -> jax.Array:
    """A global array from a value every process holds whole and alike (e.g. parameters initialized from
    the same seed): each process places its own devices' pieces."""
    host = np.asarray(value)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def replicated(value, mesh: Mesh) -> jax.Array:
    """`value` (the same on every process) on every device of `mesh`."""
    return from_host(value, NamedSharding(mesh, PartitionSpec()))


def whole_here(tree):
    """`tree`'s arrays whole on this process's first device (a copy gathered from every process's shards:
    a collective), so that this process can run the model alone, e.g. to time decoding; as is in one process."""
    if jax.process_count() == 1:
        return tree
    return jax.device_put(multihost_utils.process_allgather(tree, tiled=True), jax.local_devices()[0])


def any_process(flag: bool) -> bool:
    """Whether `flag` is set on any process (e.g. a Ctrl-C that reached one of them), so that all stop at
    the same step; a collective every process must call at the same point."""
    if jax.process_count() == 1:
        return flag
    return bool(np.asarray(multihost_utils.process_allgather(np.int32(flag))).any())


def summed(values: np.ndarray) -> np.ndarray:
    """`values` added over every process (each passes its own); a collective."""
    if jax.process_count() == 1:
        return values
    return np.asarray(multihost_utils.process_allgather(np.asarray(values))).sum(axis=0)


def same_everywhere(name: str, text: str) -> None:
    """DistributedError naming `name` unless every process passes the same `text` (its digest is
    compared): processes that trained different configs would silently average different models."""
    if jax.process_count() == 1:
        return
    digest = np.frombuffer(hashlib.sha256(text.encode()).digest()[:8], np.int64)
    every = np.asarray(multihost_utils.process_allgather(digest)).reshape(-1)
    if (every != every[0]).any():
        differ = [i for i, d in enumerate(every) if d != every[0]]
        raise DistributedError(
            f"the {name} differs between processes: process 0's is not that of process(es) {differ}. Every "
            "process must run the same command with the same files."
        )


def shared_directory(path: Path) -> None:
    """DistributedError unless every process names the same `path` and sees the same directory there:
    checkpoints are written by all processes into one directory (a shared filesystem or bucket), and
    processes writing into different ones would wait for each other for ever."""
    if jax.process_count() == 1:
        return
    path = Path(path).resolve()
    same_everywhere("run directory", str(path))
    path.mkdir(parents=True, exist_ok=True)
    nonce = int(multihost_utils.broadcast_one_to_all(np.int32(secrets.randbits(30))))
    marker = path / f".kvjax-shared-{nonce}"
    if is_primary():
        marker.touch()
    multihost_utils.sync_global_devices("kvjax: marker written")
    missing = any_process(not marker.exists())
    multihost_utils.sync_global_devices("kvjax: marker read")
    if is_primary():
        marker.unlink()
    if missing:
        raise DistributedError(
            f"the run directory {path} is not shared: some process does not see what process 0 wrote there. "
            "Every process must write into one directory (a shared filesystem), as checkpoints are written by all."
        )
