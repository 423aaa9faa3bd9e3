"""The continuous-batching engine: every request gets what `Generator` gives it alone, whatever the
batch mix, chunking, prefix hits and preemptions; pages all come back."""

import dataclasses
import json
import math
import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

from kvjax import DecodingConfig, Generator
from kvjax.compress import parse_policy
from kvjax.config import ConfigError
from kvjax.duo import save_pattern
from kvjax.engine import Engine, Request, _load_row
from kvjax.generate import prompt_bucket
from kvjax.paged import PagedKVCache
from kvjax.paged_duo import PagedDuoCache
from kvjax.paged_kivi import PagedKiviCache
from kvjax.paged_lowrank import PagedLowRankCache
from kvjax.paged_pooled import PagedPooledCache
from kvjax.paged_quest import PagedQuestCache
from kvjax.plan import compressible
from tests.conftest import GEMMA_LIKE

PROMPT_LENGTHS, NEW = (5, 17, 3, 11, 9), (6, 3, 8, 2, 5)
ADAKV = "snapkv:0.5:obs_window=2,allocator=adakv"  # AdaKV's per-head budgets, pooled pages
PYRAMID = "snapkv:0.5:obs_window=2,allocator=pyramid,beta=2"  # PyramidKV's layer budgets, a block table per layer
LONGER = [  # two requests of 32 tokens, which preempt others on a small pool
    Request(tuple(range(1, 21)), DecodingConfig(max_new_tokens=12)),
    Request(tuple(range(30, 52)), DecodingConfig(max_new_tokens=10)),
]


@pytest.fixture(scope="module")
def gqa(make_model):
    return make_model("gqa", "model.n_layers=2")[1]


@pytest.fixture(scope="module")
def requests(gqa):
    rng = np.random.default_rng(0)
    shared = list(rng.integers(0, gqa.config.vocab_size, 12))  # 3 pages of 4 that some prompts share
    out = []
    for i, (n, new) in enumerate(zip(PROMPT_LENGTHS, NEW)):
        own = list(rng.integers(0, gqa.config.vocab_size, n))
        out.append(Request(tuple(int(t) for t in (shared + own if i % 2 else own)), DecodingConfig(max_new_tokens=new)))
    return out


@pytest.fixture(scope="module")
def alone(gqa, requests):
    """Each request through Generator by itself."""
    gen = Generator(gqa, capacity=40)
    return [gen([list(r.prompt)], r.decoding) for r in requests]


def _check(completions, alone):
    for got, want in zip(completions, alone):
        np.testing.assert_array_equal(got.tokens, want.tokens[0, : len(got.tokens)])
        assert len(got.tokens) == want.tokens.shape[1]
        np.testing.assert_allclose(got.logprobs, want.logprobs[0], atol=1e-5)


@pytest.mark.parametrize("slots, chunk, prefix", [(3, 4, True), (5, 32, False)])
def test_every_request_gets_what_it_gets_alone(gqa, requests, alone, slots, chunk, prefix):
    engine = Engine(gqa, n_pages=40, page_size=4, slots=slots, chunk=chunk, prefix_cache=prefix)
    _check(engine.run(requests), alone)
    assert engine.pool.used_pages == 0  # every page came back
    assert (engine.stats.cached_tokens > 0) == prefix  # the shared 12-token prefix is reused
    total = sum(len(r.prompt) for r in requests)
    assert engine.stats.prefill_tokens + engine.stats.cached_tokens == total


def test_preempted_requests_are_recomputed_to_the_same_tokens(gqa, requests, alone):
    engine = Engine(gqa, n_pages=10, page_size=4, slots=4, chunk=4)  # 9 usable pages: too few for all at once
    completions = engine.run(requests)
    _check(completions, alone)
    assert engine.stats.preemptions > 0 and engine.pool.used_pages == 0
    # Requests 0-2 run (3 and 4 wait for pages) when a page runs short: the newest, 2, yields.
    assert [c.preempted for c in completions] == [0, 0, 1, 0, 0]


def test_several_greedy_steps_a_call_give_the_same_tokens_and_stop_at_eos(gqa, requests, alone):
    """`decode_steps`: the same tokens as one step a call, in fewer calls; a request whose EOS comes up
    inside a multi-step call stops there, as Generator stops it."""
    one = Engine(gqa, n_pages=40, page_size=4, slots=5, chunk=32, decode_steps=1)
    many = Engine(gqa, n_pages=40, page_size=4, slots=5, chunk=32, decode_steps=4)
    _check(one.run(requests), alone)
    _check(many.run(requests), alone)
    assert one.stats.calls == one.stats.steps and many.stats.calls < many.stats.steps
    eos = int(alone[2].tokens[0, 4])  # request 2's fifth token (of 8)
    stopping = [Request(r.prompt, dataclasses.replace(r.decoding, eos_id=eos)) for r in requests]
    gen = Generator(gqa, capacity=40)
    for got, r in zip(many.run(stopping), stopping):
        want = gen([list(r.prompt)], r.decoding)
        n = int(want.lengths[0])
        assert got.tokens == list(want.tokens[0, :n]) and (got.tokens[-1] == eos or n == r.decoding.max_new_tokens)
        np.testing.assert_allclose(got.logprobs, want.logprobs[0, :n], atol=1e-5)
    assert len(many.done[2].tokens) < 8 and many.pool.used_pages == 0  # it stopped early


def test_sampled_tokens_depend_on_the_request_not_on_the_batch(gqa, requests):
    """Sampling draws with each request's own key (its seed and step): the same tokens whatever the slots,
    chunking, preemptions and order of arrival, and other tokens under another seed."""
    sampled = [
        Request(r.prompt, DecodingConfig(max_new_tokens=r.decoding.max_new_tokens, temperature=1.0, seed=3))
        for r in requests
    ]
    a = Engine(gqa, n_pages=40, page_size=4, slots=5, chunk=32).run(sampled)
    b = Engine(gqa, n_pages=10, page_size=4, slots=2, chunk=4).run(sampled)
    assert [x.tokens for x in a] == [x.tokens for x in b] and sum(x.preempted for x in b) > 0
    backwards = Engine(gqa, n_pages=40, page_size=4, slots=5, chunk=32).run(sampled[::-1])
    assert [x.tokens for x in backwards[::-1]] == [x.tokens for x in a]
    np.testing.assert_allclose(
        np.concatenate([x.logprobs for x in a]), np.concatenate([x.logprobs for x in b]), atol=1e-5
    )
    other = [Request(r.prompt, dataclasses.replace(r.decoding, seed=4)) for r in sampled]
    assert [x.tokens for x in Engine(gqa, n_pages=40, page_size=4, slots=5).run(other)] != [x.tokens for x in a]


def test_mla_latents_in_pages_with_prefix_hits_and_preemptions(make_model, requests):
    """MLA's latents and RoPE keys in pages (`PagedLatentCache`): each request as Generator gives it alone."""
    mla = make_model("mla", "model.n_layers=2")[1]
    gen = Generator(mla, capacity=40)
    engine = Engine(mla, n_pages=10, page_size=4, slots=4, chunk=4)
    _check(engine.run(requests), [gen([list(r.prompt)], r.decoding) for r in requests])
    assert engine.stats.preemptions > 0 and engine.stats.cached_tokens > 0 and engine.pool.used_pages == 0
    assert engine.caches[0].k.shape[1:] == (1, 4, mla.config.mla.kv_lora_rank)


def test_requests_that_cannot_fit_and_models_it_cannot_page_are_refused(gqa, make_model):
    with pytest.raises(ConfigError, match="request 0: 30 tokens need 8 pages; a sequence may hold 4"):
        Engine(gqa, n_pages=5, page_size=4).run([Request(tuple(range(20)), DecodingConfig(max_new_tokens=10))])


@pytest.mark.parametrize(
    "name, overrides",
    [("mamba", ("model.n_layers=2",)), ("rwkv7", ("model.n_layers=2",)), ("retnet", ("model.n_layers=2",)),
     ("hybrid-mamba-attn", ("model.n_layers=3",)), ("yoco-gret", ())],
)  # fmt: skip
def test_recurrent_layers_keep_a_state_slot_per_request(make_model, requests, name, overrides):
    """Mamba, RWKV-7, RetNet, a Mamba/attention hybrid and YOCO's gated-retention self-decoder: each
    recurrent layer keeps one state per running request (`SlotStates`), attention layers pages; mixed
    prefill/decode steps, multi-step calls and preemptions (a recomputed request starts from a zero state)
    give each request what Generator gives it alone; a state slot takes the bytes `kvjax.memory` counts; a
    policy on a model of recurrent layers alone is refused by name (it has no tokens to compress)."""
    from kvjax.memory import layer_memory
    from kvjax.slot_states import SlotStates

    model = make_model(name, *overrides)[1]
    gen = Generator(model, capacity=40)
    engine = Engine(model, n_pages=10, page_size=4, slots=4, chunk=4, decode_steps=4)
    _check(engine.run(requests), [gen([list(r.prompt)], r.decoding) for r in requests])
    assert engine.stats.preemptions > 0 and engine.stats.calls < engine.stats.steps and engine.pool.used_pages == 0
    states = [c for c in engine.caches if isinstance(c, SlotStates)]
    per_sequence = sum(m.bytes_per_sequence for m in layer_memory(model.config) if m.kv_bytes_per_slot == 0)
    assert states and engine.state_nbytes() == per_sequence and sum(c.nbytes() for c in states) == 4 * per_sequence
    assert engine.prefix_cache is False  # a prefix hit would skip tokens a state must see
    # A memory budget pays for running requests' states first: as many slots as hold a request of `tokens`
    # each, then spare slots whose states cost one such request's pages at most (none where nothing pages:
    # Mamba stays at 3; at 400 tokens the hybrid takes 2 spare, YOCO's every slot), then pages.
    page = engine.page_nbytes()
    for tokens in (400, 40):
        request = per_sequence + page * tokens // 4
        budget = 3 * request + 5 * page
        slots = min(8, 3 + page * tokens // 4 // per_sequence)
        pages = 1 + (budget - slots * per_sequence) // page if page else 1 + slots * tokens // 4  # room, no bytes
        assert engine.fit(budget, 8, tokens) == (slots, pages, None)
    with pytest.raises(ConfigError, match=f"holds no request of 40 tokens: it needs {request:,}"):
        engine.fit(request - 1, 8, 40)
    if not compressible(model.config):
        with pytest.raises(ConfigError, match="has no cache that grows with the sequence"):
            Engine(model, n_pages=8, policy="snapkv:0.5")


@pytest.mark.parametrize(
    "name, overrides, policy, pages",
    [
        ("hybrid-mamba-attn", ("model.n_layers=4", "model.layer_pattern=[mamba, attention]"), PYRAMID + ",every=3", 7),
        ("yoco-gret", (), "tova:0.5+kivi:2:group=2,residual=4", 6),
    ],
)
def test_a_policy_on_a_hybrid_compresses_its_attention_and_loads_the_prompts_states(
    make_model, requests, name, overrides, policy, pages
):
    """A policy on a model with recurrent and attention layers (a Mamba/attention hybrid under PyramidKV's
    per-layer budgets evicting every 3 tokens; YOCO's gated-retention self-decoder and KIVI-2 pages of its
    global cache after TOVA; refused until 2026-12-06): each prompt is prefilled whole and compressed as Generator does,
    its attention layers' kept tokens go into pages and the state it leaves each recurrent layer into the
    request's state slot, and decoding goes on from both. Each request equals Generator alone under the
    policy, with preemptions (the prompt compressed again, its state loaded again) and multi-step calls."""
    model = make_model(name, *overrides)[1]
    gen = Generator(model, capacity=40, policy=parse_policy(policy))
    engine = Engine(model, n_pages=pages, page_size=4, slots=4, chunk=4, decode_steps=4, policy=policy, max_tokens=40)
    _check(engine.run(requests), [gen([list(r.prompt)], r.decoding) for r in requests])
    assert engine.stats.preemptions > 0 and engine.pool.used_pages == 0 and engine.prefix_cache is False
    assert engine.layout.layered == ("pyramid" in policy) and engine.state_nbytes() > 0


def test_local_and_global_layers_in_pages(make_model, requests):
    """Gemma's layout (local windows of 8 beside global layers), prompts longer than the window: by default the
    local layers page from a pool of their own in which a request holds only its window's pages, at most ceil(8 / 4)
    + 1 = 3 (the pool has room for 4 while a chunk of 4 goes in, and for the tokens of a multi-step call), freed as
    the window moves on; with `window_pages="keep"` the window is a mask over pages kept to the end, and prefix hits
    happen. Both give what Generator's rings give, with preemptions; a policy under `keep`, and `local=true`
    ending in codes the window pool cannot hold (KVQuant's), are refused by name."""
    model = make_model("gqa", *GEMMA_LIKE, "model.n_layers=2")[1]
    gen = Generator(model, capacity=40)
    alone = [gen([list(r.prompt)], r.decoding) for r in requests]
    free = Engine(model, n_pages=10, page_size=4, slots=4, chunk=4, decode_steps=1)
    _check(free.run(requests), alone)
    assert free.stats.preemptions > 0 and free.pool.used_pages == 0 and free.windows.used_pages == 0
    assert free.windows.per_decode == free.windows.peak == 3 and free.prefix_cache is False
    local, glob = free.caches  # [local, attention] pattern: the local layer's pool is (4 - 1) * 3 + 4 + null
    assert (local.windowed, glob.windowed, local.k.shape[0], glob.k.shape[0]) == (True, False, 14, 10)
    # By default the local pool holds every slot's worst case: (4 - 1) decoding at 3 pages, one prefilling at 4.
    assert free.fixed_nbytes(2) == (1 * 3 + 4 + 1) * local.page_nbytes and free.page_nbytes() == glob.page_nbytes
    # A budget buys a smaller one: after its null page and the prefilling chunk's extra page, the rest is split
    # as a request of 40 tokens takes it (10 global pages, 3 local ones): 29 pages hold 2.2 such requests, so
    # 6 + 1 local pages and 23 global ones; requests are admitted while their windows' reservations fit (two of
    # 3 pages here, where the global pages would hold three of these requests).
    page = glob.page_nbytes
    assert free.fit(31 * page, 8, 40) == (8, 1 + 23, 7)
    tight = Engine(model, n_pages=24, page_size=4, slots=8, chunk=4, decode_steps=1, window_pool=7)
    _check(tight.run(requests), alone)  # a pool short of a page would raise here
    assert tight.windows.n_pages == 8 and tight.stats.peak_running == 2 and tight.scheduler.windows_reserved == 0
    assert [w.window for w in tight.check(requests)] == [3, 3, 3, 3, 3]  # 3 pages of their positions at most
    with pytest.raises(ConfigError, match="their pool has 1 for running requests"):
        Engine(model, n_pages=24, page_size=4, slots=8, chunk=4, decode_steps=1, window_pool=2).run(requests)
    steps = Engine(model, n_pages=10, page_size=4, slots=4, chunk=4, decode_steps=4)  # 4 tokens a call: 4 pages
    _check(steps.run(requests), alone)
    assert steps.stats.calls < steps.stats.steps and steps.windows.peak <= steps.windows.per_decode == 4
    keep = Engine(model, n_pages=10, page_size=4, slots=4, chunk=4, window_pages="keep")
    _check(keep.run(requests), alone)
    assert keep.stats.preemptions > 0 and keep.stats.cached_tokens > 0 and keep.pool.used_pages == 0
    with pytest.raises(ConfigError, match=r"sliding-window layers \(local\).*window_pages='free'"):
        Engine(model, n_pages=8, policy="snapkv:0.5", window_pages="keep")
    with pytest.raises(ConfigError, match="local=true compresses the sliding-window layers too.*quantizes them with"):
        Engine(model, n_pages=8, policy="tova:0.5:local+kvquant:4")


def test_a_model_of_sliding_windows_alone(make_model, requests):
    """`swa` (Mistral's layout: every layer a window of 8): no layer pages from the main pool, whose pages
    hold nothing (until 2026-12-06 building the engine failed on it); the window pool holds every layer's
    window. Under PyramidKV's budgets with `local=true` the two rings keep budgets of their own yet share
    one length (no table per layer: none pages from the main pool). Each request equals Generator alone."""
    model = make_model("swa", "model.n_layers=2", "model.attention.window=8")[1]
    requests = [*requests, Request(tuple(range(1, 21)), DecodingConfig(max_new_tokens=12))]
    for policy in (None, PYRAMID + ",local"):
        engine = Engine(model, n_pages=33, page_size=4, slots=4, chunk=8, decode_steps=4, policy=policy, max_tokens=32)
        gen = Generator(model, capacity=40, policy=policy and parse_policy(policy))
        _check(engine.run(requests), [gen([list(r.prompt)], r.decoding) for r in requests])
        assert engine.page_nbytes() == 0 and all(c.windowed for c in engine.caches) and not engine.layout.layered
        assert engine.windows.used_pages == 0 and engine.windows.peak == (2 if policy else 4)


def test_yocos_sliding_window_self_decoder_pages_its_windows_beside_one_global_cache(make_model, requests):
    """YOCO on sliding windows (`yoco-swa`, windows of 8; refused until 2026-12-06): the self-decoder's two
    layers page from the window pool, holding at most ceil(8 / 4) + 1 pages each, and the cross-decoder's one
    global K/V from the main pool (its second layer reads it: no cache of its own), as `kvjax.memory` counts
    them. Without a policy, and with H2O evicting every 3 tokens from the global cache and the rings
    (`local=true`), each request equals Generator alone, with preemptions and multi-step calls."""
    from kvjax.memory import layer_memory

    model = make_model("yoco-swa", "model.yoco.window=8")[1]
    ring, glob = layer_memory(model.config)[0], layer_memory(model.config)[-1]
    assert model.config.mixers == ("swa", "swa", "attention", "attention") and ring.max_slots == 8
    for policy, pages in ((None, 9), ("h2o:0.5:local,every=3", 6)):
        gen = Generator(model, capacity=40, policy=policy and parse_policy(policy))
        engine = Engine(model, n_pages=pages, page_size=4, slots=4, chunk=4, policy=policy, max_tokens=40)
        _check(engine.run(requests), [gen([list(r.prompt)], r.decoding) for r in requests])
        assert engine.stats.preemptions > 0 and engine.stats.calls < engine.stats.steps, (policy, engine.stats)
        assert engine.pool.used_pages == 0 and engine.windows.used_pages == 0 and engine.windows.peak <= 4
        assert [c.windowed for c in engine.caches] == [True, True, False] and engine.prefix_cache is False
        if policy is None:  # the bytes `kvjax.memory` counts (under the policy H2O's sums lie beside them)
            assert engine.page_nbytes() == 4 * (glob.kv_bytes_per_slot + glob.meta_bytes_per_slot)
            assert all(c.page_nbytes == 4 * (ring.kv_bytes_per_slot + ring.meta_bytes_per_slot) for c in engine.caches)


@pytest.mark.parametrize("policy", ["snapkv:0.5:obs_window=1+int:8", ADAKV, "quest:0.5:page_size=4"])
def test_a_policy_on_local_and_global_layers_compresses_the_global_ones(make_model, requests, policy):
    """Gemma's layout with a policy: the global layers' pages hold the compressed prompt (kept slots, int8
    codes; AdaKV's pooled entries; every token with Quest's key bounds), the local layers' own pool the
    window of the whole prompt at its positions, as Generator's rings (the policy leaves them whole); each
    request equals Generator alone under the policy, with preemptions and multi-step calls. Positions, not
    kept slots, must fit the window tables (under Quest, which keeps every token, the main pool's first)."""
    model = make_model("gqa", *GEMMA_LIKE, "model.n_layers=2")[1]
    gen = Generator(model, capacity=40, policy=parse_policy(policy))
    pages = 9 if policy.startswith("quest") else 6  # (Quest keeps every token)
    engine = Engine(model, n_pages=pages, page_size=4, slots=4, chunk=4, decode_steps=4, policy=policy, max_tokens=32)
    _check(engine.run(requests), [gen([list(r.prompt)], r.decoding) for r in requests])
    assert engine.stats.preemptions > 0 and engine.pool.used_pages == 0 and engine.windows.used_pages == 0
    local, glob = engine.caches
    assert local.bits is None and glob.bits == (8 if "int:8" in policy else None)
    assert isinstance(glob, PagedPooledCache) == ("adakv" in policy) and type(local) is PagedKVCache
    assert isinstance(glob, PagedQuestCache) == policy.startswith("quest")
    too_long = (
        "tokens need 9 pages" if policy.startswith("quest") else "positions, past the 32 the sliding-window layers'"
    )
    with pytest.raises(ConfigError, match=f"request 0: 33 {too_long}"):
        engine.run([Request(tuple(range(1, 31)), DecodingConfig(max_new_tokens=3))])


@pytest.mark.parametrize(
    "policy, page_size",
    [
        ("tova:0.5:local", 4),
        ("snapkv:0.5:obs_window=1,local", 3),
        ("tova:0.5:local+int:8", 4),
        ("tova:0.5:local+kivi:2:group=2,residual=2", 2),
        ("h2o:0.5:local,every=3", 4),
        (ADAKV + ",local", 4),
        ("h2o:0.25:allocator=adakv,local,every=4", 4),
        ("tova:0.5:local+palu:0.5", 4),
    ],
)
def test_local_true_compresses_the_windows_into_rings_of_their_pages(make_model, requests, policy, page_size):
    """Gemma's layout under `local=true`: each local layer's window (the prompt's last 7 tokens) is compressed
    too, into Generator's ring (`WindowKVCache`), which grows back to the window of 8 as decoding goes on and
    then writes over its oldest slot. A request holds the window pool's pages its ring fills, at most
    ceil(8 / page_size) (the last one partly, at pages of 3), never the 4-5 an uncompressed window takes
    while it decodes; each request equals Generator alone under the policy, with preemptions (what it
    generated re-fed a step at a time) and multi-step calls; every page comes back; a plain engine serves
    the policy to the requests that name it. Rings of int8 codes (`WindowQuantKVCache`) page as codes in
    the window pool, which an engine whose windows stay whole cannot hold; KIVI's rings (blocks of 4 tokens)
    flush each block (2 tokens) into the ring slots of its tokens, the residual apart. Under `every=` the
    rings are re-selected with the global layers every 3 tokens (H2O's sums kept per ring slot), each ring's
    new length back to the host, which writes the next tokens after it. AdaKV's rings (`WindowPooledKVCache`)
    page as rings of entries, loaded (and under `every=` re-selected) oldest first so that a token's K entries
    go over the K oldest. Palu's rings (`WindowLowRankKVCache`) page as latents in the window pool, on bases
    calibrated for the local layers too."""
    model = make_model("gqa", *GEMMA_LIKE, "model.n_layers=2")[1]
    calibration = np.random.default_rng(1).integers(0, model.config.vocab_size, (2, 32)) if "palu" in policy else None
    gen = Generator(model, capacity=40, policy=parse_policy(policy), calibration=calibration)
    args = dict(page_size=page_size, slots=4, chunk=4, decode_steps=4, max_tokens=32, calibration=calibration)
    pages = (28 if "adakv" in policy or "palu" in policy else 24) // page_size
    engine = Engine(model, n_pages=pages, policy=policy, **args)
    if any(s in policy for s in ("kivi", "every", "adakv", "palu")):  # one that generates enough for its codes
        # or latents to wrap round the ring (14 of 8 slots), or to re-select its ring four times
        requests = [*requests, Request(tuple(range(1, 21)), DecodingConfig(max_new_tokens=12))]
    _check(engine.run(requests), [gen([list(r.prompt)], r.decoding) for r in requests])
    assert engine.stats.preemptions > 0 and engine.pool.used_pages == 0 and engine.windows.used_pages == 0
    assert engine.windows.peak == -(-8 // page_size) < engine.windows.per_decode
    if "int:8" in policy:
        assert [c.bits for c in engine.caches] == [8, 8]  # the window pool's codes, the global layer's
        with pytest.raises(
            ConfigError, match=r"hold .*int8 codes \(its policy.* needs .*int8 codes \(the windows' rings too\)"
        ):
            Engine(model, n_pages=8, policy="tova:0.5+int:8", **args).check(
                [dataclasses.replace(requests[0], policy=policy)]
            )
        return
    if "kivi" in policy:  # both pools hold KIVI's codes, the residuals one per sequence slot and layer
        assert all(isinstance(c, PagedKiviCache) for c in engine.caches) and engine.caches[0].windowed
        return
    if "every" in policy:  # both pools keep H2O's running sums
        assert all(c.stat is not None for c in engine.caches)
        return
    if "adakv" in policy:  # both pools hold AdaKV's entries, the window pool's in rings
        assert all(isinstance(c, PagedPooledCache) for c in engine.caches) and engine.caches[0].windowed
        return
    if "palu" in policy:  # both pools hold latents (fp32, int32 positions), fewer bytes than K/V pages
        assert all(isinstance(c, PagedLowRankCache) for c in engine.caches) and engine.caches[0].windowed
        latents = [page_size * (2 * k.shape[0] * k.shape[-1] * 4 + 4) for k, _ in gen.prepared["bases"]]
        att = model.config.attention
        assert [c.page_nbytes for c in engine.caches] == latents and max(latents) < page_size * (
            2 * att.n_kv_heads * att.head_dim * 4 + 4
        )
        return
    # Beside requests its own policy compresses (SnapKV's per-head positions need an engine that keeps them)
    own = policy.replace(",local", "") if "snapkv" in policy else None
    mixed = Engine(model, n_pages=48 // page_size, policy=own, **args)
    served = mixed.run([dataclasses.replace(r, policy=policy if i % 2 else None) for i, r in enumerate(requests)])
    # What a request's windows can hold, reserved at admission: a ring's kept tokens and those it generates
    ringed, whole = ([w.window for w in e.check(requests)] for e in (engine, mixed))
    assert all(r <= min(w, -(-8 // page_size)) for r, w in zip(ringed, whole)) and sum(ringed) < sum(whole)
    other = Generator(model, capacity=40, policy=own and parse_policy(own))
    _check(served, [(gen if i % 2 else other)([list(r.prompt)], r.decoding) for i, r in enumerate(requests)])


@pytest.mark.parametrize("policy, width, pages", [("snapkv:0.5:obs_window=1+int:8", 16, 7), ("int:4", 8, 10)])
def test_a_policy_engine_gives_each_request_what_generator_gives_it_alone(gqa, requests, policy, width, pages):
    """Compressed prompts in pages (SnapKV's per-head positions, then int8 codes; int4 codes, two a byte)
    decode exactly as the Generator's dense compressed cache; with too few pages for every request at once
    requests are preempted and recomputed."""
    gen = Generator(gqa, capacity=40, policy=parse_policy(policy))
    alone = [gen([list(r.prompt)], r.decoding) for r in requests]
    engine = Engine(gqa, n_pages=pages, page_size=4, slots=4, chunk=8, policy=policy)
    _check(engine.run(requests), alone)
    assert engine.pool.used_pages == 0 and engine.stats.preemptions > 0
    heads = gqa.config.attention.n_kv_heads if "snapkv" in policy else 1
    assert engine.caches[0].pos.shape[1] == heads and engine.caches[0].k.dtype == np.uint8
    assert engine.caches[0].k.shape[-1] == width  # head_dim 16: 16 bytes of int8 codes, 8 of int4


@pytest.mark.parametrize(
    "policy, page_size, pages, steps",
    [
        ("kivi:2:group=4,residual=8", 4, 10, 4),
        ("streaming:0.5+kivi:4:group=4,residual=8", 8, 5, 4),
        ("kvquant:4:group=4,residual=8,outliers=0.1,sinks=4", 4, 10, 4),
        ("gear:4:group=4,residual=4,outliers=0.2,rank=2", 4, 10, 4),
    ],
)
def test_kivi_pages_give_each_request_what_generator_gives_it_alone(gqa, requests, policy, page_size, pages, steps):
    """KIVI in pages (`kvjax.paged_kivi`): codes of whole residual blocks in pages, each sequence's newest
    tokens in a full-precision residual of its own, flushed into its pages as decoding fills it; each
    request decodes as Generator's dense KIVI cache alone, with preemptions (what it generated re-fed a
    step at a time) and multi-step calls, and the pages and residual slots hold what the formula says.
    KVQuant's blocks too: pre-RoPE keys, exact outliers in the pages, exact sinks beside the residual; and
    GEAR's: its extremes exact in the pages, each block's low-rank error Q per slot and P per page (a page
    is a block; refused until 2026-12-06)."""
    gen = Generator(gqa, capacity=40, policy=parse_policy(policy))
    alone = [gen([list(r.prompt)], r.decoding) for r in requests]
    engine = Engine(gqa, n_pages=pages, page_size=page_size, slots=4, decode_steps=steps, policy=policy, max_tokens=32)
    _check(engine.run(requests), alone)
    assert engine.pool.used_pages == 0 and engine.stats.preemptions > 0
    att, bits = gqa.config.attention, 2 if "kivi:2" in policy else 4
    K, H, ps, R = att.n_kv_heads, att.head_dim, page_size, 4 if "residual=4" in policy else 8
    kvquant, gear = policy.startswith("kvquant"), policy.startswith("gear")
    codes = 2 * K * ps * H * bits // 8  # keys and values
    value_groups = 1 if kvquant else H // 4  # KVQuant's values: one group a vector, KIVI's: groups of 4 channels
    scales = 2 * K * (ps // 4) * H * 4 + 2 * K * ps * value_groups * 4  # key groups of 4 tokens
    # exact outliers a vector, an fp32 value and a uint8 channel each: KVQuant's 10% largest, GEAR's 10% at either end
    n = math.ceil(0.1 * H) if kvquant else 2 * math.ceil(0.2 * H / 2) if gear else 0
    outliers = 2 * K * ps * n * (4 + 1)
    low_rank = 2 * K * (ps + H) * 2 * 4 if gear else 0  # K's and V's rank-2 Q a slot and P a page (block), fp32
    assert engine.page_nbytes() == 2 * (codes + scales + outliers + low_rank + ps * 4)  # 2 layers, int32 positions
    sinks = 2 * K * 4 * H * 4 if kvquant else 0  # KVQuant's 4 exact tokens (a 3-token prompt decodes its 4th)
    residual = 2 * (2 * K * R * H * 4 + R * 4 + sinks)  # 2 layers: K and V of R fp32 tokens, their positions
    assert engine.state_nbytes() == residual and engine.fixed_nbytes(4) == 4 * residual
    tables = 2 * (4 * (32 // ps) * 4 + 4 * 4 + 4 * 4)  # block tables of 32 tokens, lengths, residual rows
    assert engine.nbytes() == pages * engine.page_nbytes() + 4 * residual + tables


@pytest.mark.parametrize("policy, pages", [("lorc:0.5:heads=2", 10), ("tova:0.5+palu:0.5", 6)])
def test_palu_and_lorc_latents_in_pages(gqa, requests, policy, pages):
    """Palu's and LoRC's latents in pages (`kvjax.paged_lowrank`; refused until 2026-12-06): a page holds each
    token's key and value latents per head group, the view maps them out and rotates the keys, and each
    request equals Generator alone under the policy (LoRC's ranks differ per layer; Palu's bases from the
    engine's calibration tokens, after TOVA), with preemptions (the generated tokens re-fed as a chunk) and
    multi-step calls; a page takes the latents' bytes. Latents with positions per head or a table per layer
    are refused by name."""
    calibration = np.random.default_rng(1).integers(0, gqa.config.vocab_size, (2, 32)) if "palu" in policy else None
    gen = Generator(gqa, capacity=40, policy=parse_policy(policy), calibration=calibration)
    engine = Engine(
        gqa, n_pages=pages, page_size=4, slots=4, decode_steps=4, policy=policy, calibration=calibration, max_tokens=32
    )
    _check(engine.run(requests), [gen([list(r.prompt)], r.decoding) for r in requests])
    assert engine.stats.preemptions > 0 and engine.stats.calls < engine.stats.steps and engine.pool.used_pages == 0
    assert all(isinstance(c, PagedLowRankCache) for c in engine.caches) and engine.prefix_cache is False
    groups, ranks = zip(*((k.shape[0], k.shape[-1]) for k, _ in gen.prepared["bases"]))
    assert len(set(ranks)) == (2 if "lorc" in policy else 1)  # LoRC's progressive ranks
    assert engine.page_nbytes() == sum(
        4 * (2 * g * r * 4 + 4) for g, r in zip(groups, ranks)
    )  # fp32 latents, int32 pos
    with pytest.raises(ConfigError, match="latent pages keep one position per slot and one block table for every"):
        Engine(gqa, n_pages=9, policy="snapkv:0.5:allocator=pyramid+lorc:0.5")


def test_quest_pages_keep_every_token_and_each_decode_row_reads_its_best(gqa, make_model, requests, alone):
    """Quest in pages (`kvjax.paged_quest`; refused until 2026-12-06): every token stays, each page keeps its keys'
    min and max per head, and a decode row reads the half of its pages whose bound on q.k is highest (the page
    of its newest token always); each request equals Generator alone under Quest (whose answers differ from the
    full cache's, so reading every page fails), with preemptions, multi-step calls and prefix hits (its prompts go
    in chunks, as uncompressed ones), and a request Quest leaves alone (`none`) reads all its pages beside them.
    A page takes Quest's bytes: its K/V and positions, and a key min and max per KV head. On CLA and YOCO-gRet
    too (refused until 2026-12-06)."""
    policy = "quest:0.5:page_size=4"
    gen = Generator(gqa, capacity=40, policy=parse_policy(policy))
    mine = [dataclasses.replace(r, policy="none") if i == 2 else r for i, r in enumerate([*requests, *LONGER])]
    engine = Engine(gqa, n_pages=13, page_size=4, slots=4, chunk=4, decode_steps=4, max_tokens=40, policy=policy)
    want = [alone[i] if i == 2 else gen([list(r.prompt)], r.decoding) for i, r in enumerate(mine)]
    _check(engine.run(mine), want)
    assert engine.stats.preemptions > 0 and engine.stats.cached_tokens > 0 and engine.stats.calls < engine.stats.steps
    assert engine.pool.used_pages == 0 and all(isinstance(c, PagedQuestCache) for c in engine.caches)
    assert not any(np.allclose(want[i].logprobs, alone[i].logprobs, atol=1e-3) for i in (0, 1, 3, 4))
    K, H = gqa.config.attention.n_kv_heads, gqa.config.attention.head_dim
    assert engine.page_nbytes() == 2 * (2 * K * 4 * H * 4 + 4 * 4 + 2 * K * H * 4)  # 2 layers, fp32, int32 pos
    # CLA: the layer that shares a producer's K/V reads the pages the producer's queries chose, as in Generator;
    # YOCO-gRet: its cross-decoder reads one global cache so, its recurrent self-decoder a state slot a request
    for name in ("cla2", "yoco-gret"):
        other = make_model(name, "model.n_layers=4")[1]
        gen = Generator(other, capacity=40, policy=parse_policy(policy))
        engine = Engine(other, n_pages=18, page_size=4, slots=4, chunk=4, decode_steps=4, max_tokens=40, policy=policy)
        _check(engine.run(LONGER), [gen([list(r.prompt)], r.decoding) for r in LONGER])
    with pytest.raises(ConfigError, match=r"Quest's pages are the engine's; its page_size=16 must equal the engine's"):
        Engine(gqa, n_pages=8, page_size=4, policy="quest:0.5")


def test_duo_pages_hold_the_retrieval_heads_and_sequence_slots_the_streaming_heads(
    gqa, make_model, requests, alone, tmp_path
):
    """DuoAttention in the engine (`kvjax.paged_duo`; refused until 2026-12-07): a layer's retrieval heads keep
    every token in its pages, its streaming heads their sinks and recent ring in the request's sequence slot;
    each request equals Generator alone under the policy (whose answers differ from the full cache's), with
    preemptions (what a request generated re-fed a step at a time) and multi-step calls. A page takes the
    retrieval heads' bytes, a slot the streaming heads'. On Gemma's layout too, under local=true: a window's
    retrieval heads in the window pool by position (freed as it moves on), a window and a global layer streaming
    every head (pages of positions only), a global layer none; a prompt longer than its window, loaded into a
    reused window page, sees none of the page's last owner's tokens (it did until 2026-12-07)."""
    K, H = gqa.config.attention.n_kv_heads, gqa.config.attention.head_dim
    save_pattern(tmp_path / "split.json", [np.linspace(0.1, 0.9, K), np.linspace(0.8, 0.2, K)])
    policy = f"duo:0.5:sinks=2,window=4,pattern={tmp_path / 'split.json'}"  # one head of each layer streams
    gen = Generator(gqa, capacity=40, policy=parse_policy(policy))
    engine = Engine(gqa, n_pages=12, page_size=4, slots=4, decode_steps=4, policy=policy, max_tokens=32)
    mine = [*requests, *LONGER]
    want = [gen([list(r.prompt)], r.decoding) for r in mine]
    _check(engine.run(mine), want)
    assert engine.stats.preemptions > 0 and engine.stats.calls < engine.stats.steps and engine.pool.used_pages == 0
    assert all(isinstance(c, PagedDuoCache) and len(c.retrieval) == 1 for c in engine.caches)
    assert not any(np.allclose(w.logprobs, a.logprobs, atol=1e-3) for w, a in zip(want, alone) if w.logprobs.size > 2)
    assert engine.page_nbytes() == 2 * (2 * 4 * H * 4 + 4 * 4)  # 2 layers: one head's fp32 K/V, int32 positions
    # 2 layers: one head's K/V of 2 sinks and a ring of 4, their positions and the two lengths
    assert engine.state_nbytes() == 2 * ((2 + 4) * (2 * H * 4 + 4) + 2 * 4)
    tables = 2 * (4 * 8 * 4 + 4 * 4 + 4 * 4)  # block tables of 32 tokens, lengths, slot rows
    assert engine.nbytes() == 12 * engine.page_nbytes() + 4 * engine.state_nbytes() + tables
    model = make_model("gqa", *GEMMA_LIKE)[1]  # local=true: the windows' heads split too, by their own gates
    gates = [np.array([0.1, 0.9]), np.full(K, 0.1), np.full(K, 0.1), np.full(K, 0.9)]  # local, global, local, global
    save_pattern(tmp_path / "local.json", gates, local=True)
    policy = f"duo:0.625:sinks=2,window=4,local,pattern={tmp_path / 'local.json'}"
    gen = Generator(model, capacity=40, policy=parse_policy(policy))
    engine = Engine(model, n_pages=12, page_size=4, slots=4, decode_steps=4, policy=policy, max_tokens=32)
    _check(engine.run(mine), [gen([list(r.prompt)], r.decoding) for r in mine])
    assert engine.stats.preemptions > 0 and engine.pool.used_pages == 0 and engine.windows.used_pages == 0
    assert all(isinstance(c, PagedDuoCache) for c in engine.caches)
    assert [(len(c.retrieval), c.windowed) for c in engine.caches] == [(1, True), (0, False), (0, True), (K, False)]
    assert engine.caches[1].page_nbytes == engine.caches[2].page_nbytes == 4 * 4 and engine.caches[3].slot_nbytes == 0
    with pytest.raises(ConfigError, match=r"policy duo:0.25.*serve it from an engine started with it"):
        engine.submit(dataclasses.replace(requests[0], policy=policy.replace("duo:0.625", "duo:0.25")))


def test_d2o_pages_hold_the_budgets_its_prefill_plans_and_merge_while_decoding(make_model, requests):
    """D2O in the engine (`kvjax.paged_d2o`; refused until 2026-12-07): each prompt's prefill plans its layers'
    budgets from their attention density, the pages held for the most a layer could keep until then; every
    decode step re-selects each layer by H2O's sums and merges what it evicts, each layer's threshold kept per
    sequence slot; each request equals Generator alone, with preemptions and multi-step calls, and no layer
    ever holds more pages than its cap. 5 layers: the first two and the last are never compressed. The budgets
    are data, so the prompts of one bucket share a compile (they compiled one each until 2026-12-07: a served
    D2O compiled for nearly every request)."""
    model = make_model("gqa", "model.n_layers=5")[1]
    gen = Generator(model, capacity=40, policy=parse_policy("d2o:0.5"))
    engine = Engine(model, n_pages=11, page_size=4, slots=4, decode_steps=4, policy="d2o:0.5", max_tokens=32)
    mine = [*requests, *LONGER]
    for r in mine:
        engine.submit(r)
    caps = {
        (i, l): engine.pool.pages_for(int(n)) for i in range(len(mine)) for l, n in enumerate(engine.pool.shapes[i][1])
    }
    compiled = _load_row._cache_size()
    while engine.step():
        _audit(engine, caps)
    assert _load_row._cache_size() - compiled == len({prompt_bucket(len(r.prompt), 40) for r in mine})
    _check(engine.done, [gen([list(r.prompt)], r.decoding) for r in mine])
    assert engine.stats.preemptions > 0 and engine.stats.calls < engine.stats.steps and engine.pool.used_pages == 0
    assert engine.state_nbytes() == 5 * 4  # a threshold per layer and sequence, fp32
    # Three requests' pages (32 tokens over 5 layers' single-layer pages) buy all 16 slots' thresholds (3 slots
    # until 2026-12-07: any state at all held each slot to a request of max_tokens), the rest pages over 5 layers.
    budget = 3 * 5 * 8 * engine.page_nbytes() + 100
    assert engine.fit(budget, 16, 32) == (16, 1 + (budget - 16 * 20) // (5 * engine.page_nbytes()), None)
    tau = [np.asarray(c.tau) for c in engine.caches]
    assert np.isfinite(tau[2]).any() and np.isfinite(tau[3]).any() and np.isnan(tau[0]).all()  # merged, or never
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "tensor"))
    with pytest.raises(ConfigError, match=r"served on one device \(not yet on a mesh\)"):
        Engine(model, n_pages=11, page_size=4, policy="d2o:0.5", mesh=mesh)


def test_adakv_pages_pool_each_layers_head_budgets(gqa, requests):
    """AdaKV in pages (`kvjax.paged_pooled`): a layer's heads share K x budget entries, here unevenly (the
    longest prompt's 14 a head are 15 and 13), yet a request holds its budget's pages as under a uniform
    one; each request equals Generator's dense pool alone, with preemptions (the pool's 6 pages are reused,
    so a row whose length the host miscounted would read another's entries) and multi-step calls."""
    gen = Generator(gqa, capacity=40, policy=parse_policy(ADAKV))
    padded, lengths = gen.pad([list(requests[1].prompt)], 0)
    pool = gen.prefill_compressed(padded, lengths, 0)[1][0]
    assert np.bincount(np.asarray(pool.head[0])[np.asarray(pool.pos[0]) >= 0]).tolist() == [15, 13]
    engine = Engine(gqa, n_pages=7, page_size=4, slots=4, chunk=8, decode_steps=4, policy=ADAKV)
    work = engine.check(requests)
    _check(engine.run(requests), [gen([list(r.prompt)], r.decoding) for r in requests])
    assert engine.stats.preemptions > 0 and engine.stats.calls < engine.stats.steps and engine.pool.used_pages == 0
    assert [w.kept for w in work] == [max(len(r.prompt) // 2, 2) for r in requests]  # the window of 2 at least


@pytest.mark.parametrize("model", ["gqa", "gemma", "gemma-local", "gemma-local-every", "mla"])
def test_pyramid_pages_hold_each_layers_own_budget(gqa, make_model, requests, model):
    """PyramidKV in pages (`kvjax.layer_pages`): the lower layer keeps 3x the upper's tokens (beta=2), each
    layer in a block table of its own over one pool of single-layer pages that the layers take in turn
    (`kvjax.paged.SharedPool`); each request equals Generator alone, with preemptions (the pool's 2 x 6
    pages change hands between layers and requests) and multi-step calls; after every step each page is
    free or held once, and no (request, layer) holds more than its own slots' pages. On Gemma's layout
    the two global layers take those budgets, their windows in their own pool, left whole, or under
    local=true compressed too: the two rings keep 5 and 3 of the window's 7 tokens, and both take the
    larger one's length, the smaller one's tokens at its end (a request that generates 12 tokens wraps
    them round a ring of 8 slots: at its start, it would write over tokens still in the window). MLA's
    latent pages take the budgets as K/V pages do. Under `every=6` too: each re-selection (SnapKV's) puts
    each ring's tokens at the end of the largest one's again (else the shorter ring, its row's one window
    length the longer one's, writes over a kept token that the 12-token request's window still sees)."""
    local, every = model.startswith("gemma-local"), model.endswith("every")
    overrides = {"gqa": None, "gemma": ("gqa", *GEMMA_LIKE), "mla": ("mla", "model.n_layers=2")}
    overrides = overrides.get(model, overrides["gemma"])
    model = make_model(*overrides)[1] if overrides else gqa
    policy = PYRAMID + (",local" if local else "") + (",every=6" if every else "")
    gen = Generator(model, capacity=40, policy=parse_policy(policy))
    padded, lengths = gen.pad([list(requests[1].prompt)], 0)
    dense = gen.prefill_compressed(padded, lengths, 0)[1]
    kept = [int(dense[j].length[0]) for j in compressible(model.config, local)]
    assert kept == ([5, 17, 3, 7] if local else [22, 7])  # 29 tokens (under local=true 7 in the windows)
    engine = Engine(model, n_pages=7, page_size=4, slots=4, chunk=8, decode_steps=4, policy=policy, max_tokens=32)
    if local:
        requests = [*requests, Request(tuple(range(1, 21)), DecodingConfig(max_new_tokens=12))]
    for r in requests:
        engine.submit(r)
    pages, pool = engine.pool, engine.pool.pool
    main = [c for c in engine.caches if not c.windowed]  # the first holds the one pool, the others none
    assert [c.k.shape[0] for c in main] == [pool.n_pages, 0] == [2 * 6 + 1, 0]
    while engine.step():
        held = [p for table in pool.tables.values() for p in table]
        assert sorted(held + list(pool.free)) == list(range(1, pool.n_pages))
        for i in engine.scheduler.running:
            most = pages.shapes[i][1]  # its prompt's kept tokens in that layer plus those it generates
            assert all(len(pool.tables[(i, layer)]) <= pages.pages_for(int(n)) for layer, n in enumerate(most))
    _check(engine.done, [gen([list(r.prompt)], r.decoding) for r in requests])
    assert engine.stats.preemptions > 0 and engine.stats.calls < engine.stats.steps and pages.used_pages == 0
    assert engine.windows is None or (engine.windows.used_pages == 0 and engine.windows.peak > 0)
    if local:  # the rings' pages: ceil(8 / 4)
        assert engine.windows.peak == 2 < engine.windows.per_decode


def test_a_policy_takes_the_pages_its_budget_says(gqa):
    """A 40-token prompt and one decoded token: 41 slots are 11 pages of 4; SnapKV at 0.5 keeps 20, so
    21 slots take 6 (H2O too, evicting while decoding; AdaKV too, its 2 x 20 entries spread unevenly over
    the 2 heads); int:8 keeps every token in 11 pages of codes, each
    page a third of the fp32 bytes (codes, plus a scale per token and head). PyramidKV's layers keep 30
    and 10 (31 and 11 slots): 8 + 3 single-layer pages, of a pool of 2 x 19 (its tables twice as wide)."""
    request = Request(tuple(range(1, 41)), DecodingConfig(max_new_tokens=2))
    peaks, engines = {}, {}
    for policy in (None, "snapkv:0.5:obs_window=1", "int:8", "int:4", "h2o:0.5:every=4", ADAKV, PYRAMID):
        engines[policy] = Engine(gqa, n_pages=20, page_size=4, slots=1, policy=policy)
        engines[policy].run([request])
        peaks[policy] = engines[policy].stats.peak_pages
    assert peaks == {None: 11, "snapkv:0.5:obs_window=1": 6, "int:8": 11, "int:4": 11, "h2o:0.5:every=4": 6} | {
        ADAKV: 6,
        PYRAMID: 11,
    }
    att, producers = gqa.config.attention, 2
    K, H, ps, P = att.n_kv_heads, att.head_dim, 4, 20
    tables = 19 * 4 + 4  # one sequence slot: its block table (a column per usable page) and length
    fp32 = producers * (P * K * ps * H * 4 * 2 + P * ps * 4 + tables)
    int8 = producers * (P * K * ps * (H + 4) * 2 + P * ps * 4 + tables)
    int4 = producers * (P * K * ps * (H // 2 + 4) * 2 + P * ps * 4 + tables)
    assert engines[None].nbytes() == fp32 and engines["int:8"].nbytes() == int8 and engines["int:4"].nbytes() == int4
    # H2O's running sums: an fp32 per slot and KV head beside the positions (kept per head)
    h2o = producers * (P * K * ps * H * 4 * 2 + P * K * ps * 4 + P * K * ps * 4 + tables)
    assert engines["h2o:0.5:every=4"].nbytes() == h2o
    # AdaKV's pooled entries: K x page_size a page, each one head's K and V, its position and its head
    pooled = producers * (P * K * ps * (H * 4 * 2 + 4 + 4) + tables)
    assert engines[ADAKV].nbytes() == pooled
    one_pool = (producers * (P - 1) + 1) * K * ps * (H * 4 * 2 + 4)  # the first layer's; SnapKV's positions per head
    assert engines[PYRAMID].nbytes() == one_pool + producers * (2 * 19 * 4 + 4)
    assert engines[PYRAMID].page_nbytes() * producers == engines["snapkv:0.5:obs_window=1"].page_nbytes()


def test_requests_submitted_while_others_run_and_cancelled_midway(gqa, requests, alone):
    """A server's use: requests arrive while others decode (`submit` between `step`s), one leaves midway
    (`cancel`: its pages are free at once), and every other request still gets what it gets alone."""
    engine = Engine(gqa, n_pages=40, page_size=4, slots=3, chunk=8)
    first = [engine.submit(r) for r in requests[:2]]
    engine.step()
    engine.step()
    later = [engine.submit(r) for r in requests[2:]]
    while engine.done[later[0]].tokens == []:  # the third is running
        engine.step()
    used = engine.pool.used_pages
    engine.cancel(later[0])
    assert engine.pool.used_pages < used and engine.done[later[0]].finish == "cancelled"
    while engine.step():
        pass
    kept = [i for i in first + later if i != later[0]]
    _check([engine.done[i] for i in kept], [alone[i] for i in kept])
    assert {engine.done[i].finish for i in kept} == {"length"} and engine.pool.used_pages == 0


def test_a_warmed_engine_compiles_nothing_while_serving(gqa, requests, alone):
    """`warm` runs every step shape on empty rows: serving then compiles nothing, and what it serves is
    unchanged (the empty rows wrote nothing)."""
    engine = Engine(gqa, n_pages=40, page_size=4, slots=3, chunk=8)
    assert engine.warm() == 3 * (5 + 1)  # rows 1, 2, 3; chunks 0, 1, 2, 4, 8; a greedy call per row bucket
    compiled = engine._step._cache_size(), engine._greedy_steps._cache_size()
    _check(engine.run(requests), alone)
    assert (engine._step._cache_size(), engine._greedy_steps._cache_size()) == compiled


def test_a_request_may_bring_its_own_policy_and_top_logprobs(gqa, requests):
    """A plain engine serves a request compressed by its own `streaming:0.5` (pages of one position per
    slot) beside uncompressed ones, each equal to Generator with that policy; a request that asks for its
    top tokens gets, at each step, the likeliest ones with their log-probabilities (the picked one first,
    as greedy decoding picks it); a policy the pages cannot hold is refused, saying which layout."""
    engine = Engine(gqa, n_pages=40, page_size=4, slots=3, chunk=8)
    own = dataclasses.replace(requests[1], policy="streaming:0.5")
    top = dataclasses.replace(requests[3], top_logprobs=3)
    done = engine.run([requests[0], own, top])
    gen = Generator(gqa, capacity=40, policy=parse_policy("streaming:0.5"))
    _check([done[1]], [gen([list(own.prompt)], own.decoding)])
    _check([done[0], done[2]], [Generator(gqa, capacity=40)([list(r.prompt)], r.decoding) for r in (requests[0], top)])
    for token, lp, best in zip(done[2].tokens, done[2].logprobs, done[2].top):
        assert len(best) == 3 and best[0] == (token, pytest.approx(lp, abs=1e-5)) and best[0][1] >= best[1][1]
    with pytest.raises(ConfigError, match="pages hold one position per slot, full precision .* snapkv:0.5 needs "
                       "positions per head"):  # fmt: skip
        engine.submit(dataclasses.replace(requests[0], policy="snapkv:0.5"))
    with pytest.raises(ConfigError, match="needs one position per slot, int8 codes"):
        engine.submit(dataclasses.replace(requests[0], policy="int:8"))
    with pytest.raises(ConfigError, match=r"needs one position per slot, full precision, evicting by tova.*every=2"):
        engine.submit(dataclasses.replace(requests[0], policy="tova:0.5:every=2"))


def _audit(engine, caps, evicting: bool = True) -> None:
    """The pool's accounting: each page either free or held (reference counts equal to the tables that
    hold it), none lost, no running request above its cap of pages nor, when it evicts while decoding,
    holding a page past its slots (else pages are reserved ahead of the tokens)."""
    pool = engine.pool.pool if engine.layout.layered else engine.pool  # (layered: keyed by request and layer)
    held = [p for table in pool.tables.values() for p in table]
    assert not set(held) & set(pool.free) and set(held) | set(pool.free) == set(range(1, pool.n_pages))
    assert all(pool.refs[p] == held.count(p) for p in set(held))
    assert all(len(pool.tables[i]) <= caps[i] for i in pool.tables)
    # after a step, a capped request holds the pages of its slots and no more (eviction freed the rest)
    assert not evicting or all(len(pool.tables[i]) == pool.pages_for(pool.lengths[i]) for i in pool.tables)


@pytest.mark.parametrize(
    "policy, pages, steps, layout",
    [
        ("h2o:0.5:every=4", 7, 4, "gqa"),
        ("tova:0.5:every=3", 40, 1, "gqa"),
        ("snapkv:0.5:obs_window=1,every=3", 6, 4, "gemma"),
        ("h2o:8:allocator=pyramid,beta=2,every=3", 7, 4, "gqa"),
        ("h2o:8:allocator=pyramid,beta=2,every=3", 7, 4, "mla"),
        ("h2o:0.5:allocator=adakv,every=3", 6, 1, "gqa"),
        ("scissorhands:0.5:obs_window=2,every=3", 6, 4, "gemma"),
    ],
)
def test_eviction_while_decoding_caps_each_request_and_equals_generator(
    make_model, requests, policy, pages, steps, layout
):
    """`every=N` in pages: each decode step observes the rows' attention (H2O's running sums kept per slot
    in the pages), every N-th step of a request re-selects its slots and compacts them within its pages,
    and the pages past them go back; each request equals Generator alone under the policy, with
    preemptions (its generated tokens re-fed one decode step at a time), multi-step calls and, on Gemma's
    layout, window pages freed beside it; no request ever holds more than its budget plus N slots (H2O's
    sums and Scissorhands' counts in the pages). Under
    PyramidKV's budgets each layer is re-selected down to its own (30 and 10 of 40 tokens) and holds at most
    that plus N, its pages in one pool that the layers share (H2O's running sums in it too); MLA's latent
    pages alike (refused until 2026-12-06)."""
    model = make_model(
        "mla" if layout == "mla" else "gqa", *(GEMMA_LIKE if layout == "gemma" else ()), "model.n_layers=2"
    )[1]
    gen = Generator(model, capacity=40, policy=parse_policy(policy))
    engine = Engine(
        model, n_pages=pages, page_size=4, slots=4, chunk=8, decode_steps=steps, policy=policy, max_tokens=32
    )
    for r in requests:
        engine.submit(r)
    caps = {i: engine.pool.pages_for(w.cap) for i, w in enumerate(engine.scheduler.work)}
    if engine.layout.layered:  # each layer's own cap, its budget plus N
        caps = {(i, l): engine.pool.pages_for(int(n)) for i in caps for l, n in enumerate(engine.pool.shapes[i][1])}
    assert all(w.cap < len(w.prompt) + w.max_new_tokens for w in engine.scheduler.work if len(w.prompt) > 8)
    while engine.step():
        _audit(engine, caps)
    _check(engine.done, [gen([list(r.prompt)], r.decoding) for r in requests])
    assert engine.pool.used_pages == 0 and (engine.stats.preemptions > 0) == (pages < 40)
    main = next(c for c in engine.caches if not c.windowed)  # the pages that sum a statistic, if any
    assert (main.stat is not None) == policy.startswith(("h2o", "scissorhands"))


@pytest.mark.parametrize("policy", ["h2o:0.5:every=4", "h2o:0.5:allocator=adakv,every=4"])
def test_h2o_sums_in_the_pages_grow_by_one_attention_a_step_while_a_row_keeps_its_slots(gqa, policy):
    """H2O's running sums per slot (`PagedKVCache.stat`; per entry in AdaKV's pooled pages): each decode
    step's query adds its attention, which sums to 1 per KV head (averaged over its query heads), so a row
    that did not re-select gains exactly 1, also in a step where another row re-selects (its sums gathered
    to its kept slots), and on pages an earlier request's sums were left in (a new token's starts at 0)."""
    rng = np.random.default_rng(3)
    prompts = [tuple(int(t) for t in rng.integers(0, gqa.config.vocab_size, n)) for n in (9, 10, 12)]
    engine = Engine(gqa, n_pages=7, page_size=4, slots=2, decode_steps=1, policy=policy)
    engine.run([Request(prompts[2], DecodingConfig(max_new_tokens=20))])  # leaves its sums in the pages
    engine.submit(Request(prompts[0], DecodingConfig(max_new_tokens=12)))
    engine.step(), engine.step()  # the second request starts later, so the two re-select at different steps
    engine.submit(Request(prompts[1], DecodingConfig(max_new_tokens=12)))
    cache, K = engine.caches[0], gqa.config.attention.n_kv_heads

    def sums(i):  # per KV head, over the request's slots (entries)
        pages, n = engine.pool.tables[i], engine.pool.lengths[i]
        stat = np.asarray(engine.caches[0].stat)[pages]  # [pages, K, page_size] or [pages, 1, K * page_size]
        if not isinstance(cache, PagedPooledCache):
            return stat.transpose(1, 0, 2).reshape(K, -1)[:, :n].sum(axis=1), n
        head = np.asarray(engine.caches[0].head)[pages].reshape(-1)[: n * K]
        return np.bincount(head, weights=stat.reshape(-1)[: n * K], minlength=K), n

    before, grew, mixed = {}, 0, 0
    while engine.step():
        now = {i: sums(i) for i in engine.scheduler.running if i in engine.pool.tables}
        kept = [i for i in now if i in before and now[i][1] == before[i][1] + 1]
        for i in kept:
            np.testing.assert_allclose(now[i][0] - before[i][0], 1.0, atol=1e-5)
        grew += len(kept)
        mixed += bool(kept) and any(i in before and now[i][1] < before[i][1] for i in now)  # another re-selected
        before = now
    assert grew > 10 and mixed >= 2


def test_a_long_generation_stays_within_its_budget(gqa):
    """200 tokens after a 20-token prompt: with `h2o:0.5:every=8` the request never holds more than 10 +
    8 slots (5 pages of 4), where the full cache grows to 55 pages; under PyramidKV's budgets (15 and 5
    tokens) 23 and 13 slots, 6 + 4 single-layer pages (peak pages count those)."""
    request = Request(tuple(range(1, 21)), DecodingConfig(max_new_tokens=200))
    peaks = {}
    for policy in (None, "h2o:0.5:every=8", "h2o:0.5:allocator=pyramid,beta=2,every=8"):
        engine = Engine(gqa, n_pages=64, page_size=4, slots=1, policy=policy, decode_steps=16)
        engine.run([request])
        peaks[policy] = engine.stats.peak_pages
    assert peaks == {None: 55, "h2o:0.5:every=8": 5, "h2o:0.5:allocator=pyramid,beta=2,every=8": 6 + 4}


def test_policies_the_engine_cannot_page_are_refused(gqa, make_model):
    quest = "quest:0.5:page_size=16"
    for model, args, match in [
        (gqa, dict(policy="quest:0.5", page_size=4), r"its page_size=16 must equal the engine's page_size=4"),
        (make_model("gqa", *GEMMA_LIKE)[1], dict(policy=quest + ",local"), "reads Quest's pages of them"),
    ]:
        with pytest.raises(ConfigError, match=match):
            Engine(model, n_pages=8, **args)
    for policy, match in [
        (
            "gear:4",
            r"gear pages hold one residual block each, with its low-rank error factors: page_size must equal "
            r"the residual \(64\)",
        ),
        ("int:4:asym=true", r"quantized pages are int:8, int:4 \(symmetric\), kivi, kvquant or gear only"),
        (
            "kivi:2",
            r"page_size that is a multiple of the key group \(32\) and divides the residual \(128\): "
            r"one of \[32, 64, 128\], not 16",
        ),
        ("keynorm:0.5+kivi:2:group=4,residual=8", "positions per head .a head-wise eviction before it. are not"),
        ("tova:0.5:allocator=pyramid+kivi:2", r"different numbers of tokens.*KIVI's blocks are not paged with them"),
        ("snapkv:0.5:allocator=adakv+int:8", "allocator='adakv' must be the last stage of a chain"),
        ("keynorm:0.5+lorc:0.5", "latent pages keep one position per slot and one block table for every layer"),
        ("think:0.5", "think is not supported"),
    ]:
        with pytest.raises(ConfigError, match=match):
            Engine(gqa, n_pages=8, policy=policy)


SHARDED = textwrap.dedent(
    """
    import json
    import jax, numpy as np
    from flax import nnx
    from jax.sharding import Mesh
    from kvjax import DecodingConfig, Engine, Generator, Request
    from kvjax.compress import parse_policy
    from kvjax.config import load_config
    from kvjax.architectures import Decoder
    from kvjax.sharding import generation_mesh

    model = Decoder(load_config("gqa", ["model.n_layers=2"]).model, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    requests = [Request(tuple(int(t) for t in rng.integers(0, 258, n)), DecodingConfig(max_new_tokens=m))
                for n, m in [(5, 6), (17, 3), (3, 8), (11, 2), (9, 5)]]
    out = {}
    KVQUANT = "kvquant:2:group=4,residual=8,outliers=0.1,sinks=4"
    QUEST = "quest:0.5:page_size=4"
    import os, tempfile
    from kvjax.duo import save_pattern
    pattern = os.path.join(tempfile.mkdtemp(), "duo.json")  # the second layer's first head streams
    save_pattern(pattern, [np.array([0.9, 0.9]), np.array([0.1, 0.9])])
    DUO = f"duo:0.25:sinks=2,window=4,pattern={pattern}"
    for policy in [None, "h2o:0.5:allocator=pyramid,beta=2,every=3", "kivi:2:group=4,residual=8", KVQUANT, QUEST, DUO]:
        for name, mesh in [("one", None), ("eight", Mesh(np.asarray(jax.devices()).reshape(4, 2), ("data", "tensor")))]:
            engine = Engine(model, n_pages=12, page_size=4, slots=4, chunk=8, mesh=mesh, policy=policy)
            done = engine.run(requests)
            key = "duo" if policy == DUO else policy
            out[f"{name} {key}"] = {"tokens": [d.tokens for d in done], "logprobs": [d.logprobs for d in done],
                                       "pool": [len(engine.caches[0].k.sharding.device_set),
                                                str(getattr(engine.caches[0].k.sharding, "spec", ""))],
                                       "preemptions": engine.stats.preemptions}
    ADAKV = "h2o:0.5:allocator=adakv,every=3"  # its pool mixes heads: rows over data only, or refused
    for name, mesh in [("one", None), ("rows", Mesh(np.asarray(jax.devices()).reshape(8, 1), ("data", "tensor")))]:
        done = Engine(model, n_pages=12, page_size=4, slots=8, chunk=8, mesh=mesh, policy=ADAKV).run(requests)
        out[f"{name} adakv"] = {"tokens": [d.tokens for d in done], "logprobs": [d.logprobs for d in done]}
    try:
        Engine(model, n_pages=12, mesh=Mesh(np.asarray(jax.devices()).reshape(4, 2), ("data", "tensor")), policy=ADAKV)
    except Exception as e:
        out["adakv tensor"] = str(e)
    prompts = [list(r.prompt) for r in requests[:4]]
    scored = [list(map(int, rng.integers(0, 258, 4))) for _ in prompts]
    for name, mesh in [("alone", None), ("tensor", generation_mesh(2)), ("both", generation_mesh(2, data=4))]:
        for policy in [None, "snapkv:0.5", "int:8"]:
            gen = Generator(model, capacity=40, policy=policy and parse_policy(policy), mesh=mesh)
            res = gen(prompts, DecodingConfig(max_new_tokens=6))
            k = res.caches[0].k if policy != "int:8" else res.caches[0].k_codes
            out[f"{name} {policy}"] = {"tokens": res.tokens.tolist(), "logprobs": res.logprobs.tolist(),
                                       "score": gen.score(prompts, scored)[0].tolist(),
                                       "cache": str(k.sharding.spec) if mesh else "",
                                       "q": str(gen.params["blocks"][0]["mixer"]["q"]["kernel"].get_value()
                                                .sharding.spec) if mesh else ""}
        out[f"{name} chunked"] = np.asarray(gen.prefill(*gen.pad(prompts, 4), chunk=8)[0]).tolist()
    # A Hugging Face checkpoint read straight onto the mesh, and `kvjax generate --tensor`
    import contextlib, io, sys, tempfile
    from kvjax.commands import main
    from kvjax.training.hf_export import export_hf, export_tokenizer
    from kvjax.training.loading import load_model
    from kvjax.training.tokenizer import ByteTokenizer
    hf = export_hf(model, tempfile.mkdtemp(), bos_id=256, eos_id=257, max_positions=64)
    export_tokenizer(ByteTokenizer(), hf)
    q = load_model(str(hf), mesh=generation_mesh(2)).model.blocks[0].mixer.q.kernel.get_value()
    out["hf q"] = [str(q.sharding.spec), bool(np.array_equal(q, model.blocks[0].mixer.q.kernel.get_value()))]
    for tensor in ("1", "2", "3"):
        text, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(text), contextlib.redirect_stderr(err):
            code = main(["generate", str(hf), "--prompt", "In the", "--max-new-tokens", "6", "--tensor", tensor])
        out[f"cli {tensor}"] = [code, text.getvalue(), err.getvalue()]
    print(json.dumps(out))
    """
)


@pytest.mark.slow
def test_eight_devices_serve_what_one_device_serves():
    """Slots over data (4) and KV heads over tensor (2) on 8 simulated CPU devices: the same tokens, also
    under PyramidKV's budgets evicting while decoding (one pool every layer shares, H2O's sums in it), in
    KIVI's pages (each sequence slot's residual beside them) and KVQuant's (outliers in the pages, sinks
    beside the residual) and Quest's (each page's key bounds split over heads too, refused on a mesh until
    2026-12-06) and DuoAttention's (a layer's retrieval heads split where they divide, the other's whole, the
    streaming heads' slots beside; refused on a mesh until 2026-12-07); AdaKV's pooled pages with slots over
    data alone (8 x 1; refused over tensor until 2026-12-06 whatever its size); and the Generator on such
    meshes generates and scores what it does on one device."""
    env = {
        **os.environ,
        "XLA_FLAGS": f"{os.environ['XLA_FLAGS']} --xla_force_host_platform_device_count=8",
        "JAX_PLATFORMS": "cpu",
    }
    run = subprocess.run([sys.executable, "-c", SHARDED], capture_output=True, text=True, env=env, check=True)
    out = json.loads(run.stdout.strip().splitlines()[-1])
    kvquant, quest = "kvquant:2:group=4,residual=8,outliers=0.1,sinks=4", "quest:0.5:page_size=4"
    policies = ["None", "h2o:0.5:allocator=pyramid,beta=2,every=3", "kivi:2:group=4,residual=8", kvquant, quest, "duo"]
    for policy in policies:
        got, want = out[f"eight {policy}"], out[f"one {policy}"]
        assert got["pool"] == [8, "P(None, 'tensor')"] and want["pool"][0] == 1, policy
        assert got["tokens"] == want["tokens"], policy
        for a, b in zip(got["logprobs"], want["logprobs"]):
            np.testing.assert_allclose(a, b, atol=1e-5)
    assert out["one None"]["preemptions"] > 0 and out["one kivi:2:group=4,residual=8"]["preemptions"] > 0
    # AdaKV's pooled entries on a mesh of rows alone (8 x 1); over tensor they would not split: refused
    assert out["rows adakv"]["tokens"] == out["one adakv"]["tokens"]
    for a, b in zip(out["rows adakv"]["logprobs"], out["one adakv"]["logprobs"]):
        np.testing.assert_allclose(a, b, atol=1e-5)
    assert "cannot split over the mesh's tensor axis" in out["adakv tensor"]
    # The Generator on a mesh (eval, ruler, generate): weights' heads over tensor, rows over data, the
    # caches' KV heads over tensor; the tokens and log-probabilities of one device, under each policy.
    for name, rows in [("tensor", "None"), ("both", "'data'")]:
        for policy in ["None", "snapkv:0.5", "int:8"]:
            got, want = out[f"{name} {policy}"], out[f"alone {policy}"]
            assert got["tokens"] == want["tokens"], (name, policy)
            # int8 codes: a key 5e-7 apart may round to the next code (a 6e-5 change in a log-probability)
            atol = 2e-4 if policy == "int:8" else 1e-5
            np.testing.assert_allclose(got["logprobs"], want["logprobs"], atol=atol)
            np.testing.assert_allclose(got["score"], want["score"], atol=atol)
            assert got["cache"].startswith(f"P({rows}, 'tensor'") and got["q"] == "P(None, 'tensor')"
        np.testing.assert_allclose(out[f"{name} chunked"], out["alone chunked"], atol=1e-5)
    assert out["hf q"] == ["P(None, 'tensor')", True]
    assert out["cli 2"][:2] == out["cli 1"][:2] and out["cli 1"][0] == 0 and "In the" in out["cli 1"][1]
    assert out["cli 3"][0] == 2 and "mesh tensor=3 must divide model.attention.n_kv_heads=2" in out["cli 3"][2]


@pytest.mark.parametrize("policy, pages", [("snapkv:0.5:obs_window=2", 40), ("tova:0.5", 8), (ADAKV, 40)])
def test_compressed_prompts_read_and_enter_the_prefix_cache(gqa, requests, policy, pages):
    """Under a policy the prefix cache holds prompts' full pages uncompressed (beside each request's
    compressed pages): a prompt that starts with cached pages computes only the rest, its observed
    queries never from the cache (SnapKV's window, TOVA's last query), and equals Generator alone; with
    few pages (preemptions, no page free to cache) the same; AdaKV's pooled pages hold a whole prompt's
    entries token by token. H2O observes every query: nothing is cached."""
    gen = Generator(gqa, capacity=40, policy=parse_policy(policy))
    engine = Engine(gqa, n_pages=pages, page_size=4, slots=4, chunk=8, policy=policy)
    for r in requests:
        engine.submit(r)
    window = 2 if "snapkv" in policy else 1
    assert [w.cacheable for w in engine.scheduler.work] == [len(r.prompt) - window for r in requests]
    caps = {i: engine.pool.pages_for(len(r.prompt) + r.decoding.max_new_tokens) for i, r in enumerate(requests)}
    while engine.step():
        _audit(engine, caps, evicting=False)
    _check(engine.done, [gen([list(r.prompt)], r.decoding) for r in requests])
    s = engine.stats
    assert engine.pool.used_pages == 0 and (s.preemptions > 0) == (pages < 40)
    computed, prompts = s.prefill_tokens + s.cached_tokens, sum(len(r.prompt) for r in requests)
    assert computed == prompts if pages == 40 else computed > prompts  # a preempted request's prompt again
    assert s.cached_tokens >= (12 if pages == 40 else 0)  # the shared 3 pages, read by the second prompt
    if policy != "snapkv:0.5:obs_window=2":  # once: H2O and the refused prefix depend on neither
        return
    h2o = Engine(gqa, n_pages=40, page_size=4, slots=4, chunk=8, policy="h2o:0.5")
    shared = requests[1:4:2]
    gen = Generator(gqa, capacity=40, policy=parse_policy("h2o:0.5"))
    _check(h2o.run(shared), [gen([list(r.prompt)], r.decoding) for r in shared])
    assert h2o.stats.cached_tokens == 0 and not h2o.pool.cached
    with pytest.raises(
        ValueError, match="prefix of 28 tokens leaves 1 of a 29-token prompt; the policy observes its last 2"
    ):
        Generator(gqa, capacity=40, policy=parse_policy("snapkv:0.5:obs_window=2")).prefill_compressed(
            np.zeros((1, 8), np.int32), np.array([29]), 0, prefix=((), 28)
        )
