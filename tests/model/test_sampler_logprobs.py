"""Log-probabilities (`SamplingParams.logprobs`): the sampler's, the decode step's and the
in-process backend's equal the model's own log-softmax at the drawn ids (and under the sampling
distribution, its log-softmax after temperature and top-p), and asking for them changes no
token."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dualpath_jax.model.sampler import sample_at, top_logprobs
from dualpath_jax.model.sampling_params import MAX_TOP_LOGPROBS, SamplingError, SamplingParams
from dualpath_jax.model.transformer import init_model
from dualpath_jax.presets import TINY_DEEPSEEK, TINY_QWEN2
from dualpath_jax.rollout import InProcessBackend, Logprobs, Session, Step


def _nucleus_logsoftmax(logits: np.ndarray, t: float, top_p: float) -> np.ndarray:
    """The distribution `sample_at` draws from, in numpy: logits / t cut to the top-p nucleus."""
    z = logits.astype(np.float64) / t
    order = np.argsort(-z, kind="stable")
    p = np.exp(z[order] - z.max())
    p /= p.sum()
    before = np.cumsum(p) - p
    keep = order[before < top_p]
    out = np.full_like(z, -np.inf)
    zk = z[keep]
    out[keep] = zk - (zk.max() + np.log(np.exp(zk - zk.max()).sum()))
    return out


def test_sample_at_logprobs_match_numpy_and_change_no_token():
    rs = np.random.RandomState(0)
    logits = rs.randn(4, 50).astype(np.float32) * 3
    params = [
        SamplingParams(logprobs=0),
        SamplingParams(temperature=0.7, seed=3, logprobs=5),
        SamplingParams(temperature=1.3, top_p=0.8, seed=9, logprobs=0),
        SamplingParams(temperature=1.0, seed=1),  # asks for none
    ]
    pos = [10, 11, 12, 13]
    plain = sample_at(logits, params, pos)
    tokens, entries = sample_at(logits, params, pos, logprobs=True)
    np.testing.assert_array_equal(tokens, plain)
    assert entries[3] is None
    model = jax.nn.log_softmax(
        jnp.asarray(logits, jnp.float64 if jax.config.x64_enabled else jnp.float32)
    )
    model = np.asarray(model)
    for b in range(3):
        e = entries[b]
        assert len(e) == 1
        assert abs(e.model[0] - model[b, tokens[b]]) <= 1e-5
    assert abs(entries[0].sampled[0] - entries[0].model[0]) <= 1e-6  # greedy: the model's
    for b, (t, tp) in ((1, (0.7, 1.0)), (2, (1.3, 0.8))):
        want = _nucleus_logsoftmax(logits[b], t, tp)[tokens[b]]
        assert abs(entries[b].sampled[0] - want) <= 1e-4
    # top-5 under the model, most likely first, the drawn token's value among them if present
    order = np.argsort(-logits[1], kind="stable")[:5]
    assert entries[1].top_ids[0] == order.tolist()
    np.testing.assert_allclose(entries[1].top[0], model[1, order], atol=1e-5)
    assert entries[0].top_ids == [] and entries[2].top_ids == []


def test_held_stop_tokens_are_outside_the_sampling_distribution():
    logits = np.array([[5.0, 1.0, 0.0, -1.0]], np.float32)
    params = [SamplingParams(logprobs=0)]
    tokens, entries = sample_at(logits, params, [0], held=[[0]], logprobs=True)
    assert tokens[0] == 1  # the held token 0 is not drawn
    z = logits[0, 1:]
    want = z[0] - np.log(np.exp(z).sum())
    assert abs(entries[0].sampled[0] - want) <= 1e-5  # renormalised without it
    model = logits[0] - np.log(np.exp(logits[0]).sum())
    assert abs(entries[0].model[0] - model[1]) <= 1e-5


def test_top_logprobs_width():
    ids, vals = top_logprobs(jnp.zeros((2, 64)))
    assert ids.shape == vals.shape == (2, MAX_TOP_LOGPROBS)


@pytest.mark.parametrize("bad", [-1, MAX_TOP_LOGPROBS + 1, 1.5, True, "3"])
def test_bad_logprobs_are_refused(bad):
    with pytest.raises(SamplingError, match="logprobs"):
        SamplingParams(logprobs=bad)


def _model_logprobs(model, seq: list[int], n_prompt: int, t: float = 1.0) -> np.ndarray:
    """The model's log-softmax (over logits / t) at each generated id of `seq`, from one
    monolithic forward over the whole sequence."""
    logits, _ = model(jnp.asarray([seq], jnp.int32))
    logits = np.asarray(logits[0], np.float64) / t
    lsm = logits - logits.max(-1, keepdims=True)
    lsm -= np.log(np.exp(lsm).sum(-1, keepdims=True))
    return np.array([lsm[p - 1, seq[p]] for p in range(n_prompt, len(seq))])


@pytest.mark.parametrize("preset", [TINY_QWEN2, TINY_DEEPSEEK], ids=["qwen2", "deepseek"])
def test_inprocess_logprobs_equal_the_models_log_softmax(preset):
    model = init_model(preset, seed=0)
    engine = InProcessBackend(model, max_len=256)
    rs = np.random.RandomState(1)
    s = Session(engine, "lp")
    context: list[int] = []
    for turn, (temperature, top_k) in enumerate(((0.0, 3), (0.8, 0), (1.0, 0))):
        append = rs.randint(0, preset.vocab_size, 17 + turn).tolist()
        key = jax.random.key(turn) if temperature else None
        plain = Session(engine, f"plain{turn}")
        out = s.step(append, 6, temperature=temperature, key=key, logprobs=top_k or True)
        assert isinstance(out, Step) and isinstance(out.logprobs, Logprobs)
        assert len(out.logprobs) == len(out.tokens) == 6
        # asking for logprobs changes no token
        assert plain.step(context + append, 6, temperature=temperature, key=key) == out.tokens
        context += append
        seq = context + out.tokens
        want_model = _model_logprobs(model, seq, len(context))
        np.testing.assert_allclose(out.logprobs.model, want_model, atol=1e-4)
        want_drawn = _model_logprobs(model, seq, len(context), temperature or 1.0)
        np.testing.assert_allclose(out.logprobs.sampled, want_drawn, atol=1e-4)
        if top_k:
            assert all(len(ids) == top_k for ids in out.logprobs.top_ids)
            assert [ids[0] for ids in out.logprobs.top_ids] == out.tokens  # greedy: the argmax
        context += out.tokens
