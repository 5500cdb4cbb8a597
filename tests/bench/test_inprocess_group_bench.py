"""`bench/inprocess_group.py` at tiny shapes: the group and the one-by-one rounds draw the same
tokens, and the group computes the append once."""

from __future__ import annotations


def test_inprocess_group_against_separate_rounds(bench_modules):
    with bench_modules("inprocess_group") as (module,):
        out = module.run(group=3, append=40, gen=4, repeats=1)
    assert out["identical_tokens"]
    assert out["group"]["prompt_tokens_computed"] == 40 + 2
    assert out["separate"]["prompt_tokens_computed"] == 3 * 40
    assert out["separate_over_group"] > 0 and len(out["group"]["wall_s_all"]) == 1
