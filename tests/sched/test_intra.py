"""Compute-quota packing (paper 6.2) and DE admission."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dualpath_jax.sched.cost import FittedCostModel, summed_keys
from dualpath_jax.sched.intra import (
    PendingPrefill,
    PrefillQueue,
    admit_decode,
    pack_prefill_batch,
)


def pair_cost(per_pair: float, per_token: float = 0.0):
    """A monotone attention-time model: seconds per causal query-key pair (+ per new token)."""

    def f(pairs):
        return sum(per_pair * summed_keys(c, b) + per_token * b for c, b in pairs)

    return f


@st.composite
def pending(draw):
    n = draw(st.integers(0, 12))
    return [
        PendingPrefill(f"r{i}", draw(st.integers(0, 5000)), draw(st.integers(1, 800)))
        for i in range(n)
    ]


@settings(max_examples=100, deadline=None)
@given(
    pending(),
    st.floats(1e-9, 1e-6),
    st.floats(0.0, 1e-4),
    st.floats(1e-4, 0.5),
    st.integers(0, 5),
)
def test_packing_respects_the_quota_and_cuts_maximally(queue, per_pair, per_token, quota, max_req):
    cost = pair_cost(per_pair, per_token)
    plan = pack_prefill_batch(queue, cost, quota, max_requests=max_req)
    chunks = plan.chunks
    # FIFO: chunk i is queue item i; all but a cut last one are whole.
    assert [c.request_id for c in chunks] == [q.request_id for q in queue[: len(chunks)]]
    for c, q in zip(chunks, queue):
        assert c.cached == q.cached and 1 <= c.bsz <= q.new
    assert all(c.bsz == q.new for c, q in zip(chunks[: plan.taken], queue))
    if max_req:
        assert len(chunks) <= max_req
    # The quota holds, except for one request that cannot be cut below one token.
    if cost(plan.pairs) > quota:
        assert len(chunks) == 1 and chunks[0].bsz == 1
    assert plan.predicted_s == pytest.approx(cost(plan.pairs))
    if plan.rest is not None:
        last, q = chunks[-1], queue[len(chunks) - 1]
        assert plan.rest == PendingPrefill(q.request_id, q.cached + last.bsz, q.new - last.bsz)
        assert plan.taken == len(chunks) - 1
        # bsz' is the largest that fits: one more token overflows (unless forced to 1).
        bigger = [*plan.pairs[:-1], (last.cached, last.bsz + 1)]
        assert cost(bigger) > quota or (len(chunks) == 1 and last.bsz == 1)
    else:
        assert plan.taken == len(chunks)
        if len(chunks) < len(queue) and (not max_req or len(chunks) < max_req):
            # Stopped without a cut: not even one token of the next request fits.
            nxt = queue[len(chunks)]
            assert chunks and cost([*plan.pairs, (nxt.cached, 1)]) > quota
    assert pack_prefill_batch(queue, cost, quota, max_requests=max_req) == plan


@settings(max_examples=40, deadline=None)
@given(pending(), st.floats(1e-3, 0.3))
def test_prefill_queue_conserves_tokens_and_puts_the_rest_first(queue, quota):
    q = PrefillQueue()
    for item in queue:
        q.add(item)
    cost = pair_cost(1e-7)
    computed: dict[str, int] = {}
    order = []
    for _ in range(10_000):
        if not len(q):
            break
        plan = q.next_batch(cost, quota)
        assert plan.chunks
        for c in plan.chunks:
            # KV is computed in order: each chunk starts where the previous one ended.
            want = next(x.cached for x in queue if x.request_id == c.request_id)
            assert c.cached == want + computed.get(c.request_id, 0)
            computed[c.request_id] = computed.get(c.request_id, 0) + c.bsz
            if not order or order[-1] != c.request_id:
                order.append(c.request_id)
    assert not len(q)
    assert computed == {x.request_id: x.new for x in queue}
    assert order == [x.request_id for x in queue]  # a cut request finishes before the next


def test_max_tokens_caps_the_batch():
    queue = [PendingPrefill("a", 0, 100), PendingPrefill("b", 0, 100)]
    plan = pack_prefill_batch(queue, pair_cost(0.0), 1.0, max_tokens=150)
    assert plan.pairs == ((0, 100), (0, 50))
    assert plan.rest == PendingPrefill("b", 50, 50)


def test_fitted_model_as_the_quota_oracle():
    fitted = FittedCostModel(prefill=(0.01, 1e-4, 1e-8))
    queue = [PendingPrefill("a", 10_000, 2_000), PendingPrefill("b", 0, 50_000)]
    plan = pack_prefill_batch(queue, fitted.attention_time, 0.3)
    assert plan.taken == 1 and plan.rest is not None
    assert fitted.attention_time(plan.pairs) <= 0.3


def test_pending_prefill_needs_a_new_token():
    with pytest.raises(ValueError):
        PendingPrefill("x", 10, 0)


def test_admit_decode_is_fifo_by_hbm_and_slots():
    waiting = [("a", 100), ("b", 300), ("c", 50)]
    assert admit_decode(waiting, free_hbm_tokens=1000, free_slots=8) == ("a", "b", "c")
    # "b" does not fit, and "c" may not overtake it.
    assert admit_decode(waiting, free_hbm_tokens=350, free_slots=8) == ("a",)
    assert admit_decode(waiting, free_hbm_tokens=1000, free_slots=2) == ("a", "b")
    assert admit_decode(waiting, free_hbm_tokens=1000, free_slots=0) == ()


def _cost_models():
    from dualpath_jax.presets import HOPPER_NODE, get_preset, make_cost_model

    roofline = make_cost_model(
        HOPPER_NODE, get_preset("deepseek-v3.2-660b"), kv_format="fp8_flashmla"
    )
    return [FittedCostModel(prefill=(0.02, 2e-5, 5e-9)), roofline]


@settings(max_examples=60, deadline=None)
@given(
    items=st.lists(
        st.tuples(st.integers(0, 60_000), st.integers(1, 4_000)), min_size=1, max_size=12
    ),
    quota_ms=st.sampled_from([1.0, 30.0, 300.0]),
    max_tokens=st.sampled_from([0, 2_000]),
)
def test_packing_with_additive_terms_plans_the_same_batch(items, quota_ms, max_tokens):
    queue = [PendingPrefill(f"r{i}", c, n) for i, (c, n) in enumerate(items)]
    for cost in _cost_models():
        plain = pack_prefill_batch(
            queue, cost.attention_time, quota_ms / 1e3, max_tokens=max_tokens
        )
        fast = pack_prefill_batch(
            queue, cost.attention_time, quota_ms / 1e3, max_tokens=max_tokens, terms=cost
        )
        assert fast == plain


@settings(max_examples=200, deadline=None)
@given(
    steps=st.lists(st.floats(0.0, 5.0), min_size=1, max_size=40),
    hi=st.integers(0, 5_000),
    quota=st.floats(0.0, 50.0),
    power=st.sampled_from([0.5, 1.0, 2.0]),
)
def test_largest_fitting_is_the_binary_search_answer(steps, hi, quota, power):
    from dualpath_jax.sched.intra import _largest_fitting

    # Any nondecreasing cost: a staircase (flat runs, jumps) plus a smooth part.
    def time_of(b: int) -> float:
        return sum(steps[: b * len(steps) // (hi + 2)]) + (b / (hi + 1)) ** power

    lo, h = 0, hi
    while lo < h:
        mid = (lo + h + 1) // 2
        if time_of(mid) <= quota:
            lo = mid
        else:
            h = mid - 1
    assert _largest_fitting(hi, time_of, quota) == lo


def test_max_kv_tokens_caps_the_context_a_batch_holds():
    queue = [
        PendingPrefill("a", 900, 100),
        PendingPrefill("b", 900, 100),
        PendingPrefill("c", 10, 50),
    ]
    # a (1,000 tokens of context) fits; b would bring the batch to 2,000 > 1,500: the batch stops.
    plan = pack_prefill_batch(queue, pair_cost(0.0), 1.0, max_kv_tokens=1_500)
    assert plan.pairs == ((900, 100),) and plan.rest is None and plan.taken == 1
    # With room for part of b's new tokens, b is cut (its whole cached context counts).
    plan = pack_prefill_batch(queue, pair_cost(0.0), 1.0, max_kv_tokens=1_950)
    assert plan.pairs == ((900, 100), (900, 50)) and plan.rest == PendingPrefill("b", 950, 50)
    # A lone request runs whatever its context.
    plan = pack_prefill_batch(queue, pair_cost(0.0), 1.0, max_kv_tokens=10)
    assert plan.pairs == ((900, 100),)


@settings(max_examples=60, deadline=None)
@given(
    items=st.lists(
        st.tuples(st.integers(0, 60_000), st.integers(1, 4_000)), min_size=1, max_size=12
    ),
    max_kv=st.sampled_from([0, 5_000, 40_000, 200_000]),
)
def test_kv_bound_plans_agree_with_and_without_additive_terms(items, max_kv):
    queue = [PendingPrefill(f"r{i}", c, n) for i, (c, n) in enumerate(items)]
    for cost in _cost_models():
        plain = pack_prefill_batch(queue, cost.attention_time, 0.3, max_kv_tokens=max_kv)
        fast = pack_prefill_batch(queue, cost.attention_time, 0.3, max_kv_tokens=max_kv, terms=cost)
        assert fast == plain
        if len(plain.chunks) > 1 and max_kv:
            assert sum(c + b for c, b in plain.pairs) <= max_kv


def test_batch_kv_bound_is_per_layer_only_without_layerwise_prefill():
    from dualpath_jax.sched.intra import batch_kv_bound

    assert batch_kv_bound(1_000, 61, layerwise=False) == 1_000
    assert batch_kv_bound(1_000, 61, layerwise=True) == 61_000
    assert batch_kv_bound(0, 61, layerwise=True) == 0


@st.composite
def pending_with_leads(draw):
    """Queues where some requests recompute a lead `[0, lead)` before `new` tokens after
    `lead + loaded`."""
    out = []
    for i in range(draw(st.integers(0, 8))):
        lead, loaded, new = (
            draw(st.integers(0, 400)),
            draw(st.integers(0, 600)),
            draw(st.integers(1, 500)),
        )
        if lead and loaded:
            out.append(PendingPrefill(f"r{i}", 0, lead, lead + loaded, new))
        else:
            out.append(PendingPrefill(f"r{i}", loaded, new))
    return out


@settings(max_examples=60, deadline=None)
@given(pending_with_leads(), st.floats(1e-3, 0.3), st.integers(0, 300))
def test_a_second_range_runs_after_the_first_in_a_later_batch(queue, quota, max_tokens):
    q = PrefillQueue()
    for item in queue:
        q.add(item)
    cost = pair_cost(1e-7)
    ranges: dict[str, list[tuple[int, int]]] = {}  # request -> computed (start, end) in order
    batches = 0
    for _ in range(10_000):
        if not len(q):
            break
        plan = q.next_batch(cost, quota, max_tokens=max_tokens)
        batches += 1
        seen = [c.request_id for c in plan.chunks]
        assert len(seen) == len(set(seen))  # both ranges of a request never share a batch
        for c in plan.chunks:
            rr = ranges.setdefault(c.request_id, [])
            if rr and rr[-1][1] == c.cached:
                rr[-1] = (rr[-1][0], c.cached + c.bsz)
            else:
                rr.append((c.cached, c.cached + c.bsz))
            # the batch finishes a request exactly when it computes its last prompt token
            item = next(x for x in queue if x.request_id == c.request_id)
            end = (item.then_cached + item.then_new) if item.then_new else item.cached + item.new
            assert plan.finishes(c.request_id) == (c.cached + c.bsz == end)
    assert not len(q)
    for item in queue:
        want = [(item.cached, item.cached + item.new)]
        if item.then_new:
            want.append((item.then_cached, item.then_cached + item.then_new))
        assert ranges[item.request_id] == want


def test_a_second_range_goes_to_the_head_of_the_queue():
    q = PrefillQueue()
    q.add(PendingPrefill("a", 0, 32, 64, 8))  # lead 32, 32 loaded, 8 new
    q.add(PendingPrefill("b", 0, 40))
    plan = q.next_batch(pair_cost(0.0), 1.0)
    assert plan.pairs == ((0, 32), (0, 40)) and not plan.finishes("a") and plan.finishes("b")
    assert plan.then == (PendingPrefill("a", 64, 8),)
    plan = q.next_batch(pair_cost(0.0), 1.0)
    assert plan.pairs == ((64, 8),) and plan.finishes("a")
    with pytest.raises(ValueError, match="second range"):
        PendingPrefill("c", 0, 32, 16, 8)  # would overlap the first
