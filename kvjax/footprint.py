"""What generation needs in device memory at a batch and context, known before anything is allocated:
an analytic budget (weights, caches, the live activations of one prefill chunk and of a decode step) and
what XLA reports for the compiled programs themselves (`Compiled.memory_analysis()`), compiled from
abstract inputs (`jax.ShapeDtypeStruct`), so an 8B model at 128k tokens is planned on a laptop.

The programs are the Generator's: a chunk of a chunked prefill into caches of the full context
(`Generator.prefill(..., chunk=)`), and the decode loop. Compiled here, for this host's backend: on a CPU
the temporaries are XLA:CPU's (attention through the XLA path); an accelerator's fusions and kernels
differ, so the analytic column is the figure to hold the device to and the compiled one checks that no
program holds more than the plan (a `[T, S]` score matrix would show here first).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from kvjax.config import DecodingConfig
from kvjax.memory import cache_bytes
from kvjax.ops import key_block


@dataclasses.dataclass(frozen=True)
class Budget:
    """Analytic bytes of one program: what it reads (weights, caches) and the most it holds besides."""

    program: str
    weights: int
    caches: int
    activations: int

    @property
    def total(self) -> int:
        return self.weights + self.caches + self.activations


@dataclasses.dataclass(frozen=True)
class Compiled:
    """XLA's `memory_analysis()` of one compiled program, in bytes."""

    program: str
    arguments: int
    outputs: int
    aliased: int  # outputs written into donated arguments
    temporaries: int

    @property
    def peak(self) -> int:
        """Bytes live at once at most: inputs, outputs not written in place, and temporaries."""
        return self.arguments + self.outputs - self.aliased + self.temporaries


def weight_bytes(model: nnx.Module) -> int:
    """Bytes of a model's parameters (an abstract one's too: `nnx.eval_shape` of its constructor)."""
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(model)))


def budgets(model: nnx.Module, batch: int, context: int, chunk: int) -> tuple[Budget, Budget]:
    """Analytic budgets of a prefill chunk and of a decode step at `context` tokens of cache.

    Activations counted: the residual stream and one layer's widest intermediates (the MLP's gate and up
    `[B, C, F]`, or q/k/v and the attention output), the fp32 attention scores and probabilities of the
    XLA path (a chunk's queries against one key block of `kvjax.ops.key_block`, the whole cache when it
    has none; a decode step's one query against every slot), and the fp32 logits `[B, V]`."""
    cfg = model.config
    att, item = cfg.attention, jnp.dtype(cfg.dtype).itemsize
    weights, caches = weight_bytes(model), cache_bytes(cfg, context, batch)
    keys = key_block(context) or context

    def activations(c: int, keys: int) -> int:
        qkv = (att.n_heads + 2 * att.n_kv_heads) * att.head_dim + att.n_heads * att.head_dim
        width = 2 * cfg.d_model + max(2 * cfg.ffn_dim, qkv)
        return batch * (c * width * item + 2 * att.n_heads * c * keys * 4 + cfg.vocab_size * 4)

    return (
        Budget(f"prefill chunk of {chunk}", weights, caches, activations(chunk, keys)),
        Budget("decode step", weights, caches, activations(1, context)),
    )


def compiled(
    model: nnx.Module, batch: int, context: int, chunk: int, new_tokens: int = 16
) -> tuple[Compiled, Compiled]:
    """Compile (for this host's backend, from abstract inputs) a prefill chunk into caches of `context`
    slots and a greedy decode of `new_tokens` of `model` (abstract: `nnx.eval_shape` of its constructor),
    and report XLA's memory analysis of each."""
    from kvjax.generate import _programs, length_bucket, sampling_args
    from kvjax.plan import init_caches

    cfg = model.config
    graphdef, params = nnx.split(model)
    programs = _programs(graphdef)
    spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, jnp.dtype(dtype))  # noqa: E731
    caches = jax.eval_shape(lambda: init_caches(cfg, batch, context))
    rows, tokens = spec((batch,), "int32"), spec((batch, chunk), "int32")
    prefill = programs.prefill_chunk.trace(
        params, caches, spec((batch, cfg.d_model), cfg.dtype), tokens, rows, spec((), "int32")
    )
    decoding = DecodingConfig(max_new_tokens=new_tokens)
    decode = programs.decode.trace(
        params,
        caches,
        spec((batch, cfg.vocab_size), "float32"),
        rows,
        jax.eval_shape(lambda: jax.random.key(0)),
        (None,) * len(caches),
        None,
        spec((), "int32"),
        width=length_bucket(new_tokens),
        sampling=sampling_args(decoding),
        eos_id=None,
        pad_id=0,
        evict=None,
    )
    return (
        _analysed(f"prefill chunk of {chunk}", prefill),
        _analysed(f"decode of {new_tokens} tokens", decode),
    )


def _analysed(name: str, traced) -> Compiled:
    stats = traced.lower().compile().memory_analysis()
    return Compiled(
        name,
        stats.argument_size_in_bytes,
        stats.output_size_in_bytes,
        stats.alias_size_in_bytes,
        stats.temp_size_in_bytes,
    )


def gib(n: int) -> str:
    """Bytes as GiB, or MiB below one GiB."""
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
