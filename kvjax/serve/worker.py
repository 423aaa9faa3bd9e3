"""The engine's own thread: it steps `kvjax.Engine` whenever a request waits or runs, takes commands
(submit, cancel, score a prompt) between steps, and hands each request's new tokens to the asyncio
task that answers its client. The event loop never waits on the device."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import queue
import threading
import time
import traceback
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kvjax.engine import Engine, Request
from kvjax.generate import prompt_bucket


@dataclasses.dataclass(frozen=True)
class Tokens:
    """What a request generated since the last event; `finish` once it has ended ("stop", "length",
    "cancelled")."""

    ids: list[int]
    logprobs: list[float]
    top: list[list[tuple[int, float]]]
    finish: str | None


class Listener:
    """Where one engine request's events go: `(choice, Tokens)` into an asyncio queue (one queue may take
    the choices of a request with several prompts), filled from the engine's thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop, events: asyncio.Queue, choice: int = 0):
        self.loop, self.events, self.choice, self.sent = loop, events, choice, 0

    def push(self, event: Tokens) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, (self.choice, event))


class PromptScorer:
    """Each prompt token's log-probability given the tokens before it, and the likeliest tokens there, from
    one forward pass over the prompt (what cached decoding gives token by token: `Generator.score`)."""

    def __init__(self, model):
        graphdef, self.params = nnx.split(model)
        self._forward = jax.jit(functools.partial(_prompt_logprobs, graphdef), static_argnames=("top",))

    def __call__(self, tokens: list[int], top: int) -> tuple[list[float], list[list[tuple[int, float]]]]:
        T = prompt_bucket(len(tokens), 1 << 30)
        ids = np.zeros((1, T), np.int32)
        ids[0, : len(tokens)] = tokens
        positions = np.where(np.arange(T) < len(tokens), np.arange(T), -1)[None].astype(np.int32)
        lp, best, best_lp = (np.asarray(x[0]) for x in self._forward(self.params, ids, positions, top=max(top, 1)))
        n = len(tokens) - 1
        tops = [[(int(t), float(v)) for t, v in zip(best[i], best_lp[i])][:top] for i in range(n)]
        return [float(x) for x in lp[:n]], tops


def _prompt_logprobs(graphdef, params, ids, positions, *, top: int):
    model = nnx.merge(graphdef, params)
    logits, _ = model(ids, positions)
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)[:, :-1]
    picked = jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1)[..., 0]
    best_lp, best = jax.lax.top_k(logp, top)
    return picked, best, best_lp


class Worker:
    """Owns `engine` (and a `PromptScorer` of its model) on a thread of its own; every method is called
    from the event loop. `on_step(engine, seconds, tokens)` sees the engine after each step (metrics)."""

    def __init__(self, engine: Engine, on_step: Callable[[Engine, float, int], None] | None = None):
        self.engine, self.scorer, self.on_step = engine, PromptScorer(engine.model), on_step
        self.listeners: dict[int, Listener] = {}
        self.commands: queue.SimpleQueue = queue.SimpleQueue()
        self.stopping = False
        self.thread = threading.Thread(target=self._loop, name="kvjax-engine", daemon=True)
        self.thread.start()

    # --- from the event loop ------------------------------------------------------------------------
    async def submit(self, request: Request, listener: Listener) -> int:
        """Queue `request` (its events go to `listener`); the engine's refusal (a ConfigError) is raised."""

        def submit():
            index = self.engine.submit(request)
            self.listeners[index] = listener
            return index

        return await self._call(submit)

    def cancel(self, index: int) -> None:
        """End request `index` (its client left): its pages are free before the next step."""
        self.commands.put((lambda: self._cancel(index), None))

    async def score(self, tokens: list[int], top: int):
        """`PromptScorer` on the engine's thread (between steps)."""
        return await self._call(lambda: self.scorer(tokens, top))

    async def waiting(self) -> int:
        return await self._call(lambda: len(self.engine.scheduler.waiting))

    def cancel_all(self) -> None:
        """End every request that waits or runs (a server shutting down past its grace period)."""
        self.commands.put((lambda: [self._cancel(i) for i in list(self.listeners)], None))

    def stop(self) -> None:
        self.commands.put((self._stop, None))
        self.thread.join(timeout=60)

    async def _call(self, fn):
        future = concurrent.futures.Future()
        self.commands.put((fn, future))
        return await asyncio.wrap_future(future)

    # --- on the engine's thread ---------------------------------------------------------------------
    def _loop(self) -> None:
        while not self.stopping:
            idle = self.engine.scheduler.idle
            try:
                command = self.commands.get() if idle else self.commands.get_nowait()
            except queue.Empty:
                command = None
            while command is not None:
                self._run(*command)
                try:
                    command = self.commands.get_nowait()
                except queue.Empty:
                    command = None
            if self.stopping or self.engine.scheduler.idle:
                continue
            start = time.perf_counter()
            try:
                self.engine.step()
            except Exception:  # the device failed a step (memory, a bug): end what runs, keep serving
                traceback.print_exc()
                for index in list(self.listeners):
                    self.engine.cancel(index)
            tokens = self._publish()
            if self.on_step is not None:
                self.on_step(self.engine, time.perf_counter() - start, tokens)

    @staticmethod
    def _run(fn, future) -> None:
        try:
            result = fn()
        except BaseException as e:  # handed to the caller, which answers its client with it
            if future is None:
                raise
            future.set_exception(e)
        else:
            if future is not None:
                future.set_result(result)

    def _publish(self) -> int:
        """Each listener's new tokens, and its end; an ended request is forgotten (its memory freed).
        Returns how many tokens were new."""
        new = 0
        for index, listener in list(self.listeners.items()):
            done = self.engine.done[index]
            n = listener.sent
            new += len(done.tokens) - n
            if len(done.tokens) > n or done.finish is not None:
                listener.push(Tokens(done.tokens[n:], done.logprobs[n:], done.top[n:], done.finish))
                listener.sent = len(done.tokens)
            if done.finish is not None:
                del self.listeners[index]
                self.engine.forget(index)
        return new

    def _cancel(self, index: int) -> None:
        if index in self.listeners:
            self.engine.cancel(index)
            self._publish()

    def _stop(self) -> None:
        self.stopping = True
