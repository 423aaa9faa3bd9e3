"""Chat templates: a model's Jinja template (Hugging Face's `chat_template`, GGUF's
`tokenizer.chat_template`) rendered over a list of messages, in Jinja's sandbox as transformers renders
them, so that a chat request reads what the model was trained on."""

from __future__ import annotations

import datetime
import functools
import json

from kvjax.errors import ConfigError


def render(template: str, messages: list[dict], *, bos: str = "", eos: str = "", generation: bool = True) -> str:
    """The text of `messages` (dicts with `role` and `content`) in `template`, up to where the assistant's
    reply starts when `generation` (`add_generation_prompt`)."""
    try:
        return _compiled(template).render(
            messages=messages, add_generation_prompt=generation, bos_token=bos, eos_token=eos
        )
    except Exception as e:  # a template's own `raise_exception(...)` or a broken template
        raise ConfigError(f"the chat template cannot render these messages: {e}") from None


@functools.lru_cache(maxsize=8)
def _compiled(template: str):
    """The template compiled as transformers compiles chat templates: blocks trimmed, loop controls, its
    `raise_exception` and `strftime_now` globals and a `tojson` that keeps non-ASCII text."""
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env.from_string(template)


def _raise(message: str):
    raise ValueError(message)
