"""Properties of the inter-engine cores over random groups and queues (hypothesis).

Each test replays the decisions step by step against an independent reading of the paper's
rules, so the cores are checked decision by decision, not only in aggregate.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from dualpath_jax.config import Policy
from dualpath_jax.sched.inter import (
    GroupTotals,
    assign_paths,
    de_fetch,
    de_route,
    pe_fetch,
    rr_de_fetch,
    rr_pe_fetch,
    split_blocks,
)
from dualpath_jax.sched.types import EngineLoad, ReadPath, Request

SETTINGS = settings(max_examples=80, deadline=None)


@st.composite
def requests(draw, max_size: int = 25) -> list[Request]:
    n = draw(st.integers(0, max_size))
    out = []
    for i in range(n):
        prompt = draw(st.integers(1, 600))
        cached = draw(st.integers(0, prompt))
        out.append(Request(f"r{i}", f"t{i % 3}", i, prompt, cached, draw(st.integers(1, 80))))
    return out


@st.composite
def pe_group(draw) -> list[EngineLoad]:
    n = draw(st.integers(1, 9))
    nodes = draw(st.integers(1, 3))
    node_q = [draw(st.integers(0, 3000)) for _ in range(nodes)]
    out = []
    for e in range(n):
        node = e % nodes
        out.append(
            EngineLoad(
                engine=100 + e,
                node=node,
                group=0,
                seq_e=draw(st.integers(0, 10)),
                tok_e=draw(st.integers(0, 3000)),
                read_q=node_q[node],
            )
        )
    return out


@st.composite
def de_group(draw) -> list[EngineLoad]:
    n = draw(st.integers(1, 8))
    return [
        EngineLoad(
            engine=200 + e,
            node=10 + e // 4,
            group=1,
            seq_e=draw(st.integers(0, 6)),
            tok_e=draw(st.integers(0, 3000)),
            read_q=draw(st.integers(0, 3000)),
            free_hbm_tokens=draw(st.integers(0, 2500)),
        )
        for e in range(n)
    ]


thresholds = st.tuples(st.integers(0, 3000), st.integers(0, 4000))


@SETTINGS
@given(pe_group(), requests(), thresholds)
def test_pe_fetch_follows_algorithm_1(pes, queue, ab):
    alpha, beta = ab
    res = pe_fetch(queue, pes, alpha=alpha, beta=beta)
    # FIFO: the assigned requests are exactly the head of the queue, in order.
    assert [r for r, _ in res.assigned] == queue[: res.taken]
    tok = {x.engine: x.tok_e for x in pes}
    short = {x.engine: x.read_q <= alpha for x in pes}
    order = [x.engine for x in pes]
    for r, e in res.assigned:
        # C1 never gets work.
        assert tok[e] <= beta
        c2 = [x for x in order if tok[x] <= beta and short[x]]
        c3 = [x for x in order if tok[x] <= beta and not short[x]]
        cls = c2 or c3  # C2 before C3
        assert e in cls
        best = min(tok[x] for x in cls)
        assert tok[e] == best
        assert e == next(x for x in cls if tok[x] == best)  # first listed among equals
        tok[e] += r.tokens
    if res.taken < len(queue):  # stopped: every PE is overloaded
        assert all(t > beta for t in tok.values())
    final = {x.engine: x for x in res.loads}
    for x in pes:
        n = sum(1 for _, e in res.assigned if e == x.engine)
        assert final[x.engine].tok_e == tok[x.engine]
        assert final[x.engine].seq_e == x.seq_e + n
        assert final[x.engine].read_q == x.read_q
    assert pe_fetch(queue, pes, alpha=alpha, beta=beta) == res  # deterministic


@SETTINGS
@given(de_group(), requests(), st.sampled_from([1.0, 1.05, 1.5]))
def test_de_fetch_phase_2(des, queue, z_factor):
    res = de_fetch(queue, des, z_factor=z_factor)
    assert [r for r, _ in res.assigned] == queue[: res.taken]
    # R and Z recomputed independently.
    free_total = sum(x.free_hbm_tokens for x in des)
    head, used = [], 0
    for r in queue:
        if used + r.hbm_tokens > free_total:
            break
        used += r.hbm_tokens
        head.append(r)
    z = z_factor * (sum(r.tokens for r in head) + sum(x.tok_e for x in des)) / len(des)
    assert abs(res.z - z) < 1e-9
    assert res.taken <= len(head)
    tok = {x.engine: x.tok_e for x in des}
    seq = {x.engine: x.seq_e for x in des}
    hbm = {x.engine: x.free_hbm_tokens for x in des}
    order = [x.engine for x in des]
    for r, e in res.assigned:
        room = [x for x in order if hbm[x] >= r.hbm_tokens]
        assert e in room  # never beyond its HBM
        low = [x for x in room if tok[x] + r.tokens <= z]
        if low:
            key = min((seq[x], tok[x]) for x in low)
            assert (seq[e], tok[e]) == key and e == next(x for x in low if (seq[x], tok[x]) == key)
        else:
            best = min(tok[x] for x in room)
            assert tok[e] == best and e == next(x for x in room if tok[x] == best)
        tok[e] += r.tokens
        seq[e] += 1
        hbm[e] -= r.hbm_tokens
    assert all(v >= 0 for v in hbm.values())
    if res.taken < len(queue):  # stopped: no DE has room for the next head
        nxt = queue[res.taken]
        assert all(v < nxt.hbm_tokens for v in hbm.values())
    final = {x.engine: x for x in res.loads}
    assert all(final[e].free_hbm_tokens == hbm[e] and final[e].tok_e == tok[e] for e in order)
    assert de_fetch(queue, des, z_factor=z_factor) == res


@SETTINGS
@given(requests(), st.dictionaries(st.integers(0, 9), st.integers(0, 5000), min_size=1))
def test_de_route_sends_each_request_to_the_lightest_group(queue, group_tok):
    routes, after = de_route(queue, group_tok)
    assert [r for r, _ in routes] == queue
    tot = dict(group_tok)
    for r, g in routes:
        best = min(tot.values())
        assert tot[g] == best and g == min(k for k, v in tot.items() if v == best)
        tot[g] += r.tokens
    assert after == tot
    if queue:  # one request at a time (the simulator routes as rounds come) agrees
        tot = dict(group_tok)
        for r, g in routes:
            one, tot = de_route([r], tot)
            assert one == ((r, g),)
        assert tot == after


@SETTINGS
@given(
    st.dictionaries(st.integers(0, 9), st.integers(0, 5000), min_size=1),
    st.lists(st.tuples(st.integers(0, 40), st.integers(-1, 5000)), max_size=160),
    requests(6),
)
def test_group_totals_find_the_least_group_as_a_scan(start, changes, queue):
    """`GroupTotals` (the scheduler's phase-1 totals) against a dict: same contents after any
    mix of changes and removals (-1), the least group with ties to the smallest id (scanned up
    to `SCAN_GROUPS` groups, from its heap past them), and the same routes from `de_route` one
    request at a time and all at once."""
    plain, totals = dict(start), GroupTotals(start)
    for g, t in changes:
        if t < 0:
            if g in plain and len(plain) > 1:
                del plain[g], totals[g]
            continue
        plain[g] = t
        totals[g] = t
        assert dict(totals) == plain and len(totals) == len(plain)
        best = min(plain.values())
        assert totals.least() == min(k for k, v in plain.items() if v == best)
    for r in queue:
        assert de_route([r], totals) == de_route([r], plain)
    assert de_route(queue, totals) == de_route(queue, plain)


@SETTINGS
@given(pe_group(), de_group(), requests(), st.integers(0, 4000))
def test_round_robin_respects_beta_and_hbm(pes, des, queue, beta):
    res = rr_pe_fetch(queue, pes, beta=beta, cursor=1)
    tok = {x.engine: x.tok_e for x in pes}
    for r, e in res.assigned:
        assert tok[e] <= beta
        tok[e] += r.tokens
    assert [r for r, _ in res.assigned] == queue[: res.taken]
    d = rr_de_fetch(queue, des, cursor=0)
    hbm = {x.engine: x.free_hbm_tokens for x in des}
    for r, e in d.assigned:
        assert hbm[e] >= r.hbm_tokens
        hbm[e] -= r.hbm_tokens


@SETTINGS
@given(
    st.integers(0, 200),
    st.integers(0, 20000),
    st.integers(0, 20000),
    st.sampled_from([16, 64]),
    st.floats(0.25, 4.0),
)
def test_split_blocks_balances_drain_times(n, q_pe, q_de, bt, rate_ratio):
    pe_rate, de_rate = 1.0, rate_ratio
    pb, db = split_blocks(
        n, q_pe, q_de, block_tokens=bt, pe_read_rate=pe_rate, de_read_rate=de_rate
    )
    assert pb + db == n and pb >= 0 and db >= 0
    t_pe = (q_pe + pb * bt) / pe_rate
    t_de = (q_de + db * bt) / de_rate
    if 0 < pb < n:  # interior: both sides finish within one block of each other
        assert abs(t_pe - t_de) <= bt * (1 / pe_rate + 1 / de_rate) / 2 + 1e-6
    elif n and pb == 0:  # everything on the DE side: the PE side alone is already later
        assert (q_pe + bt / 2) / pe_rate >= (q_de + (n - 0.5) * bt) / de_rate - 1e-6
    elif n and pb == n:
        assert (q_de + bt / 2) / de_rate >= (q_pe + (n - 0.5) * bt) / pe_rate - 1e-6


@SETTINGS
@given(requests(), st.dictionaries(st.integers(0, 3), st.integers(0, 5000)))
def test_shorter_queue_path_sees_its_own_updates(queue, qs):
    pe_node = {1: 0, 2: 1}
    de_node = {5: 2, 6: 3}
    pairs = [(r, 1 + i % 2, 5 + (i // 2) % 2) for i, r in enumerate(queue)]
    out, after = assign_paths(pairs, pe_node, de_node, qs, mode="shorter", block_tokens=64)
    q = {n: qs.get(n, 0) for n in range(4)}
    for a, (r, pe, de) in zip(out, pairs):
        if r.cached_tokens == 0:
            assert a.path is ReadPath.NONE
            continue
        pq, dq = q[pe_node[pe]], q[de_node[de]]
        want = ReadPath.PE if pq <= dq else ReadPath.DE
        assert a.path is want
        q[pe_node[pe] if want is ReadPath.PE else de_node[de]] += r.cached_tokens
        assert a.pe_read_blocks + a.de_read_blocks == r.cached_blocks(64)
    assert {n: after.get(n, 0) for n in range(4)} == q


@SETTINGS
@given(requests(), st.integers(0, 3))
def test_alternate_path_takes_turns_blind_to_queues(queue, cursor):
    pe_node, de_node = {1: 0}, {5: 1}
    pairs = [(r, 1, 5) for r in queue]
    out, after = assign_paths(
        pairs,
        pe_node,
        de_node,
        {0: 10**6, 1: 0},
        mode="alternate",
        block_tokens=64,
        turns={5: cursor},
    )
    with_hits = [a for a in out if a.path is not ReadPath.NONE]
    want = [ReadPath.PE if (cursor + k) % 2 == 0 else ReadPath.DE for k in range(len(with_hits))]
    assert [a.path for a in with_hits] == want
    assert after[0] - 10**6 == sum(
        a.request.cached_tokens for a in with_hits if a.path is ReadPath.PE
    )


def test_round_robin_scheduler_alternates_read_sides_across_fetches():
    from dualpath_jax.sched.scheduler import GlobalScheduler

    s = GlobalScheduler(Policy.DUALPATH_RR, alpha=1e9, beta=1e9, block_tokens=64)
    de = EngineLoad(5, 1, 0, 0, 0, 0, 10**6)
    pe = EngineLoad(1, 0, 0, 0, 0, 0, 0)
    paths = []
    for i in range(4):
        s.submit(Request(f"r{i}", "t", 1, 128, 64, 8))
        s.fetch_de(0, [de])
        paths += [a.path for a in s.fetch_pe(0, [pe])]
    assert paths == [ReadPath.PE, ReadPath.DE, ReadPath.PE, ReadPath.DE]


def test_alternate_turns_are_kept_per_decode_engine():
    pe_node, de_node = {1: 0}, {5: 1, 6: 2}
    queue = [Request(f"r{i}", "t", 1, 128, 64, 8) for i in range(8)]
    pairs = [(r, 1, 5 + i % 2) for i, r in enumerate(queue)]  # DEs chosen in turn
    out, after = assign_paths(
        pairs, pe_node, de_node, {}, mode="alternate", block_tokens=64, turns={}
    )
    # one shared cursor would read every DE-side hit on DE 6 (lockstep with the DE turns)
    assert [a.path for a in out] == [ReadPath.PE] * 2 + [ReadPath.DE] * 2 + [ReadPath.PE] * 2 + [
        ReadPath.DE
    ] * 2
    assert after == {0: 256, 1: 128, 2: 128}
