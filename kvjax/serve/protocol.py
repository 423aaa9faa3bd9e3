"""The OpenAI API's request bodies read into what the engine needs, and its response shapes (as vLLM's
server and the `openai` client have them). Every field is checked before any compute, and a bad one is an
`APIError` naming the field, the value and what is allowed, sent back in OpenAI's error shape."""

from __future__ import annotations

import dataclasses
import secrets
import time
from typing import Any

MAX_STOP = 4  # OpenAI's limit on stop strings
MAX_LOGPROBS = 20  # top log-probabilities per token, as OpenAI and vLLM allow
UNSUPPORTED = {  # fields accepted only at the value that means "off"
    "n": 1,
    "best_of": 1,
    "presence_penalty": 0,
    "frequency_penalty": 0,
    "logit_bias": None,
    "suffix": None,
    "tools": None,
    "tool_choice": None,
    "response_format": None,
}


class APIError(Exception):
    """An error in OpenAI's shape: the HTTP status, the message, the request field it is about."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}


@dataclasses.dataclass(frozen=True)
class Params:
    """How to answer one request, whatever its endpoint."""

    max_tokens: int | None  # None: as many as the request's room allows (chat's default)
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False  # vLLM's extension: the end token ends nothing (fixed-length benchmarks)
    logprobs: int | None = None  # top log-probabilities per token (0: the chosen token's only)
    echo: bool = False
    stream: bool = False
    usage_in_stream: bool = False
    policy: str | None = None  # `kv_policy`: this request's compression, where the engine can page it


def field(body: dict, name: str, kind, default, rule: str, ok=lambda v: True):
    """`body[name]` of type `kind` for which ok(value) holds, else its default when absent or null; else a
    400 naming the field, the value and `rule`."""
    value = body.get(name)
    if value is None:
        return default
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds) or not ok(value):
        raise APIError(400, f"{name}={value!r} {rule}", name)
    return value


def params(body: dict, *, chat: bool, default_max: int | None) -> Params:
    """The generation fields of a completion or chat request, checked."""
    for name, off in UNSUPPORTED.items():
        value = body.get(name)
        if value not in (None, off) and not (off is None and value in ({}, [])):
            raise APIError(400, f"{name}={value!r} is not supported (only {off!r})", name)
    tokens_field = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = field(body, tokens_field, int, default_max, "must be an integer >= 0", lambda v: v >= 0)
    stop = field(body, "stop", (str, list), [], f"must be a string or a list of at most {MAX_STOP} strings")
    stop = [stop] if isinstance(stop, str) else stop
    if len(stop) > MAX_STOP or not all(isinstance(s, str) and s for s in stop):
        raise APIError(400, f"stop={stop!r} must be a string or a list of at most {MAX_STOP} non-empty strings", "stop")
    if chat:
        top = field(body, "top_logprobs", int, None, f"must be an integer in [0, {MAX_LOGPROBS}]", _logprobs_ok)
        wanted = field(body, "logprobs", bool, False, "must be true or false")
        logprobs = (top or 0) if wanted else None
    else:
        logprobs = field(body, "logprobs", int, None, f"must be an integer in [0, {MAX_LOGPROBS}]", _logprobs_ok)
    options = field(body, "stream_options", dict, {}, "must be an object")
    return Params(
        max_tokens=max_tokens,
        temperature=float(field(body, "temperature", (int, float), 1.0, "must be a number in [0, 2]", _in(0, 2))),
        top_p=float(field(body, "top_p", (int, float), 1.0, "must be a number in (0, 1]", lambda v: 0 < v <= 1)),
        seed=field(body, "seed", int, None, "must be an integer"),
        stop=tuple(stop),
        ignore_eos=field(body, "ignore_eos", bool, False, "must be true or false"),
        logprobs=logprobs,
        echo=False if chat else field(body, "echo", bool, False, "must be true or false"),
        stream=field(body, "stream", bool, False, "must be true or false"),
        usage_in_stream=bool(options.get("include_usage", False)),
        policy=field(body, "kv_policy", str, None, "must be a policy string, e.g. snapkv:0.5"),
    )


def _logprobs_ok(v: int) -> bool:
    return 0 <= v <= MAX_LOGPROBS


def _in(lo: float, hi: float):
    return lambda v: lo <= v <= hi


def prompts(body: dict) -> list[str | list[int]]:
    """`prompt` as OpenAI takes it: a string, token ids, or a list of either (one choice each)."""
    prompt = body.get("prompt")
    rule = "must be a string, a list of token ids, or a list of strings or of token-id lists"
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(_is_id(t) for t in prompt):
            return [prompt]
        if all(isinstance(p, str) for p in prompt) or all(isinstance(p, list) and all(map(_is_id, p)) for p in prompt):
            return list(prompt)
    raise APIError(400, f"prompt={_short(prompt)} {rule}", "prompt")


def messages(body: dict) -> list[dict]:
    """`messages`: a non-empty list of {role, content} with text content (or a list of text parts)."""
    items = body.get("messages")
    if not isinstance(items, list) or not items:
        raise APIError(400, f"messages={_short(items)} must be a non-empty list of {{role, content}}", "messages")
    out = []
    for i, m in enumerate(items):
        role, content = (m.get("role"), m.get("content")) if isinstance(m, dict) else (None, None)
        if isinstance(content, list):  # OpenAI's content parts: text only here
            if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                raise APIError(400, f"messages[{i}].content: only text parts are supported", f"messages[{i}].content")
            content = "".join(p.get("text", "") for p in content)
        if role not in ("system", "user", "assistant", "developer") or not isinstance(content, str):
            raise APIError(
                400,
                f"messages[{i}]={_short(m)} must have a role (system, user, assistant) and text content",
                f"messages[{i}]",
            )
        out.append({"role": role, "content": content})
    return out


def _is_id(t) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def request_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


def now() -> int:
    return int(time.time())
