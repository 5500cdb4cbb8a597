"""`bench/group_sampling.py` at tiny shapes on an in-process 1P1D cluster: every mode draws the
same tokens. `fork` prefills the prompt once and each other sample computes only its last token
on the decode engine, reading nothing; `store` prefills it once (the prefix round) and each
sample reads it and computes the tail after the last whole block; separate sessions each compute
the whole prompt. The store holds the prompt's blocks once either way; the groups write them
once."""

from __future__ import annotations

import pytest

PROMPT, GEN, GROUP, BT = 100, 2, 3, 16  # 6 whole blocks and a 4-token tail


@pytest.fixture(scope="module")
def group_sampling(bench_modules):
    with bench_modules("group_sampling") as (module,):
        yield module


def test_group_sampling_against_separate_sessions(group_sampling, tmp_path):
    import dataclasses

    cfg = group_sampling.default_config(PROMPT, GEN, GROUP)
    cfg = dataclasses.replace(cfg, store=dataclasses.replace(cfg.store, block_tokens=BT))
    out = group_sampling.run(cfg, tmp_path, "thread", PROMPT, GEN, GROUP, repeats=1)
    f, g, s = out["fork"], out["store"], out["separate"]
    assert out["identical_tokens"]
    tail = PROMPT % BT
    # fork: the first sample computes the prompt, each other one its last token
    assert f["rounds"] == GROUP
    assert f["computed_per_round"] == [PROMPT] + [1] * (GROUP - 1)
    # store: the prefix round computes the prompt, each sample its tail
    assert g["rounds"] == GROUP + 1
    assert g["computed_per_round"] == [PROMPT] + [tail] * GROUP
    assert g["prefill_tokens_computed"] == PROMPT + GROUP * tail
    assert s["rounds"] == GROUP
    assert s["prefill_tokens_computed"] + s["cached_tokens"] == GROUP * PROMPT
    assert s["prefill_tokens_computed"] > g["prefill_tokens_computed"]
    # the store keys blocks by content: the prompt's 6 blocks, once in every mode
    blocks = PROMPT // BT
    assert f["kv_block_files"] == g["kv_block_files"] == s["kv_block_files"] == blocks
    assert f["kv_bytes_stored"] == g["kv_bytes_stored"] == s["kv_bytes_stored"] > 0
    # ... but separate sessions each write them (unless one was stored before another began)
    per_block = g["kv_bytes_written"] // blocks
    assert f["kv_bytes_written"] == g["kv_bytes_written"] == blocks * per_block
    assert s["kv_bytes_written"] == (GROUP * blocks - s["cached_tokens"] // BT) * per_block
    assert g["kv_bytes_read"] == GROUP * blocks * per_block  # each sample reads the prompt
    assert f["kv_bytes_read"] == 0  # the forks read nothing: the prompt is in the DE's pages
    ratios = out["vs_separate"]
    assert ratios["fork"]["prefill"] > ratios["store"]["prefill"] > 1
    assert ratios["fork"]["wall"] > 0 and ratios["store"]["wall"] > 0
