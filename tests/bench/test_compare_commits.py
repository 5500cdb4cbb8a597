"""`bench/compare_commits.py`: the two revisions' demo runs summed up (medians per revision,
Basic/DualPath, ratios B / A, compiled programs, tokens against the first revision's)."""

from __future__ import annotations

import json

import pytest


def run(jct: dict[str, float], prefill: float, tokens: dict, programs: int) -> dict:
    return {
        "wall_s": 100.0,
        "compiled_programs": programs,
        "tokens_identical_across_policies": True,
        "policies": {
            p: {"jct_s": j, "prefill_s": prefill, "kv_read_s": 0.1, "tpot_s": 0.02}
            for p, j in jct.items()
        },
        "outputs": tokens,
    }


def test_summary_takes_medians_and_ratios_and_checks_tokens(bench_modules, monkeypatch):
    with bench_modules("compare_commits") as (cc,):
        monkeypatch.setattr(cc, "_git", lambda *a: "abc1234")
        same = {"basic": {"t0": [[1, 2]]}, "dualpath": {"t0": [[1, 2]]}}
        other = {"basic": {"t0": [[1, 3]]}, "dualpath": {"t0": [[1, 3]]}}
        runs = {
            "A": [run({"basic": 90, "dualpath": 40}, 0.3, same, 50)] * 2
            + [run({"basic": 99, "dualpath": 60}, 0.9, same, 52)],
            "B": [run({"basic": 95, "dualpath": 50}, 0.6, other, 70)],
        }
        s = cc.summarize(["A", "B"], runs)
        a, b = s["revisions"]["A"], s["revisions"]["B"]
        assert (
            a["policies"]["basic"]["jct_s"] == 90 and a["policies"]["dualpath"]["prefill_s"] == 0.3
        )
        assert a["basic_over_dualpath"] == pytest.approx(90 / 40)
        assert a["compiled_programs"] == 50 and b["compiled_programs"] == 70
        assert a["tokens_equal_first_revision"] and not b["tokens_equal_first_revision"]
        assert s["b_over_a"]["dualpath"]["jct_s"] == pytest.approx(50 / 40)
        assert s["b_over_a"]["basic"]["prefill_s"] == pytest.approx(2.0)
        text = cc.table(s)
        assert "Basic/DualPath 2.25x" in text and "equal to the first revision's: False" in text
        json.dumps(s)  # the --json output
