"""The decoder-only LM, built layer by layer from the model's `LayerPlan`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

# The mixer modules register their kinds' builders when imported: one import per module.
from kvjax.architectures import mamba, mla, retention, rwkv  # noqa: F401
from kvjax.architectures.attention import Attention
from kvjax.architectures.layers import GatedMLP, RMSNorm, dense
from kvjax.architectures.mixers import MIXERS
from kvjax.cache import KVCache, LatentCache, LayerCache, PooledKVCache, RingKVCache
from kvjax.config import ModelConfig
from kvjax.paged import PagedKVCache, SharedPool
from kvjax.plan import LayerPlan, sharable_kinds
from kvjax.slot_states import SlotStates

Caches = tuple[LayerCache, ...]


class Block(nnx.Module):
    """Pre-norm residual block: x + mixer(norm(x)), then x + mlp(norm(x)); with `sandwich_norms` (Gemma
    2 and 3) the mixer's and the MLP's outputs are normed too before they are added.

    Layer `layer` of the plan builds the mixer its kind registered (`kvjax.architectures.mixers`). A K/V
    producer for which `cfg.uses_kv_norm(layer)` holds (CLA producers, YOCO's first cross layer) feeds its
    K/V projections through a separate `kv_norm` of x, since those K/V also serve other layers.
    """

    def __init__(self, cfg: ModelConfig, *, layer: int, rngs: nnx.Rngs):
        kind, produces_kv = cfg.mixers[layer], cfg.kv_source[layer] == layer
        dtype = jnp.dtype(cfg.dtype)
        norm = lambda: RMSNorm(cfg.d_model, eps=cfg.norm_eps, dtype=dtype, offset=cfg.norm_offset)  # noqa: E731
        self.mixer_norm = norm()
        self.kv_norm = norm() if cfg.uses_kv_norm(layer) else None
        mixer = MIXERS[kind]
        self.mixer = mixer.build(cfg, layer, produces_kv, rngs)
        self.post_mixer_norm = norm() if cfg.sandwich_norms else None
        self.mlp_norm = norm()
        if mixer.mlp is not None:  # the kind's own MLP, which reads and updates the layer state
            self.mlp = mixer.mlp(cfg, layer, rngs)
        else:
            self.mlp = GatedMLP(cfg.d_model, cfg.ffn_dim, std=cfg.init_std, dtype=dtype, rngs=rngs, act=cfg.mlp_act)
        self.post_mlp_norm = norm() if cfg.sandwich_norms else None

    def __call__(self, x, positions, cache=None, *, shared=None):
        """Returns (x, cache, view): the mixer's updated cache and the K/V view it attended to (None for
        mixers without K/V). With `shared`, the mixer attends to that view and computes no K/V."""
        if shared is not None:
            sharing = {"shared": shared}
        else:
            sharing = {} if self.kv_norm is None else {"kv_x": self.kv_norm(x)}
        y, cache, view = self.mixer(self.mixer_norm(x), positions, cache, **sharing)
        x = x + (y if self.post_mixer_norm is None else self.post_mixer_norm(y))
        if not isinstance(self.mlp, GatedMLP):  # a kind's own MLP carries the layer state
            y, cache = self.mlp(self.mlp_norm(x), positions, cache)
        else:
            y = self.mlp(self.mlp_norm(x))
        return x + (y if self.post_mlp_norm is None else self.post_mlp_norm(y)), cache, view

    def observe(self, x, positions, view):
        """Attention probabilities of this block's queries for inputs x `[B,W,D]` over `view` (see
        `Attention.probs`, `MLA.probs`) and the post-RoPE queries `[B,W,N,H]` themselves (None for MLA,
        whose queries are not per-head keys' partners)."""
        x = self.mixer_norm(x)
        queries = self.mixer.queries(x, positions) if isinstance(self.mixer, Attention) else None
        return self.mixer.probs(x, positions, view), queries

    def write_kv(self, x, positions, cache=None):
        """Only this producer's K/V of x `[B,T,D]`, written to `cache`: (cache, view)."""
        kv_x = self.mixer_norm(x) if self.kv_norm is None else self.kv_norm(x)
        return self.mixer.kv(kv_x, positions, cache)


class Decoder(nnx.Module):
    """tokens `[B,T]` -> logits `[B,T,V]` (fp32), threading one cache per producer layer of the plan."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.config = cfg
        self.plan = LayerPlan.from_config(cfg)
        dtype = jnp.dtype(cfg.dtype)
        self.embed = nnx.Embed(
            cfg.vocab_size,
            cfg.d_model,
            dtype=dtype,
            param_dtype=dtype,
            embedding_init=nnx.initializers.normal(cfg.init_std),
            rngs=rngs,
        )
        self.blocks = nnx.List([Block(cfg, layer=i, rngs=rngs) for i in range(cfg.n_layers)])
        self.final_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, dtype=dtype, offset=cfg.norm_offset)
        self.lm_head = (
            None if cfg.tie_embeddings else dense(cfg.d_model, cfg.vocab_size, std=cfg.init_std, dtype=dtype, rngs=rngs)
        )

    def __call__(
        self, tokens: jax.Array, positions: jax.Array, caches: Caches | None = None
    ) -> tuple[jax.Array, Caches | None]:
        """Logits for tokens `[B,T]` at positions `[B,T]` (-1 marks padding), and the updated caches."""
        hidden, caches = self.hidden(tokens, positions, caches)
        return self.logits(hidden), caches

    def hidden(self, tokens, positions, caches=None):
        """Final-normed hidden states `[B,T,D]` (before the vocabulary projection) and the caches."""
        return self.run_blocks(self.embed_tokens(tokens), positions, caches)

    def embed_tokens(self, tokens: jax.Array) -> jax.Array:
        """The embeddings `[B,T,D]` of tokens, times sqrt(d_model) in the model's dtype with `embed_scale`
        (Gemma; the tied output projection reads the unscaled table)."""
        x = self.embed(tokens)
        if self.config.embed_scale:
            x = x * jnp.asarray(self.config.d_model**0.5, x.dtype)
        return x

    def run_blocks(self, x, positions, caches=None):
        """The blocks and the final norm over embeddings x `[B,T,D]`; returns (hidden, caches)."""
        if caches is not None and len(caches) != len(self.plan.producers):
            raise ValueError(f"got {len(caches)} caches; the plan has {len(self.plan.producers)} producers")
        x, caches, _ = self._run(x, positions, caches, self.plan.n_layers)
        return self.final_norm(x), caches

    def observe(self, tokens, positions, caches, obs_index, reduce, rings: bool = False):
        """`hidden` that also observes attention for KV compressors (kvjax.compress): for each producer
        whose cache keeps tokens (KVCache, PooledKVCache, LatentCache; with `rings`, sliding-window rings
        too), `reduce(probs, obs_pos, view, q)` of the probabilities `[B,K,W,G,S]` of the queries at token
        indices obs_index `[B,W]` (-1: none) over the view it attended to, and of those queries q
        `[B,W,N,H]` (None for MLA). Returns (hidden, caches, one reduction per producer or None)."""
        x, caches, observed = self._run(
            self.embed_tokens(tokens), positions, caches, self.plan.n_layers, (obs_index, reduce, rings)
        )
        return self.final_norm(x), caches, observed

    def _run(self, x, positions, caches, stop: int, observe=None):
        """Blocks 0..stop-1: producers write their cache (one per producer, in plan order); a consumer
        attends to the K/V view its producer attended to in this same call. With `observe`
        (obs_index, reduce, rings), see `observe`."""
        plan = self.plan
        new_caches = None if caches is None else list(caches)
        observed = [None] * len(plan.producers)
        views, shared = {}, SharedPool()  # layers whose pages are one pool take it in turn
        for i, block in enumerate(self.blocks[:stop]):
            src = plan.kv_source[i]
            if src != i:
                x, _, _ = block(x, positions, shared=views[src])
                continue
            slot = plan.cache_index(i)
            cache = None if caches is None else caches[slot]
            joined = getattr(cache, "source", -1) >= 0  # MiniCache: a layer reading its pair's merged K/V
            if joined:
                cache = cache.replace(merged=new_caches[cache.source])
            x_in = x
            cache = shared.enter(slot, cache)
            if isinstance(cache, SlotStates):  # the engine's states of a recurrent layer (kvjax.slot_states)
                x, cache, views[i] = cache.run(block, x, positions)
            else:
                x, cache, views[i] = block(x, positions, cache)
            if new_caches is not None:
                new_caches[slot] = shared.leave(cache.replace(merged=None) if joined else cache)
            if observe is not None and (
                isinstance(cache, KVCache | PooledKVCache | LatentCache)
                or (isinstance(cache, PagedKVCache) and not cache.windowed)  # the engine's (`kvjax.paged_eviction`)
                or (observe[2] and isinstance(cache, RingKVCache | PagedKVCache))  # rings, the engine's too
            ):
                observed[slot] = _observed(block, x_in, positions, views[i], *observe[:2])
        return x, None if new_caches is None else tuple(shared.close(new_caches)), tuple(observed)

    @property
    def tail_start(self) -> int:
        """The first layer e of the shared tail: every layer from e on is attention reading producer e's
        K/V (YOCO's cross-decoder; the last layer of any attention model). Their queries are needed only
        where logits are; n_layers when there is no such tail."""
        plan = self.plan
        e = plan.kv_source[-1]
        tail = range(e, plan.n_layers)
        if all(plan.kv_source[i] == e and plan.mixers[i] in sharable_kinds() for i in tail):
            return e
        return plan.n_layers

    def prefill_last(self, tokens, positions, caches, last):
        """Write prompts `[B,T]` (positions -1 for padding) to the caches and return the final-normed hidden
        state `[B,D]` at each row's token `last[b]`: YOCO's early exit (sec. 2.3). Layers before
        `tail_start` run on every token; the tail's producer writes K/V for every token; the tail's
        queries, MLPs and everything after them run for the last tokens only."""
        e = self.tail_start
        if e == self.plan.n_layers:
            hidden, caches = self.hidden(tokens, positions, caches)
            return jnp.take_along_axis(hidden, last[:, None, None], axis=1)[:, 0], caches
        x, caches, _ = self._run(self.embed_tokens(tokens), positions, caches, e)
        caches = list(caches)
        slot = self.plan.cache_index(e)
        caches[slot], view = self.blocks[e].write_kv(x, positions, caches[slot])
        x = jnp.take_along_axis(x, last[:, None, None], axis=1)
        pos = jnp.take_along_axis(positions, last[:, None], axis=1)
        for block in self.blocks[e:]:
            x, _, _ = block(x, pos, shared=view)
        return self.final_norm(x)[:, 0], tuple(caches)

    def logits(self, hidden: jax.Array) -> jax.Array:
        """Project hidden states to fp32 vocabulary logits (through the tied embedding if configured),
        soft-capped to c * tanh(logits / c) with `final_softcap` c (Gemma 2)."""
        if self.lm_head is None:
            table = self.embed.embedding[...]
            logits = jnp.einsum("...D,VD->...V", hidden, table, preferred_element_type=jnp.float32)
        else:
            logits = self.lm_head(hidden).astype(jnp.float32)
        cap = self.config.final_softcap
        return logits if cap is None else cap * jnp.tanh(logits / cap)


OBS_BLOCK = 512  # observed queries at a time for an additive statistic: [B,K,512,G,S] probabilities, never [T,S]


def _observed(block, x, positions, view, obs_index, reduce):
    """`reduce` of the attention the queries at token indices obs_index `[B,W]` (-1: none) pay to `view`.
    A statistic that is a sum over those queries (`reduce.additive`: H2O's over a whole prompt) is reduced
    OBS_BLOCK queries at a time in a scan and the blocks' statistics added, so no [W, S] probabilities
    exist at once (32k prompt tokens would need 4 GiB of them per KV head)."""

    def part(index):
        x_obs = jnp.take_along_axis(x, jnp.maximum(index, 0)[:, :, None], axis=1)
        pos = jnp.where(index >= 0, jnp.take_along_axis(positions, jnp.maximum(index, 0), axis=1), -1)
        probs, queries = block.observe(x_obs, pos, view)
        return reduce(probs, pos, view, queries)

    W = obs_index.shape[1]
    if W <= OBS_BLOCK or not getattr(reduce, "additive", False):
        return part(obs_index)
    n = -(-W // OBS_BLOCK)
    padded = jnp.pad(obs_index, ((0, 0), (0, n * OBS_BLOCK - W)), constant_values=-1)  # -1: no query
    blocks = padded.reshape(padded.shape[0], n, OBS_BLOCK).transpose(1, 0, 2)
    zero = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(part, blocks[0]))

    def add(total, index):
        return jax.tree.map(jnp.add, total, part(index)), None

    return jax.lax.scan(add, zero, blocks)[0]
