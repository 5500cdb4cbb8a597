"""`bench/peer_vllm.py` without vLLM: the checkpoint it writes is one this project serves (its
BPE tokenizer has the vocabulary asked for), its load is the workload it describes, and its
report compares each figure with vLLM's against the targets and counts the equal turns."""

from __future__ import annotations

import numpy as np
import pytest
from absl import flags


@pytest.fixture
def peer(bench_modules):
    with bench_modules("peer_vllm") as (module,):
        if not flags.FLAGS.is_parsed():
            flags.FLAGS(["peer_vllm"])
        yield module


def _run(tpot: float, req: float, tokens: dict) -> dict:
    load = {"ttft_first_p50_ms": 100.0, "ttft_later_p50_ms": 50.0, "ttft_later_p90_ms": 60.0,
            "tpot_p50_ms": tpot, "req_per_s": req, "out_tok_per_s": 32 * req}  # fmt: skip
    return {"ready_s": 30.0, "loads": {"4": load, "1": load}, "tokens": {"4": tokens, "1": tokens}}


def test_the_report_gives_ratios_against_the_targets_and_equal_turns(peer):
    ref = {"s0": [[1, 2], [3, 4]]}
    runs = {
        "vllm": [_run(5.0, 10.0, ref)],
        "dualpath": [_run(7.0, 7.0, ref), _run(8.0, 6.0, {"s0": [[1, 2], [3, 5]]})],
    }
    lines = peer.ratios(runs)
    assert "ready: 1.00x vLLM (target <= 1.0x): met" in lines
    assert "K=4 tpot_p50_ms: 1.50x vLLM (target <= 1.5x): met" in lines  # median of 7 and 8
    assert "K=1 req_per_s: 0.65x vLLM (target >= 0.67x): NOT met" in lines
    assert peer.same_tokens(runs) == {"4": "3/4", "1": "3/4"}
    table = peer.table(runs)
    assert "| K=4 time per output token p50 (ms) | 5 | 7 / 8 |" in table


def test_the_load_is_the_described_workload(peer):
    trajs = peer.plan(3, "x", np.random.RandomState(0), 2048)
    assert [tid for tid, _ in trajs] == ["x-s0", "x-s1", "x-s2"]
    rounds = trajs[0][1]
    assert [len(a) for a, _ in rounds] == [1340] + [134] * 5 and {g for _, g in rounds} == {32}
    ids = np.concatenate([a for _, r in trajs for a, _ in r])
    assert ids.min() >= 3 and ids.max() < 2048  # never a special token


@pytest.mark.hf
def test_the_checkpoint_is_a_qwen2_this_project_serves(peer, tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("torch")
    n = peer.write_checkpoint(tmp_path, vocab=300, hidden=64, layers=2, seed=0)
    assert 0 < n < 200_000
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert len(tok) == 300 and tok.decode(tok.encode("the decode engine")) == "the decode engine"
    from dualpath_jax.model.checkpoint import from_pretrained

    net = from_pretrained(tmp_path)
    assert net.cfg.vocab_size == 300 and net.cfg.num_layers == 2
