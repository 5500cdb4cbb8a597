"""`bench/moe_memory.py` at the tiny preset: the figures' structure, not their values."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from dualpath_jax.model.moe import MOE_IMPLS

ROOT = pathlib.Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"


@pytest.fixture(scope="module")
def moe_memory(bench_modules):
    with bench_modules("moe_memory") as (module,):
        yield module


@pytest.mark.slow  # a benchmark script's run: the full tier
def test_measure_at_tiny_shapes(moe_memory):
    results = moe_memory.measure(moe_memory.TINY)
    assert list(results) == list(MOE_IMPLS)
    for impl, r in results.items():
        for key in ("temp", "argument", "output"):
            assert type(r[key]) is int and r[key] > 0, (impl, key, r[key])
    # Same layer, same input and output: only the scratch differs.
    assert len({(r["argument"], r["output"]) for r in results.values()}) == 1
    assert moe_memory.temps(results) == {impl: r["temp"] for impl, r in results.items()}


@pytest.mark.slow  # a benchmark script's run: the full tier
def test_json_flag_prints_one_object():
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, str(BENCH / "moe_memory.py"), "--tiny", "--json"],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=120,
        check=True,
    )
    obj = json.loads(proc.stdout)  # the whole of stdout is one JSON object
    assert list(obj) == ["ragged_dot", "grouped", "gmm"]
    assert all(type(v) is int and v > 0 for v in obj.values())
