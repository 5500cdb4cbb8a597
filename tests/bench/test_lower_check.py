"""`bench/lower_check.py` at tiny shapes: the engines' programs lower for GPU and TPU on this CPU
host with the attention `auto` picks there, the kernel inside (the mesh case is in
`tests/model/mesh_cases.py`)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
TINY = dict(new=32, cached=96, slots=4, page=16)


@pytest.fixture(scope="module")
def lower_check(bench_modules):
    with bench_modules("lower_check") as (module,):
        yield module


# each platform with each model, each KV dtype with each platform and each model
@pytest.mark.parametrize(
    "platform, model, kv",
    [
        ("cuda", "tiny-qwen2", "bf16"),
        ("cuda", "tiny-deepseek", "fp8"),
        ("tpu", "tiny-qwen2", "fp8"),
        ("tpu", "tiny-deepseek", "bf16"),
    ],
)
def test_every_program_lowers_with_the_default_attention(lower_check, platform, model, kv):
    cfg = lower_check.model_config(model, kv, platform)
    result = lower_check.check(cfg, platform, None, **TINY)
    assert list(result) == list(lower_check.PROGRAMS)
    for name, r in result.items():
        assert r["lowered"], (name, r.get("error"))
        assert r["page_gathers"] == 0 and r["temp_bytes"] >= 0
    # `auto` is the paged kernel: Pallas-Triton's custom call on GPU, Mosaic's on TPU
    assert cfg.attention_impl == "pallas"
    call = "__gpu$xla.gpu.triton" if platform == "cuda" else "tpu_custom_call"
    for name in ("prefill_layer", "decode_step"):
        assert result[name]["kernels"] == {call: 1}, name
    assert result["layer_write"]["kernels"] == {}


def test_the_script_prints_one_json_object():
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    args = [f"--{k}={v}" for k, v in TINY.items()]
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "lower_check.py"), "--model=tiny-deepseek",
         "--kv=fp8", "--json", *args],
        capture_output=True, text=True, env=env, cwd=ROOT, check=True,
    )  # fmt: skip
    out = json.loads(proc.stdout)
    assert out["platform"] == "cuda" and out["model"] == "tiny-deepseek"
    assert out["kv_dtype"] == "float8_e4m3fn (scaled)" and out["mesh"] == "1"
    assert set(out["programs"]) == {"prefill_layer", "decode_step", "layer_write"}
    assert all(r["lowered"] for r in out["programs"].values())
