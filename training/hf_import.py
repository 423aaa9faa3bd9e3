"""Load a local Hugging Face checkpoint directory (config.json + safetensors) of the decoder families
kvjax expresses (`training/families/`: Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma 2 and 3), as a kvjax
model, with its tokenizer (tokenizer.json). Each family module maps its config and tensor names; this
loop reads the tensors one at a time, straight to the default device in the model's dtype (an 8B
checkpoint never has an fp32 copy on the host), checks every shape and fills a model built from shapes
only. What a config asks
for that kvjax cannot express (other RoPE scalings, activations, a non-zero output bias, Qwen's
per-layer windows) is refused by name rather than loaded approximately.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from kvjax.architectures import Decoder
from kvjax.config import Config
from kvjax.sharding import named_spec
from kvjax.training.families import BY_HF_ARCHITECTURE, HFImportError
from kvjax.training.families.llama import parameter
from kvjax.training.tokenizer import HFTokenizer

WEIGHTS = ("model.safetensors", "model.safetensors.index.json")


def is_hf_dir(ref: str | Path) -> bool:
    path = Path(ref)
    return (path / "config.json").is_file() and any((path / w).is_file() for w in WEIGHTS)


@contextlib.contextmanager
def _tensors(path: Path):
    """Every tensor name of the checkpoint -> its open safetensors file (read with jax: a tensor, or a
    slice of its rows, lands on the default device in the file's dtype, and only when asked for)."""
    from safetensors import safe_open

    if (path / WEIGHTS[0]).is_file():
        names = [WEIGHTS[0]]
    else:
        names = sorted(set(json.loads((path / WEIGHTS[1]).read_text())["weight_map"].values()))
    with contextlib.ExitStack() as stack:
        files = [stack.enter_context(safe_open(path / name, framework="flax")) for name in names]
        yield {key: f for f in files for key in f.keys()}


def _model_config(path: Path):
    """The checkpoint's ModelConfig (from its config.json) and its family module."""
    if not is_hf_dir(path):
        raise HFImportError(f"{path}: not a Hugging Face checkpoint (config.json and {' or '.join(WEIGHTS)})")
    hf = json.loads((path / "config.json").read_text())
    arch = (hf.get("architectures") or ["?"])[0]
    if arch not in BY_HF_ARCHITECTURE:
        raise HFImportError(
            f"{path}: architectures={arch!r} is not supported (supported: {', '.join(BY_HF_ARCHITECTURE)})"
        )
    family = BY_HF_ARCHITECTURE[arch]
    return family.from_hf(hf, str(path)), family


def hf_config(directory: str | Path) -> Config:
    """The Config of a checkpoint directory, read from its config.json without loading a weight."""
    return Config(model=_model_config(Path(directory))[0])


def load_hf_model(directory: str | Path, dtype: str | None = None, mesh=None) -> tuple[Config, Decoder]:
    """A kvjax Decoder with the checkpoint's weights in `dtype` (default float32; `bfloat16` halves an
    accelerator's memory), and the Config describing it. Each tensor goes from the file to the device as
    it is read; with `mesh`, straight to its devices as `kvjax.sharding` lays it out (no device ever
    holds the whole model)."""
    path = Path(directory)
    cfg, family = _model_config(path)
    cfg = cfg if dtype is None else dataclasses.replace(cfg, dtype=dtype)
    model = nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))  # shapes only: every weight is set below
    with _tensors(path) as files:
        for weight in family.weights(cfg):
            variable, name = parameter(model, weight.ours), weight.hf
            if name not in files:
                raise HFImportError(f"{path}: tensor {name} is missing")
            source = files[name].get_slice(name)
            value = source[slice(*weight.hf_rows)] if weight.hf_rows is not None else source[:]
            value = value.T if weight.transpose else value
            if variable.shape != value.shape:
                rows = "" if weight.hf_rows is None else f" (rows {weight.hf_rows[0]}:{weight.hf_rows[1]})"
                raise HFImportError(f"{path}: {name}{rows} has shape {value.shape}, kvjax expects {variable.shape}")
            # through fp32, as the reference does: a bf16 file into an fp32 model is exact either way
            value = value.astype(jnp.float32).astype(variable.dtype)
            if mesh is not None:
                spec = named_spec(weight.ours.split("."), value.shape, mesh)
                value = jax.device_put(value, NamedSharding(mesh, spec))
            variable.set_value(value)
        for i in range(cfg.n_layers):  # Llama's attention_bias also biases o_proj: only zeros map exactly
            name = f"model.layers.{i}.self_attn.o_proj.bias"
            if name in files and np.any(np.asarray(files[name].get_tensor(name))):
                raise HFImportError(f"{path}: {name} is not zero; kvjax's output projection has no bias")
    return Config(model=cfg), model


def load_hf_tokenizer(directory: str | Path):
    """The checkpoint's tokenizer.json behind kvjax's interface, BOS/EOS from its configs, the chat template
    from tokenizer_config.json when it has one."""
    from tokenizers import Tokenizer as HFTok

    path = Path(directory)
    if not (path / "tokenizer.json").is_file():
        raise HFImportError(f"{path}: no tokenizer.json (kvjax reads the fast-tokenizer file)")
    tok = HFTok.from_file(str(path / "tokenizer.json"))
    hf = json.loads((path / "config.json").read_text())
    eos = hf.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) else eos
    bos = hf.get("bos_token_id")
    return HFTokenizer(
        tok, bos_id=eos if bos is None else bos, eos_id=eos if eos is not None else bos, chat_template=_template(path)
    )


def _template(path: Path) -> str | None:
    """tokenizer_config.json's chat template: a string, or the one named `default` of a list."""
    config = path / "tokenizer_config.json"
    template = json.loads(config.read_text()).get("chat_template") if config.is_file() else None
    if isinstance(template, list):
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    return template if isinstance(template, str) else None
