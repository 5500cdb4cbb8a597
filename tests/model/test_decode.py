"""Decode after layerwise prefill equals the cache-free reference generation."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from dualpath_jax.model.decode import Decoder
from dualpath_jax.model.generation import generate, reference_generate
from dualpath_jax.model.runner import PrefillBatch
from dualpath_jax.model.sampler import sample
from dualpath_jax.model.sampling_params import SamplingParams


def test_generate_equals_reference(family_runner):
    cfg = family_runner.cfg
    rs = np.random.RandomState(0)
    prompts = [rs.randint(0, cfg.vocab_size, n).tolist() for n in (3, 29, 70)]
    got = generate(family_runner, prompts, 10)
    assert got == [reference_generate(family_runner, p, 10) for p in prompts]


def test_decode_after_layerwise_prefill(family_runner):
    """Cached prefix KV from the 'store' + layerwise prefill of the new tokens + decode."""
    cfg = family_runner.cfg
    rs = np.random.RandomState(1)
    prompt = rs.randint(0, cfg.vocab_size, 80).tolist()
    g = 12
    want = reference_generate(family_runner, prompt, g)
    # Stored KV of the first 64 tokens (one full block), as a previous turn would have left it.
    _, prefix_kv = family_runner.prefill_monolithic(PrefillBatch.build(cfg, [prompt[:64]], [0]))
    prefix_kv = np.asarray(prefix_kv[:, 0, :64])
    batch = PrefillBatch.build(cfg, [prompt[64:]], [64])
    new = {}
    res = family_runner.prefill_layerwise(
        batch, lambda i: prefix_kv[i][None], lambda i, r: new.__setitem__(i, np.asarray(r[0, :16]))
    )
    kv = np.concatenate([prefix_kv, np.stack([new[i] for i in range(cfg.num_layers)])], axis=1)
    dec = Decoder(family_runner, slots=2, max_len=256)
    first = int(np.asarray(sample(res.last_logits))[0])
    dec.insert(1, kv, len(prompt), first)
    out = [first]
    for _ in range(g - 1):
        nxt = np.asarray(sample(dec.step()))
        out.append(int(nxt[1]))
        dec.set_next(nxt)
    assert out == want


def test_continuous_batching_with_slot_reuse(family_runner):
    """Slots joining and leaving mid-run do not disturb each other."""
    cfg = family_runner.cfg
    rs = np.random.RandomState(2)
    prompts = [rs.randint(0, cfg.vocab_size, n).tolist() for n in (10, 40, 25)]
    g = [8, 5, 6]
    want = [reference_generate(family_runner, p, n) for p, n in zip(prompts, g)]
    dec = Decoder(family_runner, slots=2, max_len=128)

    def admit(idx, slot):
        res, kv = family_runner.prefill_monolithic(PrefillBatch.build(cfg, [prompts[idx]], [0]))
        first = int(np.asarray(sample(res.last_logits))[0])
        dec.insert(slot, np.asarray(kv[:, 0]), len(prompts[idx]), first)
        return [first]

    outs = {0: admit(0, 0), 1: admit(1, 1)}
    slot_of = {0: 0, 1: 1}
    while any(len(outs[i]) < g[i] for i in outs) or 2 not in outs:
        nxt = np.array(sample(dec.step()))
        for i, s in list(slot_of.items()):
            outs[i].append(int(nxt[s]))
            if len(outs[i]) == g[i]:
                dec.free(s)
                del slot_of[i]
                if 2 not in outs:
                    outs[2] = admit(2, s)
                    slot_of[2] = s
                    nxt[s] = outs[2][0]
        dec.set_next(nxt)
    assert [outs[i] for i in range(3)] == want


def test_sampling():
    logits = jax.numpy.array([[0.0, 5.0, 1.0], [3.0, 0.0, 0.0]])
    assert np.asarray(sample(logits)).tolist() == [1, 0]
    # A tiny top_p keeps only the best token.
    top = sample(logits, SamplingParams(temperature=1.0, top_p=1e-6), jax.random.key(3))
    assert np.asarray(top).tolist() == [1, 0]
    key = jax.random.key(7)
    p = SamplingParams(temperature=2.0, top_p=0.9)
    assert np.array_equal(np.asarray(sample(logits, p, key)), np.asarray(sample(logits, p, key)))
    with pytest.raises(ValueError, match="PRNG key"):
        sample(logits, SamplingParams(temperature=1.0))
    with pytest.raises(ValueError):
        SamplingParams(top_p=0.0)


def test_generate_exact_g_and_eos(tiny_runner):
    cfg = tiny_runner.cfg
    prompt = [5, 6, 7]
    full = generate(tiny_runner, [prompt], 6)[0]
    assert len(full) == 6  # exactly g, whatever the tokens are
    stopped = generate(tiny_runner, [prompt], 6, eos_id=full[2])[0]
    assert stopped == full[: full.index(full[2]) + 1]
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(tiny_runner, [prompt], 0)
    with pytest.raises(ValueError, match="max_seq_len"):
        generate(tiny_runner, [prompt], cfg.max_seq_len)


def test_decoder_bad_inputs(tiny_runner):
    cfg = tiny_runner.cfg
    dec = Decoder(tiny_runner, slots=1, max_len=32)
    with pytest.raises(ValueError, match="no active slot"):
        dec.step()
    with pytest.raises(ValueError, match="prompt KV has shape"):
        dec.insert(0, np.zeros((cfg.num_layers + 1, 4, cfg.kv_width), np.float32), 4, 1)
    with pytest.raises(ValueError, match="does not fit"):
        dec.insert(0, np.zeros((cfg.num_layers, 40, cfg.kv_width), np.float32), 40, 1)
    with pytest.raises(ValueError, match="out of range"):
        dec.insert(0, np.zeros((cfg.num_layers, 4, cfg.kv_width), np.float32), 4, cfg.vocab_size)
    dec.insert(0, np.zeros((cfg.num_layers, 4, cfg.kv_width), np.float32), 4, 1)
    with pytest.raises(ValueError, match="in use"):
        dec.insert(0, np.zeros((cfg.num_layers, 4, cfg.kv_width), np.float32), 4, 1)


def test_greedy_tokens_on_device_equal_the_host_argmax_ties_included():
    import jax.numpy as jnp

    from dualpath_jax.model.sampler import _greedy, greedy_tokens

    rng = np.random.default_rng(0)
    logits = rng.standard_normal((6, 257)).astype(np.float32)
    logits[2, [5, 9, 200]] = 10.0  # a three-way tie: the lowest id wins
    logits[4] = 0.0  # all equal
    host = logits.argmax(-1)
    assert host[2] == 5 and host[4] == 0
    assert np.asarray(_greedy(jnp.asarray(logits))).tolist() == host.tolist()
    assert greedy_tokens(jnp.asarray(logits)).tolist() == host.tolist()
    assert greedy_tokens(logits).dtype == np.int32
