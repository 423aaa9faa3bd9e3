"""Models named on the command line: a run directory trained here, a Hugging Face checkpoint directory, a
.gguf file, or a shipped GGUF name (`smollm2`, `gemma3`), loaded with what the commands need to know about them
(tokenizer, trained context, BOS)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from kvjax.architectures import Decoder
from kvjax.config import Config, ConfigError, load_config
from kvjax.sharding import check_mesh, place_model
from kvjax.training.gguf_import import (
    SHIPPED,
    gguf_adds_bos,
    gguf_config,
    gguf_context_length,
    load_gguf_model,
    load_gguf_tokenizer,
)
from kvjax.training.hf_import import hf_config, is_hf_dir, load_hf_model, load_hf_tokenizer
from kvjax.training.tokenizer import Tokenizer
from kvjax.training.trainer import RUN_CONFIG, load_trained


class ModelRefError(ConfigError):
    """A model reference that names nothing loadable, or a request past the model's trained context."""


@dataclasses.dataclass(frozen=True)
class LoadedModel:
    config: Config
    model: Decoder
    tokenizer: Tokenizer
    context: int | None  # tokens the model was trained on (None: unknown); positions past it are extrapolation
    bos: bool  # text starts with BOS: runs trained here saw it at every document start; a GGUF file says
    corpus: str  # default corpus for evaluation and calibration: the run's own, kjv for GGUF models


def is_gguf(ref: str) -> bool:
    return ref in SHIPPED or ref.endswith(".gguf")


def _missing(ref: str) -> ModelRefError:
    return ModelRefError(
        f"model {ref!r} is not a run directory (one with checkpoints/), a Hugging Face checkpoint directory "
        f"(config.json + safetensors), a .gguf file, nor a shipped model ({', '.join(sorted(SHIPPED))})"
    )


class _GGUF:
    """A .gguf file or a shipped name: the file's metadata says its context and whether text starts with BOS."""

    names = staticmethod(is_gguf)
    config = staticmethod(gguf_config)
    decoder = staticmethod(load_gguf_model)

    @staticmethod
    def load(ref: str, mesh=None) -> LoadedModel:
        config, model = load_gguf_model(ref)
        if mesh is not None:
            place_model(model, mesh)
        tokenizer, context = load_gguf_tokenizer(ref), gguf_context_length(ref)
        return LoadedModel(config, model, tokenizer, context, gguf_adds_bos(ref), "kjv")


class _HF:
    """A Hugging Face checkpoint directory: its config.json says the context."""

    names = staticmethod(is_hf_dir)
    config = staticmethod(hf_config)
    decoder = staticmethod(load_hf_model)

    @staticmethod
    def load(ref: str, mesh=None) -> LoadedModel:
        config, model = load_hf_model(ref, mesh=mesh)
        context = json.loads((Path(ref) / "config.json").read_text()).get("max_position_embeddings")
        return LoadedModel(config, model, load_hf_tokenizer(ref), context, False, "kjv")


class _Run:
    """A run directory trained here: its config, checkpoints and tokenizer; BOS starts every document."""

    @staticmethod
    def names(ref: str) -> bool:
        return (Path(ref) / "checkpoints").is_dir()

    @staticmethod
    def config(ref: str) -> Config:
        return load_config(Path(ref) / RUN_CONFIG)

    @staticmethod
    def decoder(ref: str) -> tuple[Config, Decoder]:
        config, model, _ = load_trained(ref)
        return config, model

    @staticmethod
    def load(ref: str, mesh=None) -> LoadedModel:
        config, model, tokenizer = load_trained(ref)
        if mesh is not None:
            place_model(model, mesh)
        context = config.data.seq_len
        if (record := Path(ref) / "uptrain.json").is_file():  # an uptrained model keeps its source's context
            context = max(context, json.loads(record.read_text())["context"] or 0)
        return LoadedModel(config, model, tokenizer, context, True, config.data.corpus)


SOURCES = (_GGUF, _HF, _Run)  # in the order a reference is tried


def _source(ref: str):
    """The kind of model `ref` names; a reference that names nothing is a ModelRefError."""
    if found := next((source for source in SOURCES if source.names(ref)), None):
        return found
    raise _missing(ref)


def load_model(ref: str, mesh=None) -> LoadedModel:
    """Load `ref` without writing anything; a reference that names nothing is a ModelRefError. With `mesh`
    (`kvjax.sharding.generation_mesh`) its weights lie over the mesh's devices (a Hugging Face checkpoint's
    go there tensor by tensor), checked against the model's heads before any weight is read."""
    source = _source(ref)
    if mesh is not None:
        check_mesh(mesh, source.config(ref).model)
    return source.load(ref, mesh)


def load_decoder(ref: str) -> tuple[Config, Decoder]:
    """The model `ref` names and its Config, without its tokenizer (what a benchmark needs)."""
    return _source(ref).decoder(ref)


def is_model_ref(ref: str) -> bool:
    """Whether `ref` names a model rather than a config: a shipped model, a .gguf file, a Hugging Face
    checkpoint directory or a run directory."""
    return any(source.names(ref) for source in SOURCES)


def model_config(ref: str) -> Config:
    """The Config of the model `ref` names, without loading its weights."""
    return _source(ref).config(ref)


def weights_digest(model) -> str:
    """The first 16 hex digits of the SHA-256 of a model's parameters (each one's path, dtype, shape and
    bytes, in path order): what tells two models' results apart when their names agree (~0.3 s for
    SmolLM2-135M)."""
    h = hashlib.sha256()
    leaves = jax.tree_util.tree_leaves_with_path(nnx.state(model, nnx.Param))
    for path, leaf in sorted(leaves, key=lambda item: jax.tree_util.keystr(item[0])):
        array = np.ascontiguousarray(jax.device_get(leaf))
        h.update(f"{jax.tree_util.keystr(path)} {array.dtype} {array.shape}".encode())
        h.update(array.reshape(-1).view(np.uint8))  # bytes whatever the dtype (bfloat16 has no buffer format)
    return h.hexdigest()[:16]


def check_context(loaded: LoadedModel, tokens: int, what: str, allow: bool) -> None:
    """Refuse `tokens` positions past the trained context, or with `allow` warn on stderr (as
    transformers warns about sequences past a model's maximum length)."""
    if loaded.context is None or tokens <= loaded.context:
        return
    message = (
        f"{what} needs {tokens} positions, past {loaded.config.model.name}'s trained context of "
        f"{loaded.context} tokens (quality there is extrapolation)"
    )
    if not allow:
        raise ModelRefError(f"{message}; shorten it, or pass --allow-long-context")
    print(f"kvjax: warning: {message}", file=sys.stderr)
