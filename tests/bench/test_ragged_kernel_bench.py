"""`bench/ragged_kernel.py` at small lengths: the ragged call gives the padded call's real rows
(zeros for padding) and its GPU plan attends fewer key rows."""

from __future__ import annotations


def test_the_ragged_bench_gives_the_same_rows_for_less(bench_modules):
    with bench_modules("ragged_kernel") as (module,):
        res = module.run(scale=64, repeats=1)
    assert res["interpret"]["same_real_rows"]
    keys = res["key_rows"]
    assert 0 < keys["ragged"] < keys["padded"]
    # the requests' own (query, key-block) work is all that is left: at least each real
    # query block over its request's cached keys
    assert keys["ragged"] >= sum(-(-c // 128) * 128 * -(-n * 8 // 64) for n, c in res["requests"])
