"""Lowers the engines' real programs for an accelerator on any host: does the default path lower
for `cuda` or `tpu`, with the kernel in it, and without gathering the page pool on a mesh?

Run: python bench/lower_check.py --platform=cuda --model=qwen2.5-7b [--kv=fp8] [--mesh=2x4] [--json]

No accelerator is needed: each program is traced with abstract inputs (parameters from
`nnx.eval_shape`, `jax.ShapeDtypeStruct`s, split over the mesh as the engines split them) and
lowered with `lowering_platforms=(platform,)`, which runs the Pallas GPU (Triton) or TPU
(Mosaic) lowering here. `attention_impl` is what `auto` resolves to on that platform
(`model.resolve_attention_impl("auto", platform)`). The programs (`PROGRAMS`):

- `prefill_layer`: one layer over cached pages, as the PE runs it layer by layer
  (`runner._layer_paged`): `--new` tokens over `--cached` cached ones, batch 1.
- `decode_step`: the DE's decode step (`decode_programs.step_fn`: embedding, the layer over the pool,
  writing the new rows into their pages, head, sampling) of a one-layer model over `--slots`
  slots whose contexts reach `--cached` tokens.
- `layer_write`: the DE's write of a request's blocks into the pool (`decode_programs.write_pages`).

Per program: `lowered` (or the error), `kernels` (the kernel custom calls in the lowered module:
Triton's `__gpu$xla.gpu.triton`, Mosaic TPU's `tpu_custom_call`), then, from compiling the same
program for this host's CPU (the kernel interpreted where it is picked): `page_gathers` (all-gathers
whose result is page-shaped `[..., page_size, W]`: what a step would move of the pool; must be 0),
`all_gathers` (every all-gather's result shape), `temp_bytes` (compile-only temporaries,
`memory_analysis()`) and `argument_bytes` (the program's inputs per device, the page pool's
share among them). One-layer models: the layer and the programs are the real ones, the
figures are per layer. `--mesh=DxT` builds a `data`=D, `tensor`=T mesh of this host's CPU devices
(8 forced CPU devices when JAX has not started). `--json` prints one JSON object.
"""

from __future__ import annotations

import os
import sys

if "--mesh" in " ".join(sys.argv) and "xla_force_host_platform_device_count" not in os.environ.get(
    "XLA_FLAGS", ""
):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import dataclasses  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from absl import app, flags  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from dualpath_jax.config import ModelConfig  # noqa: E402
from dualpath_jax.kernels.kv_rows import bits_dtype  # noqa: E402
from dualpath_jax.model import sharding  # noqa: E402
from dualpath_jax.model.decode_programs import step_fn, write_pages  # noqa: E402
from dualpath_jax.model.layers import resolve_attention_impl  # noqa: E402
from dualpath_jax.model.page_pool import pages_for  # noqa: E402
from dualpath_jax.model.runner import ModelRunner, PrefillBatch, _layer_paged  # noqa: E402
from dualpath_jax.model.sampling_params import MAX_HELD_STOP_TOKENS  # noqa: E402
from dualpath_jax.model.transformer import init_model  # noqa: E402
from dualpath_jax.presets import (  # noqa: E402
    DEEPSEEK_V3_660B,
    QWEN25_7B,
    TINY_DEEPSEEK,
    TINY_QWEN2,
)

MODELS = {
    "qwen2.5-7b": QWEN25_7B,
    "deepseek-v3": DEEPSEEK_V3_660B,
    "tiny-qwen2": TINY_QWEN2,
    "tiny-deepseek": TINY_DEEPSEEK,
}
PROGRAMS = ("prefill_layer", "decode_step", "layer_write")
KERNEL_CALLS = ("__gpu$xla.gpu.triton", "tpu_custom_call", "mosaic_gpu")
FP8 = "float8_e4m3fn"


def model_config(name: str, kv: str, platform: str) -> ModelConfig:
    """One layer of preset `name` with `auto` attention resolved for `platform`; `kv="fp8"`: fp8
    KV with per-token scales."""
    cfg = dataclasses.replace(
        MODELS[name],
        num_layers=1,
        attention_impl=resolve_attention_impl("auto", "gpu" if platform != "tpu" else "tpu"),
    )
    if kv == "fp8":
        return dataclasses.replace(cfg, kv_dtype=FP8, kv_scales=True)
    return dataclasses.replace(cfg, kv_dtype="bfloat16", kv_scales=False)


def _mesh(spec: str):
    if not spec:
        return None
    d, t = (int(x) for x in spec.lower().split("x"))
    return sharding.make_mesh({"data": d, "tensor": t})


def _abstract_runner(cfg: ModelConfig, mesh) -> ModelRunner:
    """A runner over abstract parameters (`ShapeDtypeStruct`s, placed as the mesh's partition
    rules place them): nothing allocated."""
    return ModelRunner(nnx.eval_shape(lambda: init_model(cfg, 0)), mesh=mesh)


def _sds(shape, dtype, mesh, spec=None):
    if mesh is None:
        return jax.ShapeDtypeStruct(shape, dtype)
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec or P()))


def programs(cfg: ModelConfig, mesh, new: int, cached: int, slots: int, page: int) -> dict:
    """{name: (jitted function, abstract args, page shape suffix)} of `PROGRAMS`."""
    runner = _abstract_runner(cfg, mesh)
    bits = bits_dtype(cfg.kv_dtype)
    w = cfg.kv_width

    def pages_sds(shape):
        if mesh is None:
            return jax.ShapeDtypeStruct(shape, bits)
        return jax.ShapeDtypeStruct(shape, bits, sharding=runner.pages_sharding(shape))

    batch = PrefillBatch.build(cfg, [[0] * new], [cached])
    n_pages = max(pages_for(cached, page), 1)
    prefill_args = (
        runner.layer_gds[0],
        runner.layer_states[0],
        _sds((1, batch.n_pad, cfg.hidden_size), jnp.dtype(cfg.dtype), mesh),
        _sds((1, batch.n_pad), jnp.int32, mesh),
        pages_sds((n_pages + 1, 1, page, w)),
        _sds((1, n_pages), jnp.int32, mesh),
        _sds((1,), jnp.int32, mesh),
        _sds((1,), jnp.int32, mesh),  # real new tokens
    )
    # Decode: contexts spread up to `cached`, a pool of exactly their pages and the fed token's.
    ctx = [max(1, cached * (i + 1) // slots) for i in range(slots)]
    pool = sum(pages_for(c + 1, page) for c in ctx) + 1
    cols = pages_for(cached + 1, page)
    s = slots
    decode_args = (
        runner.stacked_leaves[1],
        pages_sds((pool, 1, page, w)),
        _sds((s, cols), jnp.int32, mesh),
        _sds((s,), jnp.int32, mesh),
        _sds((s,), jnp.int32, mesh),
        _sds((s,), jnp.bool_, mesh),
        _sds((s,), jnp.uint32, mesh),
        _sds((s,), jnp.float32, mesh),
        _sds((s,), jnp.float32, mesh),
        _sds((s, MAX_HELD_STOP_TOKENS), jnp.int32, mesh),  # min_tokens: held stop tokens
        _sds((s,), jnp.int32, mesh),
        _sds((s,), jnp.bool_, mesh),  # slots asking for log-probabilities
    )
    blocks = pages_for(cached, page)
    write_args = (
        pages_sds((pool, 1, page, w)),
        _sds((blocks,), jnp.int32, mesh),
        pages_sds((blocks, 1, page, w)),
    )
    return {
        "prefill_layer": (_layer_paged, prefill_args, runner),
        "decode_step": (step_fn(runner), decode_args, runner),
        "layer_write": (write_pages, write_args, runner),
    }


_GATHER = re.compile(r"=\s*(\w+)\[([\d,]*)\][^=]*\ball-gather(?:-start)?\(")


def _gathers(hlo: str) -> list[tuple[str, tuple[int, ...]]]:
    out = []
    for m in _GATHER.finditer(hlo):
        dims = tuple(int(x) for x in m.group(2).split(",") if x)
        out.append((m.group(1), dims))
    return out


def check(cfg: ModelConfig, platform: str, mesh, **shapes) -> dict:
    """{program: figures} (see the module docstring)."""
    out = {}
    for name, (fn, args, runner) in programs(cfg, mesh, **shapes).items():
        r: dict = {"attention_impl": cfg.attention_impl}
        with runner.on_mesh():
            traced = fn.trace(*args)
            try:
                text = traced.lower(lowering_platforms=(platform,)).as_text()
                r["lowered"] = True
                r["kernels"] = {k: text.count(k) for k in KERNEL_CALLS if k in text}
            except Exception as e:  # noqa: BLE001 - reported, the other programs go on
                r["lowered"] = False
                r["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
            compiled = traced.lower().compile()
        hlo = compiled.as_text()
        page_tail = (shapes["page"], cfg.kv_width)
        gathers = _gathers(hlo)
        r["all_gathers"] = [f"{t}{list(d)}" for t, d in gathers]
        r["page_gathers"] = sum(1 for _, d in gathers if len(d) >= 2 and d[-2:] == page_tail)
        memory = compiled.memory_analysis()
        r["temp_bytes"] = int(memory.temp_size_in_bytes)
        r["argument_bytes"] = int(memory.argument_size_in_bytes)
        out[name] = r
    return out


def main(argv):
    del argv
    f = flags.FLAGS
    cfg = model_config(f.model, f.kv, f.platform)
    mesh = _mesh(f.mesh)
    shapes = dict(new=f.new, cached=f.cached, slots=f.slots, page=f.page)
    result = {
        "platform": f.platform,
        "model": f.model,
        "kv_dtype": cfg.kv_dtype + (" (scaled)" if cfg.kv_scales else ""),
        "mesh": f.mesh or "1",
        "jax": jax.__version__,
        "shapes": shapes,
        "programs": check(cfg, f.platform, mesh, **shapes),
    }
    if f.json:
        print(json.dumps(result))
        return
    print(
        f"{result['model']} {result['kv_dtype']} for {result['platform']} on mesh {result['mesh']}"
        f" (attention {cfg.attention_impl}, jax {jax.__version__})"
    )
    for name, r in result["programs"].items():
        status = "lowered" if r["lowered"] else f"FAILED {r['error']}"
        print(
            f"  {name:<14} {status:<8} kernels={r.get('kernels', {})} page_gathers="
            f"{r['page_gathers']} temp={r['temp_bytes'] / 2**30:.3f} GiB"
            f" args={r['argument_bytes'] / 2**30:.3f} GiB"
        )


if __name__ == "__main__":
    # Flags exist only when run as a script: tests import several bench modules at once.
    flags.DEFINE_enum("platform", "cuda", ["cuda", "rocm", "tpu"], "lowering platform")
    flags.DEFINE_enum("model", "qwen2.5-7b", list(MODELS), "model preset (one layer of it)")
    flags.DEFINE_enum("kv", "bf16", ["bf16", "fp8"], "KV dtype: bfloat16, or fp8 with scales")
    flags.DEFINE_string("mesh", "", "DxT: a data x tensor mesh of CPU devices ('' one device)")
    flags.DEFINE_integer("new", 2048, "new tokens of the prefill layer")
    flags.DEFINE_integer("cached", 32768, "cached tokens (prefill) / longest context (decode)")
    flags.DEFINE_integer("slots", 64, "decode slots")
    flags.DEFINE_integer("page", 64, "tokens per page (store.block_tokens)")
    flags.DEFINE_bool("json", False, "print one JSON object")
    app.run(main)
