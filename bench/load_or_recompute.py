"""Load or recompute a request's hit KV (`scheduler.recompute`): never (always load), auto, always.

Run:
  python bench/load_or_recompute.py                     # the simulator, the paper's DS 660B 2P4D
  python bench/load_or_recompute.py --local --workdir=/tmp/dp_lor   # real engines, cpu_1p2d
For each storage speed (`--snics`: storage-NIC bytes per second per node; "config" is the
config's own) it runs the same trajectories under the three modes and prints JCT, TTFT p50, the
hit blocks recomputed, the rounds that recomputed a leading part of their hit and read the rest,
and the hit tokens loaded. With `auto`, the scheduler recomputes the leading part of a request's
hit (none, some or all of it) that the PE's cost model says finishes first against the reads
(the reading node's queue ahead plus the blocks read at the NIC's rate). The claim: where
storage is slow relative to compute, auto beats both always-load and always-recompute on JCT;
where it is fast, auto loads (equals always-load).

The simulator rows take seconds; `--local` replays on a local cluster (one fresh cluster per
run, after one unmeasured warm-up run of the first storage speed).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

from absl import app, flags

from dualpath_jax.config import apply_overrides
from dualpath_jax.configs_loader import load_config

_CONFIG = flags.DEFINE_string(
    "config", None, "Experiment file (default: configs/paper.py:ds660b_2p4d, or cpu_1p2d --local)."
)
_SET = flags.DEFINE_multi_string("set", [], "Override `section.key=value` (repeatable).")
_SNICS = flags.DEFINE_list(
    "snics", None, "Storage-NIC bytes/s per node to compare ('config': the config's own)."
)
_AGENTS = flags.DEFINE_integer("agents", None, "Agents (default: 256 simulated, 8 local).")
_LOCAL = flags.DEFINE_bool("local", False, "Run on a local cluster instead of the simulator.")
_WORKDIR = flags.DEFINE_string("workdir", "bench_out/load_or_recompute", "Output directory.")

MODES = ("never", "auto", "always")


def _p50(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else float("nan")


def _row(summary: dict) -> dict:
    prompt = summary.get("prompt_tokens", 0)
    cached = summary.get("cached_tokens", 0)
    recomputed = summary.get("recomputed_blocks", 0)
    return {
        "jct_s": summary["jct_s"],
        "ttft_p50_s": summary.get("ttft_s", {}).get("p50", float("nan")),
        "cached_tokens": cached,
        "recomputed_blocks": recomputed,
        # rounds that recomputed a leading part of their hit and read the rest
        "lead_rounds": summary.get("router", {}).get("recompute_lead_hits", 0),
        "prompt_tokens": prompt,
        "errors": summary.get("errors", 0),
    }


def main(argv):
    del argv
    local = _LOCAL.value
    name = _CONFIG.value or ("configs/cpu_1p2d.py" if local else "configs/paper.py:ds660b_2p4d")
    base = apply_overrides(load_config(name), _SET.value)
    agents = _AGENTS.value or (8 if local else 256)
    base = dataclasses.replace(
        base,
        workload=dataclasses.replace(base.workload, agents=agents, trajectories=agents),
    )
    snics = _SNICS.value or (["config", "2e6"] if local else ["config", "2e8"])
    wd = pathlib.Path(_WORKDIR.value)
    wd.mkdir(parents=True, exist_ok=True)
    rows = []
    warmed = not local
    for snic in snics:
        over = [] if snic == "config" else [f"hardware.snic_bytes_per_s={float(snic)}"]
        for mode in MODES:
            cfg = apply_overrides(base, [*over, f"scheduler.recompute={mode}"])
            if local:
                from dualpath_jax.experiment import run_local

                if not warmed:
                    run_local(cfg, wd / "warmup", progress=False)
                    warmed = True
                summary = run_local(cfg, wd / f"snic{snic}" / mode, progress=False)
            else:
                from dualpath_jax import sim

                summary = sim.simulate(cfg).summary
            row = {
                "snic_bytes_per_s": cfg.hardware.snic_bytes_per_s,
                "mode": mode,
                **_row(summary),
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    (wd / "load_or_recompute.json").write_text(json.dumps({"config": name, "rows": rows}, indent=1))
    print(f"\n{name}, {agents} agents, {'local cluster' if local else 'simulator'}")
    head = (
        f"{'SNIC B/s':>10} {'mode':>7} {'JCT s':>9} {'TTFT p50':>9} {'recomputed':>11}"
        f" {'lead rnds':>9} {'loaded tok':>11}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        share = r["recomputed_blocks"]
        print(
            f"{r['snic_bytes_per_s']:>10.3g} {r['mode']:>7} {r['jct_s']:>9.1f}"
            f" {r['ttft_p50_s']:>9.3f} {share:>11} {r['lead_rounds']:>9} {r['cached_tokens']:>11}"
        )
    for snic in sorted({r["snic_bytes_per_s"] for r in rows}):
        by = {r["mode"]: r["jct_s"] for r in rows if r["snic_bytes_per_s"] == snic}
        print(
            f"SNIC {snic:.3g} B/s: auto {by['auto']:.1f} s vs always-load {by['never']:.1f} s"
            f" ({by['never'] / by['auto']:.2f}x) and always-recompute {by['always']:.1f} s"
            f" ({by['always'] / by['auto']:.2f}x)"
        )


if __name__ == "__main__":
    app.run(main)
