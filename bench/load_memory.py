"""Host memory of loading a Hugging Face checkpoint: the streaming loader against a whole read.

Run: python bench/load_memory.py [--gb=2.4] [--workdir=/tmp/load_memory] [--json]

Writes a synthetic Qwen2-architecture checkpoint of about `--gb` GB of bfloat16 tensors (random
values, written tensor by tensor, never whole in memory; reused when it already exists), then
loads it in a fresh process per method and samples that process's resident memory (VmRSS,
every 2 ms, plus the kernel's high-water mark) around the load:

- `streaming`: `model.from_pretrained(dir)` (memory-mapped files, each parameter placed shard
  by shard, the mapped pages released after each);
- `whole`: what a loader that reads the checkpoint first does: every tensor read into host
  memory (`safetensors.numpy.load_file`), then placed on the device.

Reported per method: the peak rise over the process's memory before the load, the bytes of the
loaded parameters (on CPU the device *is* host memory, so they stay resident after the load),
and the transient: peak rise minus parameters, the host memory the load itself needed, as a
multiple of the checkpoint's largest tensor (the issue's bound: at most 1.5x). On an
accelerator the parameters would leave the host and the peak rise would be the transient.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import threading
import time

import numpy as np
from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_float("gb", 2.4, "checkpoint size to write, GB")
flags.DEFINE_string("workdir", "/tmp/dualpath_load_memory", "where the checkpoint goes")
flags.DEFINE_bool("json", False, "print one JSON object on stdout")
flags.DEFINE_string("child", "", "internal: run one load method in this process")
flags.DEFINE_string("dir", "", "internal: the checkpoint directory of --child")


def qwen2_config(gb: float) -> dict:
    """A Qwen2 config whose bf16 tensors total about `gb` GB: hidden 4096, vocabulary 65,536
    (the largest tensors: embedding and LM head, 512 MiB each), as many layers as fit."""
    hidden, inter, vocab, heads, kv = 4096, 11008, 65536, 32, 4
    per_layer = 2 * (2 * hidden * hidden + 2 * hidden * kv * 128 + 3 * hidden * inter)
    layers = max(1, int((gb * 1e9 - 2 * 2 * vocab * hidden) // per_layer))
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }


def tensor_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    q, kv = cfg["num_attention_heads"] * 128, cfg["num_key_value_heads"] * 128
    out = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,), "lm_head.weight": (v, h)}
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}."
        out.update({
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.q_proj.bias": (q,),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.k_proj.bias": (kv,),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.v_proj.bias": (kv,),
            p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (i, h),
            p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i),
        })  # fmt: skip
    return out


def write_checkpoint(directory: pathlib.Path, gb: float) -> dict:
    """A safetensors file written tensor by tensor (header first, then each tensor's bytes)."""
    import ml_dtypes

    cfg = qwen2_config(gb)
    cfg["head_dim"] = 128
    shapes = tensor_shapes(cfg)
    directory.mkdir(parents=True, exist_ok=True)
    done = directory / "config.json"
    if done.is_file() and json.loads(done.read_text()) == cfg:
        return cfg
    header, offset = {}, 0
    for name, shape in shapes.items():
        n = int(np.prod(shape)) * 2
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    rng = np.random.default_rng(0)
    with open(directory / "model.safetensors", "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        for name, shape in shapes.items():
            if len(shape) == 1:
                x = np.ones(shape, np.float32) if "norm" in name else np.zeros(shape, np.float32)
            else:
                x = rng.standard_normal(shape, np.float32) * shape[-1] ** -0.5
            f.write(x.astype(ml_dtypes.bfloat16).tobytes())
            del x
    done.write_text(json.dumps(cfg))
    return cfg


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _hwm() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def child(method: str, directory: str) -> dict:
    """Loads the checkpoint by `method` in this process; returns its memory figures."""
    import jax
    from flax import nnx

    from dualpath_jax.model import checkpoint

    jax.numpy.zeros(1).block_until_ready()  # the runtime up before the baseline
    baseline = _rss()
    peak = [baseline]
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], _rss())
            time.sleep(0.002)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0 = time.perf_counter()
    if method == "streaming":
        model = checkpoint.from_pretrained(directory)
        leaves = jax.tree.leaves(nnx.state(model))
    else:  # whole: the checkpoint read into host memory, then placed
        from safetensors.numpy import load_file

        tensors = load_file(str(pathlib.Path(directory) / "model.safetensors"))
        leaves = [jax.device_put(t) for t in tensors.values()]
        del tensors
    jax.block_until_ready(leaves)
    seconds = time.perf_counter() - t0
    stop.set()
    sampler.join()
    peak_rss = max(peak[0], _hwm())
    params = sum(int(x.nbytes) for x in leaves)
    return {
        "method": method,
        "seconds": round(seconds, 2),
        "baseline_bytes": baseline,
        "peak_rise_bytes": peak_rss - baseline,
        "param_bytes": params,
        "transient_bytes": peak_rss - baseline - params,
    }


def run(gb: float, workdir: str) -> dict:
    directory = pathlib.Path(workdir) / "ckpt"
    cfg = write_checkpoint(directory, gb)
    shapes = tensor_shapes(cfg)
    largest = max(int(np.prod(s)) * 2 for s in shapes.values())
    total = sum(int(np.prod(s)) * 2 for s in shapes.values())
    out = {
        "checkpoint_bytes": total,
        "largest_tensor_bytes": largest,
        "layers": cfg["num_hidden_layers"],
    }
    env = dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
    for method in ("streaming", "whole"):
        proc = subprocess.run(
            [sys.executable, __file__, f"--child={method}", f"--dir={directory}"],
            capture_output=True,
            text=True,
            env=env,
            check=True,
        )
        fig = json.loads(proc.stdout.strip().splitlines()[-1])
        fig["transient_over_largest"] = round(fig["transient_bytes"] / largest, 3)
        out[method] = fig
    return out


def main(argv):
    del argv
    if FLAGS.child:
        print(json.dumps(child(FLAGS.child, FLAGS.dir)))
        return
    out = run(FLAGS.gb, FLAGS.workdir)
    if FLAGS.json:
        print(json.dumps(out))
        return
    gib = 2**30
    print(
        f"checkpoint {out['checkpoint_bytes'] / gib:.2f} GiB ({out['layers']} layers),"
        f" largest tensor {out['largest_tensor_bytes'] / gib:.2f} GiB"
    )
    print(
        f"{'method':10s} {'peak rise GiB':>14s} {'params GiB':>11s} {'transient GiB':>14s} {'x largest':>10s} {'s':>6s}"
    )
    for m in ("streaming", "whole"):
        f = out[m]
        print(
            f"{m:10s} {f['peak_rise_bytes'] / gib:14.2f} {f['param_bytes'] / gib:11.2f}"
            f" {f['transient_bytes'] / gib:14.2f} {f['transient_over_largest']:10.2f} {f['seconds']:6.1f}"
        )


if __name__ == "__main__":
    app.run(main)
