"""Weight sync to a 1P1D cluster: streamed over the transfer layer vs written as an orbax
checkpoint directory, side by side in one run.

Starts a LocalCluster (`configs/cpu_1p1d.py:tiny` with the model swapped for a Qwen2.5-0.5B-
shaped one: 24 layers, hidden 896, vocabulary 151,936, bfloat16, untied head; `--layers` makes
it shallower), then pushes random parameters of that shape `--repeats` times each way, in
alternation, from this process (the trainer):
- transfer: `Client(params_dir=None).update_params(params)`: buckets offered from this
  process's transfer server, pulled, checked and staged by both engines, committed;
- orbax: `Client(params_dir=...).update_params(params)`: written to a checkpoint directory, read
  back by both engines, checked and staged, committed.
Each time is the whole call (the trainer's call to every engine's commit); bytes/s is the
parameters' bytes over it (each engine receives them all). Reports medians; `--json` prints one
object. Loopback only; the cluster is stopped at the end.

    python bench/weight_sync.py --repeats=3 --json
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import statistics
import tempfile
import time

from absl import app, flags

_CONFIG = flags.DEFINE_string("config", "configs/cpu_1p1d.py:tiny", "config file[:arg]")
_LAYERS = flags.DEFINE_integer("layers", 24, "layers of the Qwen2.5-0.5B-shaped model")
_REPEATS = flags.DEFINE_integer("repeats", 3, "updates per path (alternating)")
_BUCKET_MB = flags.DEFINE_integer("bucket_mb", 256, "transfer bucket size, MiB")
_JSON = flags.DEFINE_bool("json", False, "print one JSON object instead of a table")


def qwen25_05b_shape(layers: int):
    from dualpath_jax.config import ModelConfig, ModelFamily

    return ModelConfig(
        name=f"qwen2.5-0.5b-shaped-{layers}l",
        family=ModelFamily.QWEN2,
        vocab_size=151936,
        hidden_size=896,
        num_layers=layers,
        num_heads=14,
        num_kv_heads=2,
        head_dim=64,
        intermediate_size=4864,
        max_seq_len=32768,
        rope_theta=1e6,
        rms_norm_eps=1e-6,
        qkv_bias=True,
        dtype="bfloat16",
        kv_dtype="bfloat16",
    )


def main(argv):
    del argv
    import jax
    from flax import nnx

    from dualpath_jax import apply_overrides, load_config
    from dualpath_jax.cluster import LocalCluster
    from dualpath_jax.model.transformer import init_model
    from dualpath_jax.presets import TINY_CPU_PREFILL_COST

    model = qwen25_05b_shape(_LAYERS.value)
    cfg = load_config(_CONFIG.value)
    cfg = dataclasses.replace(cfg, model=model)
    cfg = apply_overrides(
        cfg,
        [
            f"cluster.prefill_cost_json={TINY_CPU_PREFILL_COST.to_json()}",  # no calibration
            "cluster.params_load_timeout_s=1800",
        ],
    )
    params = [init_model(model, seed=s) for s in (1, 2)]  # alternated: every update changes
    nbytes = sum(int(x.nbytes) for x in jax.tree.leaves(nnx.state(params[0])))
    samples: dict[str, list[dict]] = {"transfer": [], "orbax": []}
    with tempfile.TemporaryDirectory() as tmp, LocalCluster(cfg, f"{tmp}/run") as cluster:
        streamed = cluster.client(params_dir=None, dead_after_s=300.0)
        written = cluster.client(params_dir=f"{tmp}/params", dead_after_s=300.0)
        k = 0
        for _ in range(_REPEATS.value):
            for name, client in (("transfer", streamed), ("orbax", written)):
                k += 1
                t = time.monotonic()
                client.update_params(
                    params[k % 2],
                    version=f"{name}-{k}",
                    bucket_bytes=_BUCKET_MB.value * 2**20,
                    timeout_s=1800.0,
                )
                total = time.monotonic() - t
                info = dict(client.last_params_update, wall_s=total)
                samples[name].append(info)
                shutil.rmtree(f"{tmp}/params", ignore_errors=True)  # the disk holds one at a time
        stats = cluster.client().stats()
    out: dict = {
        "model": model.name,
        "params_bytes": nbytes,
        "engines": len(stats["engines"]),
        "repeats": _REPEATS.value,
        "bucket_mb": _BUCKET_MB.value,
    }
    for name, runs in samples.items():
        wall = statistics.median(r["wall_s"] for r in runs)
        out[name] = {
            "seconds": wall,
            "prepare_s": statistics.median(r["prepare_s"] for r in runs),
            "bytes_per_s": nbytes / wall,
            "all_s": [round(r["wall_s"], 3) for r in runs],
        }
    out["speedup"] = out["orbax"]["seconds"] / out["transfer"]["seconds"]
    if _JSON.value:
        print(json.dumps(out))
        return
    print(f"{model.name}: {nbytes / 2**20:.0f} MiB of params to {out['engines']} engines")
    print(f"{'path':9} {'seconds':>8} {'prepare s':>10} {'MiB/s':>8}")
    for name in samples:
        r = out[name]
        print(
            f"{name:9} {r['seconds']:8.2f} {r['prepare_s']:10.2f} {r['bytes_per_s'] / 2**20:8.0f}"
        )
    print(f"orbax / transfer = {out['speedup']:.2f}x")


if __name__ == "__main__":
    app.run(main)
