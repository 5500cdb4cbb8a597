"""Weka coding-agent sessions (`workload.trace_format="weka"`) replayed on `configs/cpu_1p2d.py`
(tiny Qwen2, 1 PE and 2 DEs, in-process runtime) under Basic, DualPath and Oracle: every policy
generates the same tokens, and every round's `cached_tokens` is the hit its hash ids imply.

The expected hits are worked out here from the session files themselves, not by the code under
test: `StoreModel` replays the rounds one after another over token *labels* (a hash id's block
is the labels `(namespace, id, j)`, so equal ids are equal tokens; a private tail or append has
labels of its own; a generated token is labelled by the prompt it follows, as greedy decoding
makes it a function of that prompt). After a round, the store holds every whole store block of
its prompt and generated tokens but the last one (whose KV is never computed); a round hits the
leading blocks of its prompt the store holds, less one block when they would cover the whole
prompt (one token must be computed). The trajectories run one at a time (`max_concurrent=1`),
so each round sees exactly what the rounds before it stored.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

import pytest
from trace_helpers import WEKA_SESSIONS, req

from dualpath_jax.config import ExperimentConfig, Policy
from dualpath_jax.configs_loader import load_config
from dualpath_jax.presets import TINY_CPU_PREFILL_COST, cpu_emulated
from dualpath_jax.rollout import run_trajectories
from dualpath_jax.workload.arrivals import build_workload, check_context
from dualpath_jax.workload.trace import Round

ROOT = pathlib.Path(__file__).resolve().parents[2]
POLICIES = ("basic", "dualpath", "oracle")
TIMEOUT_S = 300.0


def replay_config(trace: pathlib.Path, policy: str, **workload: object) -> ExperimentConfig:
    """cpu_1p2d on threads, its prefill cost pinned (no calibration at start), links 100x the
    config's (the hits do not depend on them; the runs take less time), a store that keeps every
    block (`capacity_bytes=-1`: the expectation assumes no eviction), the sessions as a trace."""
    cfg = load_config(str(ROOT / "configs" / "cpu_1p2d.py"))
    w = dataclasses.replace(
        cfg.workload, trace=str(trace), trace_format="weka", agents=None, mode="offline",
        length_scale=1.0, max_len=0, max_turns=0, tool_gap_s=0.0,
    )  # fmt: skip
    return dataclasses.replace(
        cfg,
        hardware=cpu_emulated(100 * cfg.hardware.snic_bytes_per_s),
        cluster=dataclasses.replace(
            cfg.cluster, runtime="thread", prefill_cost_json=TINY_CPU_PREFILL_COST.to_json()
        ),
        store=dataclasses.replace(cfg.store, capacity_bytes=-1),
        scheduler=dataclasses.replace(cfg.scheduler, policy=Policy(policy)),
        workload=dataclasses.replace(w, **workload),
    )


# --------------------------------------------------------------------------- expected hits


def _shared_ids(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def first_requests(session: dict) -> dict[str, dict]:
    """Trajectory id -> the request its first round is (the format's rules: a session and each
    subagent `<id>:<agent_id>` are trajectories; a request whose hash-id prefix shared with the
    previous request covers under half of that one's input starts `<id>:<k>`, k = 2, 3, ...)."""
    block = session.get("block_size", 64)
    out: dict[str, dict] = {}

    def walk(requests: list[dict], tid: str) -> None:
        own = [r for r in requests if r.get("type") != "subagent"]
        out[tid] = own[0]
        k = 1
        for prev, r in zip(own, own[1:]):
            if 2 * _shared_ids(prev["hash_ids"], r["hash_ids"]) * block < prev["in"]:
                k += 1
                out[f"{tid}:{k}"] = r
        for r in requests:
            if r.get("type") == "subagent":
                walk(r["requests"], f"{tid}:{r['agent_id']}")

    walk(session["requests"], session["id"])
    return out


def first_labels(session: dict, request: dict, length_scale: float) -> list[tuple]:
    """The labels of a first round's tokens: `block x length_scale` tokens (at least 1) a hash
    id, a last id naming a partial block shortened in proportion, then the unhashed rest of the
    input (scaled) as the request's own tokens."""
    block = session.get("block_size", 64)
    bt = max(1, round(block * length_scale))
    ns = session["id"] if session.get("hash_id_scope", "local") == "local" else None
    ids, n_in = request["hash_ids"], request["in"]
    full = min(len(ids), n_in // block)
    labels = [(ns, h, j) for h in ids[:full] for j in range(bt)]
    rest = (n_in - full * block) * bt / block
    if len(ids) > full:
        labels += [(ns, ids[-1], j) for j in range(max(1, round(rest)))]
    elif round(rest) > 0 or not labels:
        labels += [("tail", id(request), j) for j in range(max(1, round(rest)))]
    return labels


class StoreModel:
    """A content-addressed store of `block_tokens`-token blocks of labels (a block's key names
    its whole prefix) that keeps every block."""

    def __init__(self, block_tokens: int):
        self.bt = block_tokens
        self._keys: dict[tuple, int] = {}
        self._held: set[int] = set()
        self._prompts: dict[tuple, int] = {}

    def _chain(self, seq: list[tuple]) -> list[int]:
        out, prev = [], -1
        for k in range(len(seq) // self.bt):
            prev = self._keys.setdefault((prev, tuple(seq[k * self.bt : (k + 1) * self.bt])), len(self._keys))  # fmt: skip
            out.append(prev)
        return out

    def round(self, prompt: list[tuple], gen: int) -> tuple[int, list[tuple]]:
        """Runs a round: its cached tokens and its generated tokens' labels."""
        hit = 0
        for key in self._chain(prompt):
            if key not in self._held:
                break
            hit += 1
        if hit * self.bt >= len(prompt):
            hit -= 1
        p = self._prompts.setdefault(tuple(prompt), len(self._prompts))
        out = [("gen", p, j) for j in range(gen)]
        self._held.update(self._chain(prompt + out[:-1]))
        return hit * self.bt, out


def expected_hits(sessions: list[dict], trajectories, length_scale: float, block_tokens: int):
    """Every round's cached tokens and prompt length, the trajectories run one after another in
    order. The round lengths come from the trajectories; which tokens are shared, from the
    sessions' hash ids."""
    firsts = {tid: (s, r) for s in sessions for tid, r in first_requests(s).items()}
    assert sorted(firsts) == sorted(t.id for t in trajectories)
    store = StoreModel(block_tokens)
    hits, prompts = [], []
    for t in trajectories:
        session, request = firsts[t.id]
        labels = first_labels(session, request, length_scale)
        assert len(labels) >= t.rounds[0].append_len  # equal unless `max_len` cut the round
        context: list[tuple] = []
        h, p = [], []
        for i, r in enumerate(t.rounds):
            if i == 0:
                prompt = labels[: r.append_len]
            else:
                prompt = context + [("append", t.id, i, j) for j in range(r.append_len)]
            cached, out = store.round(prompt, r.gen)
            h.append(cached)
            p.append(len(prompt))
            context = prompt + out
        hits.append(h)
        prompts.append(p)
    return hits, prompts


# --------------------------------------------------------------------------- replay


def replay(cfg: ExperimentConfig, workdir: pathlib.Path, start_cluster, *, gaps: bool):
    """The workload's trajectories, one at a time; `gaps=False` runs each round as soon as the
    previous one ends (the think times only idle a one-at-a-time replay)."""
    plan = build_workload(cfg)
    check_context(cfg, plan.trajectories)
    trajs = plan.trajectories
    if not gaps:  # (nor waits: one at a time, each trajectory runs to its end anyway)
        trajs = [
            dataclasses.replace(t, rounds=tuple(Round(r.append, r.gen) for r in t.rounds))
            for t in trajs
        ]
    with start_cluster(cfg, workdir, "thread") as cluster:
        outs = run_trajectories(
            cluster.client(), trajs, max_concurrent=1, progress=False, timeout_s=TIMEOUT_S
        )
    assert not [o.error for o in outs if o.error]
    return plan, outs


def check_policies(tmp_path, start_cluster, sessions: list[dict], trace, *, gaps: bool, **knobs):
    """Replays `trace` under every policy; returns the tokens and the expected hits after
    checking that the policies agree and each round hit what its hash ids imply."""
    tokens, cached, prompts = {}, {}, {}
    for policy in POLICIES:
        cfg = replay_config(trace, policy, **knobs)
        plan, outs = replay(cfg, tmp_path / policy, start_cluster, gaps=gaps)
        tokens[policy] = [o.rounds for o in outs]
        cached[policy] = [[r.cached_tokens for r in o.results] for o in outs]
        prompts[policy] = [[r.prompt_tokens for r in o.results] for o in outs]
        assert [[len(x) for x in o.rounds] for o in outs] == [
            [r.gen for r in t.rounds] for t in plan.trajectories
        ]
    hits, lengths = expected_hits(
        sessions, plan.trajectories, cfg.workload.length_scale, cfg.store.block_tokens
    )
    assert tokens["dualpath"] == tokens["basic"] and tokens["oracle"] == tokens["basic"]
    for policy in POLICIES:
        assert prompts[policy] == lengths, policy
        assert cached[policy] == hits, policy
    return plan, tokens["basic"], hits


# 64-token blocks scaled by 3/8: 24-token trace blocks over the config's 16-token store blocks
# (a shared run of n trace blocks hits floor(24 n / 16) store blocks). The parent's hash ids grow
# round by round; its subagent starts with the parent's first 4 blocks (96 tokens) and a partial
# block of its own (its `t` is when it returned; no later request of the parent waits for it
# here, `waits_for` is empty); the parent's last request keeps 2 of its 13 blocks (a rebuilt
# context): the continuation `s:2`, whose first round hits those 2 blocks (48 tokens).
SESSION = {
    "id": "s",
    "block_size": 64,
    "hash_id_scope": "local",
    "requests": [
        req(0.0, 400, 40, list(range(1, 7))),
        req(10.0, 700, 30, list(range(1, 11)), think=0.3),
        {
            "t": 12.0,
            "type": "subagent",
            "agent_id": "agent_001",
            "requests": [
                req(0.0, 300, 20, [1, 2, 3, 4, 101]),
                req(7.7, 420, 16, [1, 2, 3, 4, 101, 102, 103], think=0.2),
            ],
        },
        req(20.0, 900, 50, list(range(1, 14)), think=0.3),
        req(40.0, 350, 24, [1, 2, 50, 51, 52], think=0.3, stop="end_turn"),
    ],
}
# Two sessions in the global hash-id scope sharing a system prompt (ids 1 and 2: other tokens
# than the local session's ids 1 and 2): g2's first round hits g1's 2 blocks (48 tokens).
GLOBAL = [
    {"id": "g1", "block_size": 64, "hash_id_scope": "global",
     "requests": [req(0.0, 200, 12, [1, 2, 3]), req(3.0, 260, 8, [1, 2, 3, 4], think=0.2)]},
    {"id": "g2", "block_size": 64, "hash_id_scope": "global",
     "requests": [req(0.0, 150, 10, [1, 2, 950])]},
]  # fmt: skip


def test_weka_sessions_with_a_subagent_hit_what_their_hash_ids_imply(
    tmp_path, start_cluster, reference_tokens
):
    trace = tmp_path / "sessions"
    trace.mkdir()
    sessions = [*GLOBAL, SESSION]
    for s in sessions:
        (trace / f"{s['id']}.json").write_text(json.dumps(s))
    plan, tokens, hits = check_policies(
        tmp_path, start_cluster, sessions, trace, gaps=True, length_scale=0.375
    )
    assert [t.id for t in plan.trajectories] == ["g1", "g2", "s", "s:agent_001", "s:2"]
    # By hand: a later round hits the whole blocks of its context but the last generated token
    # (g1: 75 + 4 - 1 = 78 tokens, 64; s: 150 + 15 - 1 = 164, 160, then 262 + 11 - 1 = 272),
    # g2's first round the 48 tokens it shares with g1, the subagent's the 96 it shares with
    # its parent (its second round: 112 + 8 - 1 = 119 tokens, 112), the continuation its
    # parent's first 2 blocks (48 tokens).
    assert hits == [[0, 64], [48], [0, 160, 272], [96, 112], [48]]
    assert tokens == [
        reference_tokens((t.id, [(r.append, r.gen) for r in t.rounds])) for t in plan.trajectories
    ]


@pytest.mark.slow
@pytest.mark.skipif(
    not WEKA_SESSIONS.exists(), reason="the public Weka sessions are not beside the repo"
)
def test_the_28_weka_sessions_hit_what_their_hash_ids_imply(tmp_path, start_cluster):
    """The 28 public sessions (54 trajectories with their subagents and continuations), scaled
    by 1/256: a 64-token block stays 1 token (the least a block is), so inputs scale by 1/64 and
    outputs by 1/256. `max_turns=4` keeps each trajectory's first 4 rounds and `max_len=2048`
    (cpu_1p2d's `decode_max_len`) cuts longer ones, so that the three replays take minutes; the
    think times are not waited (one trajectory at a time, they would only idle)."""
    files = sorted(WEKA_SESSIONS.glob("*.json"))
    assert len(files) == 28
    sessions = [json.loads(f.read_text()) for f in files]
    plan, _, hits = check_policies(
        tmp_path, start_cluster, sessions, WEKA_SESSIONS, gaps=False,
        length_scale=1 / 256, max_turns=4, max_len=2048,
    )  # fmt: skip
    assert len(plan.trajectories) == 54
    assert any(":agent_" in t.id for t in plan.trajectories)
    # Hits across trajectories: a continuation's first round hits its session's system prompt.
    assert any(h[0] for h in hits)
