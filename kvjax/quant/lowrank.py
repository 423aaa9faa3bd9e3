"""Low-rank K/V caches, Palu-style (Chang et al. 2024, arXiv 2407.21118): cache a rank-r latent per group
of KV heads and reconstruct K and V at attention time.

Palu factors each layer's K (and V) projection W ~ A B per group of heads (G-LRD, sec. 3.2) and
caches h A. We factor the same map from calibration data: with X the layer's input on calibration
tokens, the best rank-r approximation of the group's pre-RoPE keys X W in the data's norm is
X W U_r U_r^T, U_r the top-r eigenvectors of (X W)^T (X W) (data-aware SVD, the role Palu's
whitening plays). So A = W U_r and B = U_r^T, and the cache can compute the latent from the keys it
receives: z = K_pre U_r, with K_pre the keys un-rotated at their positions (RoPE makes the post-RoPE
map position dependent, which is why Palu reconstructs keys before RoPE, sec. 3.4). Attention reads
K = RoPE(z U_r^T, pos) and V = z_v U_v^T. One rank for every layer, from the byte ratio (Palu also
searches per-layer ranks by Fisher information; not done here).

LoRC (Zhang et al. 2024, arXiv 2410.03111) uses the same cache with bases from the weights alone
(`lorc_bases`): the top right singular vectors of each head group's W_k and W_v (a truncated SVD
W ~ U_r S_r V_r^T caches x U_r S_r = K V_r and reads K ~ (K V_r) V_r^T; keys before RoPE, as the
paper requires), and a progressive rank per layer: layers whose cumulative condition number (the
product of kappa(W_k) kappa(W_v) from that layer to the top) is larger, the shallow ones whose errors
travel furthest, keep more. The paper's exact map from that number to a rank was not verified here:
we keep (1 - ratio) + delta (s_l - mean s) / max|s - mean s| of each layer's dimensions, s_l the
min-max normalised log cumulative condition number and delta = min(keep, 1 - keep) / 2, so the model
as a whole keeps exactly (1 - ratio).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from kvjax.cache import KVView, Ring, _Positioned
from kvjax.ops import attention, blocked_probs, decode_block, kernel_impl
from kvjax.plan import LayerPlan, init_caches, rope_base
from kvjax.rope import rotate_slots


def group_heads(n_kv_heads: int, heads: int) -> int:
    """Heads per group: `heads`, or all of them when fewer (must divide n_kv_heads)."""
    g = min(heads, n_kv_heads)
    if n_kv_heads % g:
        raise ValueError(f"palu: heads={heads} per group must divide n_kv_heads={n_kv_heads}")
    return g


def rank_for(ratio: float, group_dim: int) -> int:
    """Latent dims per group that remove `ratio` of the group's K (or V) bytes (at least 1)."""
    return max(1, round((1 - ratio) * group_dim))


def bases_from_samples(x: np.ndarray, group: int, rank: int) -> np.ndarray:
    """Top-`rank` eigenvectors of the group covariance of samples x `[N,K,H]` -> `[K/group, group*H, rank]`."""
    N, K, H = x.shape
    grouped = np.asarray(x, np.float64).reshape(N, K // group, group * H).transpose(1, 0, 2)
    cov = np.einsum("gni,gnj->gij", grouped, grouped)
    _, vecs = np.linalg.eigh(cov)  # ascending eigenvalues
    return np.ascontiguousarray(vecs[:, :, ::-1][:, :, :rank]).astype(np.float32)


def _grouped(x, groups: int):
    """`[B,K,S,H]` -> `[B,Kg,S,g*H]`."""
    B, K, S, H = x.shape
    return x.reshape(B, groups, K // groups, S, H).transpose(0, 1, 3, 2, 4).reshape(B, groups, S, -1)


def _ungrouped(x, K: int):
    """`[B,Kg,S,g*H]` -> `[B,K,S,H]`."""
    B, Kg, S, gH = x.shape
    g = K // Kg
    return x.reshape(B, Kg, S, g, gH // g).transpose(0, 1, 3, 2, 4).reshape(B, K, S, gH // g)


def latents(k_hm, v_hm, pos, k_basis, v_basis, rope_theta: float) -> tuple[jax.Array, jax.Array]:
    """Head-major k, v `[B,K,T,H]` (post-RoPE keys at positions `[B,T]`) -> their latents zk, zv `[B,Kg,T,r]`
    (fp32): the keys rotated back, each head group projected on its basis."""
    Kg = k_basis.shape[0]
    k_pre = rotate_slots(k_hm, -pos, rope_theta)
    zk = jnp.einsum("BGTi,Gir->BGTr", _grouped(k_pre, Kg).astype(jnp.float32), k_basis)
    zv = jnp.einsum("BGTi,Gir->BGTr", _grouped(v_hm, Kg).astype(jnp.float32), v_basis)
    return zk, zv


def rebuilt(zk, zv, pos, k_basis, v_basis, n_kv_heads: int, rope_theta: float) -> tuple[jax.Array, jax.Array]:
    """K (RoPE'd at positions `pos`) and V `[B,K,S,H]` (fp32) from latents zk, zv `[B,Kg,S,r]`."""
    out = lambda z, basis: _ungrouped(jnp.einsum("BGSr,Gir->BGSi", z.astype(jnp.float32), basis), n_kv_heads)  # noqa: E731
    return rotate_slots(out(zk, k_basis), pos, rope_theta), out(zv, v_basis)


@struct.dataclass
class LowRankKVCache(_Positioned):
    """zk, zv `[B,Kg,S,r]` latents per head group, pos, length; the calibrated bases `[Kg,g*H,r]` ride
    along (weights, not cache: `nbytes()` leaves them out)."""

    zk: jax.Array
    zv: jax.Array
    pos: jax.Array
    length: jax.Array
    k_basis: jax.Array
    v_basis: jax.Array
    n_kv_heads: int = struct.field(pytree_node=False, default=1)
    rope_theta: float = struct.field(pytree_node=False, default=10_000.0)

    _HEAD_MAJOR = ("zk", "zv")

    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.zk, self.zv, self.pos, self.length))

    @property
    def capacity(self) -> int:
        return self.zk.shape[2]

    @classmethod
    def from_cache(cls, cache, k_basis, v_basis, capacity: int, rope_theta: float) -> LowRankKVCache:
        """Project a dense cache's keys (un-rotated at their positions) and values onto the bases."""
        cache = cache.resized(capacity)
        K = cache.k.shape[1]
        zk, zv = latents(cache.k, cache.v, cache.pos, k_basis, v_basis, rope_theta)
        return cls(
            zk=zk.astype(cache.k.dtype),
            zv=zv.astype(cache.v.dtype),
            pos=cache.pos,
            length=cache.length,
            k_basis=k_basis,
            v_basis=v_basis,
            n_kv_heads=K,
            rope_theta=rope_theta,
        )

    def update(self, k: jax.Array, v: jax.Array, pos: jax.Array) -> tuple[LowRankKVCache, KVView]:
        """Append a chunk k, v `[B,T,K,H]` (post-RoPE keys) at positions `[B,T]`."""
        slots = self._slots(pos)
        head_major = lambda x: x.transpose(0, 2, 1, 3)  # noqa: E731
        zk, zv = latents(head_major(k), head_major(v), pos, self.k_basis, self.v_basis, self.rope_theta)
        new = self._write_slots(slots, pos, zk=jnp.moveaxis(zk, 1, 2), zv=jnp.moveaxis(zv, 1, 2))
        k_view, v_view = new.reconstructed()
        view = KVView(k_view.astype(k.dtype), v_view.astype(v.dtype), new.pos)
        return new, view._replace(reader=_LatentValues(new, view))

    def reconstructed(self) -> tuple[jax.Array, jax.Array]:
        """K (RoPE'd at each slot's position) and V `[B,K,S,H]` from the latents."""
        return rebuilt(self.zk, self.zv, self.pos, self.k_basis, self.v_basis, self.n_kv_heads, self.rope_theta)


@struct.dataclass
class WindowLowRankKVCache(Ring, LowRankKVCache):
    """A sliding-window layer's latents (a ring factored under `local=true`): as `kvjax.cache.WindowKVCache`,
    each new token's latent goes to slot n % C, over the oldest once the C slots are full."""


@struct.dataclass
class _LatentValues:
    """A low-rank cache's view attended with values left in the latent space (XLA decode steps): the
    probabilities weight the value latents zv, and the group's value basis maps the weighted latent out
    (Palu fuses the value reconstruction into the output projection: the same product; MLA's absorbed
    decode does likewise). The keys are rebuilt (a dot, then RoPE per slot: the rotation depends on each
    key's position, so it cannot move into the query; Palu's kernel fuses rebuild, RoPE and q.k on GPU).
    Prefill chunks and Pallas read the rebuilt K/V."""

    cache: LowRankKVCache
    view: KVView

    def attend(self, q, q_pos, impl, window=None, softcap=None):
        cache, view, (B, T, N, H) = self.cache, self.view, q.shape
        block = decode_block(cache.capacity)
        if T != 1 or block is None or kernel_impl(impl, softcap=softcap) != "xla":
            return attention(
                q, view.k, view.v, q_pos, view.pos, window=window, impl=impl, fresh=view.fresh, softcap=softcap
            )
        K, (Kg, _, r) = cache.n_kv_heads, cache.v_basis.shape
        g, G, C = K // Kg, N // K, cache.capacity // block
        probs = blocked_probs(((q.reshape(B, K, G, H), view.k),), q_pos, view.pos, window, H**-0.5, block, softcap)
        probs = probs.reshape(B, Kg, g, C, G, block)  # KV head k = group * g + j
        latent = jnp.einsum("BQjCnS,BQCSr->BQjnr", probs, cache.zv.reshape(B, Kg, C, block, r).astype(jnp.float32))
        out = jnp.einsum("BQjnr,Qjhr->BQjnh", latent, cache.v_basis.reshape(Kg, g, H, r))
        return out.reshape(B, 1, N, H).astype(q.dtype)


def calibrate(model, tokens: np.ndarray, compressible: tuple[int, ...], ratio: float, heads: int):
    """Bases `(k_basis, v_basis)` per compressible cache from a plain prefill of calibration tokens
    `[N,T]`: eigenvectors of the pre-RoPE key and the value covariances per head group."""
    tokens = np.asarray(tokens, np.int32)
    if tokens.ndim != 2 or tokens.size == 0:
        raise ValueError(f"palu calibration tokens must be a non-empty [N, T] array, got shape {tokens.shape}")
    N, T = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (N, T))
    _, caches = jax.jit(lambda t, p, c: model(t, p, c))(jnp.asarray(tokens), positions, init_caches(model.config, N, T))
    out = []
    for slot in compressible:
        cache = caches[slot]
        K, H = cache.k.shape[1], cache.k.shape[3]
        g = group_heads(K, heads)
        k_pre = rotate_slots(cache.k, -cache.pos, rope_base(model.config, slot))
        live = np.asarray(cache.pos) >= 0  # a ring (local=true) holds its window's last tokens of each row
        samples = lambda x: np.asarray(x).transpose(0, 2, 1, 3)[live]  # noqa: E731  [tokens, K, H]
        rank = rank_for(ratio, g * H)
        out.append(
            (
                jnp.asarray(bases_from_samples(samples(k_pre), g, rank)),
                jnp.asarray(bases_from_samples(samples(cache.v), g, rank)),
            )
        )
    return tuple(out)


def progressive_keep(log_kappa: np.ndarray, keep: float) -> np.ndarray:
    """LoRC's kept fraction per layer from each layer's log condition number (module docstring)."""
    cumulative = np.cumsum(np.asarray(log_kappa, np.float64)[::-1])[::-1]  # from layer l to the top
    spread = cumulative.max() - cumulative.min()
    if len(cumulative) < 2 or spread == 0:
        return np.full(len(cumulative), keep)
    s = (cumulative - cumulative.min()) / spread
    centred = s - s.mean()
    return keep + min(keep, 1 - keep) / 2 * centred / np.abs(centred).max()


def lorc_bases(model, compressible: tuple[int, ...], ratio: float, heads: int):
    """Bases `(k_basis, v_basis)` per compressible cache from the K/V projection weights: per head group
    the top right singular vectors of W, at LoRC's progressive ranks (module docstring)."""
    plan = LayerPlan.from_config(model.config)
    weights = []
    for slot in compressible:
        mixer = model.blocks[plan.producers[slot]].mixer
        weights.append(tuple(np.asarray(w.kernel[...], np.float64) for w in (mixer.k, mixer.v)))
    log_kappa = []
    for wk, wv in weights:
        sk, sv = np.linalg.svd(wk, compute_uv=False), np.linalg.svd(wv, compute_uv=False)
        log_kappa.append(np.log(sk[0] / sk[-1]) + np.log(sv[0] / sv[-1]))
    keeps = progressive_keep(np.array(log_kappa), 1 - ratio)
    out = []
    for slot, (wk, wv), keep in zip(compressible, weights, keeps):
        att = model.config.attention_for(plan.mixers[plan.producers[slot]])
        K, H = att.n_kv_heads, att.head_dim
        g = group_heads(K, heads)
        rank = max(1, round(keep * g * H))

        def basis(w):
            groups = w.reshape(w.shape[0], K // g, g * H).transpose(1, 0, 2)  # [Kg, D, g*H]
            _, _, vt = np.linalg.svd(groups, full_matrices=False)
            return jnp.asarray(vt[:, :rank].transpose(0, 2, 1), jnp.float32)  # [Kg, g*H, rank]

        out.append((basis(wk), basis(wv)))
    return tuple(out)
