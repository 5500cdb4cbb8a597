"""`bench/decode_rows.py`: every figure of a small run, side by side (a smoke test: no timing
is asserted). In a process of its own: its absl flags would clash with other bench scripts'."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_a_small_run_gives_every_figure():
    out = subprocess.run(
        [sys.executable, "bench/decode_rows.py", "--active=1,2", "--slots=2", "--max_len=256",
         "--context=40", "--steps=2", "--dispatches=1", "--json"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
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
