"""A Weka session whose parent waits for its subagent, replayed on `configs/cpu_1p2d.py`'s cluster
(in-process runtime): the parent's waiting round reaches the router only after the subagent's last
round finished plus the recorded gap, and every trajectory still gets the reference model's tokens
(the wait changes when rounds run, never what they compute)."""

from __future__ import annotations

import dataclasses
import json

from test_cluster import PINNED_COST

from dualpath_jax import launcher
from dualpath_jax.configs_loader import load_config
from dualpath_jax.rollout import run_trajectories
from dualpath_jax.workload.arrivals import build_workload

GAP_S = 0.2


def req(t, n_in, ids, think=0.0, api=0.1):
    return {"t": t, "type": "n", "in": n_in, "out": 4, "hash_ids": ids, "think_time": think,
            "api_time": api}  # fmt: skip


# 16-token blocks. The subagent ran from 0.3 to 0.8 s; the parent's next request (1.0 s) came
# after that: it waits for the subagent, with a gap of 0.2 s after its end.
SESSION = {
    "id": "p",
    "block_size": 16,
    "requests": [
        req(0.0, 48, [1, 2, 3]),
        {"t": 0.8, "type": "subagent", "agent_id": "a", "duration_ms": 500, "requests": [
            req(0.0, 40, [7, 8]),
            req(0.2, 70, [7, 8, 9, 10], think=0.05),
            req(0.4, 100, [7, 8, 9, 10, 11, 12], think=0.05),
        ]},
        req(1.0, 80, [1, 2, 3, 4, 5], think=0.8),
        req(1.3, 100, [1, 2, 3, 4, 5, 6], think=0.1),
    ],
}  # fmt: skip


def test_the_parent_round_goes_after_its_subagent_and_tokens_are_unchanged(
    tmp_path, start_cluster, reference_tokens
):
    d = tmp_path / "sessions"
    d.mkdir()
    (d / "p.json").write_text(json.dumps(SESSION))
    base = load_config("configs/cpu_1p2d.py")
    base = dataclasses.replace(
        base, cluster=dataclasses.replace(base.cluster, prefill_cost_json=PINNED_COST)
    )
    cfg = launcher.run_config(base, "offline", trace=str(d), trace_format="weka")
    trajs = build_workload(cfg).trajectories
    assert [t.id for t in trajs] == ["p", "p:a"]
    assert trajs[0].rounds[1].waits_for == ("p:a",) and trajs[0].rounds[1].gap_s == GAP_S
    with start_cluster(cfg, tmp_path / "run", "thread") as cluster:
        outs = run_trajectories(cluster.client(), trajs, progress=False, timeout_s=300)
    assert [o.error for o in outs] == ["", ""]
    parent, child = outs
    child_end = max(r.submit_s + r.jct_s for r in child.results)
    assert parent.results[1].submit_s >= child_end + GAP_S
    # its round 0 ran beside the child's (both arrive at 0 offline)
    assert parent.results[0].submit_s < child_end
    for t, o in zip(trajs, outs):
        assert o.rounds == reference_tokens((t.id, [(r.append, r.gen) for r in t.rounds])), t.id
    assert parent.results[1].cached_tokens > 0  # its own earlier round's blocks
