"""`sim.fit` recovers known prefill/decode costs from a router event log."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dualpath_jax.sched.cost import summed_keys
from dualpath_jax.sim.fit import fit_events

BT, KVB = 16, 768
P0, P1, P2, H_PE = 0.05, 2e-4, 3e-8, 1e-7  # prefill batch: s, s/token, s/pair, s/PE-side hit byte
C, S = 0.3, 0.02  # decode: per-request overhead, step


def _events(rng: np.random.Generator) -> list[dict]:
    ev, t, n = [], 0.0, 0
    for batch in range(40):
        size = int(rng.integers(1, 4))
        reqs = []
        for _ in range(size):
            hit_blocks, new, gen = (
                int(rng.integers(0, 40)),
                int(rng.integers(10, 200)),
                int(rng.integers(1, 30)),
            )
            reqs.append((f"r{n}", hit_blocks, new, gen))
            n += 1
        secs = P0 + sum(
            P1 * new + P2 * summed_keys(h * BT, new) + H_PE * h * BT * KVB for _, h, new, _ in reqs
        )
        for rid, h, new, gen in reqs:
            ev += [
                {
                    "kind": "submit",
                    "t": t,
                    "request": rid,
                    "prompt": h * BT + new,
                    "cached": h * BT,
                    "gen": gen,
                },
                {
                    "kind": "assign",
                    "t": t,
                    "request": rid,
                    "pe": batch % 2,
                    "de": 2,
                    "path": "pe",
                    "pe_blocks": h,
                    "de_blocks": 0,
                },
                {
                    "kind": "first_token",
                    "t": t + secs,
                    "request": rid,
                    "hit_blocks": h,
                    "prefill_s": secs,
                },
                {"kind": "decoded", "t": t + secs + C + S * (gen - 1), "request": rid},
            ]
        t += 10.0
    return ev


def test_fit_recovers_known_costs(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "events.jsonl").write_text(
        "\n".join(json.dumps(e) for e in _events(np.random.default_rng(0))) + "\n"
    )
    fit = fit_events([run], block_tokens=BT, kv_bytes_per_token=KVB)
    assert fit.cost.prefill == pytest.approx((P0, P1, P2), rel=1e-6)
    assert fit.hit_s_per_byte[0] == pytest.approx(H_PE, rel=1e-6)
    assert fit.cost.decode[0] == pytest.approx(S, rel=1e-9)
    assert fit.decode_overhead_s == pytest.approx(C, rel=1e-9)
    assert fit.prefill_batches == 40 and fit.prefill_rms_s < 1e-9


def test_fit_without_finished_requests_is_an_error(tmp_path):
    (tmp_path / "events.jsonl").write_text(json.dumps({"kind": "register", "t": 0.0}) + "\n")
    with pytest.raises(ValueError, match="no finished requests"):
        fit_events([tmp_path], block_tokens=BT, kv_bytes_per_token=KVB)
