"""Hand-worked examples in the setting of the paper's Figures 5 and 6.

Figure 5 shows one PE group of eight GPUs from which the scheduler picks the best engine for
each request; Figure 6 shows a forward batch chosen under the compute quota with the last request
cut (chunked prefill). The figures carry no numbers in the text, so the numbers below are ours;
every expected value is worked out by hand in the comments.
"""

from __future__ import annotations

from dualpath_jax.sched.cost import summed_keys
from dualpath_jax.sched.inter import de_fetch, pe_fetch
from dualpath_jax.sched.intra import PendingPrefill, PrefillQueue, pack_prefill_batch
from dualpath_jax.sched.types import EngineLoad, Request


def req(i: int, prompt: int, gen: int = 10, cached: int = 0) -> Request:
    return Request(f"r{i}", "t", i, prompt, cached, gen)


def test_figure_5_pe_group_of_eight():
    # alpha = 1000, beta = 4000. Node 0 (PE 0-3) has a short read queue (600 <= alpha), node 1
    # (PE 4-7) a long one (2400). PE 0 and PE 6 are overloaded (C1).
    # C2 = {PE1: 1500, PE2: 900, PE3: 3900}; C3 = {PE4: 100, PE5: 300, PE7: 2000}.
    toks = [4200, 1500, 900, 3900, 100, 300, 4100, 2000]
    pes = [
        EngineLoad(engine=e, node=e // 4, group=0, seq_e=1, tok_e=t, read_q=600 if e < 4 else 2400)
        for e, t in enumerate(toks)
    ]
    lens = [700, 500, 1200, 2000, 800, 3000, 500, 500, 600, 5000, 100, 4000, 4000, 1]
    queue = [req(i + 1, n) for i, n in enumerate(lens)]
    res = pe_fetch(queue, pes, alpha=1000, beta=4000)
    # r1 700  -> C2 argmin PE2 (900)          PE2 = 1600
    # r2 500  -> C2 argmin PE1 (1500)         PE1 = 2000   (PE4 has 100 but is in C3)
    # r3 1200 -> PE2 (1600)                   PE2 = 2800
    # r4 2000 -> PE1 (2000)                   PE1 = 4000   (== beta: still not overloaded)
    # r5 800  -> PE2 (2800)                   PE2 = 3600
    # r6 3000 -> PE2 (3600)                   PE2 = 6600   (now C1)
    # r7 500  -> PE3 (3900 < PE1 4000)        PE3 = 4400   (now C1)
    # r8 500  -> PE1 (4000)                   PE1 = 4500   (C2 is now empty)
    # r9 600  -> C3 argmin PE4 (100)          PE4 = 700
    # r10 5000 -> PE5 (300)                   PE5 = 5300
    # r11 100 -> PE4 (700)                    PE4 = 800
    # r12 4000 -> PE4 (800)                   PE4 = 4800
    # r13 4000 -> PE7 (2000)                  PE7 = 6000
    # r14: every PE is over beta -> the fetch ends with 13 requests assigned.
    assert [e for _, e in res.assigned] == [2, 1, 2, 1, 2, 2, 3, 1, 4, 5, 4, 4, 7]
    assert res.taken == 13
    assert [x.tok_e for x in res.loads] == [4200, 4500, 6600, 4400, 4800, 5300, 4100, 6000]
    assert [x.seq_e for x in res.loads] == [1, 4, 5, 2, 4, 2, 1, 2]


def test_de_phase_2_worked_example():
    # Four DEs of one group: (seq_e, tok_e, free HBM tokens).
    spec = [(3, 2900, 5000), (1, 2500, 1500), (2, 1000, 4000), (5, 500, 0)]
    des = [
        EngineLoad(engine=10 + i, node=9, group=1, seq_e=s, tok_e=t, free_hbm_tokens=f)
        for i, (s, t, f) in enumerate(spec)
    ]
    # (prompt, gen): HBM needs 1100, 2200, 1000, 3500, 600, 3000.
    queue = [req(1, 1000, 100), req(2, 2000, 200), req(3, 800, 200), req(4, 3000, 500)]
    queue += [req(5, 500, 100), req(6, 2500, 500)]
    res = de_fetch(queue, des, z_factor=1.05)
    # Free HBM 10500: R = r1..r5 (8400; adding r6 gives 11400).
    # Z = 1.05 * (7300 + 6900) / 4 = 3727.5
    assert res.z == 1.05 * (7300 + 6900) / 4
    # r1 (1000): room d10,d11,d12; not high: d11 (3500), d12 (2000); min seq_e -> d11
    #            (d12 has fewer tokens, but the rule balances request counts here).
    # r2 (2000): room d10,d12; not high: d12 (3000)                      -> d12
    # r3 (800):  room d10 (5000), d12 (1800); not high: d10 (3700)      -> d10
    # r4 (3000): room d10 only (4000 left); high (6700 > Z); min tok_e   -> d10
    # r5 (500):  room d12 only (1800 left); 3500 <= Z                    -> d12
    # r6 (3000): the most free HBM left is 1200 -> the fetch ends.
    assert [e for _, e in res.assigned] == [11, 12, 10, 10, 12]
    assert [x.free_hbm_tokens for x in res.loads] == [500, 400, 1200, 0]
    assert [x.tok_e for x in res.loads] == [6700, 3500, 3500, 500]


def test_figure_6_compute_quota_batch():
    def attn(pairs):  # 10 ns per causal query-key pair
        return 1e-8 * sum(summed_keys(c, b) for c, b in pairs)

    q = PrefillQueue()
    q.add(PendingPrefill("A", 4000, 400))  #  1,680,200 pairs -> 16.802 ms
    q.add(PendingPrefill("B", 20000, 1000))  # 20,500,500 pairs -> 205.005 ms
    q.add(PendingPrefill("C", 30000, 500))  # 15,125,250 pairs -> would reach 373 ms
    q.add(PendingPrefill("D", 0, 2000))
    plan = q.next_batch(attn, 0.3)
    # 300 - 221.807 = 78.193 ms = 7,819,300 pairs for C: b*30000 + b(b+1)/2 <= 7,819,300
    # b = 259 -> 7,803,670 fits; b = 260 -> 7,833,930 does not.
    assert plan.pairs == ((4000, 400), (20000, 1000), (30000, 259))
    assert plan.rest == PendingPrefill("C", 30259, 241)
    assert abs(plan.predicted_s - 1e-8 * (1_680_200 + 20_500_500 + 7_803_670)) < 1e-12
    # The remainder of C goes first next time: 241*30259 + 241*242/2 = 7,321,580 pairs.
    plan = q.next_batch(attn, 0.3)
    assert plan.pairs == ((30259, 241), (0, 2000))
    assert abs(plan.predicted_s - 1e-8 * (7_321_580 + 2_001_000)) < 1e-12
    assert len(q) == 0


def test_a_single_token_over_the_quota_still_runs_alone():
    def attn(pairs):
        return 1e-8 * sum(summed_keys(c, b) for c, b in pairs)

    queue = [PendingPrefill("huge", 40_000_000, 10), PendingPrefill("next", 0, 5)]
    plan = pack_prefill_batch(queue, attn, 0.3)
    assert plan.pairs == ((40_000_000, 1),)  # 0.4 s > quota, but nothing smaller exists
    assert plan.rest == PendingPrefill("huge", 40_000_001, 9)
