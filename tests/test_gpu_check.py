"""`bench/gpu_check.py` at `--quick` on CPU: the checks that must work without an accelerator give
numbers (the figures' structure, not their values), a failing check is recorded and the run goes
on, and the FLOP/byte model counts a tiny model as by hand."""

from __future__ import annotations

import dataclasses
import json

import pytest

from dualpath_jax.presets import TINY_QWEN2

# `memory` and `dispatch` call bench/accel_memory.py and bench/decode_dispatch.py, whose own
# tests (tests/model/) run those measurements at tiny sizes; here they would only add minutes.
ON_CPU = ("kernel", "kernel_steps", "greedy", "roofline", "sharded", "layerwise", "h2d", "channel")


@pytest.fixture(scope="module")
def gpu_check(bench_modules):
    # The checks import their sibling scripts when they run: keep bench/ on the path meanwhile.
    with bench_modules("gpu_check") as (module,):
        yield module


@pytest.mark.slow  # a benchmark script's run: the full tier
def test_quick_run_on_cpu_gives_every_figure(gpu_check, tmp_path):
    assert list(gpu_check.CHECKS) == [
        "kernel", "greedy", "memory", "dispatch", "roofline", "kernel_steps", "layerwise", "h2d",
        "channel", "sharded",
    ]  # fmt: skip
    result = gpu_check.run(tmp_path, quick=True, names=ON_CPU)
    saved = json.loads((tmp_path / "gpu_check.json").read_text())
    assert saved == json.loads(json.dumps(result))
    assert set(saved) == {"device", "backend", "jax", "jaxlib", "check_seconds", *ON_CPU}
    assert set(saved["check_seconds"]) == set(ON_CPU)
    for name in ON_CPU:
        assert "error" not in saved[name], saved[name]

    assert set(saved["kernel"]) == {"gqa_decode", "mla_prefill"}
    steps = saved["kernel_steps"]
    for case in ("decode_64", "prefill_2048"):
        assert set(steps[case]) == {"pages_1_ms", "pages_2_ms", "pages_4_ms"}
        assert all(v > 0 for v in steps[case].values())
    assert steps["ragged8"]["padded_ms"] > 0 and steps["ragged8"]["ragged_ms"] > 0
    assert all(0 <= v < 0.1 for v in saved["kernel"].values()), saved["kernel"]

    greedy = saved["greedy"]
    assert {"qwen2/reference/ragged_dot", "qwen2/pallas/ragged_dot"} <= set(greedy)
    assert all(v["tokens_equal"] is True for v in greedy.values()), greedy

    roof = saved["roofline"]
    assert roof["device_kind"] not in gpu_check.PEAKS  # a CPU: no peak, no fractions
    assert roof["peak_flops"] is None and roof["peak_bytes_per_s"] is None
    for phase in ("prefill", "decode"):
        p = roof[phase]
        assert p["seconds"] > 0 and p["flops_per_s"] > 0 and p["bytes_per_s"] > 0, p
        assert p["flops_fraction"] is None and p["bytes_fraction"] is None
    d, quick_model = roof["decode"], dataclasses.replace(TINY_QWEN2, num_layers=2)
    assert d["flops"] == gpu_check.step_cost(quick_model, d["slots"], 1, d["context"])[0]

    sh = saved["sharded"]  # one CPU device here: a mesh of one
    assert sh["mesh"] == "tensor=1" and sh["devices"] == 1
    assert sh["max_param_bytes_per_device"] == sh["param_bytes"] > 0
    assert sh["prefill"]["seconds"] > 0 and sh["decode"]["seconds"] > 0

    lw = saved["layerwise"]
    assert lw["program_vs_resident"] > 0 and lw["loop_vs_resident"] > 0
    assert 0 <= lw["program_overlap"] <= 1 and 0 <= lw["loop_overlap"] <= 1

    assert saved["h2d"]["bytes"] == 4 << 20
    assert saved["h2d"]["pageable_gb_s"] > 0 and saved["h2d"]["pinned_gb_s"] > 0
    assert saved["channel"]["intact"] is True and saved["channel"]["gb_s"] > 0

    lines = gpu_check.table(result).splitlines()
    assert lines[0].startswith("device: ")
    assert {line.split()[0] for line in lines[1:]} == set(ON_CPU)
    assert not any("ERROR" in line or "no summary" in line for line in lines)


def test_json_prints_one_object(tmp_path):
    import os
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parents[1]
    proc = subprocess.run(
        [sys.executable, str(root / "bench" / "gpu_check.py"), "--quick", "--only=h2d", "--json",
         f"--out={tmp_path}"],
        capture_output=True, text=True, check=True, cwd=root,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
    )  # fmt: skip
    out = json.loads(proc.stdout)  # the whole of stdout: one object
    assert out["jax"] and out["jaxlib"] and out["backend"] == "cpu"
    assert out["h2d"]["pinned_gb_s"] > 0 and set(out["check_seconds"]) == {"h2d"}


def test_a_failing_check_is_recorded_and_the_run_goes_on(gpu_check, tmp_path):
    def broken(quick):
        raise RuntimeError("no such device")

    checks = {"broken": broken, "h2d": gpu_check.CHECKS["h2d"]}
    result = gpu_check.run(tmp_path, quick=True, checks=checks)
    assert "RuntimeError: no such device" in result["broken"]["error"]
    assert result["h2d"]["pinned_gb_s"] > 0
    assert "broken     ERROR RuntimeError: no such device" in gpu_check.table(result)
    with pytest.raises(ValueError, match="unknown checks"):
        gpu_check.run(tmp_path, quick=True, names=["kernels"])


def test_step_cost_counts_the_tiny_model_by_hand(gpu_check):
    # Tiny Qwen2: hidden 64, 4 query / 2 KV heads of 16, MLP 96, vocab 257, 3 layers, float32.
    layer = 64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 96  # q, k and v, o, SwiGLU: 30,720
    head = 257 * 64
    weights = (3 * layer + head) * 4  # no embedding table: a step reads one row per token
    pair = 4 * 4 * 16  # QK^T and PV of one (query, key) pair in one layer
    row = 2 * 2 * 16 * 4  # one token's K and V of one layer

    # Prefill: 2 requests of 8 new tokens after 16 cached: 8 * 16 + (1 + ... + 8) pairs each.
    flops, nbytes = gpu_check.step_cost(TINY_QWEN2, batch=2, new=8, cached=16)
    assert flops == 2 * (2 * 3 * layer * 8 + 2 * head + 3 * pair * (8 * 16 + 36))
    assert nbytes == weights + 2 * 3 * 16 * row
    # A decode step of 5 slots at 100 cached tokens: each attends 101 keys.
    flops, nbytes = gpu_check.step_cost(TINY_QWEN2, batch=5, new=1, cached=100)
    assert flops == 5 * (2 * 3 * layer + 2 * head + 3 * pair * 101)
    assert nbytes == weights + 5 * 3 * 100 * row

    r = gpu_check._rates(2.0, 4e12, 6e9, (8e12, 3e9))
    assert (r["flops_per_s"], r["flops_fraction"]) == (2e12, 0.25)
    assert (r["bytes_per_s"], r["bytes_fraction"]) == (3e9, 1.0)
    assert gpu_check._rates(2.0, 4e12, 6e9, None)["bytes_fraction"] is None
