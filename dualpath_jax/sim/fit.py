"""Fitting the simulator's CPU cost model to a real local cluster's `events.jsonl`.

The router logs, per request, `submit` (prompt, cached, gen), `assign` (PE, DE, read path, blocks
per side), `first_token` (the PE's batch wall time `prefill_s` and the effective hit) and
`decoded` (the DE reported the request done, after persisting). From them:

- Prefill batches: the PE reports every request a forward batch finishes with the same
  `prefill_s`, so requests sharing `(pe, prefill_s)` are one batch. Each batch is a sample
  `prefill_s ~ p0 + p1 * new tokens + p2 * attention pairs + h_pe * PE-side hit bytes
  + h_de * DE-side hit bytes` (non-negative least squares). The hit-byte terms absorb the wait
  for the batch's cached KV (H2D / DE buffer -> PE), which the simulator moves over its links
  instead; only `(p0, p1, p2)` go into the `FittedCostModel`.
- Decode: a request's time from first token to `decoded` is a sample
  `~ c + s * (gen - 1)`: `s` is the decode step (the CPU engines step every slot, so it hardly
  depends on batch or context), `c` a fixed per-request cost: the FirstToken message, the DE's
  admission poll, the H2D copy, persistence and the DecodeDone message on a busy 2-core host.
  `c` becomes `SimOptions.decode_overhead_s`.

Samples from several runs (e.g. `basic` and `dualpath` of one config) are pooled, so one model
serves every policy of that config. Wall times on a shared CPU host are noisy; residuals are
reported with the fit.
"""

from __future__ import annotations

import collections
import dataclasses
import pathlib
from collections.abc import Iterable, Sequence

import numpy as np

from dualpath_jax.metrics.events import read_events
from dualpath_jax.sched.cost import FittedCostModel, nnls, summed_keys


@dataclasses.dataclass(frozen=True)
class CpuFit:
    """A fitted CPU cost model plus the per-request DE overhead and fit diagnostics."""

    cost: FittedCostModel
    decode_overhead_s: float
    hit_s_per_byte: tuple[float, float]  # (PE-side, DE-side) load terms of the prefill fit
    prefill_batches: int
    decode_requests: int
    prefill_rms_s: float
    decode_rms_s: float

    def to_dict(self) -> dict:
        return {
            "prefill": list(self.cost.prefill),
            "decode": list(self.cost.decode),
            "decode_overhead_s": self.decode_overhead_s,
            "hit_s_per_byte": list(self.hit_s_per_byte),
            "prefill_batches": self.prefill_batches,
            "decode_requests": self.decode_requests,
            "prefill_rms_s": self.prefill_rms_s,
            "decode_rms_s": self.decode_rms_s,
        }


def request_records(events: Iterable[dict]) -> dict[str, dict[str, dict]]:
    """`{request id: {kind: first event of that kind}}` for requests that finished."""
    recs: dict[str, dict[str, dict]] = collections.defaultdict(dict)
    for e in events:
        rid = e.get("request")
        if rid is not None:
            recs[rid].setdefault(e["kind"], e)
    need = ("submit", "assign", "first_token", "decoded")
    return {rid: r for rid, r in recs.items() if all(k in r for k in need)}


def prefill_samples(
    recs: dict[str, dict[str, dict]], block_tokens: int, kv_bytes_per_token: float
) -> list[tuple[list[float], float]]:
    """`([1, new, pairs, pe_hit_bytes, de_hit_bytes], prefill_s)` per forward batch."""
    batches: dict[tuple[int, float], list[tuple[int, int, int, int]]] = collections.defaultdict(
        list
    )
    for r in recs.values():
        ft, a = r["first_token"], r["assign"]
        cached = int(ft.get("hit_blocks", 0)) * block_tokens
        de_hit = min(cached, int(a.get("de_blocks", 0)) * block_tokens)
        pe_hit = cached - de_hit if a.get("path", "none") != "none" else 0
        batches[(a["pe"], ft["prefill_s"])].append(
            (cached, r["submit"]["prompt"] - cached, pe_hit, de_hit)
        )
    out = []
    for (_, secs), reqs in batches.items():
        out.append(
            (
                [
                    1.0,
                    float(sum(n for _, n, _, _ in reqs)),
                    float(sum(summed_keys(c, n) for c, n, _, _ in reqs)),
                    sum(p for *_, p, _ in reqs) * kv_bytes_per_token,
                    sum(d for *_, d in reqs) * kv_bytes_per_token,
                ],
                float(secs),
            )
        )
    return out


def decode_samples(recs: dict[str, dict[str, dict]]) -> list[tuple[list[float], float]]:
    """`([1, gen - 1], first token -> decoded seconds)` per request."""
    return [
        ([1.0, float(r["submit"]["gen"] - 1)], r["decoded"]["t"] - r["first_token"]["t"])
        for r in recs.values()
    ]


def fit_events(
    runs: Sequence[str | pathlib.Path], *, block_tokens: int, kv_bytes_per_token: float
) -> CpuFit:
    """Fits one CPU model to the pooled `events.jsonl` of `runs` (run directories)."""
    ps: list[tuple[list[float], float]] = []
    ds: list[tuple[list[float], float]] = []
    for run in runs:
        recs = request_records(read_events(pathlib.Path(run) / "events.jsonl"))
        ps += prefill_samples(recs, block_tokens, kv_bytes_per_token)
        ds += decode_samples(recs)
    if not ps or not ds:
        raise ValueError(f"no finished requests in the events of {list(map(str, runs))}")
    xp, yp = np.array([x for x, _ in ps]), np.array([y for _, y in ps])
    xd, yd = np.array([x for x, _ in ds]), np.array([y for _, y in ds])
    p, d = nnls(xp, yp), nnls(xd, yd)
    return CpuFit(
        cost=FittedCostModel(
            prefill=(float(p[0]), float(p[1]), float(p[2])), decode=(float(d[1]), 0.0, 0.0)
        ),
        decode_overhead_s=float(d[0]),
        hit_s_per_byte=(float(p[3]), float(p[4])),
        prefill_batches=len(ps),
        decode_requests=len(ds),
        prefill_rms_s=float(np.sqrt(np.mean((xp @ p - yp) ** 2))),
        decode_rms_s=float(np.sqrt(np.mean((xd @ d - yd) ** 2))),
    )
