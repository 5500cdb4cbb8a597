"""`bench/accel_memory.py` at the tiny presets: the figures' structure, not their values."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"


@pytest.fixture(scope="module")
def accel_memory(bench_modules):
    with bench_modules("accel_memory") as (module,):
        yield module


@pytest.mark.slow  # a benchmark script's run: the full tier
def test_measure_at_tiny_shapes(accel_memory):
    results = accel_memory.measure(accel_memory.TINY)
    assert list(results) == ["reference", "xla", "pallas"] == list(accel_memory.BACKENDS)
    for figs in results.values():
        assert list(figs) == list(accel_memory.FIGURES)
        for fig, r in figs.items():
            for key in ("temp", "argument", "output"):
                assert type(r[key]) is int and r[key] > 0, (fig, key, r[key])
            assert 0 < r["real"] <= 1, fig
        # The ragged batch is padded to its longest new length: 3 requests, more scratch than one.
        assert figs["prefill_ragged8"]["temp"] > figs["prefill_7b"]["temp"]
        assert figs["prefill_ragged8"]["shapes"].startswith("B=3 ")
    # The paged kernel attends over live pages only: less scratch than the dense oracle where
    # the dense path pads slots to the longest one.
    assert results["pallas"]["decode_64"]["temp"] < results["reference"]["decode_64"]["temp"]
    out = accel_memory.temps(results)
    assert json.loads(json.dumps(out)) == {
        b: {f: figs[f]["temp"] for f in figs} for b, figs in results.items()
    }


@pytest.mark.slow  # a benchmark script's run: the full tier
def test_json_flag_prints_one_object():
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, str(BENCH / "accel_memory.py"), "--tiny", "--json"],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=120,
        check=True,
    )
    obj = json.loads(proc.stdout)  # the whole of stdout is one JSON object
    assert list(obj) == ["reference", "xla", "pallas"]
    for figs in obj.values():
        assert list(figs) == ["prefill_7b", "prefill_ragged8", "mla_prefill", "decode_64"]
        assert all(type(v) is int and v > 0 for v in figs.values())
