"""`kvjax serve`: an OpenAI-compatible HTTP server over the engine (`kvjax.serve`), any policy behind it."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from pathlib import Path

from kvjax.commands.args import LONG_HELP, MODEL_HELP, POSITIVE, POSITIVE_FLOAT
from kvjax.errors import ConfigError

DEFAULT_MAX_TOKENS = 4096  # prompt + completion of one request, unless the model's context is shorter


def run(args) -> None:
    try:
        import uvicorn

        from kvjax.serve.app import Served, create_app
    except ImportError as e:
        raise ConfigError(
            f"kvjax serve needs the serve extra ({e.name} is missing): pip install 'kvjax[serve]'"
        ) from None
    from kvjax.commands.common import calibration_tokens, resolve_duo
    from kvjax.compress import parse_policy
    from kvjax.engine import Engine, check_engine_policy
    from kvjax.training.loading import load_model, model_config

    if args.policy:
        check_engine_policy(parse_policy(args.policy))  # before the weights load
    template = _template(args.chat_template)
    if args.memory_mib and args.pages:
        raise ConfigError("give --memory-mib or --pages, not both")
    model_config(args.model)  # a reference that names nothing fails now, not after the server started

    def load() -> Served:
        loaded = load_model(args.model)
        if args.policy:  # a duo stage reads the model's learned pattern unless it names one
            args.policy = resolve_duo([args.policy], args.model, loaded.config.model.name)[0]
        max_tokens = args.max_tokens or min(loaded.context or DEFAULT_MAX_TOKENS, DEFAULT_MAX_TOKENS)
        # Palu's bases: from the training split of the model's corpus
        calibration = calibration_tokens(loaded, [parse_policy(args.policy)] if args.policy else [], None)
        common = dict(page_size=args.page_size, chunk=args.chunk, policy=args.policy, calibration=calibration)
        probe = Engine(loaded.model, n_pages=2, slots=1, **common)
        slots, window_pool = args.slots, None
        if args.pages:
            pages = args.pages
        elif args.memory_mib:  # recurrent states first (as many slots as they fit), then pages
            slots, pages, window_pool = probe.fit(int(args.memory_mib * 2**20), args.slots, max_tokens)
            pages -= 1
        else:  # every slot can hold a whole request
            pages = args.slots * -(-max_tokens // args.page_size)
        engine = Engine(
            loaded.model,
            n_pages=pages + 1,  # + the null page
            slots=slots,
            max_tokens=max_tokens,
            window_pool=window_pool,
            **common,
        )
        if args.warm:
            engine.warm()
        tokenizer = loaded.tokenizer
        name = args.served_model_name or loaded.config.model.name
        print(
            f"kvjax serve: {name} on http://{args.host}:{args.port}/v1, {pages} pages of {args.page_size} tokens "
            f"({pages * probe.page_nbytes() / 2**20:.1f} MiB), {slots} slots, policy {args.policy or 'none'}",
            file=sys.stderr,
            flush=True,
        )
        return Served(
            engine,
            tokenizer,
            name,
            loaded.bos,
            max_tokens,
            loaded.context,
            args.allow_long_context,
            template or getattr(tokenizer, "chat_template", None),
        )

    app = create_app(load, max_waiting=args.max_waiting)
    config = uvicorn.Config(
        app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=args.grace + 10
    )
    _uvicorn(uvicorn, config, app.state.server, args.grace).run()


def _template(path: str | None) -> str | None:
    if path is None:
        return None
    try:
        return Path(path).read_text()
    except OSError as e:
        raise ConfigError(f"--chat-template={path}: {e.strerror}") from None


def _uvicorn(uvicorn, config, server, grace: float):
    """uvicorn's server with kvjax's shutdown: SIGINT or SIGTERM stops admitting and lets the requests in
    flight finish for `grace` seconds, then ends them with a last chunk; the process exits 0 (uvicorn alone
    would raise the signal again once it stopped, and a second SIGINT still forces the exit)."""

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            if server.state == "ready":
                asyncio.run_coroutine_threadsafe(server.drain(grace), server.loop)
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True
            else:
                self.should_exit = True

    return Server(config)


def register(sub) -> None:
    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server over the engine, any policy behind it")
    p.add_argument("model", help=MODEL_HELP)
    p.add_argument(
        "--policy",
        help="compress every request's prompt (and its cache while it decodes, every=N), e.g. snapkv:0.5, "
        "h2o:256:every=64 or int:8 (default: none)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    p.add_argument("--port", type=POSITIVE, default=8000, help="port (default: 8000)")
    p.add_argument("--memory-mib", type=POSITIVE_FLOAT, help="K/V memory of the pages (default: a request per slot)")
    p.add_argument("--pages", type=POSITIVE, help="K/V pages, instead of --memory-mib")
    p.add_argument("--page-size", type=POSITIVE, default=16, help="tokens per page (default: 16)")
    p.add_argument("--slots", type=POSITIVE, default=16, help="requests decoding together (default: 16)")
    p.add_argument("--chunk", type=POSITIVE, default=128, help="prompt tokens prefilled per step (default: 128)")
    p.add_argument(
        "--max-tokens",
        type=POSITIVE,
        help=f"prompt + completion tokens one request may hold (default: the model's context, at most "
        f"{DEFAULT_MAX_TOKENS})",
    )
    p.add_argument("--max-waiting", type=POSITIVE, default=256, help="requests queued before 429 (default: 256)")
    p.add_argument("--served-model-name", help="the model name clients send (default: the model's own)")
    p.add_argument("--chat-template", help="a Jinja chat template file (default: the model's own, if it has one)")
    p.add_argument(
        "--grace", type=POSITIVE_FLOAT, default=30.0, help="seconds in-flight requests get at shutdown (default: 30)"
    )
    p.add_argument("--log-level", default="warning", choices=("debug", "info", "warning", "error"),
                   help="uvicorn's log level (default: warning)")  # fmt: skip
    p.add_argument("--allow-long-context", action="store_true", help=LONG_HELP)
    p.add_argument(
        "--warm",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="compile every step shape before serving (/health says 503 until then), so no request waits "
        "on a compile (default: on)",
    )
    p.set_defaults(run=run)
