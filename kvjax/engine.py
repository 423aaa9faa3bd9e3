"""A continuous-batching engine over paged KV memory: the device runner of `kvjax.scheduler`'s plans
(Orca's iteration-level scheduling with vLLM's paged memory and recompute preemption; the scheduler's
docstring says who runs when).

Every step is one jitted pass that feeds one token to each decoding sequence and, beside them, the next
`chunk` tokens of the prompt being prefilled (one at a time), so a prefill shares the weights' reads with
the decode rows instead of stalling them (Sarathi-Serve, Agrawal et al. 2024; static shapes: one compile
per power-of-two row bucket and chunk bucket). While no prompt is being prefilled and every running
request decodes greedily, several decode steps run in one call.

Works for attention models whose layers produce or share K/V (MHA/GQA/MQA, CLA, MLKV), sliding-window
layers included (Gemma's local layers, Mistral's window, YOCO's self-decoder: by default they page from a
pool of their own in which a sequence holds only its window's pages, `kvjax.window_pages`; with
`window_pages="keep"` the window is a mask over pages kept until the request ends, and prefix hits are
possible; a policy then compresses the other layers' prompts and leaves the windows whole, as `Generator`
does, or under `local=true` compresses each window into a ring of its pages that grows back to the window), MLA
latents (`PagedLatentCache`), and recurrent layers (Mamba, RWKV-7, RetNet, YOCO's gated retention, the
hybrids), which keep one state slot per running request instead of pages (`kvjax.slot_states`; the
prefix cache is then off: a prefix hit would skip tokens a state must see; under a policy the state a
prompt's whole prefill leaves is loaded into its slot).

A token-level `policy` (kvjax.compress syntax) compresses each prompt as `Generator` does (one prefill of
the whole prompt, then eviction and/or `int:8` / `int:4` / `kivi` / `kvquant` / `gear` quantization), and
only what is kept goes into pages: `snapkv:0.5` takes half the prompt's pages, `int:8` pages hold 8-bit
codes and a scale per token (`int:4` two codes a byte), KIVI pages whole residual blocks of 2- or 4-bit
codes, each sequence's newest tokens waiting in a full-precision residual slot of its own
(`kvjax.paged_kivi`; KVQuant's blocks with their exact outliers and sinks too, GEAR's with their outliers
and each block's low-rank error), so more requests fit in the same memory; AdaKV's per-head budgets
(`allocator=adakv`) fill pages of entries its heads share unevenly (`kvjax.paged_pooled`; under `local=true`
the windows' rings too, rings of entries, `as_ring`); PyramidKV's per-layer budgets (`allocator=pyramid`)
give each layer a block table of its own over one pool of single-layer pages (`kvjax.layer_pages`; under
`local=true` the windows' rings, one length for all of a request's, `_aligned`). Decoding then appends every
new token, unless the policy evicts while decoding (`every=N`, `kvjax.paged_eviction`): each step then
observes the rows' attention and a request's every N-th token re-selects its slots within its pages and
frees the pages past them, so it never holds more than its budget plus N slots (under PyramidKV's budgets,
each layer its own). With a policy, a request's pages hold its compressed prompt, and the prefix cache holds
prompts' full pages uncompressed beside them (where the pages are full precision and keep no running
statistic): a prompt that starts with cached pages reads them into its prefill and computes only the rest
(at least the queries its policy observes: SnapKV's window, TOVA's last query; H2O observes every query: it
neither reads nor enters them), then enters its own full pages, while pages are free for them. A preempted
request is recomputed by compressing its prompt again and re-appending the tokens it generated (under
`every=` or KIVI, one decode step at a time). A request may name its own policy (`Request.policy`) when its
pages have the engine's layout (positions shared by the heads or per head, full precision or int8 codes, the
same stage evicting while decoding, if any): a plain engine serves `streaming:0.5` or `tova:0.5` beside
uncompressed requests, all sharing the prefix cache.

`run` serves a list of requests to completion; a server drives the same engine one `step` at a time,
`submit`ting requests as they arrive and `cancel`ling those whose clients left.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from kvjax.cache import LatentCache, PooledKVCache, Ring, WindowKVCache, WindowPooledKVCache
from kvjax.compress import Policy, parse_policy
from kvjax.compress.d2o import protected_layers
from kvjax.compress.methods import METHODS
from kvjax.compress.policy import Stage
from kvjax.compress.scorers import accumulates
from kvjax.config import ConfigError, DecodingConfig
from kvjax.generate import Generator
from kvjax.kinds import KINDS
from kvjax.layer_pages import LayerPages
from kvjax.page_pool import NULL_PAGE, PagePool, PoolExhausted
from kvjax.paged import PagedKVCache, PagedLatentCache, SharedPool
from kvjax.paged_d2o import PagedD2OCache
from kvjax.paged_duo import PagedDuoCache
from kvjax.paged_eviction import Eviction, budget_row, evicting_step
from kvjax.paged_kivi import PagedKiviCache, check_kivi_pages
from kvjax.paged_lowrank import PagedLowRankCache
from kvjax.paged_pooled import PagedPooledCache, as_entries, as_ring
from kvjax.paged_quest import READ_ALL, PagedQuestCache
from kvjax.plan import LayerPlan, compressible, init_caches, rope_base
from kvjax.quant.cache import QuantKVCache, QuantSpec, WindowQuantKVCache, rings_codes
from kvjax.quant.lowrank import LowRankKVCache, WindowLowRankKVCache
from kvjax.sampling import sample
from kvjax.scheduler import Completion, EngineStats, Prefill, Scheduler, Sequence, Step, Work, prefix_key
from kvjax.sharding import place_params
from kvjax.slot_states import SlotStates
from kvjax.window_pages import WindowPages


@dataclasses.dataclass(frozen=True)
class Request:
    """A prompt, how to decode it, the policy that compresses it (None: the engine's; "none": no
    compression) and how many of the likeliest tokens to report beside each generated one."""

    prompt: tuple[int, ...]
    decoding: DecodingConfig = DecodingConfig()
    policy: str | None = None
    top_logprobs: int = 0


class Rows(NamedTuple):
    """What `Engine._sync` pushes to the device for the sequences a step feeds, in its row order (a
    sequence has no fixed row: its pages and table say where its tokens are): block tables `[slots,M]`
    and lengths `[slots]` of the main pool and of the sliding-window layers' own pool (whose slot is the
    token's position, while a compressed prompt's main-pool slots are fewer than its positions; a window
    compressed under `local=true` is a ring of C slots, its length the tokens it took), and each
    row's recurrent-state slot; under decode-time eviction each row's budgets (`paged_eviction.budget_row`).
    Where the main pool's layers keep different numbers of tokens (`kvjax.layer_pages`), its tables and
    lengths have a layer axis after the rows' (`[slots,L,M]`, `[slots,L]`). Every jitted function sets them
    into each layer's cache: one transfer per step, not one per layer."""

    table: jax.Array
    window_table: jax.Array
    length: jax.Array
    window_length: jax.Array
    states: jax.Array
    window_ring: jax.Array  # each row's compressed-ring size C in the window pool (`local=true`), else 0
    budgets: jax.Array | None = None

    def first(self, n: int) -> Rows:
        return Rows(*(None if x is None else x[:n] for x in self))


def _with_rows(caches, rows: Rows, chunk_row=None):
    """Each layer's cache with the step's rows: paged caches their block tables and lengths (a
    sliding-window layer with its own pool, `kvjax.window_pages`, its own), recurrent layers their state
    slots (`kvjax.slot_states`)."""
    out, layer = [], 0
    for c in caches:
        if isinstance(c, SlotStates):
            out.append(c.replace(rows=rows.states, length=rows.window_length, chunk_row=chunk_row))
        elif c.windowed:
            # a KIVI ring's residuals are per sequence slot too
            residuals = dict(res_rows=rows.states) if isinstance(c, PagedKiviCache) else {}
            residuals |= dict(slot_rows=rows.states) if isinstance(c, PagedDuoCache) else {}  # (local=true)
            out.append(
                c.replace(
                    table=rows.window_table,
                    length=rows.window_length,
                    chunk_row=chunk_row,
                    ring=rows.window_ring,
                    **residuals,
                )
            )
        elif isinstance(c, PagedKiviCache):  # its residuals are per sequence slot, as recurrent states
            out.append(c.replace(table=rows.table, length=rows.length, chunk_row=chunk_row, res_rows=rows.states))
        elif isinstance(c, PagedDuoCache):  # its streaming heads' tokens too
            out.append(c.replace(table=rows.table, length=rows.length, chunk_row=chunk_row, slot_rows=rows.states))
        elif isinstance(c, PagedQuestCache) and rows.budgets is not None:  # the pages each row reads
            out.append(c.replace(table=rows.table, length=rows.length, chunk_row=chunk_row, read=rows.budgets[:, 0]))
        elif rows.length.ndim == 2:  # a table per layer (`kvjax.layer_pages`); D2O's thresholds per sequence slot
            slotted = dict(tau_rows=rows.states) if isinstance(c, PagedD2OCache) else {}
            out.append(
                c.replace(table=rows.table[:, layer], length=rows.length[:, layer], chunk_row=chunk_row, **slotted)
            )
            layer += 1
        else:
            out.append(c.replace(table=rows.table, length=rows.length, chunk_row=chunk_row))
    return tuple(out)


def _lengths(rows: Rows, written) -> Rows:
    """`rows` with the lengths the caches `written` now hold (main pool; window pool and states)."""
    main = [c.length for c in written if isinstance(c, PagedKVCache) and not c.windowed]
    window = [c.length for c in written if isinstance(c, SlotStates) or c.windowed]
    if rows.length.ndim == 2:  # a table per layer (`kvjax.layer_pages`)
        return rows._replace(length=jnp.stack(main, axis=1), window_length=window[0] if window else rows.window_length)
    main = main[0] if main else window[0]
    return rows._replace(length=main, window_length=window[0] if window else main)


def _forward(model, caches, rows: Rows, tokens, pos, chunk, chunk_pos, chunk_row, last, evict=None):
    """One pass over a step's tokens: a decode token for each of the first R table rows (tokens, pos
    `[R]`; position -1 where a row feeds none), then, when C > 0, a prompt chunk of row `chunk_row`
    (chunk, chunk_pos `[C]`, padded with position -1), all through the weights once (`kvjax.paged`'s
    mixed step). Returns log-probabilities `[R(+1),V]`, after each row's token and (row R) after the
    chunk's token `last`, each row's greedy token and its log-probability (all a greedy batch reads
    back), the caches and the rows with their new lengths. With `evict` (a policy's `every=`; decode
    rows only) each row is observed and re-selected on its schedule (`kvjax.paged_eviction`)."""
    R, C = tokens.shape[0], chunk.shape[0]
    rows = rows.first(R)
    if evict is not None:
        hidden, written = evicting_step(model, _with_rows(caches, rows), tokens, pos, rows.budgets, evict)
        hidden, picked = hidden[:, 0][None], jnp.arange(R)
    else:
        ids, at = jnp.concatenate([tokens, chunk])[None], jnp.concatenate([pos, chunk_pos])[None]
        hidden, written = model.hidden(ids, at, _with_rows(caches, rows, chunk_row))
        picked = jnp.arange(R) if C == 0 else jnp.concatenate([jnp.arange(R), R + last[None]])
    logp = jax.nn.log_softmax(model.logits(hidden[0, picked]))
    best = jnp.argmax(logp, axis=-1)
    caches = tuple(c.replace(**r._carried()) for c, r in zip(caches, written))
    return logp, best, jnp.take_along_axis(logp, best[:, None], axis=-1)[:, 0], caches, _lengths(rows, written)


def _step(graphdef, treedef, leaves, caches, rows, tokens, pos, chunk, chunk_pos, chunk_row, last, *, evict):
    """`_forward` of the model whose parameters come as their flat leaves (`treedef` rebuilds them):
    flattening the NNX state on every call cost more host time than a small model's whole step. The
    main and window pools' lengths come back last (read only under decode-time eviction, which shortens
    rows and compressed rings)."""
    model = nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))
    logp, best, best_lp, caches, rows = _forward(
        model, caches, rows, tokens, pos, chunk, chunk_pos, chunk_row, last, evict
    )
    return logp, best, best_lp, caches, (rows.length, rows.window_length)


def _greedy_steps(graphdef, treedef, leaves, caches, rows, tokens, pos, stop, eos, *, steps, evict):
    """Up to `steps` greedy decode steps of R rows in one call (vLLM's multi-step scheduling: a small
    model's step is shorter than the host's round trip): row r feeds tokens[r] at pos[r], then each
    token it picks, for stop[r] steps (0: an empty row) or until it picks eos[r]. Returns the tokens and
    log-probabilities picked `[steps,R]` (-1 and 0 after a row stops), the caches and the main and window
    pools' lengths."""
    model = nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))
    R = tokens.shape[0]
    none = jnp.zeros(0, jnp.int32)

    def body(carry):
        i, caches, rows, tok, pos, active, out_tok, out_lp = carry
        _, best, best_lp, caches, rows = _forward(
            model, caches, rows, tok, jnp.where(active, pos, -1), none, none, jnp.int32(0), jnp.int32(0), evict
        )
        out_tok = out_tok.at[i].set(jnp.where(active, best, -1).astype(jnp.int32))
        out_lp = out_lp.at[i].set(jnp.where(active, best_lp, 0.0))
        active = active & (i + 1 < stop) & (best != eos)
        return i + 1, caches, rows, best.astype(jnp.int32), pos + 1, active, out_tok, out_lp

    def cond(carry):
        return (carry[0] < steps) & carry[5].any()

    init = (
        jnp.int32(0),
        caches,
        rows.first(R),
        tokens,
        pos,
        stop > 0,
        jnp.full((steps, R), -1, jnp.int32),
        jnp.zeros((steps, R), jnp.float32),
    )
    _, caches, rows, _, _, _, out_tok, out_lp = jax.lax.while_loop(cond, body, init)
    return out_tok, out_lp, caches, (rows.length, rows.window_length)


@functools.lru_cache(maxsize=8)
def _jitted(graphdef, treedef):
    """The step and multi-step functions jitted for one model structure, shared by every Engine over it
    (so a second engine on the same model compiles nothing)."""
    return (
        jax.jit(functools.partial(_step, graphdef, treedef), donate_argnums=(1,), static_argnames=("evict",)),
        jax.jit(
            functools.partial(_greedy_steps, graphdef, treedef), donate_argnums=(1,), static_argnames=("steps", "evict")
        ),
    )


# rings compressed under `local=true` whose slots are tokens (not AdaKV's entries): K/V, codes or latents
_SLOT_RINGS = WindowKVCache | WindowQuantKVCache | WindowLowRankKVCache


@functools.partial(jax.jit, donate_argnums=0)
def _load_row(caches, rows: Rows, dense, stats, row, ring):
    """Load row 0 of each layer's dense (compressed) prefill cache into table row `row`'s pages (a
    sliding-window layer's ring, left whole by the policy, at its tokens' positions in its own pool; one
    compressed under `local=true`, a `WindowKVCache`, slot for slot into the ring its row holds, all of
    them `ring` slots long, `_aligned`; an AdaKV pool's, `WindowPooledKVCache`, its entries oldest first,
    `as_ring`), with the running statistic of its kept slots where the pages keep
    one (`stats`: the Generator's, per layer), and a recurrent layer's state into the row's state slot; the
    caches and the rows with the row's new lengths."""
    out, shared = [], SharedPool()
    slots = max((d.pos.shape[-1] for d in dense if isinstance(d, _SLOT_RINGS)), default=0)
    for i, (paged, d, stat) in enumerate(zip(_with_rows(caches, rows), dense, stats)):
        out.append(shared.leave(_loaded(shared.enter(i, paged), d, stat, row, (ring, slots))))
    out = tuple(shared.close(out))
    return out, _lengths(rows, out)


def _aligned(values: dict, pos: jax.Array, n: jax.Array, ring: tuple) -> tuple[dict, jax.Array]:
    """A compressed ring's `n` slots (values `[K,S,...]`, positions `[S]` or `[K,S]`) moved to the end of
    the first `ring[0]` of `ring[1]` slots, the slots before them empty (-1), so that the window pool's rings
    of one request all take one length and one shift (PyramidKV's differ in what they keep). Right,
    not left: a ring of C >= W slots then writes over only tokens out of every later query's window, as
    its token at slot j lies at a position at most j + (prompt length - ring[0])."""
    length, slots = ring
    shift = length - n

    def moved(x: jax.Array, axis: int) -> jax.Array:
        widths = [(0, 0)] * x.ndim
        widths[axis] = (0, slots - x.shape[axis])
        return jnp.roll(jnp.pad(x, widths), shift, axis=axis)

    pos = jnp.where(jnp.arange(slots) < shift, -1, moved(pos, pos.ndim - 1))
    return {name: moved(x, 1) for name, x in values.items()}, pos


def _loaded(paged, d, stat, row, ring):
    """One layer's pages with row 0 of its dense prefill cache `d` loaded into table row `row` (`_load_row`)."""
    if isinstance(paged, SlotStates):  # a recurrent layer: the state the prompt left, into the row's slot
        return paged.load(row, d)
    if isinstance(paged, PagedDuoCache):  # (a window's too, under local=true)
        return paged.load_duo(row, d)
    if paged.windowed and not isinstance(d, _SLOT_RINGS | WindowPooledKVCache):
        return paged.load_positions(row, d.pos[0], k=d.k[0], v=d.v[0])  # left whole: by position
    if isinstance(paged, PagedKiviCache):
        return paged.load_quant(row, d)
    if isinstance(paged, PagedPooledCache):  # AdaKV's pool (a ring's oldest first), or a prompt's K entries a slot
        pool = d if isinstance(d, PooledKVCache) else as_entries(d)
        return paged.load_pool(row, *(as_ring(pool, stat) if paged.windowed else (pool, stat)))
    if isinstance(d, QuantKVCache):
        values = dict(k=d.k_codes[0], v=d.v_codes[0], k_scale=d.k_scale[0], v_scale=d.v_scale[0])
    elif isinstance(d, LatentCache):  # one latent "head": keys the latents, values the RoPE keys
        values = dict(k=d.c[0][None], v=d.k_rope[0][None])
    elif isinstance(d, LowRankKVCache):  # Palu's or LoRC's latents per head group (`kvjax.paged_lowrank`)
        values = dict(k=d.zk[0], v=d.zv[0])
    else:
        values = dict(k=d.k[0], v=d.v[0])
    if paged.stat is not None:
        values["stat"] = stat[0]
    if paged.windowed:  # a ring compressed under local=true
        values, pos = _aligned(values, d.pos[0], d.length[0], ring)
        return paged.load(row, ring[0], pos, **values)
    loaded = paged.load(row, d.length[0], d.pos[0], **values)
    return loaded.load_tau(row, d) if isinstance(paged, PagedD2OCache) else loaded


@functools.partial(jax.jit, static_argnames=("cfg", "capacity"))
def _gather_prefix(caches, pages, n, *, cfg, capacity):
    """The first `n` slots of the pages `pages` `[M]` (the prefix cache's whole prompt pages, in order) of
    every layer, as a Generator's dense caches of `capacity` slots (at least M pages) hold a prompt's:
    K/V head-major, positions 0..n-1, the rest empty."""
    idx = jnp.arange(capacity, dtype=jnp.int32)
    out = []
    for paged, d in zip(caches, init_caches(cfg, 1, capacity)):
        row = paged.replace(table=pages[None])

        def dense(pool):  # the pages in table order `[1,K,M*ps,H]`, zero past n and padded to capacity
            x = row.prompt_rows(pool)
            x = jnp.pad(x, ((0, 0), (0, 0), (0, capacity - x.shape[2]), (0, 0)))
            return jnp.where((idx < n)[None, None, :, None], x, 0).astype(d.k.dtype)

        out.append(d.replace(k=dense(paged.k), v=dense(paged.v), pos=jnp.where(idx < n, idx, -1)[None], length=n[None]))
    return tuple(out)


def check_window_policy(policy: Policy, cfg, windowed: list[str], window_pages: str) -> None:
    """A policy on a model with sliding-window layers compresses the other layers' prompts and leaves the
    windows whole, which the engine serves when those layers have their own pool (`window_pages="free"`:
    their slots are positions, the main pool's are the kept tokens). Under `local=true` it compresses the
    windows too, each into a ring that grows back to the window as decoding goes on (`WindowKVCache`),
    which that pool holds as its first pages: by token eviction alone, once after the prefill (the pool is
    full precision, one position per slot, or int or KIVI codes after it: `WindowQuantKVCache`, or Palu's and
    LoRC's latents: `WindowLowRankKVCache`) and, in
    full precision, while decoding too (`every=`: a quantizer, last in its chain, has no `every=`), with one
    window size for every such layer. PyramidKV's rings keep different numbers of tokens and share one length
    (`_aligned`, and after each re-selection under `every=`, `paged_eviction._share_length`); AdaKV's pools are
    entry rings (`kvjax.paged_pooled.as_ring`)."""
    if window_pages != "free":
        raise ConfigError(
            f"engine policy {policy}: {cfg.name!r} has sliding-window layers ({', '.join(windowed)}), whose prompt a "
            "policy leaves whole: serve it with window_pages='free' (their own pool) or without a policy"
        )
    if not policy.local:
        return
    last = policy.stages[-1]
    sizes = sorted({cfg.attention_for(k).window for k in windowed})
    why = (
        f"has windows of {sizes} tokens (the engine's rings share one size)"
        if len(sizes) > 1
        else "quantizes them with a scheme's parts (the window pool holds rings of K/V, latents, int or KIVI codes)"
        if last.quantizes and not rings_codes(last.quant_spec)
        else "reads Quest's pages of them (the window pool keeps no key bounds)"
        if _quest(last)
        else None
    )
    if why:
        raise ConfigError(
            f"engine policy {policy}: local=true compresses the sliding-window layers too, and this policy {why}; "
            "drop local to compress the other layers only"
        )


class PageLayout(NamedTuple):
    """What a policy's pages hold: positions per KV head; the codes' scheme (None: full precision; int:8 or
    int:4 codes per token, or KIVI's blocks, `kvjax.paged_kivi`); the stage that evicts while decoding
    (`every=`, None: none); entries pooled over the heads (AdaKV's per-head budgets, `kvjax.paged_pooled`);
    whether the sliding-window layers' pool holds the codes too (`local=true`: rings of int or KIVI codes); a
    block table per layer (PyramidKV's per-layer budgets, `kvjax.layer_pages`); whether that pool's rings are
    pooled entries too (AdaKV under `local=true`); whether the pages hold low-rank latents (Palu, LoRC,
    `kvjax.paged_lowrank`); Quest's page size where the pages keep its key bounds (`kvjax.paged_quest`), else 0;
    the DuoAttention stage whose retrieval heads the pages hold (`kvjax.paged_duo`; its text), else ""."""

    per_head: bool = False
    codes: QuantSpec | None = None
    decoding: Stage | None = None
    pooled: bool = False
    window_codes: bool = False
    layered: bool = False
    window_pooled: bool = False
    low_rank: bool = False
    quest: int = 0
    duo: str = ""

    def __str__(self) -> str:
        heads = (
            "entries pooled over heads" + (" (the windows' rings too)" if self.window_pooled else "")
            if self.pooled
            else "positions per head"
            if self.per_head
            else "one position per slot"
        )
        codes = (
            f", {self.codes.method}{self.codes.bits} codes"
            if self.codes
            else ", low-rank latents"
            if self.low_rank
            else ", full precision"
        )
        codes += " (the windows' rings too)" if self.window_codes else ""
        codes += ", Quest's key bounds per page" if self.quest else ""
        codes += f", the retrieval heads of {self.duo} (its streaming heads per sequence)" if self.duo else ""
        layers = ", a block table per layer" if self.layered else ""
        return heads + codes + layers + (f", evicting by {self.decoding} while decoding" if self.decoding else "")


def _latent(stage: Stage) -> bool:
    """Whether `stage` keeps low-rank latents (Palu, LoRC: `kvjax.paged_lowrank`)."""
    return stage.hooks is not None and stage.hooks.kind == "low_rank"


def _quest(stage: Stage) -> bool:
    """Whether `stage` selects pages at attention time (Quest: `kvjax.paged_quest`)."""
    return stage.hooks is not None and stage.hooks.kind == "selector"


def _duo(stage: Stage) -> bool:
    """Whether `stage` keeps some heads' tokens whole and others' sinks and recent ones (DuoAttention:
    `kvjax.paged_duo`)."""
    return stage.hooks is not None and stage.hooks.kind == "head_level"


def check_engine_policy(policy: Policy, cfg=None) -> PageLayout:
    """What the engine's pages need for `policy` (`PageLayout`) on a model of config `cfg` (where given: a
    model of sliding windows alone has no main-pool layer to give a table each, and under `local=true` its
    rings share one length anyway); a policy it cannot page is a ConfigError naming the stage."""
    for stage in policy.stages:
        where = f"engine policy stage {stage.method!r}"
        if stage.quantizes:
            spec = stage.quant_spec  # int: codes and one symmetric scale per token and head; KIVI: its blocks
            per_token = spec.bits in (4, 8) and not spec.asym and not spec.blocked and spec.scheme.plain
            # blocks: KIVI's, KVQuant's and GEAR's with their parts (`kvjax.paged_kivi`)
            if not (spec.blocked or per_token):
                raise ConfigError(
                    f"{where}:{stage.bits}: quantized pages are int:8, int:4 (symmetric), kivi, kvquant or gear only"
                )
        elif not (stage.method in METHODS and METHODS[stage.method].pageable):
            raise ConfigError(
                f"{where}: the engine pages token eviction, d2o, int:8, int:4, kivi, kvquant, gear, palu, lorc, "
                f"quest and duo; {stage.method} is not supported"
            )
    last = policy.stages[-1]
    low_rank = _latent(last)
    per_head = any(s.per_head for s in policy.stages if not s.quantizes)
    codes = last.quant_spec if last.quantizes else None
    pooled = any(s.pooled for s in policy.stages)
    layered = any(not (s.allocation.same_everywhere or s.pooled) for s in policy.stages if not s.quantizes)
    layered = layered or policy.budgets_at_prefill  # (D2O's, from its prefill)
    layered = layered and (cfg is None or bool(compressible(cfg)))
    if codes is not None and codes.blocked and per_head:
        raise ConfigError(
            f"engine policy {policy}: KIVI pages keep one position per slot; positions per head (a head-wise "
            "eviction before it) are not paged with them"
        )
    if low_rank and (per_head or layered):
        raise ConfigError(
            f"engine policy {policy}: latent pages keep one position per slot and one block table for every "
            "layer; a head-wise eviction or PyramidKV's budgets before them are not paged with them"
        )
    quest = last.options.page_size if _quest(last) else 0
    if layered and codes is not None and codes.blocked:
        raise ConfigError(
            f"engine policy {policy}: its layers keep different numbers of tokens, each with its own block table "
            "(kvjax.layer_pages), in full-precision or int:8 / int:4 pages; KIVI's blocks are not paged with them"
        )
    return PageLayout(
        per_head and not pooled,
        codes,
        policy.decode_stage,
        pooled,
        bool(policy.local and codes),
        layered,
        pooled and policy.local,
        low_rank,
        quest,
        str(last) if _duo(last) else "",
    )


class Engine:
    """Serve requests on `model` with `n_pages` pages of `page_size` tokens per K/V-producing layer, at
    most `slots` sequences admitted together, prompts prefilled `chunk` tokens a step."""

    def __init__(
        self,
        model: nnx.Module,
        *,
        n_pages: int,
        page_size: int = 16,
        slots: int = 8,
        chunk: int = 128,
        max_tokens: int | None = None,
        prefix_cache: bool = True,
        mesh: jax.sharding.Mesh | None = None,
        policy: str | Policy | None = None,
        decode_steps: int = 8,
        window_pages: str = "free",
        window_pool: int | None = None,
        calibration: np.ndarray | None = None,
    ):
        """`mesh` (axes `data` and `tensor`) spreads the step's rows (sequences) over `data` and the pages' KV
        heads over `tensor`, as training splits batch and heads; the weights lie as `kvjax.sharding`
        lays them (heads and MLP hidden units over `tensor`). A policy's prefill runs on one device.
        `policy`: token eviction applied after the prefill, optionally ending in `int:8` or `int:4`, and while
        decoding with `every=` (see the module docstring). `decode_steps`: while no prompt is being prefilled
        and every running request decodes greedily, up to this many decode steps run in one device call (1:
        a call per step).
        `window_pages`: `free` gives sliding-window layers a pool of their own from which a sequence holds
        only its window's pages (`kvjax.window_pages`; no prefix cache then), `keep` pages them as the
        other layers, the window a mask, every page kept until the request ends (prefix hits possible).
        `window_pool`: pages of that own pool (besides its null page); by default every slot's worst case, so
        it never limits admission; a smaller one (what `fit` buys) admits requests by what their windows can
        hold (`WindowPages.reserve`). `calibration`: tokens `[N,T]` a policy's method learns from (Palu's
        bases), as `Generator` takes them."""
        if window_pages not in ("free", "keep"):
            raise ConfigError(f"window_pages={window_pages!r} must be 'free' or 'keep'")
        cfg = model.config
        recurrent = sorted({k for k in cfg.mixers if KINDS[k].recurrent})
        if unknown := sorted(set(cfg.mixers) - {"attention", "local", "swa", "mla", *recurrent}):
            raise ConfigError(
                f"the engine pages attention K/V and MLA latents and keeps recurrent states; model mixers "
                f"{unknown} are not supported yet"
            )
        self.policy = parse_policy(policy) if isinstance(policy, str) else policy
        windowed = sorted({k for k in cfg.mixers if k != "mla" and cfg.attention_for(k).window is not None})
        if self.policy is not None and windowed:
            check_window_policy(self.policy, cfg, windowed, window_pages)
        layout = PageLayout() if self.policy is None else check_engine_policy(self.policy, cfg)
        self.model, self.n_pages, self.page_size, self.layout = model, n_pages, page_size, layout
        self.slots, self.chunk, self.decode_steps = slots, chunk, decode_steps
        self.windowed, self.recurrent, self.window_pages = windowed, recurrent, window_pages
        self.window_pool, self.calibration = window_pool, calibration
        self.window = (
            max((cfg.attention_for(k).window for k in windowed), default=None) if window_pages == "free" else None
        )
        # A prefix hit skips the prefix's tokens: a recurrent layer's state, a freed window, would miss them;
        # the cache's pages hold whole prompts, full precision (where a policy's are codes, they are not), and
        # serve every layer (where each layer has its own tables, they do not)
        whole = layout.codes is None and not (layout.layered or layout.low_rank)
        self.prefix_cache = prefix_cache and not recurrent and self.window is None and whole
        # block-table columns: by default a request may hold the pool; with a table per layer, its largest layer
        # twice a layer's share of it (PyramidKV's largest budget is below twice the mean)
        most = max_tokens or (n_pages - 1) * page_size * (2 if layout.layered else 1)
        self.width = -(-most // page_size)
        self.reset()  # the scheduler: it checks slots, chunk and decode_steps
        att = cfg.attention
        self.gens: dict[str, Generator] = {}  # the compressed prefill of each policy served, by its text
        self.evict = None  # decode-time eviction (`kvjax.paged_eviction`)
        bases = {}  # Palu's or LoRC's bases by cache slot, for the latent pages
        streaming = {}  # DuoAttention's streaming heads by cache slot (`kvjax.paged_duo`)
        if self.policy is not None:
            codes, decoding = self.layout.codes, self.layout.decoding
            if codes and "mla" in cfg.mixers:
                raise ConfigError(
                    f"engine policy {self.policy} quantizes K/V pages; MLA's latent pages are not quantized"
                )
            if codes and codes.blocked:
                if why := check_kivi_pages(codes, page_size):
                    raise ConfigError(f"engine policy {self.policy}: {why}")
            if self.layout.quest not in (0, page_size):  # Quest's pages are the engine's (`kvjax.paged_quest`)
                raise ConfigError(
                    f"engine policy {self.policy}: Quest's pages are the engine's; its page_size={self.layout.quest} "
                    f"must equal the engine's page_size={page_size}"
                )
            if self.layout.pooled and mesh is not None and mesh.shape["tensor"] > 1:
                raise ConfigError(
                    f"engine policy {self.policy}: allocator=adakv's pages pool entries of every KV head, which "
                    "cannot split over the mesh's tensor axis (each device would hold the whole pool); serve "
                    "it on a mesh of tensor=1 (rows over data) or on one device"
                )
            gen = self._prefill_capacity(self.policy, self.width * page_size)
            if self.layout.low_rank:  # Palu's or LoRC's bases, by cache (the latent pages map them out)
                bases = dict(zip(compressible(cfg, self.policy.local), gen.prepared["bases"]))
            if self._budgets_at_prefill and mesh is not None:
                raise ConfigError(
                    f"engine policy {self.policy}: D2O's layer budgets come from each prefill, whose layer pages "
                    "are served on one device (not yet on a mesh)"
                )
            if self.layout.duo:  # (on a mesh, a layer's retrieval heads split over tensor where they divide)
                streaming = dict(zip(compressible(cfg, self.policy.local), gen.prepared["streaming"]))
            if decoding:
                most = self._most_kept(self.width * page_size)  # (D2O's budgets: the most a prompt may keep)
                plan = gen.compression_plan(np.array([self.width * page_size]), 0, layer_counts=most)[-1]
                evicted = compressible(cfg, self.policy.local)  # (under local=true, the rings too)
                rings = [self._ring_size() if r else None for r in plan.rings]
                self.evict = Eviction.of(plan, self.width * page_size, evicted, rings)
        codes, decoding = self.layout.codes, self.layout.decoding
        # a preempted request's generated tokens are re-fed a decode step each (never as a chunk) where the
        # pages change as tokens arrive: eviction while decoding, KIVI's residual flushing its blocks,
        # DuoAttention's streaming rings
        self._stepwise = decoding is not None or (codes is not None and codes.blocked) or bool(self.layout.duo)
        plan, mla, dtype = LayerPlan.from_config(cfg), cfg.mla, jnp.dtype(cfg.dtype)
        main = [
            i
            for i in plan.producers
            if not KINDS[plan.mixers[i]].recurrent and (self.window is None or plan.mixers[i] not in windowed)
        ]
        first = main[0] if main else None  # the main-pool layer whose cache holds a shared pool (`_pages`)
        self.caches = tuple(
            PagedLatentCache.init(
                self._pages(n_pages, first=i == first),
                page_size,
                slots,
                self.width,
                1,
                mla.kv_lora_rank,
                dtype,
                value_dim=mla.rope_heads * mla.qk_rope_head_dim,
                stat=bool(decoding and accumulates(decoding)),
            ).replace(shared=self.layout.layered)
            if plan.mixers[i] == "mla"
            else SlotStates.init(KINDS[plan.mixers[i]].init_cache(cfg, slots, 1, False), slots)
            if KINDS[plan.mixers[i]].recurrent
            else self._paged(cfg, plan.mixers[i], n_pages, i == first, slot, bases, streaming)
            for slot, i in enumerate(plan.producers)
        )
        graphdef, self.params = nnx.split(model)
        self._leaves, treedef = jax.tree.flatten(self.params)
        self._step, self._greedy_steps = _jitted(graphdef, treedef)
        # compressed prompts read and enter the prefix cache's whole pages where theirs are alike (plain K/V),
        # on one device (a policy's prefill runs on one)
        self._prefix_pages = (
            self.prefix_cache
            and mesh is None
            and all(
                type(c) in (PagedKVCache, PagedPooledCache) and not c.quantized and c.stat is None for c in self.caches
            )
        )
        self.mesh = mesh
        if mesh is not None:
            if slots % mesh.shape["data"] or att.n_kv_heads % mesh.shape["tensor"]:
                raise ConfigError(
                    f"slots={slots} must divide over data={mesh.shape['data']} and "
                    f"n_kv_heads={att.n_kv_heads} over tensor={mesh.shape['tensor']}"
                )
            self.params = place_params(self.params, mesh)
            self._leaves = jax.tree.leaves(self.params)
            self.caches = tuple(self._placed(c) for c in self.caches)
        self._sync([])

    def _paged(
        self, cfg, kind: str, n_pages: int, first: bool, slot: int, bases: dict, streaming: dict
    ) -> PagedKVCache:
        """Cache `slot`'s pages (an attention layer's) as the engine's layout says: the window pool's for a
        sliding-window layer when windows are freed (full precision: a policy leaves the windows whole, or
        compresses them by eviction alone); the policy's codes (int codes, or KIVI's blocks with a residual per
        sequence slot, `kvjax.paged_kivi`); a running statistic per slot (decode-time eviction that accumulates
        one, H2O's); pooled entries (AdaKV); Quest's key bounds; latents on the cache's Palu or LoRC `bases`
        where it has them; one physical pool of every layer's pages where each layer has its own tables
        (`layered`: the `first` layer's cache holds it, the others zero-size stand-ins, `kvjax.paged.SharedPool`);
        a DuoAttention cache's retrieval heads in pages, its `streaming` heads (where it has them) per sequence
        slot (`kvjax.paged_duo`)."""
        att, ps, dtype, layout = cfg.attention, self.pool.page_size, jnp.dtype(cfg.dtype), self.layout
        windowed = self.window is not None and kind in self.windowed
        codes, stat = layout.codes, bool(layout.decoding and accumulates(layout.decoding))
        if windowed:  # positions as the main pool keeps them (a head-wise `local` ring: per head); codes only in
            # rings compressed under `local=true`, the windows otherwise whole
            n, codes = self.windows.n_pages, codes if layout.window_codes else None
            stat = stat and self.policy.local  # a ring evicting while decoding keeps its running sums too
        else:
            n = self._pages(n_pages, first)
        shape = (n, ps, self.slots, self.width, att.n_kv_heads, att.head_dim, dtype)
        if slot in bases:  # (`kvjax.paged_lowrank`; under local=true a window's ring too)
            cache = PagedLowRankCache.init_low_rank(
                *bases[slot], att.n_kv_heads, rope_base(cfg, slot), n, ps, self.slots, self.width, dtype
            )
        elif slot in streaming:  # (`kvjax.paged_duo`; under local=true a window's too, its slots positions)
            stage = self.policy.stages[-1]
            cache = PagedDuoCache.init_duo(streaming[slot], stage.n_sinks, stage.recent, *shape)
        elif layout.pooled and (layout.window_pooled or not windowed):
            cache = PagedPooledCache.init_pooled(*shape, stat=stat)
        elif layout.quest and not windowed:  # (a policy leaves the windows whole)
            cache = PagedQuestCache.init_quest(*shape)
        elif self._budgets_at_prefill and not windowed:  # (D2O)
            cache = PagedD2OCache.init_d2o(*shape, per_head=layout.per_head)
        elif codes is not None and codes.blocked:  # (KVQuant's keys rotated back at this layer's RoPE base)
            cache = PagedKiviCache.init_kivi(
                dataclasses.replace(codes, rope_theta=cfg.attention_for(kind).rope_theta), *shape
            )
        else:
            cache = PagedKVCache.init(*shape, per_head_positions=layout.per_head, bits=codes and codes.bits, stat=stat)
        if windowed:
            return cache.replace(windowed=True, ring=jnp.zeros((self.slots,), jnp.int32))
        return cache.replace(shared=layout.layered)

    def _pages(self, n_pages: int, first: bool) -> int:
        """Pages of a main-pool layer's arrays: `n_pages`, or with a table per layer the whole pool of
        single-layer pages in the `first` layer's cache and none in the others' (`kvjax.paged.SharedPool`)."""
        if not self.layout.layered:
            return n_pages
        return self.pool.n_pages if first else 0

    def _window_pages(self, columns: int, n_pages: int | None = None) -> WindowPages:
        """Fresh bookkeeping of the sliding-window layers' pool (`kvjax.window_pages`) for requests of at most
        `columns` pages: `n_pages` of them (the null page included), by default every slot's worst case."""
        return WindowPages(
            max_pages=columns,
            window=self.window,
            page_size=self.pool.page_size,
            slots=self.slots,
            chunk=self.chunk,
            decode_ahead=self.decode_steps,
            n_pages=n_pages,
        )

    def reset(self) -> None:
        """Forget every sequence, the prefix cache and the statistics, keeping the compiled functions (a
        page's stale contents are never read: a row sees only the slots below its length)."""
        self.requests: list[Request] = []
        self._budgets: dict[int, np.ndarray] = {}  # under decode-time eviction, each request's `budget_row`
        # a request whose windows its policy compressed (local=true, rings of `_ring_size()` slots): its
        # positions less the tokens its rings took
        self._rings: dict[int, int] = {}
        self.pool = (
            LayerPages(self.n_pages, self.page_size, len(compressible(self.model.config)))
            if self.layout.layered
            else PagePool(self.n_pages, self.page_size)
        )
        self._slot_of: dict[int, int] = {}  # a running sequence's recurrent-state slot
        self._free_slots = list(range(self.slots))[::-1]
        pool = None if self.window_pool is None else self.window_pool + 1
        self.windows = self._window_pages(self.width, pool) if self.window else None
        self.scheduler = Scheduler(
            self.pool,
            slots=self.slots,
            chunk=self.chunk,
            decode_steps=self.decode_steps,
            prefix_cache=self.prefix_cache,
            window_pages=None if self.windows is None else self.windows.n_pages - 1 - self.windows.slack,
        )

    @property
    def stats(self) -> EngineStats:
        return self.scheduler.stats

    @property
    def done(self) -> list[Completion]:
        return self.scheduler.done

    def nbytes(self) -> int:
        """Exact bytes of the page pools, positions, block tables and lengths of every layer."""
        return sum(c.nbytes() for c in self.caches)

    def page_nbytes(self) -> int:
        """Bytes one page of the main pool takes over every layer paging from it (one layer's page where each
        layer has its own tables: the pool's pages are single-layer pages, `kvjax.layer_pages`)."""
        main = [c for c in self.caches if isinstance(c, PagedKVCache) and not c.windowed]
        return main[0].page_nbytes if self.layout.layered else sum(c.page_nbytes for c in main)

    def fixed_nbytes(self, slots: int, max_tokens: int | None = None) -> int:
        """What `slots` running sequences of at most `max_tokens` (default: this engine's) hold whatever
        their lengths: recurrent states, and the sliding-window layers' own pool (`kvjax.window_pages`: this
        engine's, or by default sized for that many sequences' windows)."""
        columns = self.width if max_tokens is None else -(-max_tokens // self.pool.page_size)
        if self.window is None:
            pages = 0
        elif self.window_pool is not None:
            pages = self.window_pool + 1
        else:
            pages = self._window_pages(columns).pool_pages(slots)
        return slots * self.state_nbytes() + pages * self._window_page_nbytes()

    def _window_page_nbytes(self) -> int:
        """Bytes one page of the sliding-window layers' own pool takes over those layers."""
        return sum(c.page_nbytes for c in self.caches if isinstance(c, PagedKVCache) and c.windowed)

    def fit(self, budget: int, slots: int, max_tokens: int) -> tuple[int, int, int | None]:
        """(slots, main-pool pages with the null page, window-pool pages besides its null page, None without
        sliding-window layers) that `budget` bytes buy for an engine of this model, policy and page size:
        each running sequence's fixed state (recurrent states, KIVI residuals, D2O's thresholds) comes out of
        the budget first, for as many slots as leave each room for a request of `max_tokens`, and for spare
        slots whose states together cost at most one such request's pages (a request shorter than
        `max_tokens` runs in one; the smaller a state, the more of them, up to `slots` as it tends to zero);
        the rest is split between the main pool and the window pool in the proportion one request of
        `max_tokens` takes of each (the window pool's null page and the one prefilling chunk's extra paid
        first). A model with no main-pool layer gets every slot that request's pages (they hold nothing)."""
        page, per_page, state = self.page_nbytes(), -(-max_tokens // self.pool.page_size), self.state_nbytes()
        page *= self.pool.n_layers if self.layout.layered else 1  # the n_pages this engine takes: over every layer
        wpage = self._window_page_nbytes()
        windows = self._window_pages(per_page) if self.window is not None else None
        share = 0 if windows is None else windows.reserve(max_tokens)  # window pages a request holds
        overhead = 0 if windows is None else (windows.slack + 1) * wpage
        one = page * per_page + share * wpage + overhead
        if budget < state + one:
            raise ConfigError(
                f"a budget of {budget:,} bytes holds no request of {max_tokens} tokens: it needs "
                f"{state + one:,} ({state:,} of per-sequence state, {share * wpage + overhead:,} of window pages, "
                f"{page * per_page:,} of pages)"
            )
        if state:  # slots that hold their states and a request of max_tokens each, then the spare ones
            held = max(n for n in range(1, slots + 1) if n * (state + one - overhead) + overhead <= budget)
            spare = (one - overhead) // state
            slots = max(n for n in range(held, min(slots, held + spare) + 1) if n * state + one <= budget)
        rest = budget - slots * state - overhead
        window_pool = None
        if windows is not None:
            requests = rest / (page * per_page + share * wpage)  # requests of max_tokens the rest holds
            window_pool = max(share, int(requests * share)) + windows.slack
            rest = budget - slots * state - (window_pool + 1) * wpage
        if page == 0:
            return slots, slots * per_page + 1, window_pool
        return slots, rest // page + 1, window_pool

    def state_nbytes(self) -> int:
        """Bytes one sequence slot holds whatever its length: its recurrent states over every recurrent
        layer, and what pages keep per sequence beside them (KIVI's residuals, DuoAttention's streaming heads,
        D2O's merge thresholds)."""
        states = sum(c.nbytes() // c.slots for c in self.caches if isinstance(c, SlotStates))
        return states + sum(c.slot_nbytes for c in self.caches if isinstance(c, PagedKVCache))

    # --- device state -----------------------------------------------------------------------------
    def _placed(self, cache: PagedKVCache) -> PagedKVCache:
        """A cache laid out on the mesh: pages' KV heads over `tensor`, slots' tables over `data`."""
        if self.mesh is None:
            return cache
        if isinstance(cache, SlotStates):  # states stay whole on every device (rows gather them)
            whole = NamedSharding(self.mesh, P())
            return cache.replace(state=jax.device_put(cache.state, whole), rows=self._rows_placed(cache.rows))
        put = lambda x, *spec: jax.device_put(x, NamedSharding(self.mesh, P(*spec)))  # noqa: E731
        split = lambda n: "tensor" if n > 1 and n % self.mesh.shape["tensor"] == 0 else None  # noqa: E731
        heads = {name: put(x, None, split(x.shape[1])) for name, x in cache._pools().items()}
        return cache.replace(**heads, table=self._rows_placed(cache.table), length=self._rows_placed(cache.length))

    def _rows_placed(self, x: jax.Array) -> jax.Array:
        """Per-slot rows (tables, lengths) split over the mesh's `data` axis (as they are without a mesh)."""
        return x if self.mesh is None else jax.device_put(x, NamedSharding(self.mesh, P("data")))

    def _sync(self, seqs, ahead: list[int] | None = None, at: list[int] | None = None) -> None:
        """Push the rows of `seqs` (rows 0.., the rest of the `slots` rows empty) to the device, once for all
        layers (the jitted functions set them into every layer's cache, `Rows`): each row will write
        `ahead` tokens (1 by default) after its first `at` positions (by default its main-pool length;
        fewer slots than positions once a policy compressed its prompt), which its window pages must hold."""
        n = self.slots - len(seqs)
        ahead = [*(ahead or [1] * len(seqs)), *[0] * n]
        at = [*(at or [self.pool.lengths[s] for s in seqs]), *[0] * n]
        seqs = [*seqs, *[None] * n]
        table = self.pool.table(seqs, self.width)
        if self.layout.layered:  # each layer's slots (`kvjax.layer_pages`)
            length = self.pool.layer_lengths(seqs)
        else:
            length = np.asarray([0 if s is None else self.pool.lengths[s] for s in seqs], np.int32)
        ring = np.asarray([self._ring_size() if s in self._rings else 0 for s in seqs], np.int32)
        shift = np.asarray([self._rings.get(s, 0) for s in seqs], np.int32)
        positions = np.asarray(at, np.int32) - shift  # a compressed ring's length: the tokens it took
        rings = {s: int(c) for s, c in zip(seqs, ring) if c}
        running = self.scheduler.running
        window = (
            table
            if self.windows is None
            else self.windows.table(seqs, positions.tolist(), ahead, self.width, running, rings)
        )
        arrays = [table, window, length, positions, self._state_slots(seqs), ring]
        if self.evict is not None:
            none = np.zeros(1 + 3 * len(self.evict.slots), np.int32)
            arrays.append(np.stack([none if s is None else self._budgets[s] for s in seqs]))
        elif self.layout.quest:  # the pages each row's decode query reads (a request Quest leaves alone: all)
            arrays.append(np.asarray([self._budgets.get(s, [READ_ALL]) for s in seqs], np.int32))
        self._rows_pushed = Rows(*(self._rows_placed(x) for x in arrays))  # numpy: jit moves it

    @property
    def _pushed(self) -> Rows:
        """What `_sync` last pushed, as the jitted steps take it."""
        return self._rows_pushed

    def _state_slots(self, seqs) -> np.ndarray:
        """The recurrent-state slot of each row's sequence (`slots`: none), given to a sequence when it is
        first fed and back when it no longer runs (at most `slots` run at once); a recomputed sequence
        starts from zeros again (`SlotStates.run`)."""
        running = self.scheduler.running
        for index in [i for i in self._slot_of if i not in running]:
            self._free_slots.append(self._slot_of.pop(index))
        for index in seqs:
            if index is not None and index not in self._slot_of:
                self._slot_of[index] = self._free_slots.pop()
        return np.asarray([self.slots if i is None else self._slot_of[i] for i in seqs], np.int32)

    def _pick(self, seq: Sequence, logp, greedy: tuple[int, float] | None = None) -> None:
        """Pick `seq`'s next token from log-probabilities `[V]`: argmax when greedy (`greedy`, the (token,
        log-probability) the device already chose, saves reading the row), else drawn with a key of the
        request's seed and step alone, so a seeded request gives the same tokens whenever it comes and
        whatever runs beside it (sampling a shifted copy of the logits is the same distribution); with the
        request's `top_logprobs` likeliest tokens when it asks for them."""
        request = self.requests[seq.index]
        decoding = request.decoding
        top = None
        if request.top_logprobs:
            best = np.argsort(-logp, kind="stable")[: request.top_logprobs]
            top = [(int(t), float(logp[t])) for t in best]
        if decoding.temperature == 0:
            tok = greedy[0] if greedy else int(np.argmax(logp))
            lp = greedy[1] if greedy else float(logp[tok])
        else:
            step = len(seq.done.tokens)
            key = jax.random.fold_in(jax.random.key(decoding.seed), step)
            tok = int(
                sample(
                    jnp.asarray(logp)[None],
                    key,
                    temperature=decoding.temperature,
                    top_k=decoding.top_k,
                    top_p=decoding.top_p,
                )[0]
            )
            lp = float(logp[tok])
        self.scheduler.picked(seq, tok, lp, top)

    def policy_of(self, request: Request) -> Policy | None:
        """The policy that compresses `request`'s prompt: its own when it names one (`none`: no compression)
        and the engine's pages can hold what that policy keeps, else the engine's. A policy the pages
        cannot hold is a ConfigError saying why."""
        if request.policy is None:
            return self.policy
        if request.policy == "none":  # (Quest's pages hold a whole prompt, as plain pages do: it reads them all)
            policy, layout = None, PageLayout(quest=self.layout.quest)
        else:
            policy = parse_policy(request.policy)
            layout = check_engine_policy(policy, self.model.config)
            if self.windowed:
                check_window_policy(policy, self.model.config, self.windowed, self.window_pages)
        if layout != self.layout:
            raise ConfigError(
                f"policy {request.policy}: this engine's pages hold {self.layout} (its policy: "
                f"{self.policy or 'none'}), and {request.policy} needs {layout}; serve it from an engine "
                "started with it"
            )
        return policy

    def _prefill_capacity(self, policy: Policy | None, tokens: int) -> Generator | None:
        """A Generator of `policy` whose dense prefill cache holds prompts of `tokens` (a prompt may take
        more slots before compression than its pages hold after); None without a policy."""
        if policy is None:
            return None
        key = str(policy)
        if key not in self.gens or self.gens[key].capacity < tokens:
            capacity = max(tokens, self.width * self.pool.page_size)
            self.gens[key] = Generator(self.model, capacity=capacity, policy=policy, calibration=self.calibration)
        return self.gens[key]

    def _work(self, request: Request, index: int) -> Work:
        """What the scheduler needs of a request, with the slots a compressed prompt keeps (its largest
        layer's, where PyramidKV's budgets differ per layer: `LayerPages.shape`); an empty prompt or an
        impossible budget is a ConfigError here, before any compute."""
        if not request.prompt:
            raise ConfigError(f"request {index}: the prompt is empty")
        kept = cap = ring_kept = None
        gen = self._prefill_capacity(self.policy_of(request), len(request.prompt))
        quest = gen is not None and self.layout.quest  # Quest keeps every token: its prompt goes in chunks, as any
        if quest:  # (its budget, whole pages, is what each of its decode queries reads)
            self._budgets[index] = [gen.compression_plan(np.array([len(request.prompt)]), 0)[-1].keep_caps[0] // quest]
            gen = None
        if gen is not None:
            most_kept = self._most_kept(len(request.prompt), request.decoding.max_new_tokens)
            plan = gen.compression_plan(np.array([len(request.prompt)]), 0, layer_counts=most_kept)[-1]
            budget = int(plan.counts.max())
            kept = ring_kept = min(budget, len(request.prompt))  # under every=, a budget above the prompt is a cap
            if self.evict is not None:  # held at its budget while decoding: at most `every` slots more
                self._budgets[index] = budget_row(plan, len(request.prompt))  # (D2O's: set at its prefill)
                cap = budget + self.evict.every if most_kept is None else None  # (D2O: its layers' own caps)
            if self.layout.layered:  # each main-pool layer's own budget (PyramidKV's), and so its own cap;
                # under local=true the rings' own budgets, the largest of which all of them take (`_prefill`)
                counts = np.minimum(plan.counts[:, 0], len(request.prompt))
                ringed = np.asarray([bool(w) for w in plan.rings])
                kept, most = int(counts[~ringed].max()), counts[~ringed] + request.decoding.max_new_tokens
                ring_kept = int(counts[ringed].max()) if ringed.any() else None
                # (D2O's layers it never compresses grow by what the request generates)
                held = counts[~ringed] if most_kept is None else most_kept[~ringed, 0]
                caps = most if self.evict is None else np.minimum(most, held + self.evict.every)
                self.pool.shape(index, counts[~ringed], caps)
        d = request.decoding
        greedy = d.temperature == 0 and not request.top_logprobs  # else each step reads the distribution
        # a compressed ring takes a token a step, and Quest's queries each read their own pages
        stepwise = bool(quest) or gen is not None and (self._stepwise or gen.policy.local)
        window = 0
        if self.windows is not None:  # what its windows can hold: its positions' pages; a ring's, its kept
            # tokens (at most the largest layer's budget) and those it generates, up to the ring's size
            # (DuoAttention's retrieval heads keep their window whole, by position)
            ringed = gen and gen.policy.local and not self.layout.duo
            ring = min(self._ring_size(), ring_kept + d.max_new_tokens) if ringed else None
            window = self.windows.reserve(len(request.prompt) + d.max_new_tokens, ring)
        # a prefix-cache hit may cover a compressed prompt up to the queries its policy observes
        cacheable = len(request.prompt) - gen.observed_queries(len(request.prompt)) if gen and self._prefix_pages else 0
        return Work(tuple(request.prompt), d.max_new_tokens, d.eos_id, greedy, kept, cap, stepwise, window, cacheable)

    def check(self, requests: list[Request]) -> list[Work]:
        """Refuse, before any compute, a request this engine can never serve (an empty prompt, an
        impossible policy budget, a policy its pages cannot hold, more pages than a sequence may hold);
        returns what the scheduler needs of each."""
        work = [self._work(r, len(self.requests) + i) for i, r in enumerate(requests)]
        self.scheduler.check(work, self.width)
        for i in range(len(work)):  # each layer's own pages, where each has its own tables
            if self.layout.layered and (need := self.pool.most_pages(len(self.requests) + i)) > self.pool.n_pages - 1:
                raise ConfigError(
                    f"request {len(self.requests) + i}: its layers hold up to {need} pages of one layer; the pool "
                    f"has {self.n_pages - 1} per layer, {self.pool.n_pages - 1} in all"
                )
        if self.windows is not None:  # window pages are indexed by position, compressed or not
            for i, r in enumerate(requests):
                if (n := len(r.prompt) + r.decoding.max_new_tokens) > self.width * self.pool.page_size:
                    raise ConfigError(
                        f"request {len(self.requests) + i}: {n} positions, past the {self.width * self.pool.page_size} "
                        "the sliding-window layers' block tables hold; raise max_tokens"
                    )
        return work

    def run(self, requests: list[Request]) -> list[Completion]:
        """Serve `requests` (in arrival order) to completion; returns one Completion per request."""
        self.requests = []
        work = self.check(requests)
        self.requests = list(requests)
        done = self.scheduler.start(work)
        while self.step():
            pass
        return done

    def submit(self, request: Request) -> int:
        """Queue `request` behind those waiting (checked first, as `check` does); returns its index, whose
        `Completion` (`done[index]`) fills in as `step` runs."""
        (work,) = self.check([request])
        self.requests.append(request)
        return self.scheduler.submit(work)

    def cancel(self, index: int) -> None:
        """End request `index` now; its pages are free for the next step."""
        self.scheduler.cancel(index)

    def forget(self, index: int) -> None:
        """Drop ended request `index`'s prompt and completion (read them first)."""
        self.scheduler.forget(index)
        self.requests[index] = None
        if self.layout.layered:
            self.pool.forget(index)
        self._budgets.pop(index, None)
        self._rings.pop(index, None)

    def step(self) -> bool:
        """Run the scheduler's next plan on the device (a prefill, one step, or several greedy steps);
        False when no request waits or runs."""
        plan = self.scheduler.next()
        if plan is None:
            self._sync([])  # the finished requests' state slots and window pages go back
            return False
        if isinstance(plan, Prefill):
            self._prefill(plan.seq, plan.cached)
            return True
        self.caches = tuple(c.copy_pages(plan.copies) for c in self.caches)
        if plan.greedy_steps:
            self._feed_greedy(plan)
        else:
            self._feed(plan)
        return True

    @property
    def _budgets_at_prefill(self) -> bool:
        """Whether the policy plans its layer budgets at each prefill (D2O), so pages are held for the most."""
        return self.policy is not None and self.policy.budgets_at_prefill

    def _most_kept(self, tokens: int, new_tokens: int = 0) -> np.ndarray | None:
        """Where the policy plans layer budgets at the prefill (D2O), the most each compressible cache keeps of
        a prompt of `tokens` `[n, 1]` (a budget of up to one token more than the prompt, `d2o.layer_counts`;
        the layers it never compresses, what it generates too), for the pages held before its prefill; else
        None."""
        if not self._budgets_at_prefill:
            return None
        n = len(compressible(self.model.config))
        most = np.full((n, 1), tokens + 1, np.int64)
        most[protected_layers(n)] = tokens + new_tokens
        return most

    def _ring_size(self) -> int:
        """Slots of a window compressed under `local=true`: any size of at least the window decodes as
        Generator's ring does (what it writes over is out of every later query's window), and whole pages
        leave no slot past the ring in its last page."""
        return -(-self.window // self.pool.page_size) * self.pool.page_size

    def _prefill(self, seq: Sequence, cached: int) -> None:
        """Prefill `seq`'s prompt, compress it as `Generator` does and load the kept tokens into its pages;
        what it generated before a preemption (if anything) is then fed by the steps. Where compressed
        prompts share the prefix cache (`Work.cacheable`), its first `cached` tokens are read from the
        cache's pages (only the rest is computed) and its other full pages enter the cache, uncompressed."""
        request, key = self.requests[seq.index], prefix_key(seq.index)
        gen = self._prefill_capacity(self.policy_of(request), len(request.prompt))
        padded, lengths = gen.pad([request.prompt], 0)
        prefix, tokens = None, padded
        if cached:
            prefix = (self._dense_prefix(key, cached, gen.capacity), cached)
            tokens, _ = gen.pad([request.prompt[cached:]], 0)
        caching = self.scheduler.work[seq.index].cacheable > 0
        whole = caching and self._hold_whole_pages(key, len(request.prompt))
        if self._budgets_at_prefill:  # its protected layers keep what any request may generate (never evicting),
            # so that the dense caches of a bucket's prompts take one shape: one compile, not one per request
            room = self.width * self.pool.page_size - len(request.prompt)
            out = gen.prefill_compressed(tokens, lengths, room, sized_for=padded.shape[1])
            self._budgets[seq.index] = budget_row(gen.compression_plan(lengths, 0)[-1], len(request.prompt))
        else:
            out = gen.prefill_compressed(tokens, lengths, 0, sized_for=padded.shape[1], prefix=prefix, whole=whole)
        logits, dense, stats = out[:3]
        if whole:
            self._write_whole_pages(key, out[3], request.prompt, cached)
        if caching:
            self.pool.release(key)
        self._rings.pop(seq.index, None)
        heads = self.model.config.attention.n_kv_heads  # an AdaKV ring's length counts entries, K a token (the
        # last token's maybe not all kept: `PagedPooledCache.load_pool`)
        rings = jax.device_get(
            [-(-d.length[0] // (heads if isinstance(d, PooledKVCache) else 1)) for d in dense if isinstance(d, Ring)]
        )
        ring = int(max(rings, default=0))  # local=true: every ring takes the largest one's length (`_aligned`)
        if rings:
            self._rings[seq.index] = len(request.prompt) - ring
        self._sync([seq.index], [0], [len(request.prompt)])  # the window before the prompt's end
        self.caches, self._rows_pushed = _load_row(self.caches, self._pushed, dense, stats, 0, ring)
        first = self.scheduler.prefilled(seq, cached)
        if self._budgets_at_prefill:  # its layers' pages were held for the most they could keep: now what they do
            self.pool.truncate(seq.index, np.asarray(self._rows_pushed.length[0]))
        if first:  # nothing generated yet: the prefill's logits give the first token
            self._pick(seq, np.asarray(jax.nn.log_softmax(logits[0])))

    def _dense_prefix(self, key, n: int, capacity: int) -> tuple:
        """The first `n` tokens of the prompt whose cached pages `key` holds, as a Generator's dense caches
        of `capacity` slots (one row)."""
        pages = self.pool.table([key], self.width)[0]
        return _gather_prefix(self.caches, pages, jnp.int32(n), cfg=self.model.config, capacity=capacity)

    def _hold_whole_pages(self, key, length: int) -> bool:
        """Give `key` pages for the full pages of a prompt of `length` past those it holds (the cache's
        hits), to enter the prefix cache; False when there are none to enter or no page is free for them
        (the cache is a saving, never a reason to wait)."""
        new = length // self.pool.page_size * self.pool.page_size - self.pool.lengths[key]
        try:
            return new > 0 and not self.pool.reserve(key, new)
        except PoolExhausted:
            return False

    def _write_whole_pages(self, key, whole: tuple, prompt, cached: int) -> None:
        """Write the full pages of `prompt` past its first `cached` tokens from the uncompressed prefill
        caches `whole` into the pages `key` holds, and enter them into the prefix cache."""
        full = len(self.pool.tables[key]) * self.pool.page_size
        table = self.pool.table([key, *[None] * (self.slots - 1)], self.width)
        table[0, : cached // self.pool.page_size] = NULL_PAGE  # the hits hold their tokens already
        empty = np.zeros(self.slots, np.int32)
        arrays = [table, table, empty, empty, np.full(self.slots, self.slots, np.int32), empty]
        rows = Rows(*(self._rows_placed(x) for x in arrays))
        dense = tuple(d.replace(length=jnp.full_like(d.length, full)) for d in whole)
        self.caches, _ = _load_row(self.caches, rows, dense, (None,) * len(dense), 0, 0)
        self.pool.advance(key, full - cached)
        self.pool.register(key, prompt)

    def _feed(self, plan: Step) -> None:
        """One step: the decode rows (rows 0.. of the step) and the chunk of the sequence being filled
        (the row after them)."""
        rows, filling, piece = plan.rows, plan.filling, plan.chunk
        order = rows + ([filling] if filling else [])
        R = self._rows(len(order))
        ids, pos = np.zeros(R, np.int32), np.full(R, -1, np.int32)
        for i, r in enumerate(rows):
            ids[i], pos[i] = r.tokens[r.at], r.at
        C = self._chunk_bucket(len(piece))
        chunk, chunk_pos = np.zeros(C, np.int32), np.full(C, -1, np.int32)
        chunk[: len(piece)], chunk_pos[: len(piece)] = piece, np.arange(len(piece)) + (filling.at if filling else 0)
        self._sync([r.index for r in order], [1] * len(rows) + ([len(piece)] if filling else []), [r.at for r in order])
        last = np.int32(max(len(piece) - 1, 0))
        logp, best, best_lp, self.caches, lengths = self._step(
            self._leaves,
            self.caches,
            self._pushed,
            ids,
            pos,
            chunk,
            chunk_pos,
            np.int32(len(rows)),
            last,
            evict=self.evict,
        )
        held, rings = self._held(lengths)  # slots each row's pages hold now, under eviction while decoding
        self.stats.steps += 1
        self.stats.calls += 1
        self.stats.prefill_chunks += bool(piece)
        best, best_lp = np.asarray(best), np.asarray(best_lp)
        fed = [(r, 1, i) for i, r in enumerate(rows)] + ([(filling, len(piece), R)] if filling else [])
        reading = any(not self.scheduler.work[r.index].greedy for r, _, _ in fed)
        logp = np.asarray(logp) if reading else None  # the distribution only when a request samples or asks for it
        for r, n, out in fed:
            if self.scheduler.fed(r, n, None if held is None else held[out]):
                self._pick(r, None if logp is None else logp[out], (int(best[out]), float(best_lp[out])))
        self._rings_after(order, rings)

    def _feed_greedy(self, plan: Step) -> None:
        """Up to `decode_steps` greedy decode steps of the plan's rows in one call (`_greedy_steps`)."""
        rows = plan.rows
        R = self._rows(len(rows))
        ids, pos, eos = np.zeros(R, np.int32), np.full(R, -1, np.int32), np.full(R, -1, np.int32)
        stops = np.zeros(R, np.int32)
        for i, (r, n) in enumerate(zip(rows, plan.stops)):
            ids[i], pos[i], stops[i] = r.tokens[r.at], r.at, n
            eos[i] = -1 if self.requests[r.index].decoding.eos_id is None else self.requests[r.index].decoding.eos_id
        self._sync([r.index for r in rows], list(plan.stops), [r.at for r in rows])
        tokens, logprobs, self.caches, lengths = self._greedy_steps(
            self._leaves, self.caches, self._pushed, ids, pos, stops, eos, steps=plan.greedy_steps, evict=self.evict
        )
        tokens, logprobs, (held, rings) = np.asarray(tokens), np.asarray(logprobs), self._held(lengths)
        self.stats.steps += int((tokens >= 0).any(axis=1).sum())
        self.stats.calls += 1
        for step_tokens, step_lps in zip(tokens, logprobs):
            for i, (r, tok, lp) in enumerate(zip(rows, step_tokens, step_lps)):
                if tok >= 0 and self.scheduler.fed(r, 1, None if held is None else held[i]):
                    self.scheduler.picked(r, int(tok), float(lp))
        self._rings_after(rows, rings)

    def _held(self, lengths: tuple[jax.Array, jax.Array]) -> tuple[list | None, list | None]:
        """Each row's main-pool length after a call (with a table per layer, each layer's) and its window
        pool's, read back only under eviction while decoding (which shortens rows and compressed rings; the
        host frees the pages past them); None when the host's own counts are right."""
        if self.evict is None:
            return None, None
        return tuple(np.asarray(x).tolist() for x in lengths)

    def _rings_after(self, rows: list[Sequence], rings: list[int] | None) -> None:
        """The fed rows' compressed rings hold `rings` tokens (`_held`) at their new positions (`_rings`: the
        positions less the tokens held)."""
        for r, n in zip(rows, rings or []):
            if r.index in self._rings:
                self._rings[r.index] = r.at - n

    def warm(self) -> int:
        """Compile every step this engine can run (each row bucket with each chunk bucket, and each row
        bucket's multi-step greedy call) on empty rows, which write nothing, so that serving never stops
        to compile; a policy's prefill still compiles per prompt bucket when first met. Returns the
        programs run."""
        self._sync([])
        rows = sorted({self._rows(n) for n in range(1, self.slots + 1)})
        chunks = [0] if self._stepwise else sorted({self._chunk_bucket(n) for n in range(self.chunk + 1)})
        for R in rows:
            idle, none = np.full(R, -1, np.int32), np.zeros(R, np.int32)
            for C in chunks:
                args = (none, idle, np.zeros(C, np.int32), np.full(C, -1, np.int32), np.int32(R), np.int32(0))
                self.caches = self._step(self._leaves, self.caches, self._pushed, *args, evict=self.evict)[3]
            if self.decode_steps > 1:
                self.caches = self._greedy_steps(
                    self._leaves,
                    self.caches,
                    self._pushed,
                    none,
                    idle,
                    none,
                    idle,
                    steps=self.decode_steps,
                    evict=self.evict,
                )[2]
        jax.block_until_ready(self.caches)
        return len(rows) * (len(chunks) + (self.decode_steps > 1))

    def _chunk_bucket(self, n: int) -> int:
        """Padded length of a prompt chunk of n tokens: 0 for none, else the next power of two from
        chunk / 8 up, capped at `chunk` (a prompt's last chunk computes at most twice its tokens, for
        four compiles per row bucket)."""
        if n == 0:
            return 0
        return min(self.chunk, max(self.chunk // 8, 1 << (n - 1).bit_length()))

    def _rows(self, n: int) -> int:
        """Rows a step of n sequences runs: n rounded up to a power of two (one compile each; all slots
        under a mesh, whose data axis splits them)."""
        if self.mesh is not None:
            return self.slots
        return min(self.slots, 1 << (n - 1).bit_length())
