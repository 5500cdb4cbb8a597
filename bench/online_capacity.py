"""Online serving capacity: sweep the agent arrival rate (APS) per policy (paper Figure 10 style).

Run:
  python bench/online_capacity.py --config=configs/cpu_1p2d.py --set workload.duration_s=150 --aps=0.04,0.08,0.16,0.32 --bisect=2
Each point replays agents arriving as a Poisson process at that rate (the same arrival times for
every policy) for `workload.duration_s` seconds, or `workload.agents` agents when that is 0. Use a
duration: with a fixed number of agents a high rate is just a burst of that many agents (an
offline run), not a sustained load, and "capacity" stops measuring throughput. the capacity of a policy is the highest rate whose SLO attainment
(TTFT <= workload.ttft_slo_s and TPOT <= workload.tpot_slo_s per round) reaches --attainment.
The grid stops at the first failing rate; then --bisect=N halves the gap between the highest passing and the lowest
failing rate N times (geometric midpoints) per policy. Writes WORKDIR/capacity.json and
WORKDIR/capacity.png and prints the table.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from absl import app, flags  # noqa: E402

from dualpath_jax.config import apply_overrides  # noqa: E402
from dualpath_jax.configs_loader import load_config  # noqa: E402
from dualpath_jax.experiment import (
    run_local,  # noqa: E402
    with_policy,  # noqa: E402
)

_CONFIG = flags.DEFINE_string("config", "configs/cpu_1p2d.py", "Experiment file.")
_SET = flags.DEFINE_multi_string("set", [], "Override `section.key=value` (repeatable).")
_POLICIES = flags.DEFINE_list("policies", ["basic", "dualpath"], "Policies to compare.")
_APS = flags.DEFINE_list("aps", ["0.5", "1", "2", "4"], "Arrival rates (agents per second).")
_ATTAIN = flags.DEFINE_float("attainment", 0.9, "Fraction of rounds that must meet the SLO.")
_BISECT = flags.DEFINE_integer(
    "bisect", 0, "Refinement steps between the last passing and first failing rate."
)
_WORKDIR = flags.DEFINE_string("workdir", "/tmp/dp_capacity", "Output directory.")


def main(argv):
    del argv
    base = apply_overrides(load_config(_CONFIG.value), _SET.value)
    wd = pathlib.Path(_WORKDIR.value)
    rates = sorted(float(x) for x in _APS.value)
    points: dict[str, list[dict]] = {}

    def measure(p: str, aps: float) -> bool:
        cfg = with_policy(base, p)
        cfg = dataclasses.replace(
            cfg, workload=dataclasses.replace(cfg.workload, mode="online", aps=aps)
        )
        s = run_local(cfg, wd / p / f"aps{aps:g}", progress=False)
        points[p].append(
            {
                "aps": aps,
                "slo_attainment": s["slo_attainment"],
                "ttft_p90": s["ttft_s"]["p90"],
                "tpot_mean": s["tpot_s"]["mean"],
                "jct_p50": s["round_jct_s"]["p50"],
            }
        )
        points[p].sort(key=lambda x: x["aps"])
        print(
            f"{p:<10} aps {aps:6.3f}: SLO attainment {s['slo_attainment']:.2f}, "
            f"TTFT p90 {s['ttft_s']['p90']:.2f} s, TPOT {s['tpot_s']['mean'] * 1e3:.1f} ms",
            flush=True,
        )
        return s["slo_attainment"] >= _ATTAIN.value

    for p in _POLICIES.value:
        points[p] = []
        ok: dict[float, bool] = {}
        for aps in rates:  # ascending; rates above the first failing one are not run
            ok[aps] = measure(p, aps)
            if not ok[aps]:
                break
        for _ in range(_BISECT.value):
            passing = [a for a, good in ok.items() if good]
            lo = max(passing, default=0.0)
            above = [a for a, good in ok.items() if not good and a > lo]
            if not passing or not above:
                break  # nothing to refine: every rate passed, or none did
            hi = min(above)
            mid = round((lo * hi) ** 0.5, 4)
            ok[mid] = measure(p, mid)
    capacity = {
        p: max([x["aps"] for x in pts if x["slo_attainment"] >= _ATTAIN.value], default=0.0)
        for p, pts in points.items()
    }
    result = {
        "config": base.name,
        "emulated": base.hardware.emulated,
        "slo": {
            "ttft_s": base.workload.ttft_slo_s,
            "tpot_s": base.workload.tpot_slo_s,
            "attainment": _ATTAIN.value,
        },
        "points": points,
        "capacity_aps": capacity,
    }
    wd.mkdir(parents=True, exist_ok=True)
    (wd / "capacity.json").write_text(json.dumps(result, indent=1))
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for p, pts in points.items():
        axes[0].plot([x["aps"] for x in pts], [x["ttft_p90"] for x in pts], "o-", label=p)
        axes[1].plot([x["aps"] for x in pts], [x["slo_attainment"] for x in pts], "o-", label=p)
    axes[0].axhline(base.workload.ttft_slo_s, color="gray", ls="--", lw=1)
    axes[0].set(xlabel="APS", ylabel="TTFT p90 (s)", title=f"TTFT vs arrival rate, {base.name}")
    axes[1].axhline(_ATTAIN.value, color="gray", ls="--", lw=1)
    axes[1].set(xlabel="APS", ylabel="SLO attainment", title="SLO attainment")
    for ax in axes:
        ax.legend()
    fig.tight_layout()
    fig.savefig(wd / "capacity.png", dpi=110)
    print("capacity (APS):", ", ".join(f"{p} {c:g}" for p, c in capacity.items()))
    if capacity.get("basic") and "dualpath" in capacity:
        print(f"dualpath / basic capacity: {capacity['dualpath'] / capacity['basic']:.2f}x")
    print(f"figure: {wd / 'capacity.png'}")


if __name__ == "__main__":
    app.run(main)
