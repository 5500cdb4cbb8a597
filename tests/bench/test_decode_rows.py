"""`bench/decode_rows.py`: every figure of a small run, side by side (a smoke test: no timing
is asserted), the whole-gather figure's runner tracing the gather and the others the chunks."""

from __future__ import annotations

import json

from absl import flags


def test_a_small_run_gives_every_figure(bench_modules, capsys):
    with bench_modules("decode_rows") as (bench,):
        flags.FLAGS(
            ["decode_rows", "--active=1,2", "--slots=2", "--max_len=256", "--context=40",
             "--steps=2", "--dispatches=1", "--json"]
        )  # fmt: skip
        try:
            bench.main([])
        finally:
            flags.FLAGS.unparse_flags()
        chunked = bench.paged_decode.paged_decode_chunked
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [r["active"] for r in report["rows"]] == [1, 2]
    for r in report["rows"]:
        assert set(r) == {
            "active",
            "every_slot_ms",
            "whole_gather_ms",
            "active_rows_ms",
            "multi_2_ms",
        }
        assert all(v > 0 for k, v in r.items() if k != "active")
    assert chunked.__name__ == "paged_decode_chunked"  # put back after the gather figure
