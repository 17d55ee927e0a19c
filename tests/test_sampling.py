"""The sampler in the ops layer: each control does what it says, and seeded draws are keyed."""

import numpy as np
import pytest

from model.ops.numpy_ops import NumpyOps
from model.ops.numpy_sampling import SAMPLING_CANDIDATES
from model.ops.protocol import SampleBatch
from model.sampling import SamplingParams, seeded_uniform


def draw(logits, params: SamplingParams, n=1, prompt=(), output=()):
    """n draws of one row, each with its own seed."""
    logits = np.asarray(logits, dtype=np.float32)[None, :]
    rng = np.random.default_rng(0)
    out = []
    for i in range(n):
        p = params if params.seed is None and params.greedy else SamplingParams(**{**vars(params), "seed": i})
        ids = NumpyOps().sample(logits, SampleBatch([p], [prompt], [output], rng)).token_ids
        out.append(int(ids[0]))
    return np.array(out)


PROBS = np.array([0.5, 0.3, 0.15, 0.05])
LOGITS = np.log(PROBS)


def test_greedy_is_argmax():
    logits = np.random.default_rng(1).standard_normal(1000)
    assert draw(logits, SamplingParams(temperature=0.0))[0] == np.argmax(logits)


def test_temperature_one_follows_the_distribution():
    tokens = draw(LOGITS, SamplingParams(temperature=1.0), n=4000)
    freq = np.bincount(tokens, minlength=4) / len(tokens)
    np.testing.assert_allclose(freq, PROBS, atol=0.03)


def test_low_temperature_sharpens():
    tokens = draw(LOGITS, SamplingParams(temperature=0.1), n=500)
    assert (tokens == 0).mean() > 0.95


def test_top_k():
    logits = np.random.default_rng(2).standard_normal(500)
    tokens = draw(logits, SamplingParams(temperature=5.0, top_k=3), n=600)
    assert set(tokens) == set(np.argsort(-logits)[:3])


def test_top_p_and_min_p():
    assert set(draw(LOGITS, SamplingParams(top_p=0.7), n=400)) == {0, 1}
    assert set(draw(LOGITS, SamplingParams(top_p=0.85), n=400)) == {0, 1, 2}
    assert set(draw(LOGITS, SamplingParams(min_p=0.5), n=400)) == {0, 1}
    assert set(draw(LOGITS, SamplingParams(min_p=0.2), n=400)) == {0, 1, 2}


def test_top_n_sigma_keeps_the_logits_within_n_deviations_of_the_largest():
    """Top-nσ (Tang et al., as llama.cpp's sampler): the kept tokens are those with a logit at
    least max - n * std over the row, whatever the temperature; with top-k it keeps the smaller set."""
    logits = np.random.default_rng(4).standard_normal(300) * 2
    for n, temperature in ((1.0, 1.0), (1.5, 3.0), (0.5, 0.7)):
        kept = set(np.flatnonzero(logits >= logits.max() - n * logits.std()).tolist())
        tokens = draw(logits, SamplingParams(temperature=temperature, top_n_sigma=n), n=1500)
        assert set(tokens.tolist()) == kept, (n, temperature)
    both = draw(logits, SamplingParams(temperature=2.0, top_n_sigma=2.0, top_k=3), n=300)
    assert set(both.tolist()) == set(np.argsort(-logits)[:3].tolist())


def test_top_n_sigma_draws_the_same_token_alone_and_in_a_batch():
    rng = np.random.default_rng(5)
    batch = rng.standard_normal((6, 400)).astype(np.float32) * 3
    params = [SamplingParams(temperature=1.0, top_n_sigma=1.0, seed=s) for s in range(6)]
    together = NumpyOps().sample(batch, SampleBatch(params, [()] * 6, [()] * 6, rng)).token_ids
    for r in range(6):
        alone = NumpyOps().sample(batch[r:r + 1], SampleBatch(params[r:r + 1], [()], [()], rng)).token_ids
        assert alone[0] == together[r]


def test_top_p_reaching_past_the_candidates_is_exact():
    """A flat distribution: the nucleus of 0.9 spans 900 of 1000 tokens, more than the
    256 candidates taken first, so the sampler must fall back to a full sort."""
    tokens = draw(np.zeros(1000), SamplingParams(top_p=0.8995), n=2000)
    assert tokens.max() < 900 and (tokens >= SAMPLING_CANDIDATES).mean() > 0.5


def test_logit_bias_forces_and_bans():
    logits = np.random.default_rng(3).standard_normal(300)
    assert draw(logits, SamplingParams(temperature=0.0, logit_bias={17: 100.0}))[0] == 17
    best = int(np.argmax(logits))
    assert best not in draw(logits, SamplingParams(temperature=0.0, logit_bias={best: -100.0}))


def test_repetition_penalty_over_prompt_and_output():
    logits = [2.0, 1.5, -1.0]
    greedy = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    assert draw(logits, greedy, prompt=[0])[0] == 1  # 2.0 / 2 < 1.5
    assert draw(logits, greedy, output=[0])[0] == 1
    assert draw(logits, greedy, prompt=[2])[0] == 0


def test_presence_and_frequency_penalties_count_output_only():
    logits = [2.0, 1.5, -1.0]
    freq = SamplingParams(temperature=0.0, frequency_penalty=0.2)
    assert draw(logits, freq, output=[0, 0])[0] == 0  # 2.0 - 0.4 > 1.5
    assert draw(logits, freq, output=[0, 0, 0])[0] == 1  # 2.0 - 0.6 < 1.5
    assert draw(logits, freq, prompt=[0, 0, 0])[0] == 0
    presence = SamplingParams(temperature=0.0, presence_penalty=0.6)
    assert draw(logits, presence, output=[0])[0] == 1


def test_logprobs_are_raw_log_softmax_with_sorted_top_n():
    logits = np.random.default_rng(4).standard_normal((2, 200)).astype(np.float32)
    params = [SamplingParams(temperature=0.0, logprobs=5), SamplingParams(temperature=1.0, seed=3, logprobs=0)]
    got = NumpyOps().sample(logits, SampleBatch(params, [(), ()], [(), ()], np.random.default_rng()))
    ids, logprobs, top = got.token_ids, got.logprobs, got.top_logprobs
    lsm = logits - logits.max(axis=1, keepdims=True)
    lsm = lsm - np.log(np.exp(lsm).sum(axis=1, keepdims=True))
    for r in range(2):
        assert logprobs[r] == pytest.approx(lsm[r, ids[r]], abs=1e-5)
    assert [t for t, _ in top[0]] == list(np.argsort(-lsm[0])[:5])
    assert [lp for _, lp in top[0]] == pytest.approx(list(np.sort(lsm[0])[::-1][:5]), abs=1e-5)
    assert top[1] == []


def test_seeded_uniform_is_keyed_and_uniform():
    u = np.array([seeded_uniform(42, i) for i in range(20000)])
    assert ((u >= 0) & (u < 1)).all()
    assert abs(u.mean() - 0.5) < 0.01
    np.testing.assert_allclose(np.histogram(u, bins=10, range=(0, 1))[0] / len(u), 0.1, atol=0.01)
    assert seeded_uniform(42, 7) == seeded_uniform(42, 7) != seeded_uniform(43, 7)


@pytest.mark.parametrize("bad,msg", [
    (dict(temperature=-0.5), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(min_p=2.0), "min_p"),
    (dict(top_k=-3), "top_k"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(presence_penalty=3.0), "presence_penalty"),
    (dict(logit_bias={5000: 1.0}), "vocabulary"),
    (dict(logit_bias={5: 500.0}), "logit_bias"),
    (dict(logprobs=50), "top_logprobs"),
])
def test_validation_names_the_bad_field(bad, msg):
    with pytest.raises(ValueError, match=msg):
        SamplingParams(**bad).validate(vocab_size=1000)


def test_a_grammar_mask_limits_every_draw_and_logprobs_stay_raw():
    """Masked rows only ever pick allowed tokens, greedy or sampled (the best token is masked
    out here), and their logprobs are of the model's raw distribution."""
    from model.sampling import allowed_tokens

    rng = np.random.default_rng(11)
    vocab = 300
    logits = (rng.standard_normal((4, vocab)) * 3).astype(np.float32)
    allowed = rng.random((4, vocab)) < 0.1
    allowed[np.arange(4), np.argmax(logits, axis=1)] = False
    words = np.packbits(np.pad(allowed, ((0, 0), (0, 20))), axis=1, bitorder="little").view(np.int32)
    assert np.array_equal(allowed_tokens(words[0], vocab), allowed[0])
    params = [SamplingParams(temperature=0.0, logprobs=0), SamplingParams(temperature=1.0, top_p=0.9),
              SamplingParams(temperature=0.7, repetition_penalty=1.3), SamplingParams(temperature=1.0)]
    for _ in range(30):
        got = NumpyOps().sample(logits, SampleBatch(params, [[1, 2]] * 4, [[]] * 4, rng, masks=list(words)))
        ids, logprobs = got.token_ids, got.logprobs
        assert all(allowed[r, t] for r, t in enumerate(ids))
    raw = logits[0] - logits[0].max()
    assert logprobs[0] == pytest.approx(float(raw[ids[0]] - np.log(np.exp(raw).sum())), abs=1e-5)
