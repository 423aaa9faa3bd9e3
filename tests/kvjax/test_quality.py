import numpy as np
import pytest

from kvjax import Generator, quality
from kvjax.compress import parse_policy

PROMPTS = [list(range(3, 43)), list(range(50, 120)), list(range(7, 62))]
CONTINUATIONS = [[9, 4, 11, 2, 8], list(range(100, 117)), [5] * 9]


@pytest.fixture(scope="module")
def model(make_model):
    return make_model("gqa", "model.n_layers=2")[1]


def _alone(model, prompt, continuation, policy):
    """KL per scored position of one request, scored unpadded and alone."""
    capacity = len(prompt) + len(continuation)
    _, ref = Generator(model, capacity=capacity).score([prompt], [continuation], keep_logits=True)
    _, got = Generator(model, capacity=capacity, policy=parse_policy(policy)).score(
        [prompt], [continuation], keep_logits=True
    )
    return quality.kl_per_position(ref, got)[0, 1:]


@pytest.mark.parametrize("rows_fit", [1, 3])
def test_padded_batches_score_each_continuation_as_it_alone_is_scored(model, monkeypatch, rows_fit):
    """Continuations of 5, 17 and 9 tokens, padded to 32 (one batch) or to 8, 16 and 32 (a row a batch):
    decode-time eviction (every=4) fires inside the padding, yet every counted position equals the request
    scored alone and unpadded, and the first token (the prefill's prediction) is never counted."""
    v = model.config.vocab_size
    monkeypatch.setattr(quality, "LOGITS_BYTES", rows_fit * 32 * v * 4)
    policy = "h2o:16:every=4"
    got = quality.continuation_kl(model, PROMPTS, CONTINUATIONS, policy)
    each = [_alone(model, p, c, policy) for p, c in zip(PROMPTS, CONTINUATIONS)]
    assert got.positions == sum(len(c) - 1 for c in CONTINUATIONS) == sum(e.size for e in each)
    np.testing.assert_allclose(got.kl, np.concatenate(each).mean(), rtol=1e-4)
    np.testing.assert_allclose(got.kl_max, max(e.max() for e in each), rtol=1e-4)
    assert got.kl > 1e-4  # 16 of 40-70 tokens kept: a cost, not noise


def test_a_policy_that_keeps_every_token_costs_nothing(model):
    """A budget above every prompt and continuation (a cap that never binds) is the full cache."""
    got = quality.continuation_kl(model, PROMPTS, CONTINUATIONS, "h2o:256:every=4")
    assert got.positions == 28 and got.kl < 1e-6


def test_kl_per_position_matches_a_hand_value():
    full = np.log(np.array([[0.5, 0.5], [1.0, 1e-30]]))
    other = np.log(np.array([[0.9, 0.1], [1.0, 1e-30]]))
    np.testing.assert_allclose(
        quality.kl_per_position(full, other), [0.5 * np.log(0.5 / 0.9) + 0.5 * np.log(0.5 / 0.1), 0.0], atol=1e-12
    )


def test_bad_inputs_are_named(model):
    with pytest.raises(ValueError, match="one continuation per prompt"):
        quality.continuation_kl(model, PROMPTS, CONTINUATIONS[:2], "snapkv:0.5")
    with pytest.raises(ValueError, match="at least one token"):
        quality.continuation_kl(model, PROMPTS[:1], [[]], "snapkv:0.5")
