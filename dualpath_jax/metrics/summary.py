"""The run summary (`summary.json`, docs/launchers.md) from round results (`results.RoundResult`),
events and link reports.

Pure functions of their inputs, shared by the local-cluster launchers and the simulator.
"""

from __future__ import annotations

import json
import math
import pathlib
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from dualpath_jax.results import RoundResult


def dist(values: Iterable[float]) -> dict[str, float]:
    """`{p50, p90, p99, mean}` of the finite values (zeros when there are none)."""
    v = np.array(values if isinstance(values, list) else list(values), float)  # None -> NaN
    v = v[np.isfinite(v)]
    if v.size == 0:
        return {"p50": 0.0, "p90": 0.0, "p99": 0.0, "mean": 0.0}
    p50, p90, p99 = np.percentile(v, [50, 90, 99])
    return {"p50": float(p50), "p90": float(p90), "p99": float(p99), "mean": float(v.mean())}


def max_over_avg(
    series: dict[str, list[tuple[float, float]]], window_s: float = 1.0, *, weighted: bool = True
) -> float:
    """Storage-NIC balance (paper Fig. 13): per time window, the busiest link's bytes over the
    mean of all links' bytes (1.0 = balanced).

    `weighted` (the default): windows count by the bytes they carry, i.e. `sum(max) / sum(mean)`
    over windows. Unweighted: the plain mean of the per-window ratios over windows where any
    traffic flowed; then a near-idle window (one read on one of N links: ratio N), as in a run's
    ramp-up and tail, weighs as much as a saturated one, although it costs no throughput.

    `series`: per link, `[(absolute window start, bytes)]` on a shared clock.

    >>> s = {"a": [(0.0, 10.0), (1.0, 1.0)], "b": [(0.0, 10.0)]}
    >>> max_over_avg(s), max_over_avg(s, weighted=False)
    (1.0476..., 1.5)
    """
    if len(series) < 2:
        return 1.0
    buckets: dict[int, dict[str, float]] = {}
    for name, points in series.items():
        for t, b in points:
            if b > 0:
                per = buckets.setdefault(int(t // window_s), {})
                per[name] = per.get(name, 0.0) + b
    maxes, means = [], []
    for per in buckets.values():
        vals = [per.get(n, 0.0) for n in series]
        mean = sum(vals) / len(vals)
        if mean > 0:
            maxes.append(max(vals))
            means.append(mean)
    if not means:
        return 1.0
    if weighted:
        return float(sum(maxes) / sum(means))
    return float(np.mean([m / a for m, a in zip(maxes, means)]))


def read_link_reports(workdir: str | pathlib.Path) -> list[dict[str, Any]]:
    d = pathlib.Path(workdir) / "links"
    return [json.loads(p.read_text()) for p in sorted(d.glob("*.json"))] if d.is_dir() else []


def link_totals(reports: Sequence[dict[str, Any]]) -> dict[str, int]:
    """Bytes per link name over every engine's report (each link is owned by one process)."""
    out: dict[str, int] = {}
    for r in reports:
        for name, v in r["snapshot"]["links"].items():
            out[name] = out.get(name, 0) + int(v["bytes"])
    return dict(sorted(out.items()))


def _breakdown(results: Sequence[RoundResult], firsts: dict[str, dict], key: str) -> list[float]:
    """A TTFT component per round: from the round's `first_token` event (the router's), else
    from the result itself (the simulator keeps `read_s` / `prefill_s` on its results; NaN: not
    known, which `dist` drops)."""
    out = []
    for r in results:
        e = firsts.get(r.request)
        out.append(e[key] if e is not None else getattr(r, key))
    return out


def summarize(
    *,
    policy: str,
    mode: str,
    emulated: bool,
    agents: int,
    results: Sequence[RoundResult],
    errors: int,
    jct_s: float,
    reports: Sequence[dict[str, Any]],
    events: Sequence[dict[str, Any]] = (),
    counters: dict[str, Any] | None = None,
    ttft_slo_s: float = math.inf,
    tpot_slo_s: float = math.inf,
    window_s: float = 1.0,
) -> dict[str, Any]:
    """The summary of one run. `results`: its rounds' `RoundResult`s (the router's or the
    simulator's); `reports`: engine link reports
    (`read_link_reports`); `events`: the router's events (TTFT breakdown)."""
    pe_nodes = {f"node{r['node']}" for r in reports if r["role"] == "prefill"}
    de_nodes = {f"node{r['node']}" for r in reports if r["role"] == "decode"}
    totals = link_totals(reports)
    snic_rx = {n: b for n, b in totals.items() if n.startswith("snic_rx:")}
    series = {}
    for r in reports:
        for name, pts in r.get("windows", {}).items():
            if name.startswith("snic_rx:"):
                series[name] = pts
    for n in [f"snic_rx:{x}" for x in pe_nodes | de_nodes]:
        series.setdefault(n, [])
    firsts = {e["request"]: e for e in events if e.get("kind") == "first_token"}
    ok_slo = [
        r
        for r in results
        if r.ttft_s <= ttft_slo_s and (len(r.tokens) < 2 or r.tpot_s <= tpot_slo_s)
    ]
    paths: dict[str, int] = {}
    for r in results:
        paths[r.read_path] = paths.get(r.read_path, 0) + 1
    return {
        "policy": policy,
        "mode": mode,
        "emulated": emulated,
        "agents": agents,
        "requests": len(results),
        "jct_s": jct_s,
        "round_jct_s": dist(r.jct_s for r in results),
        "ttft_s": dist(r.ttft_s for r in results),
        "ttst_s": dist(r.ttst_s for r in results if len(r.tokens) > 1),
        "tpot_s": dist(r.tpot_s for r in results if len(r.tokens) > 1),
        "ttft_breakdown_s": {
            "queueing": dist(r.queue_s for r in results),
            "kv_read": dist(_breakdown(results, firsts, "read_s")),
            "prefill": dist(_breakdown(results, firsts, "prefill_s")),
        },
        "tokens_generated": sum(len(r.tokens) for r in results),
        "bytes_read_pe_path": sum(b for n, b in snic_rx.items() if n.split(":", 1)[1] in pe_nodes),
        "bytes_read_de_path": sum(b for n, b in snic_rx.items() if n.split(":", 1)[1] in de_nodes),
        "read_paths": dict(sorted(paths.items())),
        "snic_max_over_avg": max_over_avg(series, window_s),
        "snic_max_over_avg_unweighted": max_over_avg(series, window_s, weighted=False),
        "recomputed_blocks": sum(r.recomputed_blocks for r in results),
        "cached_tokens": sum(r.cached_tokens for r in results),
        "prompt_tokens": sum(r.prompt_tokens for r in results),
        "slo_attainment": len(ok_slo) / len(results) if results else 0.0,
        "errors": errors,
        "link_bytes": totals,
        "router": counters or {},
    }
