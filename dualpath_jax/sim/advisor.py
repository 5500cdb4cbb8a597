"""Deployment advisor: sweep P/D, alpha and beta on the simulator and pick the best configuration.

    space = AdviseSpace(pd=pd_splits(6), alpha_s=(1.5, 3, 6), beta_s=(2.5, 5, 10))
    report = advise(cfg, space)                     # offline: lowest JCT wins
    report = advise(cfg, space, objective="capacity", aps=(0.5, 1, 2))  # online: highest APS under SLO

Every candidate is `cfg` with `cluster.prefill_nodes/decode_nodes` and `scheduler.alpha_s/beta_s`
replaced (and `alpha_tokens/beta_tokens` set to 0, so alpha and beta are derived from the seconds,
appendix A.4), simulated by `sim.run.simulate` on the same agents. Without `cost` every candidate
gets `simulate`'s default cost model built from its own config (the GPU rooflines depend on the
split: routed experts are spread over the decode GPUs); `cost` may instead be a factory called with
each candidate's config, or one fixed model for all (e.g. a `FittedCostModel` of CPU engines).
Hardware that depends on the split (the paper presets derive HBM-for-KV from the weights each GPU
holds under expert parallelism over the decode GPUs) comes from `configure`: called with `(P, D)`
it returns the split's base config, to which alpha and beta are applied, e.g.
`configure=lambda p, d: presets.paper_config(f"ds660b_{p}p{d}d")` (each split's
`configs/paper.py` config, which names its calibrated roofline, so no `cost` is needed).
Offline, a candidate's score is the JCT of the workload's agents started together. Online, it is the APS capacity: the highest rate
of `aps` (ascending, stopping at the first miss) whose SLO attainment (`workload.ttft_slo_s`,
`workload.tpot_slo_s`) reaches `attainment`; ties go to the lower mean TTFT at that rate.

Beside every candidate: whether its P/D lies in the bottleneck-free range of paper section 4.2
(`analysis.pd_range`) for the hardware's `g`, `s`, DRAM and storage NIC bandwidth (None when the
storage NIC is unlimited, so no range applies).
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
from collections.abc import Callable, Sequence
from typing import Any

from dualpath_jax.analysis.pd_range import PDRange, as_fraction, pd_range
from dualpath_jax.config import ExperimentConfig, HardwareConfig
from dualpath_jax.sched.cost import CostModel
from dualpath_jax.sim.run import build_agents, simulate
from dualpath_jax.sim.state import SimOptions

OBJECTIVES = ("jct", "capacity")
NEAR = 0.01  # candidates within 1% of the best JCT are reported as ties


@dataclasses.dataclass(frozen=True)
class AdviseSpace:
    """The grid: `(P, D)` node counts, alpha seconds and beta seconds (every combination)."""

    pd: tuple[tuple[int, int], ...]
    alpha_s: tuple[float, ...]
    beta_s: tuple[float, ...]

    def __post_init__(self):
        if not self.pd or not self.alpha_s or not self.beta_s:
            raise ValueError("the advisor needs at least one P/D split, one alpha and one beta")
        for p, d in self.pd:
            if p < 1 or d < 1:
                raise ValueError(f"P and D must be >= 1, got {p}P{d}D")
        if any(x <= 0 for x in (*self.alpha_s, *self.beta_s)):
            raise ValueError("alpha_s and beta_s must be > 0")

    def candidates(self) -> list[tuple[int, int, float, float]]:
        return [(p, d, a, b) for p, d in self.pd for a in self.alpha_s for b in self.beta_s]


def pd_splits(total_nodes: int) -> tuple[tuple[int, int], ...]:
    """Every `(P, D)` with `P + D = total_nodes`, `P, D >= 1`."""
    if total_nodes < 2:
        raise ValueError(f"a P/D split needs at least 2 nodes, got {total_nodes}")
    return tuple((p, total_nodes - p) for p in range(1, total_nodes))


def parse_pd(spec: str) -> tuple[tuple[int, int], ...]:
    """`"1p2d,2p1d"` -> `((1, 2), (2, 1))`."""
    out = []
    for part in filter(None, (s.strip().lower() for s in spec.split(","))):
        m = re.fullmatch(r"(\d+)p(\d+)d", part)
        if not m:
            raise ValueError(f"bad P/D split {part!r}; write e.g. 1p2d,2p4d")
        out.append((int(m.group(1)), int(m.group(2))))
    if not out:
        raise ValueError(f"no P/D split in {spec!r}")
    return tuple(out)


def bottleneck_free_range(hw: HardwareConfig) -> PDRange | None:
    """The section 4.2 range for `hw` (None without a storage NIC limit or when none exists)."""
    snic, cnic = hw.snic_bytes_per_s, hw.cnic_bytes_per_s
    if snic <= 0:
        return None
    s = snic / cnic if cnic > 0 else 0.0
    if s <= 0:  # unlimited compute NICs: only DRAM bounds P/D
        s = 1e-9
    mem = hw.dram_bytes_per_s if hw.dram_bytes_per_s > 0 else math.inf
    try:
        return pd_range(hw.engines_per_node, s, mem / 1e9, snic / 1e9)
    except ValueError:
        return None


def candidate_config(
    cfg: ExperimentConfig, p: int, d: int, alpha_s: float, beta_s: float
) -> ExperimentConfig:
    cl = dataclasses.replace(cfg.cluster, prefill_nodes=p, decode_nodes=d)
    sc = dataclasses.replace(
        cfg.scheduler, alpha_s=alpha_s, beta_s=beta_s, alpha_tokens=0.0, beta_tokens=0.0
    )
    return dataclasses.replace(cfg, name=f"{cfg.name}:{p}p{d}d", cluster=cl, scheduler=sc)


def online_config(cfg: ExperimentConfig, aps: float) -> ExperimentConfig:
    return dataclasses.replace(
        cfg, workload=dataclasses.replace(cfg.workload, mode="online", aps=aps)
    )


def candidate_cost(
    cost: CostModel | Callable[[ExperimentConfig], CostModel] | None, cfg: ExperimentConfig
) -> CostModel | None:
    """The cost model candidate `cfg` runs with; None leaves `simulate` to build its default
    from `cfg` (a split-dependent expert-parallel width for the GPU rooflines)."""
    if cost is None or not callable(cost):
        return cost
    return cost(cfg)


def advise(
    cfg: ExperimentConfig,
    space: AdviseSpace,
    *,
    cost: CostModel | Callable[[ExperimentConfig], CostModel] | None = None,
    configure: Callable[[int, int], ExperimentConfig] | None = None,
    options: SimOptions | None = None,
    objective: str = "jct",
    aps: Sequence[float] = (),
    attainment: float = 0.9,
) -> dict[str, Any]:
    """Simulates every candidate of `space`; returns the report (`advise.json`'s content).

    `cost`: None (each candidate's own default, as `simulate(candidate, cost=None)`), a callable
    `candidate config -> cost model`, or one fixed cost model shared by every candidate.
    `configure`: `(P, D) -> base config` of a split (None: `cfg` with the node counts replaced);
    its workload must be `cfg`'s (offline, every candidate replays the same agents). A split for
    which it raises `ValueError` is reported as infeasible (its reason in `infeasible`), ranked
    last."""
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
    rates = sorted(float(a) for a in aps)
    if objective == "capacity" and not rates:
        raise ValueError("objective 'capacity' needs arrival rates (aps)")
    rng = bottleneck_free_range(cfg.hardware)
    offline = build_agents(cfg) if objective == "jct" else None
    wall = time.perf_counter()
    rows: list[dict[str, Any]] = []
    for p, d, a, b in space.candidates():
        row: dict[str, Any] = {
            "prefill_nodes": p,
            "decode_nodes": d,
            "pd_ratio": p / d,
            "alpha_s": a,
            "beta_s": b,
            "in_bottleneck_free_range": rng.contains(p, d) if rng else None,
        }
        try:
            base = cfg if configure is None else configure(p, d)
        except ValueError as e:  # the split cannot be deployed (e.g. its weights do not fit)
            row.update(
                infeasible=str(e),
                errors=0,
                jct_s=math.inf,
                capacity_aps=0.0,
                ttft_mean_at_capacity_s=math.inf,
            )
            rows.append(row)
            continue
        if base.workload != cfg.workload:
            raise ValueError(
                f"configure({p}, {d}) changed the workload; candidates must share cfg's"
            )
        c = candidate_config(base, p, d, a, b)
        c_cost = candidate_cost(cost, c)
        if objective == "jct":
            assert offline is not None
            run = simulate(
                c, cost=c_cost, options=options, trajectories=offline[0], arrivals=offline[1]
            )
            s = run.summary
            row.update(
                jct_s=s["jct_s"],
                errors=s["errors"],
                alpha_tokens=s["sim"]["alpha_tokens"],
                beta_tokens=s["sim"]["beta_tokens"],
                snic_max_over_avg=s["snic_max_over_avg"],
                ttft_p50_s=s["ttft_s"]["p50"],
            )
        else:
            cap, points = 0.0, []
            for r in rates:
                s = simulate(online_config(c, r), cost=c_cost, options=options).summary
                points.append(
                    {
                        "aps": r,
                        "slo_attainment": s["slo_attainment"],
                        "ttft_mean_s": s["ttft_s"]["mean"],
                        "tpot_mean_s": s["tpot_s"]["mean"],
                        "errors": s["errors"],
                    }
                )
                if s["slo_attainment"] < attainment or s["errors"]:
                    break
                cap = r
                row.update(
                    alpha_tokens=s["sim"]["alpha_tokens"], beta_tokens=s["sim"]["beta_tokens"]
                )
            at = next((x for x in points if x["aps"] == cap), None)
            row.update(
                capacity_aps=cap,
                ttft_mean_at_capacity_s=at["ttft_mean_s"] if at else math.inf,
                points=points,
            )
        rows.append(row)
    best = min(rows, key=_rank_key(objective))
    if objective == "jct":
        near = [r for r in rows if r["errors"] == 0 and r["jct_s"] <= best["jct_s"] * (1 + NEAR)]
    else:
        near = [
            r for r in rows if "infeasible" not in r and r["capacity_aps"] == best["capacity_aps"]
        ]
    return {
        "config": cfg.name,
        "objective": objective,
        "policy": cfg.scheduler.policy.value,
        "agents": cfg.workload.agents,
        "aps": rates,
        "attainment": attainment,
        "slo": {"ttft_s": cfg.workload.ttft_slo_s, "tpot_s": cfg.workload.tpot_slo_s},
        "bottleneck_free_range": None
        if rng is None
        else {
            "lower": rng.lower,
            "upper": rng.upper,
            "lower_str": as_fraction(rng.lower),
            "upper_str": as_fraction(rng.upper) if math.isfinite(rng.upper) else "inf",
            "binding_lower": list(rng.binding_lower),
            "binding_upper": list(rng.binding_upper),
        },
        "candidates": rows,
        "best": best,
        "near_best": len(near),  # candidates within NEAR of the best JCT (or at the best capacity)
        "wall_s": time.perf_counter() - wall,
    }


def _rank_key(objective: str):
    if objective == "jct":
        return lambda r: (r["errors"] > 0, r["jct_s"])
    return lambda r: (-r["capacity_aps"], r["ttft_mean_at_capacity_s"])


def format_report(report: dict[str, Any]) -> str:
    """The candidates table, the best one and the bottleneck-free range beside it."""
    jct = report["objective"] == "jct"
    score = "JCT s" if jct else "APS cap"
    head = (
        f"{'P':>3}{'D':>4}{'P/D':>7}{'in range':>9}{'alpha s':>8}{'beta s':>8}{'alpha tok':>11}"
        f"{'beta tok':>10}{score:>10}{'SNIC m/a' if jct else 'TTFT s':>9}"
    )
    lines = [head, "-" * len(head)]
    best = report["best"]
    for r in report["candidates"]:
        rng = {True: "yes", False: "no", None: "-"}[r["in_bottleneck_free_range"]]
        if "infeasible" in r:
            lines.append(
                f"{r['prefill_nodes']:>3}{r['decode_nodes']:>4}{as_fraction(r['pd_ratio']):>7}{rng:>9}"
                f"{r['alpha_s']:8.3g}{r['beta_s']:8.3g}  infeasible: {r['infeasible']}"
            )
            continue
        val = f"{r['jct_s']:10.1f}" if jct else f"{r['capacity_aps']:10.3g}"
        extra = f"{r['snic_max_over_avg']:9.2f}" if jct else f"{r['ttft_mean_at_capacity_s']:9.2f}"
        lines.append(
            f"{r['prefill_nodes']:>3}{r['decode_nodes']:>4}{as_fraction(r['pd_ratio']):>7}{rng:>9}"
            f"{r['alpha_s']:8.3g}{r['beta_s']:8.3g}{r.get('alpha_tokens', math.nan):11.4g}"
            f"{r.get('beta_tokens', math.nan):10.4g}{val}{extra}"
            + ("  <- best" if r is best else "")
        )
    rng = report["bottleneck_free_range"]
    bound = (
        "none (unlimited storage NIC)"
        if rng is None
        else f"{rng['lower_str']} <= P/D <= {rng['upper_str']} (binding: "
        f"{', '.join(rng['binding_lower'])}; {', '.join(rng['binding_upper'])})"
    )
    what = (
        f"JCT {best['jct_s']:.1f} s"
        if jct
        else f"capacity {best['capacity_aps']:g} APS at SLO attainment >= {report['attainment']:g}"
    )
    lines.append(
        f"best: {best['prefill_nodes']}P{best['decode_nodes']}D, alpha_s {best['alpha_s']:g}, "
        f"beta_s {best['beta_s']:g}: {what}"
    )
    if report["near_best"] > 1:
        lines.append(
            f"  ({report['near_best']} candidates tie with it: within {NEAR:.0%} of its JCT, or the same "
            "capacity; the first in the table is reported)"
        )
    lines.append(f"bottleneck-free P/D range (section 4.2): {bound}")
    return "\n".join(lines)
