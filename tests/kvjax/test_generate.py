import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import DecodingConfig, Generator, generate, memory
from kvjax.cache import caches_nbytes
from tests.conftest import GEMMA_LIKE

PROMPTS = [[5, 17, 3], list(range(40, 51)), [200, 1, 2, 3, 4, 9]]
CAPACITY = 32
GREEDY = DecodingConfig(max_new_tokens=8)


@pytest.fixture(scope="module", params=["gqa", "swa"])
def setup(request, make_model):
    overrides = ["model.n_layers=2"] + (["model.attention.window=8"] if request.param == "swa" else [])
    cfg, model = make_model(request.param, *overrides)
    return cfg, model, Generator(model, capacity=CAPACITY)


def test_greedy_tokens_are_the_argmax_of_the_full_forward(setup):
    """Every generated token is argmax of a full (uncached) forward over prompt + generated so far."""
    _, model, gen = setup
    result = gen(PROMPTS, GREEDY)
    for row, prompt in enumerate(PROMPTS):
        seq = jnp.asarray([prompt + result.tokens[row].tolist()])
        logits, _ = model(seq, jnp.arange(seq.shape[1])[None])
        step_logits = logits[0, len(prompt) - 1 : -1]
        np.testing.assert_array_equal(result.tokens[row], np.argmax(step_logits, -1))
        logp = jax.nn.log_softmax(step_logits)[np.arange(8), result.tokens[row]]
        np.testing.assert_allclose(result.logprobs[row], logp, atol=1e-5)
    np.testing.assert_array_equal(result.lengths, [8, 8, 8])


def test_batch_equals_each_prompt_alone(setup):
    _, _, gen = setup
    batch = gen(PROMPTS, GREEDY)
    for row, prompt in enumerate(PROMPTS):
        alone = gen([prompt], GREEDY)
        np.testing.assert_array_equal(batch.tokens[row], alone.tokens[0])
        np.testing.assert_allclose(batch.logprobs[row], alone.logprobs[0], atol=1e-5)


def test_eos_stops_a_row_and_pads_it(setup):
    _, _, gen = setup
    free = gen(PROMPTS, GREEDY)
    eos = int(free.tokens[0, 2])
    first_eos = [int(np.argmax(r == eos)) if (r == eos).any() else None for r in free.tokens]
    stopped = gen(PROMPTS, DecodingConfig(max_new_tokens=8, eos_id=eos))
    for row, at in enumerate(first_eos):
        n = 8 if at is None else at + 1
        assert stopped.lengths[row] == n
        np.testing.assert_array_equal(stopped.tokens[row, :n], free.tokens[row, :n])
        assert np.all(stopped.tokens[row, n:] == eos) and np.all(stopped.logprobs[row, n:] == 0)


def test_sampling_is_reproducible_per_rng_and_greedy_at_top_k_1(setup):
    _, _, gen = setup
    hot = DecodingConfig(max_new_tokens=8, temperature=1.0)
    a = gen(PROMPTS, hot, rng=jax.random.key(7))
    b = gen(PROMPTS, hot, rng=jax.random.key(7))
    c = gen(PROMPTS, hot, rng=jax.random.key(8))
    np.testing.assert_array_equal(a.tokens, b.tokens)
    assert (a.tokens != c.tokens).any()
    top1 = gen(PROMPTS, DecodingConfig(max_new_tokens=8, temperature=1.0, top_k=1))
    np.testing.assert_array_equal(top1.tokens, gen(PROMPTS, GREEDY).tokens)


def test_cache_after_generation_measures_the_analytic_bytes(setup):
    cfg, _, gen = setup
    result = gen(PROMPTS, GREEDY)
    assert caches_nbytes(result.caches) == memory.cache_bytes(cfg, CAPACITY, batch=len(PROMPTS))
    np.testing.assert_array_equal(result.caches[0].length, [len(p) + 7 for p in PROMPTS])


def _prefill_then_decode(gen, chunk):
    tokens, lengths = gen.pad(PROMPTS, GREEDY.max_new_tokens)
    logits, caches = gen.prefill(tokens, lengths, chunk=chunk)
    return logits, gen.decode(caches, logits, lengths, GREEDY, jax.random.key(0))


@pytest.mark.parametrize("chunk", [1, 5])
def test_chunked_prefill_equals_one_pass(setup, chunk):
    """Prompts of 3, 11 and 6 tokens (bucket 16) through chunks of 1 or 5 columns (so rows end in
    different chunks, and the sliding window's ring wraps between chunks): the same next-token logits,
    and decoding continues from those caches to the same tokens."""
    _, _, gen = setup
    logits, result = _prefill_then_decode(gen, None)
    chunked_logits, chunked = _prefill_then_decode(gen, chunk)
    np.testing.assert_allclose(chunked_logits, logits, atol=2e-5, rtol=1e-5)
    np.testing.assert_array_equal(chunked.tokens, result.tokens)
    np.testing.assert_allclose(chunked.logprobs, result.logprobs, atol=1e-5)


@pytest.mark.parametrize("name", ["yoco-gret", "mla", "rwkv7"])
def test_chunked_prefill_equals_one_pass_beyond_attention(make_model, name):
    """YOCO's early exit, MLA's latents and RWKV's recurrent state carried from chunk to chunk."""
    _, model = make_model(name, "model.n_layers=2" if name != "yoco-gret" else "model.n_layers=4")
    gen = Generator(model, capacity=CAPACITY)
    logits, result = _prefill_then_decode(gen, None)
    chunked_logits, chunked = _prefill_then_decode(gen, 5)
    np.testing.assert_allclose(chunked_logits, logits, atol=2e-5, rtol=1e-5)
    np.testing.assert_array_equal(chunked.tokens, result.tokens)


def test_bad_requests_fail_before_compute(setup):
    cfg, model, gen = setup
    with pytest.raises(
        ValueError, match="prompt of 30 tokens \\+ max_new_tokens=8 needs 38 cache slots but the capacity is 32"
    ):
        gen([[1] * 30], GREEDY)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        gen([[1], []], GREEDY)
    with pytest.raises(ValueError, match="at least one prompt"):
        gen([], GREEDY)
    with pytest.raises(ValueError, match=f"token ids must be in \\[0, {cfg.vocab_size}\\)"):
        gen([[1, cfg.vocab_size]], GREEDY)
    with pytest.raises(ValueError, match="capacity=0 must be > 0"):
        Generator(model, capacity=0)
    with pytest.raises(ValueError, match="chunk=0 must be >= 1"):
        gen.prefill(*gen.pad(PROMPTS, 8), chunk=0)


def test_generate_convenience_picks_a_capacity(setup):
    _, model, gen = setup
    np.testing.assert_array_equal(generate(model, PROMPTS, GREEDY).tokens, gen(PROMPTS, GREEDY).tokens)


def test_prompt_buckets_are_powers_of_two_then_quarter_octaves():
    from kvjax.generate import prompt_bucket

    assert [prompt_bucket(n, 1 << 16) for n in (1, 8, 9, 600, 1024)] == [8, 8, 16, 1024, 1024]
    assert [prompt_bucket(n, 1 << 16) for n in (1025, 1100, 1536, 1537, 2049, 5000)] == [
        1280,
        1280,
        1536,
        1792,
        2560,
        5120,
    ]
    assert prompt_bucket(1100, 1200) == 1200  # never past the capacity
    for n in range(1025, 9000, 37):  # at most 25% padding above 1k
        assert n <= prompt_bucket(n, 1 << 16) <= 1.25 * n


@pytest.mark.parametrize(
    "model_args, policy",
    [
        (("model.n_layers=2", "model.init_std=0.2"), p)
        for p in (None, "snapkv:0.5:obs_window=4", "tova:0.5", "keynorm:0.5", "kivi:2:group=4,residual=8", "quest:0.5")
    ]
    + [(GEMMA_LIKE, p) for p in ("streaming:0.5", "snapkv:0.3:local,obs_window=2", "int:8")],
)
def test_a_question_fed_as_one_chunk_answers_as_one_token_at_a_time(make_model, model_args, policy):
    """`Generator.answer` feeds the question through the compressed cache in one pass: the same tokens and
    log-probs as a decode step per token, for every cache layout (slots, per-head positions, KIVI's
    residual, Quest's pages, sliding-window rings whole and compressed under `local`: the last three fed a
    token at a time, as a chunk would not attend as they do)."""
    from kvjax.compress import parse_policy
    from kvjax.generate import _takes_chunks

    model = make_model("gqa", *model_args)[1]
    gen = Generator(model, capacity=64, policy=policy and parse_policy(policy))
    rng = np.random.default_rng(2)
    contexts = [[int(t) for t in rng.integers(0, 256, n)] for n in (33, 21)]
    questions = [[int(t) for t in rng.integers(0, 256, 11)] for _ in contexts]
    chunk, steps = (gen.answer(contexts, questions, GREEDY, stepwise=s) for s in (False, True))
    stepped = ("kivi", "quest", "snapkv:0.3:local")  # KIVI's residual, Quest's pages, a compressed ring
    assert all(map(_takes_chunks, chunk.caches)) == (not str(policy).startswith(stepped))
    np.testing.assert_array_equal(chunk.tokens, steps.tokens)
    np.testing.assert_allclose(chunk.logprobs, steps.logprobs, atol=2e-5)


def test_a_question_fed_after_its_compressed_context_is_never_scored(make_model):
    """`Generator.answer` (kvpress's question-agnostic protocol): SnapKV keeps the same context tokens
    whatever question follows, where compressing context + question (the question-aware way) keeps
    different ones for different questions; with the full cache both ways give the same tokens. Questions
    a few tokens apart leave caches of one shape (one compile per bucket, not per sample)."""
    from kvjax.compress import parse_policy

    model = make_model("gqa", "model.n_layers=2", "model.init_std=0.2")[1]
    rng = np.random.default_rng(1)
    context = [int(t) for t in rng.integers(0, 256, 40)]
    questions = [[int(t) for t in rng.integers(0, 256, 6)] for _ in range(2)]
    snap = Generator(model, capacity=64, policy=parse_policy("snapkv:0.5:obs_window=4"))

    def kept(result):  # per KV head, the context positions still cached
        pos = np.asarray(result.caches[0].pos[0])
        return [sorted(p[(p >= 0) & (p < len(context))].tolist()) for p in pos]

    agnostic = [kept(snap.answer([context], [q], GREEDY)) for q in questions]
    asked = (questions[0], questions[0] * 2)  # 6 and 12 tokens, both padded to 16
    shapes = [jax.tree.map(np.shape, snap.answer([context], [q], GREEDY).caches) for q in asked]
    assert shapes[0] == shapes[1]
    aware = [kept(snap([context + q], GREEDY)) for q in questions]
    assert agnostic[0] == agnostic[1] and aware[0] != aware[1]
    full = Generator(model, capacity=64)
    for q in questions:
        np.testing.assert_array_equal(full.answer([context], [q], GREEDY).tokens, full([context + q], GREEDY).tokens)
    with pytest.raises(ValueError, match="one non-empty sequence per context, all of the same length"):
        full.answer([context, context], [[1], [2, 3]], GREEDY)
