"""DuoAttention (Xiao et al. 2024, arXiv 2410.10819): a few *retrieval* heads need every token, the
other *streaming* heads only the attention sinks and a recent window, so their cache stays constant.

Which head is which is learned (sec. 3.1): a gate alpha per KV head mixes the two ways of attending,
`o = alpha * full_attention + (1 - alpha) * streaming_attention` (eq. 1, alpha shared by the query
heads of a KV group), trained with the model frozen (`training.duo`). At deployment (sec. 3.2) the
lowest-alpha heads become streaming heads: `GateMix` is the training-time mixing, `DuoKVCache` the
deployed cache (the policy `duo:RATIO`, the fraction of streaming heads), `streaming_heads` the choice
and `load_pattern` / `save_pattern` the learned gates on disk.

As in the reference code the prefill attends fully with every head (`one_way_reordered`: the first
prefill chunk is full attention); afterwards each streaming head keeps the first `sinks` positions and
the last `recent` ones, and a decode query of a streaming head sees exactly those (a key is visible
when `j < sinks` or `i - j < recent`, the reference's `generate_streaming_mask`).

The paper splits full-attention layers. With `local=true` (kvjax's extension, for Gemma's sliding-window
layers) a local layer's heads are split too: its retrieval heads see its window, its streaming heads
the part of their sinks and recent tokens that the window still covers; the gates of those layers are
learned with the rest (`kvjax duo-train MODEL --local`).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from kvjax.cache import KVCache, KVView, RingKVCache, _Arrays, heads_first
from kvjax.config import CONFIG_ROOT, ConfigError
from kvjax.ops import attend, attention, attention_probs
from kvjax.plan import compressible, kv_heads

SINKS, RECENT = 64, 256  # the reference evaluation scripts' deployment sinks and recent window
PATTERN_FILE = "duo_pattern.json"  # the learned gates of a run, next to its checkpoints


def streaming_attention(
    q, k, v, q_pos, k_pos, *, sinks: int, recent: int, window=None, impl="xla", softcap=None
) -> jax.Array:
    """Attention `[B,T,N,Hv]` of q `[B,T,N,H]` over k, v `[B,K,S,H]` where query i sees key j iff
    j <= i and (j < sinks or i - j < recent), and in a sliding-window layer also i - j < window (its
    sinks are seen only while the window still covers them)."""
    probs = attention_probs(
        q, k, v, q_pos, k_pos, window=recent, sinks=sinks, horizon=window, impl=impl, softcap=softcap
    )
    return attend(probs, v).astype(q.dtype)


def _per_query_head(x: jax.Array, n_heads: int) -> jax.Array:
    """A value per KV head `[K]` repeated for the query heads of its group `[N]`."""
    return jnp.repeat(x, n_heads // x.shape[0])


class _GatedView:
    """A chunk's own K/V, attended with eq. 1's per-head mix of full and streaming attention."""

    def __init__(self, view: KVView, mix: GateMix):
        self.view, self.mix = view, mix

    def attend(self, q, q_pos, impl, window=None, softcap=None):
        view, mix = self.view, self.mix
        seen = (q, view.k, view.v, q_pos, view.pos)
        full = attention(*seen, window=window, impl=impl, fresh=view.fresh, softcap=softcap)
        stream = streaming_attention(
            *seen, sinks=mix.sinks, recent=mix.recent, window=window, impl=impl, softcap=softcap
        )
        alpha = _per_query_head(jnp.clip(mix.gates, 0.0, 1.0), q.shape[2])[None, None, :, None]
        return (alpha * full.astype(jnp.float32) + (1 - alpha) * stream.astype(jnp.float32)).astype(q.dtype)


@struct.dataclass
class GateMix:
    """Training-time stand-in for one attention producer's cache: stores nothing, and makes the layer's
    queries attend to their own chunk with the gated mix of eq. 1. gates `[K]` (clipped to [0, 1] in the
    forward, as the reference clamps them)."""

    gates: jax.Array
    sinks: int = struct.field(pytree_node=False, default=SINKS)
    recent: int = struct.field(pytree_node=False, default=RECENT)

    def update(self, k, v, pos):
        view = KVView(heads_first(k), heads_first(v), pos, fresh=k.shape[1])
        return self, view._replace(reader=_GatedView(view, self))


class _DuoView:
    """What a chunk attends to in a `DuoKVCache`: the retrieval heads' full view and the streaming
    heads' sinks + recent view; `attend` runs each on its query heads and puts the heads back in order."""

    def __init__(self, cache: DuoKVCache, full: KVView | None, stream: KVView | None):
        self.cache, self.full, self.stream = cache, full, stream

    def attend(self, q, q_pos, impl, window=None, softcap=None):
        cache, (T, N) = self.cache, q.shape[1:3]
        G = N // (len(cache.retrieval) + len(cache.streaming))
        outs, order = [], []
        for heads, view in ((cache.retrieval, self.full), (cache.streaming, self.stream)):
            if not heads:
                continue
            idx = np.concatenate([np.arange(h * G, (h + 1) * G) for h in heads])
            q_part = q[:, :, idx]
            if view is self.full or T == 1:  # a decode query's streaming view holds exactly its sinks + recent
                outs.append(
                    attention(q_part, view.k, view.v, q_pos, view.pos, window=window, impl=impl, softcap=softcap)
                )
            else:
                stream = dict(sinks=cache.sinks, recent=cache.recent, window=window, impl=impl, softcap=softcap)
                outs.append(streaming_attention(q_part, view.k, view.v, q_pos, view.pos, **stream))
            order.append(idx)
        out = jnp.concatenate(outs, axis=2)
        return out[:, :, np.argsort(np.concatenate(order))]


@struct.dataclass
class DuoKVCache(_Arrays):
    """DuoAttention's deployed cache of one attention producer: retrieval heads in a dense cache
    (`full`, `[B,Kr,S,H]`; a ring in a sliding-window layer), streaming heads in a cache of their first
    `sinks` positions (`sink`) and a ring of their last `recent` positions past the sinks (`ring`), so
    their memory is constant. A part with no heads is None. `retrieval` and `streaming` are the KV head
    indices of each part."""

    full: KVCache | RingKVCache | None
    sink: KVCache | None
    ring: RingKVCache | None
    retrieval: tuple[int, ...] = struct.field(pytree_node=False, default=())
    streaming: tuple[int, ...] = struct.field(pytree_node=False, default=())
    sinks: int = struct.field(pytree_node=False, default=SINKS)
    recent: int = struct.field(pytree_node=False, default=RECENT)

    @classmethod
    def from_cache(
        cls, cache: KVCache, streaming: tuple[int, ...], sinks: int, recent: int, capacity: int, ring: bool = False
    ):
        """Split a dense prefill cache (positions shared by its heads): retrieval heads keep every token
        in `capacity` slots (`ring`: a sliding-window layer's ring of that many, as the layer had),
        streaming heads their sinks and last `recent` tokens."""
        if cache.pos.ndim != 2:
            raise ValueError("DuoAttention splits a dense cache (positions shared by the heads)")
        B, K, _, H = cache.k.shape
        retrieval = tuple(h for h in range(K) if h not in streaming)
        k, v, pos = cache.k.transpose(0, 2, 1, 3), cache.v.transpose(0, 2, 1, 3), cache.pos  # token-major
        empty = cls(None, None, None, retrieval, tuple(streaming), sinks, recent)
        parts = empty._parts(B, capacity, H, cache.k.dtype, RingKVCache if ring else KVCache)
        new, _ = empty.replace(**parts).update(k, v, pos)
        return new

    def _parts(self, batch, capacity, head_dim, dtype, full_cache=KVCache) -> dict:
        full = full_cache.init(batch, capacity, len(self.retrieval), head_dim, dtype) if self.retrieval else None
        Ks = len(self.streaming)
        sink = KVCache.init(batch, self.sinks, Ks, head_dim, dtype) if Ks and self.sinks else None
        ring = RingKVCache.init(batch, self.recent, Ks, head_dim, dtype) if Ks else None
        return {"full": full, "sink": sink, "ring": ring}

    def update(self, k, v, pos):
        """Write a chunk k, v `[B,T,K,H]`: retrieval heads append it, streaming heads keep positions
        below `sinks` in `sink` and the rest in the ring (a chunk attends over the old ring plus itself,
        then its last `recent` tokens stay)."""
        full = stream = None
        new = self
        if self.retrieval:
            r = np.array(self.retrieval)
            cache, full = self.full.update(k[:, :, r], v[:, :, r], pos)
            new = new.replace(full=cache)
        if self.streaming:
            s = np.array(self.streaming)
            ks, vs = k[:, :, s], v[:, :, s]
            ring, ring_view = self.ring.update(ks, vs, jnp.where(pos >= self.sinks, pos, -1))
            new, stream = new.replace(ring=ring), ring_view
            if self.sink is not None:
                sink, sink_view = self.sink.update(ks, vs, jnp.where(pos < self.sinks, pos, -1))
                new = new.replace(sink=sink)
                stream = KVView(
                    *(
                        jnp.concatenate([a, b], axis=-2 if a.ndim == 4 else -1)
                        for a, b in zip(sink_view[:3], ring_view[:3])
                    )
                )
        main = full if full is not None else stream
        return new, KVView(main.k, main.v, main.pos, reader=_DuoView(new, full, stream))


def streaming_heads(gates: list[np.ndarray], ratio: float) -> tuple[tuple[int, ...], ...]:
    """The streaming heads of each layer (gates `[K_l]` per layer): the round(ratio x all heads) heads
    with the lowest gates over the whole model (kvpress's `DuoAttentionPress` count; the reference's
    quantile threshold differs by at most a head).

    Ties at the cut go to the lower layer, then the lower head (a stable sort over the flattened gates).
    kvpress sorts with `np.argsort`'s default quicksort, which is not stable, so where several heads
    share the gate at the cut (SmolLM2's learned pattern has 30 heads at exactly 0) the two may stream
    different heads of equal gates; the count, and every head whose gate differs from the cut's, agree."""
    flat = np.concatenate([np.asarray(g, np.float64) for g in gates])
    n = int(round(ratio * flat.size))
    chosen = set(np.argsort(flat, kind="stable")[:n].tolist())
    out, start = [], 0
    for g in gates:
        out.append(tuple(h for h in range(len(g)) if start + h in chosen))
        start += len(g)
    return tuple(out)


def save_pattern(path: str | Path, gates: list[np.ndarray], **record) -> None:
    """Write learned gates (one list per compressible layer) and their training record as JSON,
    atomically (a temporary file renamed over the target)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    body = json.dumps({"gates": [np.asarray(g, np.float64).round(6).tolist() for g in gates], **record}, indent=1)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        f.write(body + "\n")
    os.chmod(tmp, 0o644)  # readable like any other file (mkstemp makes it private)
    os.replace(tmp, path)


def load_pattern(path: str | Path, heads: tuple[int, ...], local_heads: tuple[int, ...] = ()) -> tuple[list, dict]:
    """Gates of a pattern file checked against the model: KV heads of each compressible layer (`heads`),
    or of each compressible layer and ring (`local_heads`) when the pattern was learned with the rings
    (its record says `local`)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(
            f"policy stage 'duo': no learned pattern at {path}; learn one with `kvjax duo-train MODEL` "
            "(--local for duo:R:local) or pass pattern=PATH"
        )
    try:
        record = json.loads(path.read_text())
        gates = [np.asarray(g, np.float64) for g in record["gates"]]
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"policy stage 'duo': {path} is not a DuoAttention pattern file ({e})") from None
    shape = tuple(len(g) for g in gates)
    if record.get("local"):
        heads = local_heads
    if shape != tuple(heads):
        raise ConfigError(
            f"policy stage 'duo': {path} has gates for KV heads {shape} per layer; this model's compressible "
            f"layers have {tuple(heads)}: the pattern was learned on another model"
        )
    return gates, record


def duo_heads(stage, cfg) -> tuple[tuple[int, ...], ...]:
    """The streaming heads of each compressible cache of `cfg` for a `duo:RATIO` stage, from its pattern."""
    if not stage.options.pattern:
        raise ConfigError(
            "policy stage 'duo' needs the model's learned pattern: pass pattern=PATH (the kvjax command finds "
            f"{PATTERN_FILE} of a run, or configs/duo/NAME.json of an imported model)"
        )
    growing, every = compressible(cfg), compressible(cfg, local=True)
    gates, record = load_pattern(
        stage.options.pattern, tuple(kv_heads(cfg, s) for s in growing), tuple(kv_heads(cfg, s) for s in every)
    )
    if stage.local and not record.get("local"):
        raise ConfigError(
            f"policy stage 'duo': local=true needs gates for the sliding-window layers too, and "
            f"{stage.options.pattern} has the growing caches' only: learn them with `kvjax duo-train MODEL --local`"
        )
    if record.get("local") and not stage.local:  # the rings' gates stay out of the choice
        gates = [g for g, slot in zip(gates, every) if slot in growing]
    return streaming_heads(gates, stage.ratio)


def _pattern_name(model_name: str, local: bool) -> str:
    """An imported model's pattern file: `NAME.json`, or `NAME.local.json` with the rings' gates too."""
    return f"{model_name}{'.local' if local else ''}.json"


def default_pattern(model_ref: str, model_name: str, local: bool = False) -> Path:
    """Where `duo:R` (`local`: `duo:R:local`) reads a model's learned pattern: `duo_pattern.json` in a run
    directory trained here, else the shipped `configs/duo/<model name>[.local].json` (imported GGUF and
    Hugging Face models)."""
    if is_run(model_ref):
        return Path(model_ref) / PATTERN_FILE
    return CONFIG_ROOT / "duo" / _pattern_name(model_name, local)


def learned_pattern_path(model_ref: str, model_name: str | None, local: bool = False) -> Path | None:
    """Where `kvjax duo-train` writes by default: the run directory's `duo_pattern.json`, else
    `runs/duo/<model name>[.local].json` (None while the name is unknown); never the shipped patterns."""
    if is_run(model_ref):
        return Path(model_ref) / PATTERN_FILE
    return None if model_name is None else Path("runs") / "duo" / _pattern_name(model_name, local)


def check_pattern_target(path: Path, overwrite: bool) -> None:
    """Refuse to write a pattern over a shipped one (read-only input) or, without `overwrite`, over any file."""
    if path.resolve().is_relative_to(CONFIG_ROOT.resolve()):
        raise ConfigError(
            f"--out={path} is inside kvjax's shipped configs ({CONFIG_ROOT}), which commands only "
            "read; write the pattern elsewhere and pass it as duo:R:pattern=PATH"
        )
    if path.exists() and not overwrite:
        raise ConfigError(
            f"{path} exists (a pattern learned before); pass --overwrite to replace it, or --out another file"
        )


def is_run(model_ref: str) -> bool:
    """A run directory trained here (it has checkpoints/)."""
    return (Path(model_ref) / "checkpoints").is_dir()


def with_pattern(policy_text: str, path: str | Path, local_path: str | Path | None = None) -> str:
    """A policy text whose `duo` stages without `pattern=` read `path` (`local_path` for a stage that says
    `local`): `duo:0.5` -> `duo:0.5:pattern=PATH` (also `duo` and `duo:sinks=4`, methods whose budget
    comes later)."""
    stages = []
    for stage in policy_text.split("+"):
        parts = stage.strip().split(":")
        if parts[0] == "duo" and "pattern=" not in stage:
            budget = len(parts) > 1 and parts[1].replace(".", "", 1).isdigit()
            options = parts[2:] if budget else parts[1:]
            head = parts[:2] if budget else parts[:1]
            flags = [tuple(x.strip() for x in o.partition("=")[::2]) for part in options for o in part.split(",")]
            local = any(name == "local" and value.lower() in ("", "true") for name, value in flags)
            chosen = local_path if local and local_path is not None else path
            stage = ":".join([*head, ",".join([*options, f"pattern={chosen}"])])
        stages.append(stage)
    return "+".join(stages)
