"""Multi-step decode (`Decoder.advance_many`, `cluster.decode_steps`): several steps in one
dispatch draw the tokens, log-probabilities and KV rows that as many single steps draw, greedy
and sampled; a dispatch that would outgrow a slot's pages or max_len runs one step; a warmed
decoder compiles nothing new for it."""

from __future__ import annotations

import numpy as np
import pytest

from dualpath_jax.model.decode import Decoder
from dualpath_jax.model.runner import PrefillBatch, compile_count
from dualpath_jax.model.sampling_params import SamplingParams

SAMPLINGS = [
    SamplingParams(logprobs=0),
    SamplingParams(temperature=0.9, seed=11, logprobs=0),
    SamplingParams(temperature=1.7, top_p=0.3, seed=12345, logprobs=0),
]


def _prefill(runner, prompt):
    res, kv = runner.prefill_monolithic(PrefillBatch.build(runner.cfg, [prompt], [0]))
    return np.asarray(kv[:, 0]), int(np.asarray(res.last_logits)[0].argmax())


def _pair(runner, prompts, *, max_len=128, page_size=16):
    """Two decoders holding the same prompts in the same slots."""
    decs = [Decoder(runner, slots=3, max_len=max_len, page_size=page_size) for _ in range(2)]
    for slot, (p, sampling) in enumerate(zip(prompts, SAMPLINGS)):
        kv, first = _prefill(runner, p)
        for dec in decs:
            dec.insert(slot, kv, len(p), first, len(p) + 40, sampling=sampling)
    return decs


def test_several_steps_in_one_dispatch_draw_what_single_steps_draw(tiny_runner):
    cfg = tiny_runner.cfg
    rs = np.random.RandomState(7)
    prompts = [rs.randint(0, cfg.vocab_size, n).tolist() for n in (12, 30, 7)]
    single, multi = _pair(tiny_runner, prompts)
    got_tokens, got_lp, want_tokens, want_lp = [], [], [], []
    for _ in range(5):
        tokens, n = multi.advance_many(4)
        assert n == 4
        got_tokens.append(np.asarray(tokens))
        got_lp.append(np.asarray(multi.logprobs))
        for _ in range(n):
            want_tokens.append(np.asarray(single.advance()))
            want_lp.append(np.asarray(single.logprobs))
    np.testing.assert_array_equal(np.concatenate(got_tokens), np.stack(want_tokens))
    np.testing.assert_allclose(np.concatenate(got_lp), np.stack(want_lp), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(multi.lengths, single.lengths)
    np.testing.assert_array_equal(multi.pending, single.pending)
    for slot in range(len(prompts)):
        end = int(single.lengths[slot])
        np.testing.assert_allclose(multi.rows(slot, 0, end), single.rows(slot, 0, end), atol=1e-6)


def test_a_dispatch_runs_one_step_where_a_slot_would_outgrow_its_pages_or_max_len(tiny_runner):
    cfg = tiny_runner.cfg
    kv = np.zeros((cfg.num_layers, 42, cfg.kv_width), np.float32)
    dec = Decoder(tiny_runner, slots=2, max_len=48, page_size=8)
    dec.insert(0, kv, 13, 1)  # pages for 14 tokens: 16 held, rows 13..15 free
    # 4 steps need row 16: one step each until a step takes the third page, which holds 4 more
    assert [dec.advance_many(4)[1] for _ in range(5)] == [1, 1, 1, 4, 4]
    assert int(dec.lengths[0]) == 24
    dec.free(0)
    dec.insert(1, kv, 42, 1, 48)  # pages up to max_len
    assert [dec.advance_many(4)[1] for _ in range(3)] == [4, 1, 1]  # 42..45, 46, 47
    assert int(dec.lengths[1]) == 48
    with pytest.raises(ValueError, match="max_len"):
        dec.advance_many(4)


def test_top_logprobs_need_single_steps(tiny_runner):
    cfg = tiny_runner.cfg
    kv = np.zeros((cfg.num_layers, 8, cfg.kv_width), np.float32)
    dec = Decoder(tiny_runner, slots=1, max_len=64)
    dec.insert(0, kv, 8, 1, 40)
    dec.advance_many(1)
    ids, _ = dec.top_logprobs()
    assert np.asarray(ids).shape[0] == 1
    dec.advance_many(4)
    with pytest.raises(ValueError, match="several steps"):
        dec.top_logprobs()


def test_a_warmed_decoder_compiles_nothing_for_multi_step_dispatches(tiny_runner):
    cfg = tiny_runner.cfg
    rs = np.random.RandomState(1)
    dec = Decoder(tiny_runner, slots=2, max_len=128, page_size=16)
    prompts = [rs.randint(0, cfg.vocab_size, n).tolist() for n in (20, 90)]
    prefilled = [_prefill(tiny_runner, p) for p in prompts]
    dec.warmup(steps=4)
    before = compile_count()
    for slot, (p, (kv, first)) in enumerate(zip(prompts, prefilled)):
        dec.insert(slot, kv, len(p), first, sampling=SAMPLINGS[slot])  # pages grow as it goes
    steps = []
    while dec.lengths.max() < 118:
        steps.append(dec.advance_many(4)[1])
    assert 4 in steps and 1 in steps
    assert compile_count() == before, "a decode shape compiled after warm-up"


def test_a_step_runs_over_the_slots_up_to_the_last_active_one(tiny_runner):
    """Idle slots cost nothing: a step runs over the first power-of-two slots that hold every
    active one, and draws what a step over all of them draws (the same request in the last
    slot, with every slot in the step)."""
    cfg = tiny_runner.cfg
    prompt = np.random.RandomState(4).randint(0, cfg.vocab_size, 30).tolist()
    kv, first = _prefill(tiny_runner, prompt)
    front, back = (Decoder(tiny_runner, slots=8, max_len=128, page_size=16) for _ in range(2))
    front.insert(0, kv, len(prompt), first, sampling=SAMPLINGS[1])
    back.insert(7, kv, len(prompt), first, sampling=SAMPLINGS[1])
    got = [int(np.asarray(front.advance())[0]) for _ in range(6)]
    want = [int(np.asarray(back.advance())[7]) for _ in range(6)]
    assert got == want
    assert (front._rows, back._rows) == (1, 8)
    assert np.asarray(front.step()).shape[0] == 8  # `step` gives every slot's row
    front.insert(2, kv, len(prompt), first)
    front.advance()
    assert front._rows == 4
