"""The simulated runs behind `bench/paper_figures.py`: what one run is (`Spec`), running it on the
paper's testbed and reducing it to the numbers the figures need (`execute`), and a cache of runs
under OUT/runs that runs what is missing, in parallel processes when asked (`Runner`).

A spec's config is `configs/paper.py:ARG` (`Spec.config`), loaded as the launchers load it, and
simulated with the cost model that config names: `python launch/simulate.py --config=...` with
the same ARG runs the same simulation.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import math
import pathlib
import time

import numpy as np

from dualpath_jax import native

# The simulator's compiled core when a fresh build exists (`make native`; the same results),
# before any of its modules is imported; the pure modules otherwise.
native.install()

from dualpath_jax.configs_loader import load_config  # noqa: E402
from dualpath_jax.metrics.summary import dist, max_over_avg  # noqa: E402
from dualpath_jax.sim import simulate  # noqa: E402

CONFIG_FILE = pathlib.Path(__file__).resolve().parents[1] / "configs" / "paper.py"


@dataclasses.dataclass(frozen=True)
class Spec:
    """One simulated run of the paper's testbed."""

    model: str
    p: int
    d: int
    policy: str
    agents: int = 1024
    preset: str = "64k"
    mode: str = "offline"
    aps: float = 0.0
    duration_s: float = 0.0
    append_scale: float = 1.0
    gen_scale: float = 1.0
    max_turns: int = 0
    snic_gbps: float = 400.0  # storage NIC rate per node
    ep_decode_nodes: int = 0  # decode nodes per expert-parallel group (0: all)

    @property
    def name(self) -> str:
        parts = [self.model, f"{self.p}p{self.d}d", self.policy, self.preset]
        if self.mode == "online":
            parts += [f"aps{self.aps:g}", f"dur{self.duration_s:g}"]
        else:
            parts.append(f"n{self.agents}")
        if self.append_scale != 1.0:
            parts.append(f"app{self.append_scale:g}")
        if self.gen_scale != 1.0:
            parts.append(f"gen{self.gen_scale:g}")
        if self.max_turns:
            parts.append(f"t{self.max_turns}")
        if self.snic_gbps != 400.0:
            parts.append(f"snic{self.snic_gbps:g}")
        if self.ep_decode_nodes:
            parts.append(f"ep{self.ep_decode_nodes}")
        return "_".join(parts)

    @property
    def config(self) -> str:
        """`configs/paper.py:ARG` of this run (floats written exactly, as `repr` does)."""
        options = {
            "policy": self.policy,
            "agents": self.agents,
            "preset": self.preset,
            "mode": self.mode,
            "aps": repr(self.aps),
            "duration_s": repr(self.duration_s),
            "append_scale": repr(self.append_scale),
            "gen_scale": repr(self.gen_scale),
            "max_turns": self.max_turns,
            "snic_gbps": repr(self.snic_gbps),
            "ep_decode_nodes": self.ep_decode_nodes,
        }
        split = f"{self.model}_{self.p}p{self.d}d"
        return f"{CONFIG_FILE}:" + ",".join([split, *(f"{k}={v}" for k, v in options.items())])


def execute(spec: Spec) -> dict:
    """Simulates `spec` and reduces the run to the numbers the figures need."""
    cfg = load_config(spec.config)
    t0, c0 = time.perf_counter(), time.process_time()
    run = simulate(cfg)  # the cost model the config names (the calibrated Hopper roofline)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    s = run.summary
    results = run.cluster.results
    # Online: measure the rounds submitted in the second half of the arrival period (steady
    # state, before the drain); offline: every round.
    if spec.mode == "online":
        lo = spec.duration_s / 2
        measured = [r for r in results if lo <= r.submit_s <= spec.duration_s]
    else:
        measured = results
    agents: dict[str, list[float]] = {}
    for r in results:
        a = agents.setdefault(r.request.rsplit("/r", 1)[0], [math.inf, 0.0])
        a[0], a[1] = min(a[0], r.submit_s), max(a[1], r.submit_s + r.jct_s)
    ok = [
        r
        for r in measured
        if r.ttft_s <= cfg.workload.ttft_slo_s
        and (len(r.tokens) < 2 or r.tpot_s <= cfg.workload.tpot_slo_s)
    ]
    series = {}
    for rep in run.cluster.link_reports(run.cluster.loop.now):
        for name, pts in rep["windows"].items():
            if name.startswith("snic_rx:"):
                series[name] = pts
    for rep in run.cluster.link_reports(run.cluster.loop.now):
        series.setdefault(f"snic_rx:node{rep['node']}", [])
    return {
        "spec": dataclasses.asdict(spec),
        "jct_s": s["jct_s"],
        "errors": s["errors"],
        "requests": s["requests"],
        "ttft_s": dist(r.ttft_s for r in measured),
        "ttst_s": dist(r.ttst_s for r in measured if len(r.tokens) > 1),
        "tpot_s": dist(r.tpot_s for r in measured if len(r.tokens) > 1),
        "queue_s": dist(r.queue_s for r in measured),
        "measured_rounds": len(measured),
        "slo_attainment": len(ok) / len(measured) if measured else 0.0,
        "agent_jct_mean_s": float(np.mean([b - a for a, b in agents.values()])) if agents else 0.0,
        "snic_max_over_avg": s["snic_max_over_avg"],
        "snic_balance": snic_balance(series),
        "snic_series": {n: coarse(pts, 10.0) for n, pts in series.items()},
        "bytes_read_pe_path": s["bytes_read_pe_path"],
        "bytes_read_de_path": s["bytes_read_de_path"],
        "alpha_tokens": s["sim"]["alpha_tokens"],
        "beta_tokens": s["sim"]["beta_tokens"],
        "events": run.events,
        "wall_s": wall,
        "cpu_s": cpu,
    }


def coarse(points: list, window_s: float) -> list[list[float]]:
    out: dict[int, float] = {}
    for t, b in points:
        k = int(t // window_s)
        out[k] = out.get(k, 0.0) + b
    return [[k * window_s, b] for k, b in sorted(out.items())]


def snic_balance(series: dict[str, list], windows=(1.0, 10.0, 60.0)) -> dict[str, float]:
    """Max/avg of storage-NIC read bytes across nodes: per window size, over all windows with
    traffic (the summary's metric) and over the busy ones only (mean read rate at least half of
    the busiest window's), plus over the whole run."""
    out = {}
    for w in windows:
        out[f"all_{w:g}s"] = max_over_avg(series, w)
        buckets: dict[int, dict[str, float]] = {}
        for name, pts in series.items():
            for t, b in pts:
                buckets.setdefault(int(t // w), {})[name] = (
                    buckets.get(int(t // w), {}).get(name, 0.0) + b
                )
        totals = {k: sum(v.values()) for k, v in buckets.items()}
        peak = max(totals.values(), default=0.0)
        ratios = []
        for k, per in buckets.items():
            if totals[k] >= 0.5 * peak and peak > 0:
                vals = [per.get(n, 0.0) for n in series]
                ratios.append(max(vals) / (sum(vals) / len(vals)))
        out[f"busy_{w:g}s"] = float(np.mean(ratios)) if ratios else 1.0
    tot = [sum(b for _, b in pts) for pts in series.values()]
    out["run"] = max(tot) / (sum(tot) / len(tot)) if tot and sum(tot) > 0 else 1.0
    return out


class Collected(Exception):
    """Raised by a collecting `Runner.get`: the specs a figure asked for."""

    def __init__(self, specs: list[Spec]):
        super().__init__(len(specs))
        self.specs = specs


class Runner:
    """Runs specs once each (cached under OUT/runs), in parallel processes when asked. Every
    figure asks once, before it draws; with `collect`, `get` raises `Collected` instead, so that
    `main` can run every figure's specs in one pool, the longest first."""

    def __init__(
        self, out: pathlib.Path, jobs: int, collect: bool = False, snic_gbps: float = 400.0
    ):
        self.dir = out / "runs"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.jobs = jobs
        self.collect = collect
        self.snic_gbps = snic_gbps

    def get(self, specs: list[Spec]) -> dict[Spec, dict]:
        """Results keyed by the given specs (run at this runner's storage NIC rate)."""
        actual = {s: dataclasses.replace(s, snic_gbps=self.snic_gbps) for s in specs}
        if self.collect:
            raise Collected(list(actual.values()))
        res = self._get(list(actual.values()))
        return {s: res[a] for s, a in actual.items()}

    def _get(self, specs: list[Spec]) -> dict[Spec, dict]:
        todo = list(dict.fromkeys(s for s in specs if not (self.dir / f"{s.name}.json").exists()))
        todo.sort(key=cost_guess, reverse=True)
        if todo:
            print(f"simulating {len(todo)} runs ({self.jobs} at a time)", flush=True)
        if self.jobs > 1 and len(todo) > 1:
            with concurrent.futures.ProcessPoolExecutor(self.jobs) as pool:
                for spec, res in zip(todo, pool.map(execute, todo)):
                    self._save(spec, res)
        else:
            for spec in todo:
                self._save(spec, execute(spec))
        return {s: json.loads((self.dir / f"{s.name}.json").read_text()) for s in specs}

    def _save(self, spec: Spec, res: dict) -> None:
        (self.dir / f"{spec.name}.json").write_text(json.dumps(res))
        print(
            f"  {spec.name}: JCT {res['jct_s']:.0f} s, TTFT mean {res['ttft_s']['mean']:.2f} s, "
            f"errors {res['errors']}, {res['events']} events in {res['wall_s']:.0f} s",
            flush=True,
        )


def cost_guess(s: Spec) -> float:
    """Relative simulation cost (rounds simulated), to start the longest runs first."""
    agents = s.agents if s.mode == "offline" else s.aps * s.duration_s
    return agents * (s.max_turns or 150) * (1.0 if s.policy != "oracle" else 0.5)
