"""The accelerator check of the attention backends, one script for a GPU (or TPU) machine.

Run: python bench/gpu_check.py [--out=DIR] [--quick]

On the machine's default backend (no interpret mode unless the platform needs it), checks and
records, as `DIR/gpu_check.json` and on stdout:

- `kernel`: the paged kernel against the dense oracle at bf16 for a Qwen2.5-7B-shaped decode
  batch (GQA, 7 queries per KV head) and a DeepSeek-V3-shaped MLA prefill block: max abs error.
- `greedy`: greedy tokens of the tiny Qwen2 and DeepSeek models (f32 KV, and fp8 KV with scales)
  under every attention backend and MoE implementation, against the `reference`/`ragged_dot`
  tokens (identical or not), and the largest logit difference of a layerwise prefill over
  cached KV.
- `memory`: `bench/accel_memory.py`'s temporary bytes per backend at the full shapes (`--quick`:
  the tiny shapes).
- `dispatch`: `bench/decode_dispatch.py` for the 28-layer tiny model.

Every check runs in its own try block; a failure is recorded as its error text and the script
goes on, so one run returns everything there is to learn.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags


def _kernel_checks() -> dict:
    from dualpath_jax.model import paged_attention as pa

    rng = np.random.default_rng(0)
    out = {}
    for name, layout, hq, n, lens in (
        ("gqa_decode", pa.RowLayout.gqa(4, 128), 28, 1, [1000, 5000, 33, 2048]),
        ("mla_prefill", pa.RowLayout.mla(512, 64), 16, 256, [0, 3000]),
    ):
        b, ps = len(lens), 64
        m = max(-(-c // ps) for c in lens) + 1
        w = 2 * layout.num_kv_heads * layout.value_width if layout.head_stride else 576
        pages = jnp.asarray(rng.normal(size=(b * m + 1, 1, ps, w)), jnp.bfloat16)
        table = jnp.asarray(1 + np.arange(b * m).reshape(b, m), jnp.int32)
        q = jnp.asarray(rng.normal(size=(b, n, hq, layout.key_width)), jnp.bfloat16)
        new = jnp.asarray(rng.normal(size=(b, n, w)), jnp.bfloat16)
        cl = jnp.asarray(lens, jnp.int32)
        scale = layout.key_width**-0.5
        got = pa.paged_attention(q, pages, table, cl, new, layout, scale)
        want = pa.paged_attention_reference(q, pages, table, cl, new, layout, scale)
        out[name] = float(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32)).max())
    return out


def _greedy_checks() -> dict:
    from dualpath_jax import model as dm
    from dualpath_jax.model.layers import ATTENTION_IMPLS
    from dualpath_jax.model.moe import MOE_IMPLS
    from dualpath_jax.model.runner import ModelRunner, PrefillBatch
    from dualpath_jax.presets import TINY_DEEPSEEK, TINY_QWEN2

    prompts = [[(7 * i + 3) % 257 for i in range(37)], [(5 * i + 1) % 257 for i in range(20)]]
    out = {}
    fp8 = {"kv_dtype": "float8_e4m3fn", "kv_scales": True}
    for fam, cfg in (
        ("qwen2", TINY_QWEN2),
        ("deepseek", TINY_DEEPSEEK),
        ("qwen2-fp8-scaled", dataclasses.replace(TINY_QWEN2, **fp8)),
        ("deepseek-fp8-scaled", dataclasses.replace(TINY_DEEPSEEK, **fp8)),
    ):
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


def _dispatch() -> dict:
    import decode_dispatch

    return decode_dispatch.measure(28, 200)


def main(argv):
    del argv
    result: dict = {"device": str(jax.devices()[0]), "backend": jax.default_backend()}
    for name, fn in (
        ("kernel", _kernel_checks),
        ("greedy", _greedy_checks),
        ("memory", lambda: _memory(_QUICK.value)),
        ("dispatch", _dispatch),
    ):
        try:
            result[name] = fn()
        except Exception:  # noqa: BLE001 - recorded, the next check runs
            result[name] = {"error": traceback.format_exc()[-4000:]}
        print(json.dumps({name: result[name]}), flush=True)
    out = pathlib.Path(_OUT.value)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    # Flags exist only when run as a script: tests import several bench modules at once.
    _OUT = flags.DEFINE_string("out", ".", "directory for gpu_check.json")
    _QUICK = flags.DEFINE_bool("quick", False, "memory figures at the tiny shapes")
    app.run(main)
