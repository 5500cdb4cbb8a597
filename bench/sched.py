"""Scheduler throughput: decisions per second on one core.

Queues 10k requests shaped like the 64K trace (about 33K-token prompts, 98.7% hit, 176 generated
tokens) and lets 144 engines pull them: by default 48 PEs (6 groups of 8, one per prefill node)
and 96 DEs (12 groups of 8), i.e. 18 nodes of 8 GPUs. Engines report loads that drain between
fetches, so every fetch has work to do. Prints the end-to-end rate (DE phase 1 + phase 2 +
Algorithm 1 + read side per request) and the rates of the pure cores, next to the request rate
of the paper's 1,152-GPU run (48P96D, 48K agents x 157 turns in 3,201 s ~ 2.4k requests/s).

  python bench/sched.py [--requests=10000] [--pe_nodes=6] [--de_nodes=12] [--policy=dualpath]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from dualpath_jax.config import Policy
from dualpath_jax.sched import EngineLoad, GlobalScheduler, Request, de_fetch, pe_fetch

PAPER_RATE = 48_000 * 157 / 3201  # requests per second at 1,152 GPUs


def make_requests(n: int, seed: int = 0) -> list[Request]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        context = int(rng.integers(1_000, 64_000))
        append = int(rng.integers(50, 900))
        cached = context // 64 * 64
        out.append(Request(f"r{i}", f"t{i % 5000}", i // 5000, context + append, cached, 176))
    return out


def build_loads(pe_nodes: int, de_nodes: int, gpus: int = 8):
    pes, des = [], []
    for n in range(pe_nodes):
        pes.append([EngineLoad(n * gpus + k, n, n) for k in range(gpus)])
    base = pe_nodes * gpus
    for n in range(de_nodes):
        des.append(
            [
                EngineLoad(base + n * gpus + k, pe_nodes + n, n, free_hbm_tokens=4_000_000)
                for k in range(gpus)
            ]
        )
    return pes, des


def drained(loads: list[EngineLoad], known: dict[int, EngineLoad], rng) -> list[EngineLoad]:
    """The group's next report: the scheduler's view with part of the work finished."""
    out = []
    for x in loads:
        cur = known.get(x.engine, x)
        keep = float(rng.uniform(0.3, 0.7))
        out.append(
            EngineLoad(
                x.engine,
                x.node,
                x.group,
                int(cur.seq_e * keep),
                int(cur.tok_e * keep),
                int(rng.integers(0, 2_000_000)),
                x.free_hbm_tokens,
            )
        )
    return out


def end_to_end(policy: Policy, reqs: list[Request], pe_nodes: int, de_nodes: int) -> dict:
    pes, des = build_loads(pe_nodes, de_nodes)
    s = GlobalScheduler(policy, alpha=3.75e6, beta=2.2e6)
    rng = np.random.default_rng(1)
    for r in reqs:
        s.submit(r)
    done = 0
    fetch_times = []
    t0 = time.perf_counter()
    while done < len(reqs):
        view = s.view()
        known = {x.engine: x for x in (*view.pe, *view.de)}
        for g, loads in enumerate(des):
            rep = drained(loads, known, rng)
            t = time.perf_counter()
            s.fetch_de(g, rep)
            fetch_times.append(time.perf_counter() - t)
        for g, loads in enumerate(pes):
            rep = drained(loads, known, rng)
            t = time.perf_counter()
            done += len(s.fetch_pe(g, rep))
            fetch_times.append(time.perf_counter() - t)
    wall = time.perf_counter() - t0
    return {
        "requests_per_s": len(reqs) / sum(fetch_times),
        "wall_requests_per_s": len(reqs) / wall,
        "fetches": len(fetch_times),
        "fetch_p50_ms": 1e3 * statistics.median(fetch_times),
        "fetch_max_ms": 1e3 * max(fetch_times),
    }


def core_rates(reqs: list[Request]) -> dict:
    group = [EngineLoad(k, k // 4, 0, read_q=k * 1000) for k in range(8)]
    t = time.perf_counter()
    res = pe_fetch(reqs, group, alpha=3.75e6, beta=float("inf"))
    pe_rate = res.taken / (time.perf_counter() - t)
    dgroup = [EngineLoad(100 + k, 50, 1, free_hbm_tokens=10**9) for k in range(8)]
    t = time.perf_counter()
    res = de_fetch(reqs, dgroup, z_factor=1.05)
    de_rate = res.taken / (time.perf_counter() - t)
    return {"pe_fetch_per_s": pe_rate, "de_fetch_per_s": de_rate}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument("--pe_nodes", type=int, default=6)
    ap.add_argument("--de_nodes", type=int, default=12)
    ap.add_argument("--policy", default="dualpath", type=Policy, choices=list(Policy))
    args = ap.parse_args()
    reqs = make_requests(args.requests)
    engines = 8 * (args.pe_nodes + args.de_nodes)
    print(
        f"{args.requests} queued requests, {engines} engines ({args.pe_nodes * 8} PE, "
        f"{args.de_nodes * 8} DE, groups of 8), policy {args.policy}, one core"
    )
    e2e = end_to_end(args.policy, reqs, args.pe_nodes, args.de_nodes)
    print(
        f"end to end: {e2e['requests_per_s']:,.0f} requests/s in the scheduler "
        f"({e2e['wall_requests_per_s']:,.0f}/s counting the bench's own load reports; "
        f"{e2e['fetches']} fetches, p50 {e2e['fetch_p50_ms']:.2f} ms, "
        f"max {e2e['fetch_max_ms']:.2f} ms per fetch)"
    )
    cores = core_rates(reqs)
    print(
        f"pure cores: Algorithm 1 {cores['pe_fetch_per_s']:,.0f} decisions/s, "
        f"DE phase 2 {cores['de_fetch_per_s']:,.0f} decisions/s (one group of 8)"
    )
    print(
        f"paper's 1,152-GPU run needs ~{PAPER_RATE:,.0f} requests/s: "
        f"{e2e['requests_per_s'] / PAPER_RATE:.1f}x headroom on one core"
    )


if __name__ == "__main__":
    main()
