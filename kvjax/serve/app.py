"""The HTTP front: OpenAI's API over `kvjax.Engine` (Starlette, served by uvicorn). It only translates:
requests in (checked by `protocol`), engine requests out (through the `Worker`'s thread), tokens back as
text, log-probabilities, SSE chunks and metrics. The engine knows nothing of HTTP.

Endpoints: `POST /v1/completions`, `POST /v1/chat/completions`, `GET /v1/models`, `POST /tokenize`,
`POST /detokenize`, `GET /tokenizer_info` (what lm-evaluation-harness probes for a remote tokenizer),
`GET /health`, `GET /metrics` (Prometheus)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import threading
import time
import traceback
from collections.abc import Callable

import numpy as np
from starlette.applications import Starlette
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kvjax.chat import render
from kvjax.config import DecodingConfig
from kvjax.engine import Engine, Request
from kvjax.errors import ConfigError
from kvjax.report import plural
from kvjax.serve import protocol
from kvjax.serve.metrics import Metrics
from kvjax.serve.protocol import APIError, Params
from kvjax.serve.worker import Listener, Tokens, Worker

POLL = 0.5  # seconds between checks that a non-streaming client is still there


@dataclasses.dataclass
class Served:
    """What the server serves: the engine over the model, its tokenizer and what requests may ask."""

    engine: Engine
    tokenizer: object  # kvjax.training.tokenizer's interface: encode, decode, bos_id, eos_id
    name: str
    bos: bool  # text prompts start with BOS (the model was trained so)
    max_tokens: int  # prompt + generated tokens one request may hold
    context: int | None  # the model's trained context (None: unknown)
    allow_long_context: bool = False
    chat_template: str | None = None


class Server:
    """The served model's life: loading (503), ready, draining (503 to new requests). `load` runs on a
    thread of its own so that the server answers (503) while the weights load."""

    def __init__(self, load: Callable[[], Served], *, max_waiting: int):
        self.load, self.max_waiting = load, max_waiting
        self.served: Served | None = None
        self.worker: Worker | None = None
        self.metrics = Metrics()
        self.state, self.error = "loading", None
        self.inflight = 0

    def start(self) -> None:
        """At the app's startup, on its event loop: load on a thread."""
        self.loop = asyncio.get_running_loop()
        threading.Thread(target=self._load, name="kvjax-load", daemon=True).start()

    def close(self) -> None:
        """At the app's shutdown: the engine's thread ends."""
        if self.worker is not None and self.worker.thread.is_alive():
            self.worker.stop()

    def _load(self) -> None:
        try:
            self.served = self.load()
            self.metrics.describe(self.served.engine)
            self.worker = Worker(self.served.engine, on_step=self.metrics.step)
            self.state = "ready"
        except Exception as e:  # the server stays up to say why
            self.error, self.state = f"{type(e).__name__}: {e}", "failed"
            traceback.print_exc()

    def ready(self) -> Served:
        """The served model, or the 503 (loading, draining) or 500 (failed to load) that says why not."""
        if self.state == "ready":
            return self.served
        if self.state == "failed":
            raise APIError(500, f"the model failed to load: {self.error}", kind="server_error")
        why = "the model is loading" if self.state == "loading" else "the server is shutting down"
        raise APIError(503, f"{why}; try again later", kind="service_unavailable")

    async def drain(self, grace: float) -> None:
        """Stop admitting (503); let the requests in flight finish for `grace` seconds, then end them (their
        clients get a last chunk with finish_reason "abort")."""
        if self.state != "ready":
            return
        self.state = "draining"
        deadline = time.monotonic() + grace
        while self.inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.inflight:
            self.worker.cancel_all()
        while self.inflight:
            await asyncio.sleep(0.05)
        self.worker.stop()


def create_app(load: Callable[[], Served], *, max_waiting: int = 256) -> Starlette:
    """The Starlette app serving `load()`'s model; `app.state.server` is its `Server`."""
    server = Server(load, max_waiting=max_waiting)

    def endpoint(fn):
        async def wrapped(request: HTTPRequest):
            try:
                return await fn(server, request)
            except APIError as e:
                return JSONResponse(e.body(), status_code=e.status)

        return wrapped

    routes = [
        Route("/v1/completions", endpoint(completions), methods=["POST"]),
        Route("/v1/chat/completions", endpoint(chat_completions), methods=["POST"]),
        Route("/v1/models", endpoint(models)),
        Route("/tokenize", endpoint(tokenize), methods=["POST"]),
        Route("/detokenize", endpoint(detokenize), methods=["POST"]),
        Route("/tokenizer_info", endpoint(tokenizer_info)),
        Route("/health", endpoint(health)),
        Route("/metrics", endpoint(metrics)),
    ]

    @contextlib.asynccontextmanager
    async def lifespan(app):
        server.start()
        yield
        server.close()

    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.server = server
    return app


# --- endpoints -------------------------------------------------------------------------------------


async def health(server: Server, request: HTTPRequest) -> Response:
    server.ready()
    return JSONResponse({"status": "ok"})


async def metrics(server: Server, request: HTTPRequest) -> Response:
    return Response(server.metrics.render(), media_type=server.metrics.content_type)


async def models(server: Server, request: HTTPRequest) -> Response:
    served = server.ready()
    card = {"id": served.name, "object": "model", "created": protocol.now(), "owned_by": "kvjax"}
    return JSONResponse({"object": "list", "data": [{**card, "max_model_len": served.max_tokens}]})


async def tokenize(server: Server, request: HTTPRequest) -> Response:
    served, body = server.ready(), await _body(request)
    prompt = protocol.field(body, "prompt", str, None, "must be a string")
    if prompt is None:
        raise APIError(400, "prompt is required (a string)", "prompt")
    special = protocol.field(body, "add_special_tokens", bool, True, "must be true or false")
    tokens = _encode(served, prompt, bos=special)
    return JSONResponse({"tokens": tokens, "count": len(tokens), "max_model_len": served.max_tokens})


async def detokenize(server: Server, request: HTTPRequest) -> Response:
    served, body = server.ready(), await _body(request)
    tokens = body.get("tokens")
    vocab = served.engine.model.config.vocab_size
    if not isinstance(tokens, list) or not all(protocol._is_id(t) and 0 <= t < vocab for t in tokens):
        raise APIError(400, f"tokens={protocol._short(tokens)} must be a list of token ids in [0, {vocab})", "tokens")
    return JSONResponse({"prompt": served.tokenizer.decode(tokens)})


async def tokenizer_info(server: Server, request: HTTPRequest) -> Response:
    served = server.ready()
    return JSONResponse(
        {
            "tokenizer_class": type(served.tokenizer).__name__,
            "bos_token": _piece(served.tokenizer, served.tokenizer.bos_id),
            "eos_token": _piece(served.tokenizer, served.tokenizer.eos_id),
            "pad_token": None,
            "chat_template": served.chat_template,
            "model_max_length": served.max_tokens,
        }
    )


async def completions(server: Server, request: HTTPRequest) -> Response:
    served, body = server.ready(), await _body(request)
    _check_model(served, body)
    params = protocol.params(body, chat=False, default_max=16)
    prompts = [_encode(served, p, bos=True) if isinstance(p, str) else list(p) for p in protocol.prompts(body)]
    _check_tokens(served, prompts)
    job = Job(server, request, served, prompts, params, "cmpl", chat=False)
    return await job.answer()


async def chat_completions(server: Server, request: HTTPRequest) -> Response:
    served, body = server.ready(), await _body(request)
    _check_model(served, body)
    if not served.chat_template:
        raise APIError(400, f"model {served.name!r} has no chat template; start the server with --chat-template")
    text = render(
        served.chat_template,
        protocol.messages(body),
        bos=_piece(served.tokenizer, served.tokenizer.bos_id) or "",
        eos=_piece(served.tokenizer, served.tokenizer.eos_id) or "",
    )
    prompt = _encode(served, text, bos=False)  # the template writes BOS where the model wants it
    params = protocol.params(body, chat=True, default_max=None)
    _check_tokens(served, [prompt])
    job = Job(server, request, served, [prompt], params, "chatcmpl", chat=True)
    return await job.answer()


# --- answering one request -------------------------------------------------------------------------


class Job:
    """One completion or chat request: its prompts through the engine (one choice each), answered whole
    or as SSE chunks; a client that leaves cancels its engine requests."""

    def __init__(self, server, request, served, prompts, params: Params, prefix: str, *, chat: bool):
        self.server, self.http, self.served, self.prompts, self.params = server, request, served, prompts, params
        self.chat, self.id, self.created = chat, protocol.request_id(prefix), protocol.now()
        self.indices: list[int] = []
        self.texts = [Text(served.tokenizer, params.stop, served.tokenizer.eos_id) for _ in prompts]
        self.generated = [Tokens([], [], [], None) for _ in prompts]
        self.finish: list[str | None] = [None] * len(prompts)

    def new_tokens(self, prompt: list[int]) -> int:
        room = self.served.max_tokens - len(prompt)
        return room if self.params.max_tokens is None else self.params.max_tokens

    async def answer(self) -> Response:
        server, params = self.server, self.params
        waiting = await server.worker.waiting()
        if waiting + len(self.prompts) > server.max_waiting:
            raise APIError(
                429,
                f"{waiting} {plural(waiting, 'request')} waiting (at most {server.max_waiting}); retry later",
                kind="rate_limit_exceeded",
            )
        server.inflight += 1
        try:
            self.echoed = await self._echo() if params.echo and params.logprobs is not None else None
            self.events: asyncio.Queue = asyncio.Queue()
            await self._submit()
        except BaseException:
            server.inflight -= 1
            self._cancel()
            raise
        if params.stream:
            return StreamingResponse(self._stream(), media_type="text/event-stream")
        try:
            await self._collect()
        finally:
            server.inflight -= 1
            self._cancel()
        return JSONResponse(self._whole())

    async def _echo(self):
        """The prompts' own log-probabilities (with `echo` and `logprobs`): each token after the first."""
        return [await self.server.worker.score(p, self.params.logprobs) for p in self.prompts]

    async def _submit(self) -> None:
        loop, p = asyncio.get_running_loop(), self.params
        for choice, prompt in enumerate(self.prompts):
            n = self.new_tokens(prompt)
            if n == 0:  # echo alone: nothing to generate
                self.finish[choice] = "length"
                self.indices.append(None)
                continue
            decoding = DecodingConfig(
                max_new_tokens=n,
                temperature=p.temperature,
                top_p=p.top_p,
                seed=p.seed if p.seed is not None else int(np.random.default_rng().integers(2**31)),
                eos_id=None if p.ignore_eos else self.served.tokenizer.eos_id,
            )
            engine_request = Request(tuple(prompt), decoding, policy=p.policy, top_logprobs=p.logprobs or 0)
            try:
                index = await self.server.worker.submit(engine_request, Listener(loop, self.events, choice))
            except ConfigError as e:
                raise APIError(400, str(e), "kv_policy" if p.policy else "prompt") from None
            self.indices.append(index)
            self.server.metrics.submitted(len(prompt))
        self.submitted = time.perf_counter()

    def _cancel(self) -> None:
        for index, finish in zip(self.indices, self.finish):
            if index is not None and finish is None:
                self.server.worker.cancel(index)

    def _take(self, choice: int, event: Tokens) -> str:
        """Add an engine event to its choice; the text it makes safe to show (stop strings held back)."""
        got = self.generated[choice]
        if not got.ids and event.ids:
            self.server.metrics.first_token(time.perf_counter() - self.submitted)
        self.generated[choice] = Tokens(got.ids + event.ids, got.logprobs + event.logprobs, got.top + event.top, None)
        text, stopped = self.texts[choice].feed(event.ids, ended=event.finish is not None)
        if stopped:
            self.finish[choice] = "stop"
            index = self.indices[choice]
            if event.finish is None:
                self.server.worker.cancel(index)
        elif event.finish is not None:
            self.finish[choice] = {"cancelled": "abort"}.get(event.finish, event.finish)
        return text

    async def _collect(self) -> None:
        while any(f is None for f in self.finish):
            try:
                choice, event = await asyncio.wait_for(self.events.get(), POLL)
            except TimeoutError:
                if await self.http.is_disconnected():
                    return
                continue
            if self.finish[choice] is None:
                self._take(choice, event)

    async def _stream(self):
        try:
            if self.chat:
                yield _sse(self._chunk(0, {"role": "assistant", "content": ""}, None, None))
            if self.params.echo:
                for choice, prompt in enumerate(self.prompts):
                    echoed = self._echo_logprobs(choice) if self.echoed is not None else None
                    yield _sse(self._chunk(choice, self.served.tokenizer.decode(prompt), None, echoed))
            for choice, finish in enumerate(self.finish):
                if finish is not None:
                    yield _sse(self._chunk(choice, "", finish, None))
            while any(f is None for f in self.finish):
                choice, event = await self.events.get()
                if self.finish[choice] is not None:
                    continue
                start = len(self.generated[choice].ids)
                text = self._take(choice, event)
                logprobs = self._logprobs(choice, start) if self.params.logprobs is not None else None
                if text or logprobs or self.finish[choice]:
                    content = {"content": text} if self.chat else text
                    yield _sse(self._chunk(choice, content, self.finish[choice], logprobs))
            if self.params.usage_in_stream:
                yield _sse({**self._head(chunk=True), "choices": [], "usage": self._usage()})
            yield "data: [DONE]\n\n"
        finally:
            self.server.inflight -= 1
            self._cancel()  # a client gone mid-stream: its pages free at once

    # --- response shapes ----------------------------------------------------------------------------
    def _head(self, chunk: bool) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.served.name}

    def _chunk(self, choice: int, content, finish, logprobs) -> dict:
        key = "delta" if self.chat else "text"
        choice = {"index": choice, key: content, "logprobs": logprobs, "finish_reason": finish}
        return {**self._head(chunk=True), "choices": [choice]}

    def _whole(self) -> dict:
        choices = []
        for choice, prompt in enumerate(self.prompts):
            text = self.texts[choice].text
            logprobs = self._logprobs(choice, 0) if self.params.logprobs is not None else None
            if self.chat:
                message = {"role": "assistant", "content": text}
                choices.append(
                    {"index": choice, "message": message, "logprobs": logprobs, "finish_reason": self.finish[choice]}
                )
                continue
            if self.params.echo:
                text = self.served.tokenizer.decode(prompt) + text
                if logprobs is not None:
                    echoed = self._echo_logprobs(choice)
                    shift = sum(map(len, echoed["tokens"]))
                    logprobs = {k: echoed[k] + v for k, v in self._logprobs(choice, 0, shift).items()}
            choices.append({"index": choice, "text": text, "logprobs": logprobs, "finish_reason": self.finish[choice]})
        return {**self._head(chunk=False), "choices": choices, "usage": self._usage()}

    def _usage(self) -> dict:
        prompt = sum(len(p) for p in self.prompts)
        completion = sum(len(g.ids) for g in self.generated)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def _logprobs(self, choice: int, start: int, offset: int = 0):
        """The generated tokens' log-probabilities from `start` on, in the endpoint's shape (a completion's
        text offsets counted from `offset`)."""
        got, tok = self.generated[choice], self.served.tokenizer
        ids, lps, tops = got.ids[start:], got.logprobs[start:], got.top[start:] or [[]] * len(got.ids[start:])
        if self.chat:
            entry = lambda t, lp: {"token": _piece(tok, t), "logprob": lp, "bytes": list(_piece(tok, t).encode())}  # noqa: E731
            return {
                "content": [
                    {**entry(t, lp), "top_logprobs": [entry(a, b) for a, b in top]}
                    for t, lp, top in zip(ids, lps, tops)
                ]
            }
        return _completion_logprobs(tok, ids, lps, tops, offset=offset)

    def _echo_logprobs(self, choice: int) -> dict:
        """The prompt's tokens in a completion's logprobs shape: the first has no log-probability."""
        prompt, (lps, tops) = self.prompts[choice], self.echoed[choice]
        return _completion_logprobs(self.served.tokenizer, prompt, [None, *lps], [None, *tops], offset=0)


def _completion_logprobs(tokenizer, ids, lps, tops, offset: int) -> dict:
    pieces = [_piece(tokenizer, t) for t in ids]
    offsets = [offset + int(x) for x in np.cumsum([0, *map(len, pieces)])[:-1]]
    top = [None if t is None else {_piece(tokenizer, a): b for a, b in t} for t in tops]
    return {"tokens": pieces, "token_logprobs": list(lps), "top_logprobs": top, "text_offset": offsets}


class Text:
    """A choice's text as its tokens arrive: the end token is not text, a stop string ends it (and is not
    shown), and what could still become a stop string, or is half a UTF-8 character, is held back."""

    def __init__(self, tokenizer, stop: tuple[str, ...], eos: int | None):
        self.tokenizer, self.stop, self.eos = tokenizer, stop, eos
        self.ids: list[int] = []
        self.text, self.shown = "", 0
        self.hold = max(map(len, stop), default=1) - 1

    def feed(self, ids: list[int], ended: bool) -> tuple[str, bool]:
        """(the text newly safe to show, whether a stop string ended it)."""
        self.ids += [t for t in ids if t != self.eos]
        full = self.tokenizer.decode(self.ids)
        cut = min((at for at in (full.find(s) for s in self.stop) if at >= 0), default=-1)
        if cut >= 0:
            self.text = full[:cut]
            return self._show(len(self.text)), True
        self.text = full
        if ended:
            return self._show(len(full)), False
        safe = len(full) - self.hold
        while safe > self.shown and full[safe - 1] == "\ufffd":  # maybe half of a character
            safe -= 1
        return self._show(safe), False

    def _show(self, upto: int) -> str:
        out = self.text[self.shown : max(upto, self.shown)]
        self.shown = max(upto, self.shown)
        return out


# --- helpers ---------------------------------------------------------------------------------------


async def _body(request: HTTPRequest) -> dict:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise APIError(400, "the request body is not JSON") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    return body


def _check_model(served: Served, body: dict) -> None:
    model = body.get("model")
    if model is not None and model != served.name:
        raise APIError(404, f"model {model!r} does not exist; this server serves {served.name!r}", "model",
                       kind="model_not_found")  # fmt: skip


def _check_tokens(served: Served, prompts: list[list[int]]) -> None:
    vocab = served.engine.model.config.vocab_size
    for i, prompt in enumerate(prompts):
        if not prompt:
            raise APIError(400, f"prompt {i} is empty", "prompt")
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise APIError(400, f"prompt {i} has token ids outside [0, {vocab})", "prompt")
        if len(prompt) >= served.max_tokens:
            raise APIError(
                400,
                f"prompt {i} has {len(prompt)} tokens; a request holds at most {served.max_tokens} (prompt and "
                "completion together)",
                "prompt",
            )
        if served.context and len(prompt) > served.context and not served.allow_long_context:
            raise APIError(400, f"prompt {i} has {len(prompt)} tokens, past the model's context of {served.context}",
                           "prompt")  # fmt: skip


def _encode(served: Served, text: str, *, bos: bool) -> list[int]:
    ids = served.tokenizer.encode(text)
    return [served.tokenizer.bos_id, *ids] if bos and served.bos else ids


def _piece(tokenizer, token: int) -> str:
    """A token's text (a special token's name where it has one)."""
    named = getattr(getattr(tokenizer, "tokenizer", None), "id_to_token", None)
    if token in (tokenizer.bos_id, tokenizer.eos_id) and named is not None:
        return named(token) or ""
    if token in (tokenizer.bos_id, tokenizer.eos_id):
        return "<bos>" if token == tokenizer.bos_id else "<eos>"
    return tokenizer.decode([token])


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"
