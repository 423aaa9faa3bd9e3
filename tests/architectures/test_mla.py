"""MLA (DeepSeek-V2 sec. 2.1): absorbed == naive, cached == full, MLA contains MHA, exact cache bytes."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kvjax import memory
from kvjax.architectures.mla import MLA
from kvjax.cache import LatentCache, caches_nbytes
from kvjax.config import AttentionConfig, ConfigError, load_config
from kvjax.kinds.mla import MLAConfig
from kvjax.ops import attention
from kvjax.plan import init_caches
from tests.architectures.oracles import (
    B,
    T,
    assert_cached_decode_equals_full_forward,
    assert_gradient_causal,
    stepper,
    tokens_and_positions,
)

TWO_LAYERS = "model.n_layers=2"
NAIVE = "model.mla.absorb=false"
Q_LORA = "model.mla.q_lora_rank=24"
# MHA2MLA's layout: a RoPE key per (source) KV head, each on its own frequency pairs of a 16-dim head
ROPE_HEADS = ("model.mla.rope_heads=2", "model.mla.rope_pairs=[[[0, 3], [1, 5]], [[7, 2], [4, 6]]]")


def decode_all(model, cfg, tokens, pos, prefill):
    """Logits of a prefill of `prefill` tokens, then one token at a time, jitted."""
    step = stepper(model, jit=True)
    logits, caches = step(tokens[:, :prefill], pos[:, :prefill], init_caches(cfg, B, T))
    out = [logits]
    for t in range(prefill, T):
        logits, caches = step(tokens[:, t : t + 1], pos[:, t : t + 1], caches)
        out.append(logits)
    return jnp.concatenate(out, axis=1), caches


@pytest.mark.parametrize(
    "overrides",
    [[], [NAIVE], [Q_LORA], ROPE_HEADS, [*ROPE_HEADS, NAIVE]],
    ids=["absorbed", "naive", "q-lora", "rope-heads", "rope-heads-naive"],
)
def test_cached_decode_equals_full_forward(make_model, overrides):
    caches = assert_cached_decode_equals_full_forward(*make_model("mla", TWO_LAYERS, *overrides), prefill=7)
    assert all(isinstance(c, LatentCache) for c in caches) and len(caches) == 2


@pytest.mark.parametrize("overrides", [[], [NAIVE]], ids=["absorbed", "naive"])
def test_decode_over_key_blocks_equals_full_forward(make_model, overrides):
    """40 tokens decoded into 64 slots, through kvjax.ops' blocked path (blocks of 32, keys in both):
    absorbed (latent and RoPE logits summed over the shared latents) and naive (expanded keys of 20
    dims, values of 16)."""
    assert_cached_decode_equals_full_forward(
        *make_model("mla", TWO_LAYERS, *overrides), prefill=30, length=40, capacity=64
    )


@pytest.mark.parametrize("q_lora", [[], [Q_LORA], ROPE_HEADS], ids=["direct-q", "q-lora", "rope-heads"])
def test_absorbed_equals_naive_for_prefill_and_decode(make_model, q_lora):
    cfg, absorbed = make_model("mla", TWO_LAYERS, *q_lora)
    _, naive = make_model("mla", TWO_LAYERS, NAIVE, *q_lora)  # same seed: the same weights
    tokens, pos = tokens_and_positions(cfg.vocab_size)
    np.testing.assert_allclose(absorbed(tokens, pos)[0], naive(tokens, pos)[0], atol=1e-5, rtol=1e-5)
    a, _ = decode_all(absorbed, cfg, tokens, pos, prefill=5)
    n, _ = decode_all(naive, cfg, tokens, pos, prefill=5)
    np.testing.assert_allclose(a, n, atol=1e-5, rtol=1e-5)


def intermediate_shapes(jaxpr) -> list[tuple]:
    """Shapes of every value a jaxpr computes, nested jaxprs (jit, custom_jvp, ...) included."""
    shapes = []
    for eqn in jaxpr.eqns:
        shapes += [v.aval.shape for v in eqn.outvars]
        for param in eqn.params.values():
            inner = getattr(param, "jaxpr", param)
            if hasattr(inner, "eqns"):
                shapes += intermediate_shapes(inner)
    return shapes


def test_absorbed_decode_never_builds_per_head_keys_or_values():
    """Intermediates of one decode step over S cached tokens: the naive path has [.., S, N, d_head]
    tensors (expanded K/V); the absorbed path has none (only scores [.., N, S] and latents [.., S, Dc])."""
    N, S = 3, 37
    att = AttentionConfig(n_heads=N, n_kv_heads=N, head_dim=8)
    cfg = MLAConfig(kv_lora_rank=7, qk_nope_head_dim=5, qk_rope_head_dim=2, v_head_dim=6)
    x = jnp.ones((2, 1, 32))
    pos = jnp.full((2, 1), 10, jnp.int32)
    cache = LatentCache.init(2, S, 7, 2, jnp.float32)

    def per_head_kv_shapes(absorb: bool):
        mla = dataclasses.replace(cfg, absorb=absorb)
        layer = MLA(32, att, mla, norm_eps=1e-5, std=0.1, dtype=jnp.float32, rngs=nnx.Rngs(0))
        shapes = intermediate_shapes(jax.make_jaxpr(lambda x, c: layer(x, pos, c))(x, cache).jaxpr)
        return [s for s in shapes if S in s and N in s and {5, 6, 7} & set(s[s.index(S) :])]

    assert per_head_kv_shapes(absorb=False)  # the check can fail: naive expands [B,S,N,d]
    assert per_head_kv_shapes(absorb=True) == []


def test_mla_reproduces_an_mha_layer():
    """With d_c = 2 N H, no latent norm and zero RoPE queries, MLA is MHA without positions: W_DKV = [W_K W_V],
    W_UK / W_UV pick each head's block, and W_Q absorbs the change of softmax scale."""
    N, H, D, Dr = 4, 6, 32, 2
    att = AttentionConfig(n_heads=N, n_kv_heads=N, head_dim=H)
    cfg = MLAConfig(kv_lora_rank=2 * N * H, qk_nope_head_dim=H, qk_rope_head_dim=Dr, v_head_dim=H, latent_norm=False)
    layer = MLA(D, att, cfg, norm_eps=1e-5, std=0.2, dtype=jnp.float32, rngs=nnx.Rngs(3))
    keys = jax.random.split(jax.random.key(7), 5)
    w_q, w_k, w_v = (jax.random.normal(k, (D, N * H)) * 0.3 for k in keys[:3])
    w_o = jax.random.normal(keys[3], (N * H, D)) * 0.3
    x = jax.random.normal(keys[4], (2, 9, D))
    pos = jnp.broadcast_to(jnp.arange(9), (2, 9))

    q = jnp.zeros((D, N, H + Dr)).at[:, :, :H].set(w_q.reshape(D, N, H) * ((H + Dr) / H) ** 0.5)
    layer.q.kernel[...] = q.reshape(D, -1)
    layer.kv_down.kernel[...] = jnp.concatenate([w_k, w_v], axis=1)
    eye = jnp.eye(N * H)
    layer.k_up.kernel[...] = jnp.concatenate([eye, jnp.zeros_like(eye)], axis=0)
    layer.v_up.kernel[...] = jnp.concatenate([jnp.zeros_like(eye), eye], axis=0)
    layer.o.kernel[...] = w_o

    def heads(w):
        return (x @ w).reshape(2, 9, N, H)

    ref = attention(heads(w_q), heads(w_k).transpose(0, 2, 1, 3), heads(w_v).transpose(0, 2, 1, 3), pos, pos)
    ref = ref.reshape(2, 9, N * H) @ w_o
    for absorb in (True, False):
        layer.cfg = dataclasses.replace(cfg, absorb=absorb)
        np.testing.assert_allclose(layer(x, pos)[0], ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("capacity", [1, 50])
def test_measured_bytes_equal_analytic(make_model, capacity):
    cfg, _ = make_model("mla")
    assert caches_nbytes(init_caches(cfg, 3, capacity)) == memory.cache_bytes(cfg, capacity, batch=3)
    # 4 layers x (12-dim latent + 4-dim rope key) x fp32: a quarter of GQA's K/V payload
    assert memory.kv_bytes_per_token(cfg) == 4 * 16 * 4 == memory.kv_bytes_per_token(load_config("gqa").model) // 4


def test_rope_heads_and_pairs_shape_the_cache_and_the_rotation(make_model):
    """Two RoPE key heads of 4 dims per token; each head rotates with its pairs' frequencies: a key
    head's RoPE part at position p equals the standard rotation by theta^(-2k/16) of its pairs k."""
    from kvjax.rope import frequencies, rotate

    cfg, model = make_model("mla", TWO_LAYERS, *ROPE_HEADS)
    assert memory.kv_bytes_per_token(cfg) == 2 * (12 + 2 * 4) * 4
    assert caches_nbytes(init_caches(cfg, 2, 9)) == memory.cache_bytes(cfg, 9, batch=2)
    layer = model.blocks[1].mixer
    x = jnp.asarray(np.random.default_rng(0).normal(size=(1, 3, 2, 4)), jnp.float32)
    pos = jnp.asarray([[0, 5, 11]], jnp.int32)
    for head, pairs in enumerate(((7, 2), (4, 6))):
        inv = frequencies(jnp.asarray(pairs), 16, cfg.attention.rope_theta)[None, None]
        np.testing.assert_allclose(layer.rope(x, pos)[:, :, head], rotate(x[:, :, head], pos, 0.0, inv), atol=1e-6)


def test_gradient_causality(make_model):
    assert_gradient_causal(*make_model("mla", TWO_LAYERS))


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["model.mla.qk_rope_head_dim=3"], "model.mla.qk_rope_head_dim=3 must be a positive even number"),
        (["model.mla.kv_lora_rank=0"], "model.mla.kv_lora_rank=0 must be > 0"),
        (["model.mla.q_lora_rank=-1"], "model.mla.q_lora_rank=-1 must be >= 0"),
        (["model.mla.v_head_dim=0"], "model.mla.v_head_dim=0 must be > 0"),
        (["model.attention.window=8"], "model.attention.window=8 must be null for MLA layers"),
        (["model.kv_sharing.kind=cla", "model.kv_sharing.factor=2"], "model.kv_sharing.kind='cla' must be 'none'"),
        (["model.layer_pattern=[mla, lstm]"], "model.layer_pattern=['mla', 'lstm'] must be a non-empty list"),
        (["model.layer_pattern=[]"], "model.layer_pattern=[] must be a non-empty list"),
        (["model.mla.rope_heads=3"], "model.mla.rope_heads=3 must divide model.attention.n_heads=8"),
        ([*ROPE_HEADS, "model.n_layers=3"], "must have one entry per layer (model.n_layers=3)"),
        (["model.mla.rope_pairs=[[[0]]]"], "must list rope_heads=1 heads of qk_rope_head_dim/2 pair indices"),
        (
            [ROPE_HEADS[0], "model.attention.impl=pallas"],
            "decodes with kvjax's Pallas kernels, which have none for MLA with several RoPE key heads",
        ),
    ],
)
def test_invalid_settings_raise(overrides, message):
    with pytest.raises(ConfigError) as info:
        load_config("mla", overrides)
    assert message in str(info.value)


def test_wrong_latent_chunk_is_an_error():
    cache = LatentCache.init(2, 8, 12, 4, jnp.float32)
    with pytest.raises(ValueError, match="must be \\[B=2, T, Dc=12\\]"):
        cache.update(jnp.zeros((2, 1, 11)), jnp.zeros((2, 1, 4)), jnp.zeros((2, 1), jnp.int32))
