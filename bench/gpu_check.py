"""The accelerator check of the model and the KV data path, one script for a GPU (or TPU) machine.

Run: python bench/gpu_check.py [--out=DIR] [--quick] [--only=roofline,h2d] [--json]

On the machine's default backend (no interpret mode unless the platform needs it), checks and
records, as `DIR/gpu_check.json` (rewritten after every check) and on stdout:

- `kernel`: the paged kernel against the dense oracle at bf16 for a Qwen2.5-7B-shaped decode
  batch (GQA, 7 queries per KV head) and a DeepSeek-V3-shaped MLA prefill block: max abs error
  (`--quick`: tiny layouts over short contexts).
- `greedy`: greedy tokens of the tiny Qwen2 and DeepSeek models (f32 KV, and fp8 KV with scales)
  under every attention backend and MoE implementation, against the `reference`/`ragged_dot`
  tokens (identical or not), and the largest logit difference of a layerwise prefill over
  cached KV (`--quick`: the tiny Qwen2 model under every attention backend).
- `memory`: `bench/accel_memory.py`'s temporary bytes per backend at the full shapes (`--quick`:
  the tiny shapes).
- `dispatch`: `bench/decode_dispatch.py` for the 28-layer tiny model (`--quick`: 3 layers).
- `roofline`: a prefill (`ModelRunner.prefill_program` over cached pages in device memory) and a
  decode step (`Decoder.advance`) of a Qwen2.5-7B-shaped model cut to `ROOFLINE_LAYERS` layers,
  median of a few timed runs after a compiling one, against the model's FLOPs and bytes moved
  (`step_cost`): achieved FLOP/s and bytes/s and their fraction of the device's peak (`PEAKS`,
  by `device_kind`; null for a device not in it, e.g. a CPU). `--quick`: a tiny model.
- `kernel_steps`: the paged kernel alone, timed (median ms): a Qwen2.5-7B-shaped decode batch
  (64 slots, contexts up to 32K) and a prefill block (2,048 new over 32K cached) with 1, 2 and
  4 cached pages per step (`pages_per_compute_block`; the default's pick recorded), and
  `bench/accel_memory.py`'s ragged 8-request batch padded and told its lengths (`new_lens`)
  (`--quick`: tiny layouts over short contexts).
- `layerwise`: `bench/layerwise.py`'s figures (program / resident and loop / resident, the
  overlap fractions) at its default shapes (`--quick`: its tiny shapes).
- `h2d`: host-to-device bandwidth of a 256 MiB buffer (`--quick`: 4 MiB) from pageable numpy
  and from `pinned_host` memory, median of a few copies.
- `channel`: the KV channel's bandwidth: two `JaxTransferChannel`s in this process on loopback,
  one offering 64 MiB of Layer Blocks (`--quick`: 1 MiB) and the other pulling them.
- `sharded`: a Qwen2.5-7B-shaped model of all its layers (random bf16 weights) made on a mesh
  of every local device by `init_model(mesh=)` (`tensor` = the device count), then the same
  prefill and decode as `roofline`, with the parameter bytes per device (`--quick`: tiny).
  Last, as the longest: on an H200 (jax 0.11.2) the model's one initialiser program compiled
  for minutes; `init_model` now compiles one program per kind of layer.

On a CPU, pinned host and device memory are both host DRAM, so `h2d` and the layerwise copies
time host copies (or none); the figures that measure the data path come from an accelerator.

Every check runs in its own try block; a failure is recorded as its error text and the script
goes on, so one run returns everything there is to learn. A table with one line per figure is
printed at the end; with `--json`, exactly one JSON object instead (the same as the file: the
device, backend, jax and jaxlib versions, each check's figures by name). Every model path runs
with `attention_impl="auto"`, so on a GPU the roofline, sharded and memory figures are the paged
kernel's (`model.resolve_attention_impl`).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import time
import traceback
from collections.abc import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from jax.sharding import SingleDeviceSharding
from layerwise import median_seconds  # a sibling script: bench/ is on the path

from dualpath_jax.config import ModelConfig
from dualpath_jax.model.layout import np_dtype
from dualpath_jax.presets import GPU_PRESETS
from dualpath_jax.sched.cost import ModelCost

_H100, _H200 = GPU_PRESETS["h100"], GPU_PRESETS["h200"]
# device_kind -> (dense bf16 FLOP/s, memory bytes/s): the vendors' peak figures.
PEAKS: dict[str, tuple[float, float]] = {
    "NVIDIA H200": (_H200.bf16_flops, _H200.hbm_bytes_per_s),
    "NVIDIA H100 80GB HBM3": (_H100.bf16_flops, _H100.hbm_bytes_per_s),  # H100 SXM
    "TPU v4": (275e12, 1.2e12),
    "TPU v5 lite": (197e12, 819e9),  # v5e
    "TPU v5": (459e12, 2.765e12),  # v5p
    "TPU v6 lite": (918e12, 1.64e12),  # v6e
}
ROOFLINE_LAYERS = 8  # of Qwen2.5-7B's 28: the weights of 8 layers and the head fit and load fast
REPEATS = 5


def _kernel_case(seed: int, layout, hq: int, news, lens, page: int = 64):
    """Random bf16 inputs of `paged_attention` (made on the device: the decode pool is 4 GiB)
    for requests of `news[b]` new tokens (padded to the longest) over `lens[b]` cached ones in
    pages of `page`."""
    b, n, w = len(lens), max(news), layout.row_width
    m = max(-(-c // page) for c in lens) + 1
    k = jax.random.split(jax.random.key(seed), 3)
    pages = jax.random.normal(k[0], (b * m + 1, 1, page, w), jnp.bfloat16)
    table = jnp.asarray(1 + np.arange(b * m).reshape(b, m), jnp.int32)
    q = jax.random.normal(k[1], (b, n, hq, layout.key_width), jnp.bfloat16)
    new = jax.random.normal(k[2], (b, n, w), jnp.bfloat16)
    return q, pages, table, jnp.asarray(lens, jnp.int32), new, jnp.asarray(news, jnp.int32)


def _kernel_checks(quick: bool) -> dict:
    from dualpath_jax.kernels import paged_attention as pa
    from dualpath_jax.kernels.kv_rows import RowLayout

    out = {}
    cases = (
        ("gqa_decode", RowLayout.gqa(4, 128), 28, 1, [1000, 5000, 33, 2048]),
        ("mla_prefill", RowLayout.mla(512, 64), 16, 256, [0, 3000]),
    )
    if quick:  # off GPU the kernel runs in interpret mode, slow at the full layouts
        cases = (
            ("gqa_decode", RowLayout.gqa(2, 16), 4, 1, [100, 300, 33, 64]),
            ("mla_prefill", RowLayout.mla(32, 8), 4, 16, [0, 200]),
        )
    for seed, (name, layout, hq, n, lens) in enumerate(cases):
        q, pages, table, cl, new, _ = _kernel_case(seed, layout, hq, [n] * len(lens), lens)
        scale = layout.key_width**-0.5
        got = pa.paged_attention(q, pages, table, cl, new, layout, scale)
        want = pa.paged_attention_reference(q, pages, table, cl, new, layout, scale)
        out[name] = float(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32)).max())
    return out


def _kernel_steps(quick: bool) -> dict:
    from accel_memory import RAGGED  # a sibling script

    from dualpath_jax.kernels import paged_attention as pa
    from dualpath_jax.kernels.kv_rows import RowLayout

    layout, hq, ctx, new, repeats = RowLayout.gqa(4, 128), 28, 32768, 2048, REPEATS
    ragged = RAGGED
    if quick:  # interpret mode off an accelerator: tiny
        layout, hq, ctx, new, repeats = RowLayout.gqa(2, 16), 4, 512, 32, 1
        ragged = [(max(1, n // 64), c // 64) for n, c in RAGGED]
    slots = 8 if quick else 64
    decode = _kernel_case(0, layout, hq, [1] * slots,
                          [max(1, ctx * (i + 1) // slots) for i in range(slots)])  # fmt: skip
    prefill = _kernel_case(1, layout, hq, [new], [ctx])
    scale = layout.key_width**-0.5

    def timed(args, **kw):
        q, pages, table, lens, rows, news = args
        f = jax.jit(lambda *a: pa.paged_attention(*a[:5], layout, scale, new_lens=a[5], **kw))
        return 1e3 * median_seconds(lambda: f(q, pages, table, lens, rows, news), repeats)

    out: dict = {"default_pages_per_step": {
        "gpu": pa._pages_per_block(decode[2].shape[1], 64, 1, None, pa._BLOCK_KEYS),
        "tpu": pa._pages_per_block(decode[2].shape[1], 64, 1, None, pa._TPU_BLOCK_KEYS),
    }}  # fmt: skip
    for name, args in (("decode_64", decode), ("prefill_2048", prefill)):
        out[name] = {f"pages_{p}_ms": timed(args, pages_per_compute_block=p) for p in (1, 2, 4)}
    q, pages, table, lens, rows, news = _kernel_case(
        2, layout, hq, [n for n, _ in ragged], [c for _, c in ragged]
    )
    padded = (q, pages, table, lens, rows, jnp.full_like(news, q.shape[1]))
    out["ragged8"] = {"padded_ms": timed(padded), "ragged_ms": timed((*padded[:5], news))}
    return out


def _greedy_checks(quick: bool) -> dict:
    from dualpath_jax import model as dm
    from dualpath_jax.model.layers import ATTENTION_IMPLS
    from dualpath_jax.model.moe import MOE_IMPLS
    from dualpath_jax.model.runner import ModelRunner, PrefillBatch
    from dualpath_jax.presets import TINY_DEEPSEEK, TINY_QWEN2

    prompts = [[(7 * i + 3) % 257 for i in range(37)], [(5 * i + 1) % 257 for i in range(20)]]
    out = {}
    fp8 = {"kv_dtype": "float8_e4m3fn", "kv_scales": True}
    families = [("qwen2", TINY_QWEN2)]
    if not quick:
        families += [
            ("deepseek", TINY_DEEPSEEK),
            ("qwen2-fp8-scaled", dataclasses.replace(TINY_QWEN2, **fp8)),
            ("deepseek-fp8-scaled", dataclasses.replace(TINY_DEEPSEEK, **fp8)),
        ]
    for fam, cfg in families:
        combos = [(a, "ragged_dot") for a in ATTENTION_IMPLS]
        if cfg.is_moe_layer(cfg.num_layers - 1) and not cfg.kv_scales:
            combos += [("reference", m) for m in MOE_IMPLS if m != "ragged_dot"]
        ref_tokens = ref_logits = None
        for attn, moe in combos:
            key = f"{fam}/{attn}/{moe}"
            try:
                c = dataclasses.replace(cfg, attention_impl=attn, moe_impl=moe)
                runner = ModelRunner(dm.init_model(c, seed=0))
                tokens = dm.generate(runner, prompts, 12)
                _, kv = runner.prefill_monolithic(PrefillBatch.build(c, prompts, [0, 0]))
                kv = np.asarray(kv)
                tail = PrefillBatch.build(c, [p[16:] for p in prompts], [16, 16])
                res = runner.prefill_layerwise(tail, lambda i, kv=kv: kv[i][:, : tail.c_pad])
                logits = np.asarray(res.last_logits, np.float32)
                if ref_tokens is None:
                    ref_tokens, ref_logits = tokens, logits
                out[key] = {
                    "tokens_equal": tokens == ref_tokens,
                    "max_logit_diff": float(np.abs(logits - ref_logits).max()),
                }
            except Exception as e:  # noqa: BLE001 - recorded, the check goes on
                out[key] = {"error": f"{type(e).__name__}: {e}"[:2000]}
    return out


def _memory(quick: bool) -> dict:
    import accel_memory

    return accel_memory.temps(
        accel_memory.measure(accel_memory.TINY if quick else accel_memory.FULL)
    )


def _dispatch(quick: bool) -> dict:
    import decode_dispatch

    return decode_dispatch.measure(3, 20) if quick else decode_dispatch.measure(28, 200)


# --- roofline ------------------------------------------------------------------------------


def step_cost(cfg: ModelConfig, batch: int, new: int, cached: int) -> tuple[float, float]:
    """(model FLOPs, bytes moved) of one forward of `batch` requests of `new` new tokens after
    `cached` cached ones each (a decode step: `new` = 1, `batch` = the slots).

    FLOPs: 2 x the matmul parameters a token uses x the tokens (the LM head for each request's
    last token only) plus attention (`ModelCost`: causal (query, key) pairs). Bytes: the
    weights a step reads (every layer and the LM head; of the embedding table only a row per
    token, left out) plus the cached KV each request reads. What a kernel spills or a dense
    backend gathers beyond that is not counted: the fractions are of the useful work."""
    cost = ModelCost.from_model(cfg)
    flops = batch * cost.prefill_flops(cached, new)
    weights = cost.active_params * np_dtype(cfg.dtype).itemsize
    return flops, weights + batch * cost.kv_bytes(cached)


def _rates(seconds: float, flops: float, nbytes: float, peaks) -> dict:
    out = {
        "seconds": seconds,
        "flops": flops,
        "bytes": nbytes,
        "flops_per_s": flops / seconds,
        "bytes_per_s": nbytes / seconds,
        "flops_fraction": None,
        "bytes_fraction": None,
    }
    if peaks is not None:
        out["flops_fraction"] = out["flops_per_s"] / peaks[0]
        out["bytes_fraction"] = out["bytes_per_s"] / peaks[1]
    return out


def _roofline(quick: bool) -> dict:
    from dualpath_jax.model.runner import ModelRunner
    from dualpath_jax.model.transformer import init_model
    from dualpath_jax.presets import QWEN25_7B, TINY_QWEN2

    if quick:
        cfg = dataclasses.replace(TINY_QWEN2, num_layers=2)
        (batch, new, cached), (slots, context) = (1, 16, 64), (2, 64)
    else:
        cfg = dataclasses.replace(QWEN25_7B, num_layers=ROOFLINE_LAYERS)
        (batch, new, cached), (slots, context) = (1, 2048, 8192), (32, 4096)
    return _prefill_decode(ModelRunner(init_model(cfg, 0)), (batch, new, cached), (slots, context))


def _prefill_decode(runner, prefill_shape, decode_shape) -> dict:
    """Times a prefill over cached pages in device memory and a decode step of `runner`'s
    model (median of a few runs after a compiling one) against its FLOPs and bytes."""
    from dualpath_jax.model.cached_kv import CachedPages, LayerPages
    from dualpath_jax.model.decode import Decoder
    from dualpath_jax.model.layers import resolve_attention_impl
    from dualpath_jax.model.runner import PrefillBatch

    cfg = runner.cfg
    (batch, new, cached), (slots, context) = prefill_shape, decode_shape
    dev = jax.devices()[0]
    peaks = PEAKS.get(dev.device_kind)
    rng = np.random.default_rng(0)

    prompts = [rng.integers(0, cfg.vocab_size, new).tolist() for _ in range(batch)]
    pb = PrefillBatch.build(cfg, prompts, [cached] * batch)
    rows = rng.standard_normal((batch, cached, cfg.kv_width), np.float32).astype(cfg.kv_dtype)
    layer = LayerPages.from_rows(list(rows), 64, cfg.kv_width, cfg.kv_dtype)
    kv = CachedPages.from_layers([layer] * cfg.num_layers)
    kv = kv.to_device(runner.pages_sharding(kv.pages.shape))
    del rows, layer

    def prefill():
        res, new_kv = runner.prefill_program(pb, kv)
        return res.last_logits, new_kv

    t_prefill = median_seconds(prefill, 3)

    # No `warmup()`: it compiles every table width a slot may pass, and the timed steps pass one.
    dec = Decoder(runner, slots, context + 64)
    prompt_kv = np.zeros((cfg.num_layers, context, cfg.kv_width), dec.kv_np)
    for s in range(slots):
        dec.insert(s, prompt_kv, context, 1)
    del prompt_kv
    t_decode = median_seconds(dec.advance, REPEATS)
    return {
        "device_kind": dev.device_kind,
        "model": {
            "layers": cfg.num_layers,
            "hidden": cfg.hidden_size,
            "dtype": cfg.dtype,
            "attention_impl": resolve_attention_impl(cfg.attention_impl),
        },
        "peak_flops": peaks[0] if peaks else None,
        "peak_bytes_per_s": peaks[1] if peaks else None,
        "prefill": {
            "batch": batch,
            "new": new,
            "cached": cached,
            **_rates(t_prefill, *step_cost(cfg, batch, new, cached), peaks),
        },
        "decode": {
            "slots": slots,
            "context": context,
            **_rates(t_decode, *step_cost(cfg, slots, 1, context), peaks),
        },
    }


def _sharded(quick: bool) -> dict:
    """A real-size model (Qwen2.5-7B shape, all 28 layers, random bf16 weights) created on a
    mesh of every local device (`tensor` = the device count) by `init_model(mesh=)`, then
    `_prefill_decode` as `roofline` runs it, with the parameter bytes each device holds.
    `--quick`: a tiny model whose heads divide by 8."""
    from dualpath_jax.model import sharding
    from dualpath_jax.model.runner import ModelRunner
    from dualpath_jax.model.transformer import init_model
    from dualpath_jax.presets import QWEN25_7B, TINY_QWEN2

    n = jax.device_count()
    mesh = sharding.make_mesh({"tensor": n})
    if quick:
        cfg = dataclasses.replace(
            TINY_QWEN2, num_heads=8, num_kv_heads=8, head_dim=8, vocab_size=256, num_layers=2
        )
        shapes = (1, 16, 64), (2, 64)
    else:
        cfg = QWEN25_7B
        shapes = (1, 2048, 8192), (32, 4096)
    t0 = time.perf_counter()
    net = init_model(cfg, 0, mesh=mesh)
    from flax import nnx

    leaves = jax.block_until_ready(jax.tree.leaves(nnx.state(net)))
    init_s = time.perf_counter() - t0
    per_device: dict[str, int] = {}
    for leaf in leaves:
        for shard in leaf.addressable_shards:
            per_device[str(shard.device)] = per_device.get(str(shard.device), 0) + shard.data.nbytes
    out = _prefill_decode(ModelRunner(net), *shapes)
    out.update(
        mesh=sharding.describe(mesh),
        devices=n,
        layers=cfg.num_layers,
        init_seconds=init_s,
        param_bytes=sum(int(x.nbytes) for x in leaves),
        max_param_bytes_per_device=max(per_device.values()),
    )
    return out


# --- the KV data path ----------------------------------------------------------------------


def _layerwise(quick: bool) -> dict:
    import layerwise

    return layerwise.measure(layerwise.TINY if quick else layerwise.Shapes())


def _h2d(quick: bool) -> dict:
    dev = jax.devices()[0]
    nbytes = (4 if quick else 256) << 20
    host = np.random.default_rng(0).integers(0, 256, nbytes, np.uint8)
    pinned = jax.device_put(host, SingleDeviceSharding(dev, memory_kind="pinned_host"))
    to_dev = SingleDeviceSharding(dev, memory_kind="device")
    t = {
        "pageable": median_seconds(lambda: jax.device_put(host, dev), REPEATS),
        "pinned": median_seconds(lambda: jax.device_put(pinned, to_dev), REPEATS),
    }
    return {
        "bytes": nbytes,
        "seconds": t,
        "pageable_gb_s": nbytes / t["pageable"] / 1e9,
        "pinned_gb_s": nbytes / t["pinned"] / 1e9,
    }


def _channel(quick: bool) -> dict:
    from dualpath_jax.transfer.channel import make_uuid
    from dualpath_jax.transfer.jax_channel import JaxTransferChannel

    row, n = 2048, 4  # a Qwen2.5-7B token's bf16 KV of one layer; Layer Blocks per transfer
    nbytes = (1 if quick else 64) << 20
    shape = (1, nbytes // n // row, row)  # Layer Blocks [1, tokens, bytes]
    rng = np.random.default_rng(0)
    blocks = [jax.device_put(rng.integers(0, 256, shape, np.uint8)) for _ in range(n)]
    specs = [(b.shape, b.dtype) for b in blocks]
    uuids = iter(range(1 << 20))
    try:
        with JaxTransferChannel() as sender, JaxTransferChannel() as receiver:

            def move():
                uuid = make_uuid("gpu_check", next(uuids))
                sender.offer(uuid, blocks)
                return receiver.pull(sender.address, uuid, specs, timeout_s=60.0)

            intact = all(np.array_equal(a, b) for a, b in zip(move(), blocks))
            seconds = median_seconds(move, REPEATS)
    except Exception as e:
        raise RuntimeError(
            f"two JaxTransferChannels in one process failed ({type(e).__name__}: {e});"
            " no peer process is started"
        ) from e
    return {
        "bytes": nbytes,
        "arrays": n,
        "intact": intact,
        "seconds": seconds,
        "gb_s": nbytes / seconds / 1e9,
    }


CHECKS: dict[str, Callable[[bool], dict]] = {
    "kernel": _kernel_checks,
    "greedy": _greedy_checks,
    "memory": _memory,
    "dispatch": _dispatch,
    "roofline": _roofline,
    "kernel_steps": _kernel_steps,
    "layerwise": _layerwise,
    "h2d": _h2d,
    "channel": _channel,
    "sharded": _sharded,  # last: a real-size model made on the mesh takes the longest
}


# --- the run -------------------------------------------------------------------------------


def run(
    out: pathlib.Path,
    quick: bool,
    names: Sequence[str] | None = None,
    checks: Mapping[str, Callable[[bool], dict]] = CHECKS,
    echo: bool = True,
) -> dict:
    """Runs `names` (default: all) of `checks`, each in its own try block, printing each result
    as a JSON line and rewriting `out/gpu_check.json` after each (a check that kills the process
    leaves the earlier ones). Returns the result: device, backend, each check's seconds and one
    entry per check."""
    unknown = sorted(set(names or ()) - set(checks))
    if unknown:
        raise ValueError(f"unknown checks {unknown}; known: {list(checks)}")
    import jaxlib

    result: dict = {
        "device": str(jax.devices()[0]),
        "backend": jax.default_backend(),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "check_seconds": {},  # each check's wall time, compiles included
    }
    out.mkdir(parents=True, exist_ok=True)
    for name, fn in checks.items():
        if names and name not in names:
            continue
        t0 = time.perf_counter()
        try:
            result[name] = fn(quick)
        except Exception:  # noqa: BLE001 - recorded, the next check runs
            result[name] = {"error": traceback.format_exc()[-4000:]}
        result["check_seconds"][name] = time.perf_counter() - t0
        if echo:
            print(json.dumps({name: result[name]}), flush=True)
        (out / "gpu_check.json").write_text(json.dumps(result, indent=1))
    return result


def _g(x: float) -> str:
    return f"{x:.3g}"


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def _figures(name: str, r: dict) -> list[str]:
    """One line per figure of check `name`'s result `r`."""
    if name == "kernel":
        return [f"{case} max abs error {_g(v)}" for case, v in r.items()]
    if name == "kernel_steps":
        lines = [
            f"{case} ms: " + ", ".join(f"{k[:-3]} {v:.3f}" for k, v in r[case].items())
            for case in ("decode_64", "prefill_2048", "ragged8")
        ]
        return [f"default pages per step {r['default_pages_per_step']}", *lines]
    if name == "greedy":
        ok = [k for k, v in r.items() if v.get("tokens_equal")]
        diffs = [v["max_logit_diff"] for v in r.values() if "max_logit_diff" in v]
        bad = [k for k in r if k not in ok]
        worst = _g(max(diffs, default=0.0))
        lines = [f"tokens equal in {len(ok)}/{len(r)} runs, max logit diff {worst}"]
        return lines + [f"differs or failed: {k}" for k in bad]
    if name == "memory":
        return [
            f"{b} temp MiB: " + ", ".join(f"{f} {_g(v / 2**20)}" for f, v in figs.items())
            for b, figs in r.items()
        ]
    if name == "dispatch":
        return [
            f"{r['layers']} layers: dispatch {r['dispatch_ms']:.3f} ms (launch"
            f" {r['launch_ms']:.3f}), step {r['step_ms']:.2f} ms; one run per layer"
            f" {r['per_layer_dispatch_ms']:.3f} ms"
        ]
    if name == "roofline":
        return [
            f"{phase} {p['seconds'] * 1e3:.2f} ms: {_g(p['flops_per_s'] / 1e12)} TFLOP/s"
            f" ({_pct(p['flops_fraction'])} of peak), {_g(p['bytes_per_s'] / 1e9)} GB/s"
            f" ({_pct(p['bytes_fraction'])} of peak)"
            for phase, p in ((k, r[k]) for k in ("prefill", "decode"))
        ]
    if name == "sharded":
        head = (
            f"{r['layers']} layers on {r['mesh']}: params {_g(r['param_bytes'] / 2**30)} GiB"
            f" ({_g(r['max_param_bytes_per_device'] / 2**30)} GiB per device), made in"
            f" {r['init_seconds']:.1f} s"
        )
        return [head, *_figures("roofline", r)]
    if name == "layerwise":
        return [
            f"program/resident {r['program_vs_resident']:.3f}, overlap {r['program_overlap']:.2f}",
            f"loop/resident {r['loop_vs_resident']:.3f}, overlap {r['loop_overlap']:.2f}",
        ]
    if name == "h2d":
        mib = r["bytes"] >> 20
        return [
            f"pageable numpy {_g(r['pageable_gb_s'])} GB/s ({mib} MiB)",
            f"pinned host {_g(r['pinned_gb_s'])} GB/s ({mib} MiB)",
        ]
    if name == "channel":
        return [
            f"{_g(r['gb_s'])} GB/s ({r['bytes'] >> 20} MiB in {r['arrays']} Layer Blocks,"
            f" intact: {r['intact']})"
        ]
    return [json.dumps(r)]


def table(result: dict) -> str:
    """The human-readable summary: one line per figure, `check  figure`."""
    lines = [f"device: {result['device']} ({result['backend']})"]
    for name, r in result.items():
        if name in ("device", "backend", "jax", "jaxlib", "check_seconds"):
            continue
        if "error" in r:
            lines.append(f"{name:<10} ERROR {r['error'].strip().splitlines()[-1]}")
            continue
        try:
            lines += [f"{name:<10} {line}" for line in _figures(name, r)]
        except (KeyError, TypeError, ValueError) as e:
            lines.append(f"{name:<10} (no summary: {type(e).__name__}: {e})")
    return "\n".join(lines)


def main(argv):
    del argv
    result = run(pathlib.Path(_OUT.value), _QUICK.value, _ONLY.value, echo=not _JSON.value)
    print(json.dumps(result) if _JSON.value else table(result), flush=True)


if __name__ == "__main__":
    # Flags exist only when run as a script: tests import several bench modules at once.
    _OUT = flags.DEFINE_string("out", ".", "directory for gpu_check.json")
    _QUICK = flags.DEFINE_bool("quick", False, "tiny shapes everywhere (a smoke run)")
    _ONLY = flags.DEFINE_list("only", [], f"checks to run (default: all of {list(CHECKS)})")
    _JSON = flags.DEFINE_bool("json", False, "print one JSON object instead of lines and a table")
    app.run(main)
