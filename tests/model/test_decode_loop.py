"""The device-side decode loop: layers under a scan, sampling and state on the device, nothing
compiled after `warmup()` and nothing copied host-to-device by a step that changed nothing."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from dualpath_jax import model as dm
from dualpath_jax.model.decode import Decoder
from dualpath_jax.model.generation import reference_generate
from dualpath_jax.model.page_pool import PagesExhausted
from dualpath_jax.model.runner import ModelRunner, PrefillBatch, compile_count
from dualpath_jax.model.sampler import sample_at
from dualpath_jax.model.sampling_params import SamplingParams
from dualpath_jax.presets import TINY_DEEPSEEK, TINY_QWEN2


def _prefill(runner, prompt):
    res, kv = runner.prefill_monolithic(PrefillBatch.build(runner.cfg, [prompt], [0]))
    return np.asarray(kv[:, 0]), np.asarray(res.last_logits)


def test_advance_samples_as_sample_at_on_the_device(tiny_runner):
    """Tokens drawn inside the step equal `sample_at` on the step's logits, greedy and sampled."""
    cfg = tiny_runner.cfg
    rs = np.random.RandomState(3)
    prompts = [rs.randint(0, cfg.vocab_size, n).tolist() for n in (12, 30, 7)]
    params = [
        SamplingParams(),
        SamplingParams(temperature=0.9, seed=11),
        SamplingParams(temperature=1.7, top_p=0.3, seed=12345),
    ]
    a, b = (Decoder(tiny_runner, slots=3, max_len=64) for _ in range(2))
    for slot, (p, sampling) in enumerate(zip(prompts, params)):
        kv, _ = _prefill(tiny_runner, p)
        for dec in (a, b):
            dec.insert(slot, kv, len(p), 5, sampling=sampling)
    for _ in range(6):
        lengths = b.lengths.copy()
        logits = b.step()
        want = sample_at(logits, params, list(lengths + 1))
        b.set_next(want)
        got = np.asarray(a.advance())
        np.testing.assert_array_equal(got, want)


def test_sample_at_top_p_draws_from_the_nucleus_only():
    """Per-row top-p: a row draws only tokens of its nucleus (the most likely tokens whose mass
    reaches top_p); a row at top-p 1 draws as it does without top-p, whatever its neighbours."""
    rs = np.random.RandomState(0)
    logits = rs.randn(4, 50).astype(np.float32) * 3
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    order = np.argsort(-probs, axis=-1)
    top_ps = [0.5, 1.0, 1e-6, 0.9]
    nucleus = []
    for b, p in enumerate(top_ps):
        mass = np.cumsum(probs[b, order[b]])
        nucleus.append(set(order[b, : int(np.searchsorted(mass, p)) + 1].tolist()))
    drawn = [set() for _ in top_ps]
    for pos in range(200):
        rows = [SamplingParams(temperature=1.0, top_p=p, seed=7) for p in top_ps]
        got = sample_at(logits, rows, [pos] * 4)
        alone = sample_at(logits[1:2], [SamplingParams(temperature=1.0, seed=7)], [pos])
        assert got[1] == alone[0]
        for b, t in enumerate(got):
            drawn[b].add(int(t))
    for b in (0, 2, 3):
        assert drawn[b] <= nucleus[b], b
    assert drawn[2] == {int(order[2, 0])}
    assert len(drawn[1]) > len(drawn[0])


def test_sample_at_masks_held_tokens_of_their_row_only():
    """`held` tokens cannot be drawn, greedy or sampled; rows without any draw as without
    `held`, and the caller's logits stay as they were."""
    rs = np.random.RandomState(1)
    logits = rs.randn(3, 40).astype(np.float32)
    top = logits.argmax(-1)
    before = logits.copy()
    params = [SamplingParams(), SamplingParams(temperature=1.0, seed=3), SamplingParams()]
    free = sample_at(logits, params, [5, 5, 5])
    got = sample_at(logits, params, [5, 5, 5], [[int(top[0])], [], []])
    np.testing.assert_array_equal(logits, before)
    assert got[0] != top[0] and got[0] == np.argsort(-logits[0])[1]
    assert list(got[1:]) == list(free[1:])
    # a sampled row never draws a held token, whatever its seed
    only = np.zeros((1, 4), np.float32)
    only[0, 2] = 50.0  # all the mass on token 2
    hot = SamplingParams(temperature=1.0, seed=0)
    drawn = {int(sample_at(only, [hot], [p], [[2]])[0]) for p in range(50)}
    assert 2 not in drawn and drawn


def test_a_decode_slot_draws_no_stop_token_before_min_tokens(tiny_runner):
    """On the device: a slot whose stop token is the model's greedy choice draws another one
    until it has `min_tokens` tokens, then the greedy one again; a slot without `min_tokens`
    (beside it, same stop token) draws exactly the greedy tokens."""
    cfg = tiny_runner.cfg
    prompt = np.random.RandomState(5).randint(0, cfg.vocab_size, 20).tolist()
    kv, logits = _prefill(tiny_runner, prompt)
    first = int(sample_at(logits, [SamplingParams()], [len(prompt)])[0])
    plain = Decoder(tiny_runner, slots=1, max_len=64)
    plain.insert(0, kv, len(prompt), first)
    greedy = [int(np.asarray(plain.advance())[0]) for _ in range(8)]
    stop = greedy[0]  # the token the model draws second: held back below
    held = SamplingParams(min_tokens=4)
    dec = Decoder(tiny_runner, slots=2, max_len=64)
    dec.insert(0, kv, len(prompt), first, sampling=held, stop_tokens=[stop, 256])
    dec.insert(1, kv, len(prompt), first, stop_tokens=[stop])
    out = np.array([np.asarray(dec.advance()) for _ in range(8)])  # [step, slot]
    assert list(out[:, 1]) == greedy  # no min_tokens: the same tokens as without stop tokens
    # generated token k = 1 + step; tokens 1..3 (k < 4) may not be a stop token
    assert stop not in out[:3, 0] and 256 not in out[:3, 0]
    assert out[0, 0] != greedy[0]
    dec.free(0)
    with pytest.raises(ValueError, match="at most 16 stop tokens"):
        dec.insert(0, kv, len(prompt), first, sampling=held, stop_tokens=range(17))


def test_scan_over_two_layer_kinds_equals_the_reference():
    """DeepSeek's dense then MoE layers are two scans; tokens equal the cache-free oracle."""
    runner = ModelRunner(dm.init_model(TINY_DEEPSEEK, seed=0))
    assert [(s, n) for _, s, n in runner.layer_runs] == [(0, 1), (1, 2)]
    prompt = list(range(3, 40))
    kv, logits = _prefill(runner, prompt)
    dec = Decoder(runner, slots=2, max_len=64)
    dec.insert(1, kv, len(prompt), int(logits[0].argmax()))
    out = [int(logits[0].argmax())]
    for _ in range(7):
        out.append(int(np.asarray(dec.advance())[1]))
    assert out == reference_generate(runner, prompt, 8)


def test_nothing_compiles_after_warmup_over_a_random_trace():
    """1,000 requests of random prompt and generation lengths through 8 slots of a small page
    pool (requests wait for pages): after `warmup()` the compile count stays flat. (One family:
    the shapes a decoder compiles do not depend on it.)"""
    tiny_runner = ModelRunner(dm.init_model(TINY_QWEN2, seed=0))
    cfg = tiny_runner.cfg
    dec = Decoder(tiny_runner, slots=8, max_len=128, page_size=16, num_pages=40)
    assert dec.warmup() > 0
    before = compile_count()
    rs = np.random.RandomState(7)
    todo = [(int(rs.randint(1, 100)), int(rs.randint(1, 9))) for _ in range(1000)]
    kv = np.zeros((cfg.num_layers, 128, cfg.kv_width), np.float32)
    warm = SamplingParams(temperature=0.5)
    left: dict[int, int] = {}
    done = steps = 0
    while todo or left:
        for slot in dec.free_slots():
            if not todo or not dec.can_insert(sum(todo[0])):
                break
            n, g = todo.pop(0)
            dec.insert(slot, kv, n, int(rs.randint(cfg.vocab_size)), n + g, sampling=warm)
            left[slot] = g
        tokens = np.asarray(dec.advance())
        steps += 1
        assert ((tokens >= 0) & (tokens < cfg.vocab_size))[list(left)].all()
        for slot in list(left):
            left[slot] -= 1
            if left[slot] <= 1:
                dec.free(slot)
                del left[slot]
                done += 1
    assert done == 1000 and dec.free_pages == dec.num_pages
    assert compile_count() == before, "a decode shape compiled after warm-up"


def test_a_warmed_step_copies_nothing_host_to_device(tiny_runner):
    prompt = list(range(5, 25))
    kv, logits = _prefill(tiny_runner, prompt)
    dec = Decoder(tiny_runner, slots=2, max_len=64)
    dec.warmup()
    dec.insert(0, kv, len(prompt), int(logits[0].argmax()), len(prompt) + 10)
    out = [int(logits[0].argmax()), int(np.asarray(dec.advance())[0])]  # uploads the insert
    with jax.transfer_guard_host_to_device("disallow_explicit"):
        pending = [dec.advance() for _ in range(6)]  # dispatched back to back
    out += [int(np.asarray(t)[0]) for t in pending]
    assert out == reference_generate(tiny_runner, prompt, 8)
    # A change does upload (and says so under the guard).
    dec.free(0)
    dec.insert(1, kv, len(prompt), 3)
    with (
        jax.transfer_guard_host_to_device("disallow_explicit"),
        pytest.raises(Exception, match="host"),
    ):
        dec.advance()


def test_a_slot_outgrowing_its_pages_takes_one_or_fails_clearly(tiny_runner):
    cfg = tiny_runner.cfg
    kv = np.zeros((cfg.num_layers, 16, cfg.kv_width), np.float32)
    dec = Decoder(tiny_runner, slots=2, max_len=64, page_size=8, num_pages=3)
    dec.insert(0, kv, 15, 1)  # 2 pages: tokens 0..15
    dec.insert(1, kv, 7, 1)  # 1 page: tokens 0..7, none left
    assert dec.free_pages == 0 and not dec.can_insert(1)
    dec.advance()  # slot 0 writes token 15, slot 1 token 7: both fit
    with pytest.raises(PagesExhausted, match="1 KV pages needed, 0 of 3 free"):
        dec.advance()
    dec.free(1)
    dec.advance()  # slot 0 takes the freed page
    assert len(dec.alloc.pages(0)) == 3


def test_new_parameters_reuse_the_compiled_step_and_take_effect():
    """`update_params` (an RL update) swaps the step's parameter leaves: nothing recompiles, and
    the next tokens are the new model's."""
    old, new = (dm.init_model(TINY_QWEN2, seed=s) for s in (0, 1))
    runner = ModelRunner(old)
    prompt = list(range(7, 30))
    dec = Decoder(runner, slots=1, max_len=64)
    dec.warmup()
    runner.update_params(new)
    kv, logits = _prefill(runner, prompt)
    before = compile_count()
    dec.insert(0, kv, len(prompt), int(logits[0].argmax()))
    out = [int(logits[0].argmax())] + [int(np.asarray(dec.advance())[0]) for _ in range(5)]
    assert compile_count() == before
    assert out == reference_generate(ModelRunner(new), prompt, 6)


@pytest.mark.parametrize("spread", [6.0, 0.5], ids=["peaked", "flat"])
def test_the_top_k_nucleus_of_a_large_vocabulary_is_the_sorted_one(spread):
    """Above `NUCLEUS_TOP_K` tokens the nucleus is cut from each row's most likely tokens when
    every row's lies among them (peaked rows) and from the sorted row otherwise (flat rows,
    whose nucleus is most of the vocabulary): either way the kept tokens are the sorted cut's."""
    from dualpath_jax.model import sampler

    v = 4 * sampler.NUCLEUS_TOP_K
    logits = np.random.RandomState(1).randn(5, v).astype(np.float32) * spread
    top_ps = np.asarray([0.5, 0.9, 1.0, 0.99, 1e-6], np.float32)
    got = np.asarray(sampler._nucleus(logits, top_ps))
    want = np.asarray(sampler._sorted_nucleus(logits, top_ps))
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want))
    np.testing.assert_array_equal(got[np.isfinite(got)], want[np.isfinite(want)])
    kept = np.isfinite(got).sum(-1)
    assert kept[2] == v and kept[4] == 1  # top-p 1 keeps the row, a tiny one the top token
    if spread > 1:
        assert kept.max(initial=0, where=top_ps < 1) <= sampler.NUCLEUS_TOP_K
    else:
        assert kept[1] > sampler.NUCLEUS_TOP_K  # the fallback's case


def test_a_greedy_batch_draws_the_argmax_without_random_numbers():
    """`draw_rows` skips the random draw when no row samples; a mixed batch's greedy rows are
    still their argmax and its sampled rows are what they were drawn as alone."""
    from dualpath_jax.model import sampler

    logits = np.random.RandomState(2).randn(3, 300).astype(np.float32)
    seeds, pos = np.arange(3, dtype=np.uint32), np.arange(3, dtype=np.int32)
    ones = np.ones(3, np.float32)
    tokens, _ = sampler.draw_rows(logits, seeds, pos, np.zeros(3, np.float32), ones)
    np.testing.assert_array_equal(np.asarray(tokens), logits.argmax(-1))
    mixed = np.asarray([0.0, 0.8, 0.0], np.float32)
    tokens, _ = sampler.draw_rows(logits, seeds, pos, mixed, ones)
    alone, _ = sampler.draw_rows(logits, seeds, pos, np.full(3, 0.8, np.float32), ones)
    assert np.asarray(tokens)[[0, 2]].tolist() == logits.argmax(-1)[[0, 2]].tolist()
    assert int(np.asarray(tokens)[1]) == int(np.asarray(alone)[1])


def test_a_step_computes_log_probabilities_only_when_a_slot_asks(tiny_runner):
    """`advance` returns the drawn tokens' log-probabilities when an active slot asks for them
    (`SamplingParams.logprobs`), zeros when none does; the tokens are the same either way."""
    from dualpath_jax.model.sampler import chosen_logprobs

    rs = np.random.RandomState(5)
    prompt = rs.randint(0, tiny_runner.cfg.vocab_size, 20).tolist()
    kv, _ = _prefill(tiny_runner, prompt)
    plain, asking = (Decoder(tiny_runner, slots=2, max_len=64) for _ in range(2))
    plain.insert(0, kv, len(prompt), 5)
    asking.insert(0, kv, len(prompt), 5, sampling=SamplingParams(logprobs=0))
    for _ in range(3):
        assert np.asarray(plain.advance()).tolist() == np.asarray(asking.advance()).tolist()
        assert not np.asarray(plain.logprobs).any()
        logits = asking.logits
        want = chosen_logprobs(logits, logits, jax.numpy.argmax(logits, -1))
        np.testing.assert_allclose(np.asarray(asking.logprobs)[0], np.asarray(want)[0], rtol=1e-6)
        assert np.asarray(asking.logprobs)[0, 1] < 0
