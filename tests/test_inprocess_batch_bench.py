"""`bench/inprocess_batch.py` at tiny sizes: the figures' structure, not their values."""

from __future__ import annotations


def test_measure_compares_slots_with_one_slot(bench_modules):
    with bench_modules("inprocess_batch") as (module,):
        r = module.measure(trajectories=3, rounds=2, slots=(3,), hidden=64, layers=2)
    assert list(r["slots"]) == [1, 3]
    assert all(row["same_tokens"] and row["seconds"] > 0 for row in r["slots"].values())
    assert r["slots"][1]["speedup"] == 1.0
