"""Multi-head latent attention (DeepSeek-V2, sec. 2.1.2): per token only the normalized latent c_KV and
the RoPE key(s), `(kv_lora_rank + rope_heads x qk_rope_head_dim)` values and an int32 position; the one
latent serves every head."""

import dataclasses

import jax.numpy as jnp

from kvjax.cache import LatentCache
from kvjax.errors import positive, require
from kvjax.kinds.base import INT32, Kind, LayerMemory, register


@dataclasses.dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2, arXiv 2405.04434, sec. 2.1): the cache holds a
    `kv_lora_rank`-dim latent c_KV (RMSNormed when `latent_norm`) and one `qk_rope_head_dim` RoPE key shared
    by all heads. Heads come from model.attention.n_heads, RoPE theta from model.attention.rope_theta.
    `q_lora_rank` 0 projects queries directly (DeepSeek-V2-Lite); > 0 compresses them too. `absorb`
    folds W_UK into the query and W_UV into the output and attends over the latent itself.

    A model converted from MHA/GQA (MHA2MLA, Ji et al. 2025, sec. 3.2) caches one RoPE key per source KV
    head (`rope_heads`; query head h reads key h // (n_heads / rope_heads)) and keeps RoPE on a chosen
    subset of each head's frequency pairs: `rope_pairs[layer][rope head]` lists the qk_rope_head_dim / 2
    pairs k (of a model.attention.head_dim-dim RoPE, frequency theta^(-2k / head_dim)) its RoPE dims carry.
    null: the standard frequencies of a qk_rope_head_dim-dim RoPE."""

    kv_lora_rank: int = 12
    q_lora_rank: int = 0
    qk_nope_head_dim: int = 16
    qk_rope_head_dim: int = 4
    v_head_dim: int = 16
    latent_norm: bool = True
    absorb: bool = True
    rope_heads: int = 1
    rope_pairs: tuple[tuple[tuple[int, ...], ...], ...] | None = None

    def __post_init__(self):
        p = "model.mla"
        positive(p, self, "kv_lora_rank", "v_head_dim", "rope_heads")
        require(
            self.qk_nope_head_dim >= 0,
            f"{p}.qk_nope_head_dim",
            self.qk_nope_head_dim,
            "must be >= 0 (0: every query/key dim carries RoPE)",
        )
        if self.rope_pairs is not None:
            for layer, heads in enumerate(self.rope_pairs):
                require(
                    len(heads) == self.rope_heads and all(len(k) * 2 == self.qk_rope_head_dim for k in heads),
                    f"{p}.rope_pairs[{layer}]",
                    heads,
                    f"must list rope_heads={self.rope_heads} heads of qk_rope_head_dim/2 pair indices",
                )
        require(self.q_lora_rank >= 0, f"{p}.q_lora_rank", self.q_lora_rank, "must be >= 0 (0 turns it off)")
        require(
            self.qk_rope_head_dim > 0 and self.qk_rope_head_dim % 2 == 0,
            f"{p}.qk_rope_head_dim",
            self.qk_rope_head_dim,
            "must be a positive even number (RoPE rotates pairs of channels)",
        )


@register
class MLA(Kind):
    name = "mla"
    section = "mla"
    Config = MLAConfig
    caches_tokens = True

    def init_cache(self, cfg, batch, capacity, fresh):
        mla = cfg.mla
        return LatentCache.init(
            batch, capacity, mla.kv_lora_rank, mla.rope_heads * mla.qk_rope_head_dim, jnp.dtype(cfg.dtype)
        )

    def memory(self, cfg):
        mla = cfg.mla
        per_token = (mla.kv_lora_rank + mla.rope_heads * mla.qk_rope_head_dim) * jnp.dtype(cfg.dtype).itemsize
        return LayerMemory(per_token, INT32, INT32, None)

    def compressible(self, cfg):
        return True

    def kv_heads(self, cfg):
        return 1
