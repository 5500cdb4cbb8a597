"""Tool-gap prefetch on the local cluster: the turns after a tool call, prefetch off vs on.

Run:
  python bench/prefetch_cluster.py                     # cpu_1p2d, in-process runtime
  python bench/prefetch_cluster.py --runtime=process   # one process per engine
  python bench/prefetch_cluster.py --sessions=6 --gap_s=4 --json
  python bench/prefetch_cluster.py --policy=basic      # PE-side prefetch

`--sessions` agents each run `--rounds` rounds on `configs/cpu_1p2d.py` (tiny Qwen2, emulated
links: 0.5 MB/s storage NICs): a first context of `--first` tokens, then appends of
`--append` tokens, each after a tool call of `--gap_s` seconds, `--gen` tokens a round. Both
runs replay the same sessions under `--policy` (dualpath: the prefetch reads into a DE; basic:
into the PE); with prefetch on, each gap starts with a `tool_call` hint
(`run_trajectories(tool_calls=True)`) and an engine reads the session's stored blocks into
memory meanwhile (router/prefetch.py). For the turns after a tool call it prints the hit read
time (the prefill engine's wait for the hit KV, from the router's `first_token` events), the
reading engine's own store read time (`pe_reads`/`de_reads` events), TTFT p50/p99, the blocks
taken from prefetch memory, and whether the two runs' tokens are identical.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import sys
import time

import numpy as np
from absl import app, flags

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "configs"))

from dualpath_jax.cluster import InProcessCluster, LocalCluster  # noqa: E402
from dualpath_jax.config import Policy  # noqa: E402
from dualpath_jax.metrics.events import read_events  # noqa: E402
from dualpath_jax.rollout import Round, Trajectory, run_trajectories  # noqa: E402

_SESSIONS = flags.DEFINE_integer("sessions", 4, "Agents (sessions).")
_ROUNDS = flags.DEFINE_integer("rounds", 4, "Rounds per session.")
_FIRST = flags.DEFINE_integer("first", 960, "First context, tokens.")
_APPEND = flags.DEFINE_integer("append", 32, "Tokens appended after each tool call.")
_GEN = flags.DEFINE_integer("gen", 8, "Tokens generated per round.")
_GAP = flags.DEFINE_float("gap_s", 3.0, "Tool call between rounds, seconds.")
_RUNTIME = flags.DEFINE_enum("runtime", "thread", ["thread", "process"], "Cluster runtime.")
_POLICY = flags.DEFINE_enum(
    "policy", "dualpath", ["dualpath", "dualpath_rr", "split", "basic", "layerwise"], "Policy."
)
_WORKDIR = flags.DEFINE_string("workdir", "bench_out/prefetch_cluster", "Output directory.")
_JSON = flags.DEFINE_bool("json", False, "Print the rows as JSON too.")


def sessions(
    n: int, rounds: int, first: int, append: int, gen: int, gap: float, vocab: int
) -> list[Trajectory]:
    rs = np.random.RandomState(0)
    return [
        Trajectory(
            f"agent{k}",
            tuple(
                Round(
                    tuple(rs.randint(0, vocab, first if i == 0 else append).tolist()),
                    gen,
                    gap_s=gap if i else 0.0,
                )
                for i in range(rounds)
            ),
        )
        for k in range(n)
    ]


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) if xs else float("nan")


def run_one(cfg, workdir: pathlib.Path, trajs, prefetch: bool) -> dict:
    sched = dataclasses.replace(cfg.scheduler, prefetch=prefetch, policy=Policy(_POLICY.value))
    cfg = dataclasses.replace(cfg, scheduler=sched)
    runtime = InProcessCluster if _RUNTIME.value == "thread" else LocalCluster
    with runtime(cfg, workdir) as cluster:
        client = cluster.client()
        t0 = time.monotonic()
        outs = run_trajectories(client, trajs, progress=False, tool_calls=prefetch)
        jct = time.monotonic() - t0
        counters = client.stats()["counters"]
    errors = [o.error for o in outs if o.error]
    if errors:
        raise SystemExit(f"rounds failed: {errors[:3]}")
    after = {r.request for o in outs for r in o.results[1:]}  # turns after a tool call
    events = read_events(workdir / "events.jsonl")
    pe_read = [e["read_s"] for e in events if e["kind"] == "first_token" and e["request"] in after]
    reads = [e for e in events if e["kind"] in ("pe_reads", "de_reads") and e["request"] in after]
    ttft = [r.ttft_s for o in outs for r in o.results[1:]]
    return {
        "prefetch": prefetch,
        "turns": len(after),
        "hit_read_p50_s": pct(pe_read, 50),
        "hit_read_p99_s": pct(pe_read, 99),
        "store_read_p50_s": pct([e["read_s"] for e in reads], 50),
        "ttft_p50_s": pct(ttft, 50),
        "ttft_p99_s": pct(ttft, 99),
        "held_blocks": sum(e["held_blocks"] for e in reads),
        "hit_blocks": sum(r.cached_tokens for o in outs for r in o.results[1:])
        // cfg.store.block_tokens,
        "prefetch_started": counters["prefetch_started"],
        "prefetch_used": counters["prefetch_used"],
        "jct_s": jct,
        "tokens": [o.rounds for o in outs],
    }


def main(argv) -> None:
    del argv
    import cpu_1p2d

    cfg = cpu_1p2d.get_config()
    trajs = sessions(
        _SESSIONS.value,
        _ROUNDS.value,
        _FIRST.value,
        _APPEND.value,
        _GEN.value,
        _GAP.value,
        cfg.model.vocab_size,
    )
    out = pathlib.Path(_WORKDIR.value)
    rows = [run_one(cfg, out / ("on" if p else "off"), trajs, p) for p in (False, True)]
    same = rows[0]["tokens"] == rows[1]["tokens"]
    print(
        f"{_SESSIONS.value} sessions x {_ROUNDS.value} rounds, first {_FIRST.value} tokens,"
        f" +{_APPEND.value} after each {_GAP.value:g} s tool call ({_RUNTIME.value} runtime,"
        f" {_POLICY.value})"
    )
    print(
        "prefetch  turns  hit read p50/p99 s  store read p50 s  TTFT p50/p99 s  held/hit blocks  JCT s"
    )
    for r in rows:
        print(
            f"{'on' if r['prefetch'] else 'off':8}  {r['turns']:5}  "
            f"{r['hit_read_p50_s']:7.3f} / {r['hit_read_p99_s']:6.3f}  "
            f"{r['store_read_p50_s']:16.3f}  "
            f"{r['ttft_p50_s']:6.3f} / {r['ttft_p99_s']:6.3f}  "
            f"{r['held_blocks']:6} / {r['hit_blocks']:<6}  {r['jct_s']:6.1f}"
        )
    print(f"tokens identical: {same}")
    if _JSON.value:
        print(json.dumps([{k: v for k, v in r.items() if k != "tokens"} for r in rows]))
    if not same:
        raise SystemExit("the tokens differ between the runs")


if __name__ == "__main__":
    app.run(main)
