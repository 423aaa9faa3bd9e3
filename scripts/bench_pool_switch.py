"""Which XLA decode path is faster for the engine's decode rows: each row's pages gathered, then attended
(`PagedKVCache.view`), or every row attending over the whole pool (`PagedKVCache.attend_pool`)? Times the
decode attention both ways, chained over a model's layers so that the pages are read cold as in a step,
for the shapes of the committed serve-bench runs and random shapes whose tables span the pool; prints
what `kvjax.paged.pool_is_cheaper` picks beside the faster path, how much slower its picks are than always
the faster one (against always gathering, always the pool and the old rule, the pool once R x M >= P),
and with --fit the per-slot costs of its two cost models fitted to these timings:

    python scripts/bench_pool_switch.py [--random 70] [--no-runs] [--max-pool-mb 64] [--repeats 5] [--fit]

R rows (sequence slots) of M table columns, P pool pages of `page` slots, K KV heads of H dims, G query
heads per KV head; the rows hold 90% of the pool's pages between them, as a busy engine's do.
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.ops import attention
from kvjax.paged import PagedKVCache, pool_is_cheaper
from kvjax.report import format_table
from kvjax.timing import rounds

# (name, layers, R, M, P, K, G, H, page): the committed runs' shapes (docs/serving.md).
RUNS = [
    ("smollm2 chat", 30, 16, 20, 74, 3, 3, 64, 32),
    ("smollm2 long-prompt", 30, 16, 40, 388, 3, 3, 64, 32),
    ("demo gqa chat", 4, 31, 36, 1090, 2, 4, 16, 16),
    ("demo gqa long-gen", 4, 32, 132, 1934, 2, 4, 16, 16),
]


def random_shapes(n: int, max_pool_mb: float = 64, seed: int = 5) -> list[tuple]:
    """`n` shapes whose tables span the pool (R x M >= P, where the old rule took the pool), at most
    `max_pool_mb` MB of pool a layer, over 8 layers."""
    rng, shapes = np.random.default_rng(seed), []
    while len(shapes) < n:
        R, M = int(rng.choice([4, 8, 16, 32, 64])), int(rng.choice([4, 8, 16, 32, 64, 128]))
        P = int(rng.integers(max(R * M // 16, 2 * R, 16), max(R * M, 2 * R + 1) + 1))
        K, G, H = int(rng.choice([1, 2, 4])), int(rng.choice([1, 2, 4, 8])), int(rng.choice([16, 64, 128]))
        page = int(rng.choice([16, 32]))
        if P * page * K * H * 8 <= max_pool_mb * 1e6:
            shapes.append((f"random {len(shapes)}", 8, R, M, P, K, G, H, page))
    return shapes


def cache_for(R, M, P, K, H, page, seed=0) -> PagedKVCache:
    """A pool of random K/V whose rows hold distinct pages, 90% of the pool between them (each row at most M)."""
    rng = np.random.default_rng(seed)
    cache = PagedKVCache.init(P, page, R, M, K, H, jnp.float32)
    held = max(1, min(M, int(0.9 * (P - 1)) // R))
    pages = rng.permutation(np.arange(1, P))[: R * held].reshape(R, held)
    table = np.zeros((R, M), np.int32)
    table[:, :held] = pages
    length = np.random.default_rng(0).integers((held - 1) * page + 1, held * page + 1, R)  # the same in every layer
    pos = np.full((P, 1, page), -1, np.int32)
    for row in range(R):
        slots = np.arange(held * page)
        pos[pages[row], 0] = np.where(slots < length[row], slots, -1).reshape(held, page)
    k, v = (jnp.asarray(rng.standard_normal((P, K, page, H)), jnp.float32) for _ in range(2))
    return cache.replace(k=k, v=v, pos=jnp.asarray(pos), table=jnp.asarray(table), length=jnp.asarray(length))


def gathered(q, q_pos, cache):
    view = cache.view()
    return attention(q, view.k, view.v, q_pos, view.pos)


def pooled(q, q_pos, cache):
    return cache.attend_pool(q, q_pos, None)


def chained(path):
    """`path` over every layer's cache in turn, each layer's output the next one's query (a barrier between
    them, as a real layer's projections keep XLA from fusing across layers)."""

    @jax.jit
    def run(q, q_pos, caches):
        for cache in caches:
            q = jax.lax.optimization_barrier(path(q, q_pos, cache))
        return q

    return run


def costs(R, M, P, K, G, H) -> tuple[list[float], list[float]]:
    """The terms of `pool_is_cheaper`'s cost models, a slot: gathered R M K H, R M N, R M N H; pool P K H, R P N,
    R P N H."""
    N = K * G
    return [R * M * K * H, R * M * N, R * M * N * H], [P * K * H, R * P * N, R * P * N * H]


def fit(shapes, times) -> None:
    """Least squares of each path's seconds a slot (relative errors) on its cost terms, in ns."""
    for i, (path, names) in enumerate((("gathered", "RMKH RMN RMNH"), ("pool", "PKH RPN RPNH"))):
        terms = np.array([costs(*s[2:8])[i] for s in shapes]) * np.array([s[8] for s in shapes])[:, None]
        seconds = np.array([t[i] for t in times])
        coef = np.linalg.lstsq(terms / seconds[:, None], np.ones(len(times)), rcond=None)[0]
        print(f"{path}: " + ", ".join(f"{c * 1e9:.3g} ns x {n}" for c, n in zip(coef, names.split())))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--random", type=int, default=70, help="random shapes beside the committed runs'")
    parser.add_argument("--runs", action=argparse.BooleanOptionalAction, default=True, help="the committed shapes")
    parser.add_argument("--max-pool-mb", type=float, default=64, help="the random shapes' largest pool a layer")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--fit", action="store_true", help="fit the two cost models to the timings")
    args = parser.parse_args()
    if args.random < 0 or args.repeats < 1 or args.max_pool_mb <= 0 or (args.random == 0 and not args.runs):
        parser.error("--random must be >= 0 (and > 0 with --no-runs), --repeats >= 1, --max-pool-mb > 0")
    paths = chained(gathered), chained(pooled)
    shapes, times, rows = (RUNS if args.runs else []) + random_shapes(args.random, args.max_pool_mb), [], []
    for name, L, R, M, P, K, G, H, page in shapes:
        caches = [cache_for(R, M, P, K, H, page, seed=layer) for layer in range(L)]
        q = jnp.asarray(np.random.default_rng(1).standard_normal((R, 1, K * G, H)), jnp.float32)
        q_pos = caches[0].length[:, None]
        np.testing.assert_allclose(paths[1](q, q_pos, caches), paths[0](q, q_pos, caches), atol=1e-3)
        times.append([min(rounds(lambda f=f: f(q, q_pos, caches), args.repeats)[0]) / L for f in paths])
        picked = "pool" if pool_is_cheaper(R, M, P, K * G, K, H) else "gathered"
        faster = "pool" if times[-1][1] < times[-1][0] else "gathered"
        rows.append(
            [name, R, M, P, K, G, H, page, *(f"{t * 1e3:.2f}" for t in times[-1]), faster,
             picked + ("" if picked == faster else " (!)")]
        )  # fmt: skip
    headers = ["shape", "R", "M", "P", "K", "G", "H", "page", "gathered ms", "pool ms", "faster", "rule picks"]
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}: decode attention a layer, best of {args.repeats}")
    print(format_table(headers, rows))
    t = np.array(times)
    rules = {
        "pool_is_cheaper": [pool_is_cheaper(R, M, P, K * G, K, H) for _, _, R, M, P, K, G, H, _ in shapes],
        "always gathered": [False] * len(shapes),
        "always the pool (the old rule here)": [True] * len(shapes),
    }
    summary = []
    for name, picks in rules.items():
        slowdown = t[np.arange(len(t)), np.array(picks, int)] / t.min(axis=1)
        summary.append([name, f"{slowdown.mean():.2f}x", f"{slowdown.max():.2f}x"])
    print(format_table(["rule", "mean time / the faster path's", "worst"], summary))
    if args.fit:
        fit(shapes, times)


if __name__ == "__main__":
    main()
