"""DuoAttention: the streaming mask, the deployed cache (degenerate settings, exact bytes, what streaming
heads keep), decoding equal to the gated model it came from, the head choice, the gate objective and
its optimization, and clear errors."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kvjax import Generator
from kvjax.cache import caches_nbytes
from kvjax.compress import compressed_cache_bytes, parse_policy
from kvjax.config import ConfigError
from kvjax.duo import (
    DuoKVCache,
    GateMix,
    default_pattern,
    learned_pattern_path,
    load_pattern,
    save_pattern,
    streaming_attention,
    streaming_heads,
    with_pattern,
)
from kvjax.ops import attention
from kvjax.plan import compressible, kv_heads
from kvjax.training.duo import GateTraining, gate_caches, learn_gates, objective, passkey_sample
from kvjax.training.tokenizer import ByteTokenizer
from kvjax.training.trainer import TrainingError
from tests.conftest import GEMMA_LIKE
from tests.kvjax.test_compress import CAPACITY, GREEDY, NEW, PROMPTS


@pytest.fixture(scope="module")
def gqa(make_model):
    return make_model("gqa", "model.n_layers=2", "model.init_std=0.2")


@pytest.fixture(scope="module")
def pattern(tmp_path_factory, gqa):
    """Gates with a clear order: layer 0 head 0 lowest, then layer 1 head 1, ..."""
    cfg, _ = gqa
    K = cfg.attention.n_kv_heads
    path = tmp_path_factory.mktemp("duo") / "pattern.json"
    save_pattern(path, [np.linspace(0.1, 0.9, K), np.linspace(0.8, 0.2, K)], model=cfg.name)
    return str(path)


def _duo(pattern, ratio, **options):
    extra = "".join(f",{k}={v}" for k, v in options.items())
    return parse_policy(f"duo:{ratio}:pattern={pattern}{extra}")


@pytest.mark.parametrize("window", [None, 5])
def test_streaming_attention_sees_sinks_and_the_recent_window_only(window):
    """...and in a sliding-window layer its sinks only while the window covers them, even when the first
    token holds nearly all the weight (as Gemma's heads put it): masked before the softmax, the rest is
    attended as if it were never there (renormalizing after it divided underflowed zeros: NaN)."""
    rng = np.random.default_rng(0)
    B, T, K, G, H = 1, 12, 2, 2, 8
    q = jnp.asarray(rng.normal(size=(B, T, K * G, H)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(B, K, T, H)), jnp.float32) for _ in range(2))
    k = k.at[:, :, 0].set(400 * q[0].reshape(T, K, G, H).mean((0, 2)))  # logits of ~+200 on position 0
    pos = jnp.arange(T)[None]
    out = streaming_attention(q, k, v, pos, pos, sinks=2, recent=3, window=window)
    grad = jax.grad(lambda q: streaming_attention(q, k, v, pos, pos, sinks=2, recent=3, window=window).sum())(q)
    assert np.isfinite(np.asarray(grad)).all()
    for i in range(T):
        keys = [j for j in range(i + 1) if (j < 2 or i - j < 3) and (window is None or i - j < window)]
        ref = attention(q[:, i : i + 1], k[:, :, keys], v[:, :, keys], pos[:, i : i + 1], pos[:, keys])
        np.testing.assert_allclose(out[:, i : i + 1], ref, atol=1e-6)


def test_heads_with_the_lowest_gates_stream_over_the_whole_model():
    gates = [np.array([0.5, 0.1, 0.9]), np.array([0.2, 0.2, 0.7])]
    assert streaming_heads(gates, 0.0) == ((), ())
    assert streaming_heads(gates, 0.5) == ((1,), (0, 1))  # 3 of 6; the tie 0.2/0.2 both in
    assert streaming_heads(gates, 0.34) == ((1,), (0,))  # round(2.04) = 2; the tie goes to the lower head
    assert streaming_heads(gates, 0.99) == ((0, 1, 2), (0, 1, 2))


def _plain_and_duo(model, policy):
    plain = Generator(model, capacity=CAPACITY)
    gen = Generator(model, capacity=CAPACITY, policy=policy)
    tokens, lengths = plain.pad(PROMPTS, NEW)
    logits, caches = plain.prefill(tokens, lengths)
    _, duo_caches, stats = gen.prefill_compressed(tokens, lengths, NEW)
    return plain, gen, lengths, logits, caches, duo_caches, stats


def test_no_streaming_head_decodes_bitwise_as_the_full_cache(gqa, pattern):
    _, model = gqa
    plain, gen, lengths, logits, caches, duo_caches, stats = _plain_and_duo(model, _duo(pattern, 0))
    assert all(isinstance(c, DuoKVCache) and c.streaming == () for c in duo_caches)
    ref = plain.decode(caches, logits, lengths, GREEDY, jax.random.key(0))
    out = gen.decode(duo_caches, logits, lengths, GREEDY, jax.random.key(0), stats)
    np.testing.assert_array_equal(ref.tokens, out.tokens)
    np.testing.assert_array_equal(ref.logprobs, out.logprobs)


def test_streaming_heads_whose_window_covers_everything_decode_as_the_full_cache(gqa, pattern):
    _, model = gqa
    policy = _duo(pattern, 0.75, sinks=4, window=CAPACITY)
    plain, gen, lengths, logits, caches, duo_caches, stats = _plain_and_duo(model, policy)
    ref = plain.decode(caches, logits, lengths, GREEDY, jax.random.key(0))
    out = gen.decode(duo_caches, logits, lengths, GREEDY, jax.random.key(0), stats)
    np.testing.assert_array_equal(ref.tokens, out.tokens)
    np.testing.assert_allclose(ref.logprobs, out.logprobs, atol=1e-5)


def test_streaming_heads_keep_sinks_and_recent_tokens_and_bytes_are_exact(gqa, pattern):
    cfg, model = gqa
    policy = _duo(pattern, 0.5, sinks=3, window=5)
    gen = Generator(model, capacity=CAPACITY, policy=policy)
    tokens, lengths = gen.pad(PROMPTS, NEW)
    logits, caches, stats = gen.prefill_compressed(tokens, lengths, NEW)
    plans = gen.compression_plan(lengths, NEW)
    assert caches_nbytes(caches) == compressed_cache_bytes(cfg, plans, len(PROMPTS), CAPACITY)
    K = cfg.attention.n_kv_heads
    assert [c.streaming for c in caches] == list(
        streaming_heads([np.linspace(0.1, 0.9, K), np.linspace(0.8, 0.2, K)], 0.5)
    )
    for cache in caches:
        if not cache.streaming:
            continue
        for b, n in enumerate(lengths):
            kept = sorted(np.asarray(cache.sink.pos[b]).tolist() + np.asarray(cache.ring.pos[b]).tolist())
            assert kept == [0, 1, 2] + list(range(n - 5, n))
        np.testing.assert_array_equal(cache.full.length, lengths)
    out = gen.decode(caches, logits, lengths, GREEDY, jax.random.key(0), stats)
    assert caches_nbytes(out.caches) == caches_nbytes(caches)  # streaming heads stay at sinks + window
    for cache in out.caches:
        if cache.streaming:
            assert sorted(np.asarray(cache.ring.pos[0]).tolist()) == list(range(40 + NEW - 1 - 5, 40 + NEW - 1))
    full = Generator(model, capacity=CAPACITY)
    _, full_caches = full.prefill(tokens, lengths)
    assert caches_nbytes(caches) < caches_nbytes(full_caches)


def test_decoding_with_rounded_gates_equals_the_gated_model(gqa, pattern):
    cfg, model = gqa
    gates = load_pattern(pattern, (cfg.attention.n_kv_heads,) * 2)[0]
    _assert_decoding_matches_rounded_gates(cfg, model, gates, None, sinks=2, recent=6, path=pattern)


def _assert_decoding_matches_rounded_gates(cfg, model, gates, tmp_path, *, sinks, recent, path=None, local=False):
    """Prompt within sinks + window (where streaming = full), then 16 tokens scored through the deployed
    cache (duo:0.5) == the gated model's forward over the whole sequence with the gates rounded to 0 / 1.
    `local`: the gates cover the sliding-window layers too (duo:0.5:local)."""
    if path is None:
        path = tmp_path / "learned.json"
        save_pattern(path, gates, local=local)
    flags = {"local": "true"} if local else {}
    gen = Generator(model, capacity=sinks + recent + 20, policy=_duo(path, 0.5, sinks=sinks, window=recent, **flags))
    rng = np.random.default_rng(1)
    n = min(8, sinks + recent)
    prompt, cont = rng.integers(3, cfg.vocab_size, n).tolist(), rng.integers(3, cfg.vocab_size, 16).tolist()
    logp, _ = gen.score([prompt], [cont])
    streaming = gen._prepared["streaming"]
    K = cfg.attention.n_kv_heads
    gates = tuple(jnp.asarray([0.0 if h in s else 1.0 for h in range(K)]) for s in streaming)
    tokens = jnp.asarray([prompt + cont])
    pos = jnp.arange(tokens.shape[1])[None]
    logits, _ = model(tokens, pos, gate_caches(cfg, gates, sinks, recent, local))
    ref = jnp.take_along_axis(jax.nn.log_softmax(logits[0, len(prompt) - 1 : -1]), jnp.asarray(cont)[:, None], 1)[:, 0]
    np.testing.assert_allclose(logp[0], ref, atol=1e-5)
    full, _ = Generator(model, capacity=sinks + recent + 20).score([prompt], [cont])
    if n + 16 > sinks + recent:
        assert np.abs(full[0] - logp[0]).max() > 1e-3  # the streaming heads really dropped tokens


def test_on_sliding_window_layers_too_decoding_equals_the_gated_model(make_model, tmp_path):
    """duo:R:local splits the heads of the rings as well: a local layer's streaming heads see their sinks
    and recent tokens only while its window (8) covers them, in the deployed cache as in the gated model
    (21 tokens: the sinks leave the window). A pattern learned with the rings serves duo:R too (their
    gates stay out of the choice); one learned without them cannot serve duo:R:local."""
    cfg, model = make_model("gqa", *GEMMA_LIKE)
    every = compressible(cfg, local=True)
    gates = [np.random.default_rng(3).uniform(size=kv_heads(cfg, s)) for s in every]
    _assert_decoding_matches_rounded_gates(cfg, model, gates, tmp_path, sinks=2, recent=3, local=True)
    assert {cfg.mixers[s] for s, heads in enumerate(streaming_heads(gates, 0.5)) if heads} == {"local", "attention"}
    gen = Generator(model, capacity=CAPACITY, policy=_duo(tmp_path / "learned.json", 0.5, local="true", window=3))
    padded, lengths = gen.pad(PROMPTS, NEW)
    _, caches, _ = gen.prefill_compressed(padded, lengths, NEW)  # the rings' retrieval heads stay rings
    assert [type(c.full).__name__ for c in caches] == ["RingKVCache", "KVCache"] * 2
    assert caches_nbytes(caches) == compressed_cache_bytes(cfg, gen.compression_plan(lengths, NEW), 2, CAPACITY)
    growing = [g for s, g in zip(every, gates) if cfg.mixers[s] == "attention"]
    gen = Generator(model, capacity=CAPACITY, policy=_duo(tmp_path / "learned.json", 0.5))
    assert gen._prepared["streaming"] == streaming_heads(growing, 0.5)
    save_pattern(tmp_path / "global.json", growing)
    with pytest.raises(ConfigError, match="needs gates for the sliding-window layers too.*duo-train MODEL --local"):
        Generator(model, capacity=CAPACITY, policy=_duo(tmp_path / "global.json", 0.5, local="true"))


def test_duo_stages_without_a_pattern_read_the_models_own_for_their_layers():
    """The commands fill in a `duo` stage's pattern: the model's, or the one with the rings' gates for a
    stage that says `local`; a stage that names one keeps it."""
    assert with_pattern("duo:0.5", "g.json", "l.json") == "duo:0.5:pattern=g.json"
    assert with_pattern("snapkv:0.5", "g.json", "l.json") == "snapkv:0.5"
    assert with_pattern("duo:0.5:local", "g.json", "l.json") == "duo:0.5:local,pattern=l.json"
    assert with_pattern("duo:sinks=4,local=true", "g", "l") == "duo:sinks=4,local=true,pattern=l"
    assert with_pattern("duo:0.5:local,pattern=x", "g", "l") == "duo:0.5:local,pattern=x"
    assert default_pattern("gemma3", "gemma-3-270m", local=True).name == "gemma-3-270m.local.json"
    assert learned_pattern_path("gemma3", "gemma-3-270m", local=True) == Path("runs/duo/gemma-3-270m.local.json")


def test_all_gates_open_is_the_full_model_and_the_objective_is_its_l1_term(gqa):
    cfg, model = gqa
    graphdef, params = nnx.split(model)
    tokens = jnp.asarray(np.random.default_rng(0).integers(3, cfg.vocab_size, (1, 40)))
    mask = jnp.ones((1, 40))
    pos = jnp.arange(40)[None]
    teacher, _ = model.hidden(tokens, pos)
    K = cfg.attention.n_kv_heads
    ones = (jnp.ones(K), jnp.ones(K))
    total, (distill, l1) = objective(
        graphdef, params, ones, tokens, mask, teacher.astype(jnp.float32), sinks=2, recent=4, reg=0.05
    )
    assert float(distill) == 0.0 and float(l1) == 1.0 and float(total) == pytest.approx(0.05)
    half = (jnp.full(K, 0.5), jnp.zeros(K))
    total, (distill, l1) = objective(
        graphdef, params, half, tokens, mask, teacher.astype(jnp.float32), sinks=2, recent=4, reg=0.05
    )
    assert float(distill) > 0 and float(l1) == pytest.approx(0.25)
    mixed, _ = model.hidden(tokens, pos, gate_caches(cfg, half, 2, 4))
    expected = jnp.mean((mixed.astype(jnp.float32) - teacher) ** 2)
    assert float(distill) == pytest.approx(float(expected), rel=1e-5)


def test_passkey_samples_supervise_the_question_and_answer_tail():
    tok = ByteTokenizer()
    filler = np.frombuffer(b"In the beginning was the word. " * 40, np.uint8).astype(np.int32)
    cfg = GateTraining(length=500, keys=2, words=3, sinks=4, recent=16)
    tokens, mask = passkey_sample(tok, filler, cfg, np.random.default_rng(0))
    text = tok.decode(tokens.tolist())
    assert len(tokens) == 500 and "first passkey to the vault: " in text and "second passkey" in text
    tail = tok.decode(tokens[mask == 1].tolist())
    assert tail.startswith("\nWhat is the first passkey") and tail.count("Passkey: ") == 2
    assert mask[: -len(tail)].sum() == 0


@pytest.mark.slow
def test_gate_learning_lowers_the_held_out_objective_and_is_repeatable(gqa, tmp_path):
    cfg, model = gqa
    tok = ByteTokenizer()
    filler = np.frombuffer(("And God said, Let there be light: and there was light. " * 200).encode(), np.uint8)
    train = GateTraining(steps=12, length=400, keys=1, words=3, sinks=4, recent=32, lr=0.05, held_out=2)
    first = learn_gates(model, tok, filler.astype(np.int32), train, log=lambda _: None)
    again = learn_gates(model, tok, filler.astype(np.int32), train, log=lambda _: None)
    assert first["held_out_after"] < first["held_out_before"]
    assert all(np.array_equal(a, b) for a, b in zip(first["gates"], again["gates"]))
    assert streaming_heads(first["gates"], 0.5) == streaming_heads(again["gates"], 0.5)
    assert min(g.min() for g in first["gates"]) < 1.0  # the gates moved
    _assert_decoding_matches_rounded_gates(cfg, model, first["gates"], tmp_path, sinks=2, recent=6)


def test_gate_training_stops_at_a_non_finite_objective(gqa, monkeypatch):
    _, model = gqa
    nan = jnp.float32(jnp.nan)
    monkeypatch.setattr("kvjax.training.duo.objective", lambda *a, **k: (nan + a[2][0].sum(), (nan, nan)))
    filler = np.frombuffer(b"In the beginning was the word. " * 40, np.uint8).astype(np.int32)
    train = GateTraining(steps=3, length=300, keys=1, words=1, sinks=2, recent=8, held_out=1)
    with pytest.raises(TrainingError, match="objective became nan at step 1; nothing was written"):
        learn_gates(model, ByteTokenizer(), filler, train, log=lambda _: None)


def test_bad_duo_policies_and_patterns_are_clear_errors(gqa, pattern, tmp_path, make_model):
    cfg, model = gqa
    with pytest.raises(ConfigError, match="fraction of KV heads"):
        parse_policy("duo:12")
    with pytest.raises(ConfigError, match="cannot be chained"):
        parse_policy(f"snapkv:0.5+duo:0.5:pattern={pattern}")
    with pytest.raises(ConfigError, match="unknown option 'pattern'"):
        parse_policy("snapkv:0.5:pattern=x")
    with pytest.raises(ConfigError, match="every=, allocator= and reducer="):
        parse_policy("duo:0.5:every=2")
    with pytest.raises(ConfigError, match="needs the model's learned pattern"):
        Generator(model, capacity=CAPACITY, policy=parse_policy("duo:0.5"))
    with pytest.raises(ConfigError, match="no learned pattern at"):
        Generator(model, capacity=CAPACITY, policy=_duo(tmp_path / "none.json", 0.5))
    wrong = tmp_path / "wrong.json"
    save_pattern(wrong, [np.ones(3)])
    with pytest.raises(ConfigError, match="learned on another model"):
        Generator(model, capacity=CAPACITY, policy=_duo(wrong, 0.5))
    (tmp_path / "junk.json").write_text("{}")
    with pytest.raises(ConfigError, match="not a DuoAttention pattern"):
        load_pattern(tmp_path / "junk.json", (2, 2))
    _, mla = make_model("mla", "model.n_layers=2")
    with pytest.raises(ConfigError, match="MLA"):
        Generator(mla, capacity=CAPACITY, policy=_duo(pattern, 0.5))
    with pytest.raises(ConfigError, match="length=.* must exceed sinks"):
        GateTraining(length=300, sinks=64, recent=256)
    assert isinstance(gate_caches(cfg, (jnp.ones(2), jnp.ones(2)), 2, 4)[0], GateMix)
    with pytest.raises(ConfigError, match="local=true learns gates of sliding-window layers, and 'gqa' has none"):
        learn_gates(model, ByteTokenizer(), np.zeros(10, np.int32), GateTraining(local=True))
