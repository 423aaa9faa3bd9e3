"""Learning DuoAttention's gates (Xiao et al. 2024, arXiv 2410.10819, sec. 3.1): with the model frozen,
one gate alpha per KV head mixes full and streaming attention (`kvjax.duo.GateMix`), and the gates
minimise the distance between the full model's last hidden states and the mixed model's on synthetic
passkey retrieval, plus an L1 penalty that pushes gates (and so heads) towards streaming:

    L = mean over supervised positions of mean_d (H_full - H_mixed)^2  +  reg * mean |alpha|   (eq. 2-3)

as the reference `duo_attn/train.py` computes it (the L1 term a mean over gates, reg = 0.05; AdamW,
lr 0.02, no weight decay, the reference's warm-up / cool-down multiplier, gates clamped to [0, 1] after
every step). Deviations, for a CPU: contexts of about a thousand tokens instead of 1k-32k, fewer
passkeys of fewer words, a few hundred steps instead of 2,000; both terms of eq. 1 come from the
mixed model's own states (the paper's form; the reference feeds the full-attention term from the
teacher's states), and streaming attention is token-exact rather than in 128-token blocks.
"""

from __future__ import annotations

import dataclasses
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from kvjax.config import ConfigError
from kvjax.duo import RECENT, SINKS, GateMix
from kvjax.plan import LayerPlan, compressible, kv_heads
from kvjax.training.retrieval import haystack
from kvjax.training.trainer import TrainingError

NATO = (
    "alfa",
    "bravo",
    "charlie",
    "delta",
    "echo",
    "foxtrot",
    "golf",
    "hotel",
    "india",
    "juliett",
    "kilo",
    "lima",
    "mike",
    "november",
    "oscar",
    "papa",
    "quebec",
    "romeo",
    "sierra",
    "tango",
    "uniform",
    "victor",
    "whiskey",
    "xray",
    "yankee",
    "zulu",
)
ORDINALS = ("first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth", "ninth", "tenth")


@dataclasses.dataclass(frozen=True)
class GateTraining:
    """What `learn_gates` runs: data shape, streaming window, optimizer (defaults: the reference's, scaled
    to a CPU as the module docstring says)."""

    steps: int = 200
    length: int = 1024  # tokens per sample
    keys: int = 4  # passkeys per sample (reference: 10)
    words: int = 8  # NATO words per passkey (reference: 32)
    sinks: int = SINKS
    recent: int = RECENT
    lr: float = 0.02
    reg: float = 0.05
    seed: int = 0
    held_out: int = 4  # samples the objective is reported on, drawn apart from the training ones
    local: bool = False  # gates for the sliding-window layers too (the policy's `local=true`)

    def __post_init__(self):
        for name in ("steps", "length", "keys", "words", "recent", "held_out"):
            if getattr(self, name) < 1:
                raise ConfigError(f"duo training: {name}={getattr(self, name)} must be >= 1")
        if self.keys > len(ORDINALS):
            raise ConfigError(f"duo training: keys={self.keys} must be <= {len(ORDINALS)}")
        if self.sinks < 0 or self.lr <= 0 or self.reg < 0:
            raise ConfigError(f"duo training: sinks={self.sinks} must be >= 0, lr={self.lr} > 0, reg={self.reg} >= 0")
        if self.length <= self.sinks + self.recent:
            raise ConfigError(
                f"duo training: length={self.length} must exceed sinks + recent = "
                f"{self.sinks + self.recent}, or streaming heads see every token"
            )


def passkey_sample(tokenizer, filler: np.ndarray, cfg: GateTraining, rng: np.random.Generator):
    """One training sample (the reference's `data.py`, scaled down): `keys` passkeys of `words` NATO words
    hidden at sorted random depths in corpus text, then each asked for and answered. Returns tokens
    `[length]` and the supervised mask (the question-and-answer tail, as the reference's labels)."""
    keys = [" ".join(rng.choice(NATO, size=cfg.words)) for _ in range(cfg.keys)]
    depths = np.sort(rng.choice(np.linspace(0.05, 0.95, 1000), size=cfg.keys, replace=False))
    needles = [
        (d, f" Remember this sequence of words, it's the {ORDINALS[i]} passkey to the vault: {k}. ")
        for i, (d, k) in enumerate(zip(depths, keys))
    ]
    tail = "".join(f"\nWhat is the {ORDINALS[i]} passkey to the vault?\nPasskey: {k}" for i, k in enumerate(keys))
    n_tail = len(tokenizer.encode(tail))
    start = int(rng.integers(0, max(1, len(filler) - cfg.length)))
    tokens = haystack(tokenizer, filler[start:], cfg.length, needles, tail, bos=False)
    mask = np.zeros(len(tokens), np.float32)
    mask[-n_tail:] = 1
    return np.asarray(tokens, np.int32), mask


def gate_caches(model_cfg, gates, sinks: int, recent: int, local: bool = False) -> tuple:
    """The caches argument that makes a frozen model run eq. 1: a `GateMix` per compressible producer
    (gates `[K]` each, in `compressible(model_cfg, local)` order), None for every other producer."""
    caches = [None] * len(LayerPlan.from_config(model_cfg).producers)
    for g, slot in zip(gates, compressible(model_cfg, local)):
        caches[slot] = GateMix(g, sinks, recent)
    return tuple(caches)


def _positions(tokens):
    return jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)


def teacher_hidden(graphdef, params, tokens):
    """The full model's final-normed hidden states `[B,T,D]` (fp32)."""
    hidden, _ = nnx.merge(graphdef, params).hidden(tokens, _positions(tokens))
    return hidden.astype(jnp.float32)


def objective(graphdef, params, gates, tokens, mask, teacher, *, sinks, recent, reg, local=False):
    """(L, (distillation term, L1 term)) of eq. 2-3 for gates (a tuple of `[K]` arrays)."""
    model = nnx.merge(graphdef, params)
    caches = gate_caches(model.config, gates, sinks, recent, local)
    hidden, _ = model.hidden(tokens, _positions(tokens), caches)
    err = jnp.mean((hidden.astype(jnp.float32) - teacher) ** 2, axis=-1)
    distill = jnp.sum(err * mask) / jnp.maximum(jnp.sum(mask), 1.0)
    l1 = jnp.mean(jnp.abs(jnp.concatenate(gates)))
    return distill + reg * l1, (distill, l1)


def lr_multiplier(steps: int):
    """The reference's schedule factor: linear warm-up over the first fifth of the steps and cool-down
    over the last fifth, never below 0.1 of the rate."""
    fifth = max(steps / 5, 1)

    def factor(step):
        return jnp.minimum(
            1.0, jnp.minimum(jnp.maximum((step + 1) / fifth, 0.1), jnp.maximum((steps - step) / fifth, 0.1))
        )

    return factor


def learn_gates(model, tokenizer, filler: np.ndarray, cfg: GateTraining = GateTraining(), log=print) -> dict:
    """Optimise the gates of `model` (weights frozen); returns {"gates": [per layer `[K]`], "history":
    per-step losses, "held_out_before"/"held_out_after": the objective on held-out samples, "seconds"}."""
    mcfg = model.config
    slots = compressible(mcfg, cfg.local)
    if cfg.local and slots == compressible(mcfg):
        raise ConfigError(f"duo training: local=true learns gates of sliding-window layers, and {mcfg.name!r} has none")
    if not slots or "mla" in mcfg.mixers:
        raise ConfigError(f"model {mcfg.name!r} has no attention cache with per-head keys for DuoAttention's gates")
    graphdef, params = nnx.split(model)
    rng = np.random.default_rng(cfg.seed)
    held = [
        passkey_sample(tokenizer, filler, cfg, np.random.default_rng(cfg.seed + 10_000 + i))
        for i in range(cfg.held_out)
    ]
    gates = tuple(jnp.ones((kv_heads(mcfg, s),), jnp.float32) for s in slots)
    schedule = lambda step: cfg.lr * lr_multiplier(cfg.steps)(step)  # noqa: E731
    tx = optax.adamw(schedule, weight_decay=0.0)
    opt = tx.init(gates)
    teach = jax.jit(partial(teacher_hidden, graphdef))
    loss_fn = partial(objective, graphdef, sinks=cfg.sinks, recent=cfg.recent, reg=cfg.reg, local=cfg.local)

    @jax.jit
    def step(params, gates, opt, tokens, mask, teacher):
        (loss, parts), grads = jax.value_and_grad(loss_fn, argnums=1, has_aux=True)(
            params, gates, tokens, mask, teacher
        )
        updates, opt = tx.update(grads, opt, gates)
        gates = jax.tree.map(lambda g: jnp.clip(g, 0.0, 1.0), optax.apply_updates(gates, updates))
        return gates, opt, loss, parts

    evaluate = jax.jit(loss_fn)

    def held_out(gates):
        vals = []
        for tokens, mask in held:
            t, m = tokens[None], mask[None]
            vals.append(float(evaluate(params, gates, t, m, teach(params, t))[0]))
        return float(np.mean(vals))

    before = held_out(gates)
    history, start = [], time.perf_counter()
    for i in range(cfg.steps):
        tokens, mask = passkey_sample(tokenizer, filler, cfg, rng)
        t, m = tokens[None], mask[None]
        gates, opt, loss, (distill, l1) = step(params, gates, opt, t, m, teach(params, t))
        loss = float(loss)
        if not np.isfinite(loss):
            raise TrainingError(
                f"duo training: the objective became {loss} at step {i + 1}; nothing was written. Lower --lr."
            )
        history.append({"step": i + 1, "loss": loss, "distill": float(distill), "l1": float(l1)})
        if (i + 1) % max(1, cfg.steps // 10) == 0 or i + 1 == cfg.steps:
            log(f"step {i + 1}/{cfg.steps}: loss {loss:.5f} (distill {float(distill):.5f}, mean gate {float(l1):.3f})")
    after = held_out(gates)
    return {
        "gates": [np.asarray(g) for g in gates],
        "history": history,
        "held_out_before": before,
        "held_out_after": after,
        "seconds": time.perf_counter() - start,
    }
