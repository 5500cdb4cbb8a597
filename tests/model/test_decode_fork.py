"""Forks of one prompt in a decoder (group sampling on a decode engine): a slot started from a
prompt another slot holds shares its whole pages, copies its last one, and draws the tokens a
slot inserted from the prompt's prefill would; pages return to the pool when the last holder
lets go, and nothing a fork writes reaches the shared pages."""

from __future__ import annotations

import numpy as np
import pytest

from dualpath_jax.model.decode import Decoder
from dualpath_jax.model.generation import reference_generate
from dualpath_jax.model.page_pool import PageAllocator, PagesExhausted
from dualpath_jax.model.runner import PrefillBatch
from dualpath_jax.model.sampler import sample_at
from dualpath_jax.model.sampling_params import SamplingParams

PS = 16


def _prefill(runner, prompt):
    res, kv = runner.prefill_monolithic(PrefillBatch.build(runner.cfg, [prompt], [0]))
    return np.asarray(kv[:, 0]), np.asarray(res.last_logits)


def _run(dec, slots, n):
    """`n` steps' tokens of each slot in `slots`, drawn on the device (`advance`)."""
    out = {s: [] for s in slots}
    for _ in range(n):
        got = np.asarray(dec.advance())
        for s in slots:
            out[s].append(int(got[s]))
    return out


def test_shared_pages_return_to_the_pool_with_their_last_owner():
    a = PageAllocator(6)
    first = a.allocate(0, 3)
    a.share("hold", first[:2])
    a.share(1, first[:2])
    assert [a.owners(p) for p in first] == [3, 3, 1]
    assert a.free(0) == 1 and a.free_pages == 4  # only the page no one else holds
    assert a.free("hold") == 0 and a.free(1) == 2 and a.free_pages == 6
    with pytest.raises(ValueError, match="not allocated"):
        a.share(2, [first[0]])


@pytest.mark.parametrize("length", [70, 64, 1])
def test_greedy_forks_generate_the_reference_tokens(family_runner, length):
    """Prompts whose last token starts a page, ends one, or is alone: every fork's tokens are
    the reference's, after the prompt's slot was freed (its hold keeps the pages)."""
    cfg = family_runner.cfg
    prompt = np.random.RandomState(length).randint(0, cfg.vocab_size, length).tolist()
    want = reference_generate(family_runner, prompt, 6)
    dec = Decoder(family_runner, slots=3, max_len=128, page_size=PS)
    kv, logits = _prefill(family_runner, prompt)
    first = int(np.argmax(logits[0]))
    dec.insert(0, kv, length, first, reserve_tokens=length + 6)
    dec.hold("g", 0, length)
    dec.free(0)  # the prompt's own round ended before its forks started
    dec.fork(1, "g", length, prompt[-1], reserve_tokens=length + 6)
    got = _run(dec, [1], 6)
    assert got[1] == want
    dec.free(1)
    assert dec.free_pages == dec.num_pages


def test_sampled_forks_draw_what_a_prefilled_slot_draws(tiny_runner):
    """G forks with their own seeds, beside the prompt's slot still decoding: each draws the
    tokens a slot inserted from the prompt's prefill (its first token by `sample_at` at the
    prompt's length) draws with those params; the prompt's slot is not disturbed."""
    cfg = tiny_runner.cfg
    prompt = np.random.RandomState(5).randint(0, cfg.vocab_size, 41).tolist()
    n, gen = len(prompt), 7
    params = [SamplingParams(temperature=1.0, seed=s) for s in (3, 4, 5)]
    kv, logits = _prefill(tiny_runner, prompt)

    ref = Decoder(tiny_runner, slots=3, max_len=128, page_size=PS)
    want = {}
    for slot, p in enumerate(params):
        first = int(sample_at(logits, [p], [n])[0])
        ref.insert(slot, kv, n, first, reserve_tokens=n + gen, sampling=p)
        want[slot] = [first]
    for s, toks in _run(ref, [0, 1, 2], gen - 1).items():
        want[s] += toks

    dec = Decoder(tiny_runner, slots=3, max_len=128, page_size=PS)
    dec.insert(0, kv, n, want[0][0], reserve_tokens=n + gen, sampling=params[0])
    for slot in (1, 2):
        dec.hold(("g", slot), 0, n)
    before = dec.full_blocks(0, 0, n // PS).copy()
    used = dec.alloc.used_pages
    dec.fork(1, ("g", 1), n, prompt[-1], reserve_tokens=n + gen, sampling=params[1])
    dec.fork(2, ("g", 2), n, prompt[-1], reserve_tokens=n + gen, sampling=params[2])
    # the forks took only the prompt's last page and the pages after it
    assert dec.alloc.used_pages - used == 2 * dec.fork_pages(n, n + gen)
    got = _run(dec, [0, 1, 2], gen)
    assert got[0][: gen - 1] == want[0][1:]  # the prompt's slot went on undisturbed
    assert got[1] == want[1] and got[2] == want[2]
    np.testing.assert_array_equal(dec.full_blocks(0, 0, n // PS), before)
    for s in (0, 1, 2):
        dec.free(s)
    assert dec.free_pages == dec.num_pages


def test_a_fork_that_does_not_fit_changes_nothing(tiny_runner):
    cfg = tiny_runner.cfg
    prompt = list(range(1, 40))
    dec = Decoder(tiny_runner, slots=2, max_len=64, page_size=PS, num_pages=5)
    kv, logits = _prefill(tiny_runner, prompt)
    dec.insert(0, kv, len(prompt), 1, reserve_tokens=64)
    dec.hold("g", 0, len(prompt))
    free = dec.free_pages
    with pytest.raises(PagesExhausted):
        dec.fork(1, "g", len(prompt), prompt[-1], reserve_tokens=64)
    assert dec.free_pages == free and not dec.active[1]
    with pytest.raises(ValueError, match="cannot hold"):
        dec.hold("h", 0, len(prompt) + 1)
    dec.release("g")
    dec.free(0)
    assert dec.free_pages == dec.num_pages
    assert cfg.vocab_size > 40
