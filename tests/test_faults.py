"""Fault injection (dualpath_jax.testing) against a real file block store and in-process channels."""

from __future__ import annotations

import errno
import json
import logging
import os
import threading

import numpy as np
import pytest

from dualpath_jax.config import StoreConfig
from dualpath_jax.engines.fault_hook import fault_injection
from dualpath_jax.kvstore import (
    BlockFormat,
    StoreError,
    TensorStoreBlockStore,
    block_keys,
    model_fingerprint,
)
from dualpath_jax.model.layout import BlockLayout
from dualpath_jax.presets import TINY_QWEN2
from dualpath_jax.testing.fault_plan import FaultPlan, load_plan, parse_plan
from dualpath_jax.testing.faulty import FaultyChannel, FaultyStore, wrap_channel, wrap_store
from dualpath_jax.transfer.channel import TransferError, TransferTimeout
from dualpath_jax.transfer.inprocess_channel import InProcessChannel, InProcessFabric

LAYOUT = BlockLayout(3, 4, 12)  # 3 layers, 4-token blocks, 12 bytes per token per layer
STORE_TIMEOUT_S = 7.0


def write_plan(path, plan) -> None:
    """Replaces the plan file atomically, as a test or the chaos bench does mid-run."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(plan if isinstance(plan, str) else json.dumps(plan))
    os.replace(tmp, path)


class FakeSleep:
    """Records the sleeps of delays and hangs; returns at once unless a gate is set."""

    def __init__(self, gate: threading.Event | None = None):
        self.calls: list[float] = []
        self.gate = gate

    def __call__(self, seconds: float) -> None:
        self.calls.append(seconds)
        if self.gate is not None:
            assert self.gate.wait(10)


@pytest.fixture
def plan_path(tmp_path):
    return tmp_path / "faults.json"


@pytest.fixture
def make_plan(plan_path):
    """`make_plan(rules, seed=0, **FaultPlan kwargs)`: writes the file, returns a plan that
    checks it at every operation with a fake sleep."""

    def make(rules=(), seed=0, **kw):
        write_plan(plan_path, {"rules": list(rules), "seed": seed})
        kw.setdefault("check_every_s", 0.0)
        kw.setdefault("sleep", FakeSleep())
        return FaultPlan(plan_path, **kw)

    return make


@pytest.fixture
def inner_store(tmp_path):
    cfg = StoreConfig(
        kind="file", root=str(tmp_path / "store"), block_tokens=4, timeout_s=STORE_TIMEOUT_S
    )
    st = TensorStoreBlockStore(cfg, BlockFormat(LAYOUT, "float32", model_fingerprint(TINY_QWEN2)))
    yield st
    st.close()


def keys_and_blocks(store, n: int, seed: int = 0):
    keys = block_keys(range(seed * 100, seed * 100 + 4 * n), 4, store.fmt.fingerprint)
    blocks = np.random.default_rng(seed).integers(0, 256, (n, *LAYOUT.shape), dtype=np.uint8)
    return keys, blocks


@pytest.fixture
def fabric():
    return InProcessFabric()


# --- the plan file ----------------------------------------------------------------------------


def test_no_plan_leaves_objects_unchanged(inner_store, fabric):
    assert load_plan("") is None
    ch = InProcessChannel(fabric, "a")
    assert wrap_store(inner_store, None, "pe0") is inner_store
    assert wrap_channel(ch, None, "pe0") is ch
    ch.close()


def test_the_engines_hook_wraps_only_with_a_plan(inner_store, fabric, plan_path):
    ch = InProcessChannel(fabric, "a")
    none = fault_injection("", "pe0")
    assert none.store(inner_store) is inner_store and none.channel(ch) is ch
    faults = fault_injection(str(plan_path), "pe0")
    store, channel = faults.store(inner_store), faults.channel(ch)
    assert isinstance(store, FaultyStore) and isinstance(channel, FaultyChannel)
    assert store.plan is channel.plan and store.who == channel.who == "pe0"  # one plan each
    channel.close()
    plan_path.write_text('{"rules": [{"op": "store.rite", "error": "EIO"}]}')
    with pytest.raises(ValueError, match="unknown op"):
        fault_injection(str(plan_path), "pe0")


def test_missing_file_is_a_plan_without_faults(inner_store, plan_path):
    plan = load_plan(str(plan_path))
    assert plan is not None and plan.rules == ()
    store = wrap_store(inner_store, plan, "pe0")
    assert isinstance(store, FaultyStore)
    keys, blocks = keys_and_blocks(store, 2)
    assert store.write_full(keys, blocks).result().written == 2
    assert store.lookup(keys).result() == 2


@pytest.mark.parametrize(
    "text, names",
    [
        ('{"rules": [{"op": "store.rite", "error": "EIO"}]}', "unknown op 'store.rite'"),
        ('{"rules": [{"op": "store.read", "eror": "EIO"}]}', "unknown field 'eror'"),
        ('{"rules": [{"op": "store.read", "error": "ENOPE"}]}', "unknown errno name 'ENOPE'"),
        ('{"rules": [{"op": "store.read", "error": "EIO", "count": 0}]}', "count"),
        ('{"rules": [{"op": "store.read", "error": "EIO", "prob": 1.5}]}', "prob"),
        ('{"rules": [{"op": "store.read", "delay_s": -1}]}', "delay_s"),
        ('{"rules": [{"op": "store.read", "hang": "yes"}]}', "hang"),
        ('{"rules": [{"op": "store.read", "error": "EIO", "engines": "de1"}]}', "engines"),
        ('{"rules": [{"op": "store.read"}]}', "nothing to inject"),
        ('{"rules": [{"op": "store.read", "hang": true, "error": "EIO"}]}', "hang cannot"),
        ('{"rules": [], "sead": 1}', "unknown key 'sead'"),
        ('{"rule": []}', "unknown key 'rule'"),
        ("[]", "JSON object"),
        ('{"rules": [', "not valid JSON"),
    ],
)
def test_invalid_plans_name_the_problem(plan_path, text, names):
    with pytest.raises(ValueError) as e:
        parse_plan(text)
    assert names in str(e.value)
    write_plan(plan_path, text)
    with pytest.raises(ValueError, match=str(plan_path)):
        load_plan(str(plan_path))


def test_valid_plan_parses():
    rules, seed = parse_plan(
        json.dumps(
            {
                "rules": [
                    {"op": "store.write", "error": "ENOSPC", "count": 3, "prob": 1.0},
                    {"op": "store.read", "delay_s": 2.0},
                    {"op": "channel.pull", "hang": True},
                    {"op": "store.lookup", "error": "EIO", "engines": ["de1", "pe0"]},
                    {"op": "store.write", "error": "EROFS"},
                ],
                "seed": 5,
            }
        )
    )
    assert seed == 5 and len(rules) == 5
    assert (rules[0].errno, rules[0].count) == (errno.ENOSPC, 3)
    assert rules[1].describe() == "delay 2s" and rules[2].describe() == "hang"
    assert rules[3].engines == ("de1", "pe0") and rules[4].error == "EROFS"


# --- store faults -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "op, code",
    [
        ("store.write", "ENOSPC"),
        ("store.write", "EROFS"),
        ("store.read", "EIO"),
        ("store.lookup", "EIO"),
        ("store.delete", "EIO"),
    ],
)
def test_store_errors_surface_on_the_future(inner_store, make_plan, op, code):
    plan = make_plan([{"op": op, "error": code}])
    store = wrap_store(inner_store, plan, "pe0")
    keys, blocks = keys_and_blocks(store, 2)
    if op != "store.write":
        inner_store.write_full(keys, blocks).result()
    calls = {
        "store.write": [lambda: store.write_full(keys, blocks)],
        "store.read": [lambda: store.read_full(keys), lambda: store.read_layers(keys, (1, 3))],
        "store.lookup": [lambda: store.lookup(keys)],
        "store.delete": [lambda: store.delete(keys)],
    }[op]
    for call in calls:
        fut = call()  # the call itself does not raise: the future carries the error
        with pytest.raises(StoreError) as e:
            fut.result()
        num = getattr(errno, code)
        assert os.strerror(num) in str(e.value) and f"injected {code} into {op}" in str(e.value)
        assert keys[0] in str(e.value)
        assert isinstance(e.value.__cause__, OSError) and e.value.__cause__.errno == num
    assert plan.injected[0] == len(calls)
    # The failed operation did nothing to the stored blocks.
    assert inner_store.lookup(keys).result() == (0 if op == "store.write" else 2)


def test_count_spends_the_rule(inner_store, make_plan):
    plan = make_plan([{"op": "store.write", "error": "ENOSPC", "count": 2}])
    store = wrap_store(inner_store, plan, "pe0")
    keys, blocks = keys_and_blocks(store, 1)
    for _ in range(2):
        with pytest.raises(StoreError, match="No space left on device"):
            store.write_full(keys, blocks).result()
    assert store.write_full(keys, blocks).result().written == 1
    assert store.write_full(keys, blocks).result().existed == 1
    assert plan.injected[0] == 2


def test_first_rule_that_fires_applies(inner_store, make_plan):
    plan = make_plan(
        [
            {"op": "store.lookup", "error": "EIO", "count": 1},
            {"op": "store.lookup", "error": "EROFS", "count": 1},
        ]
    )
    store = wrap_store(inner_store, plan, "pe0")
    keys, _ = keys_and_blocks(store, 1)
    for text in ("Input/output error", "Read-only file system"):
        with pytest.raises(StoreError, match=text):
            store.lookup(keys).result()
    assert store.lookup(keys).result() == 0
    assert dict(plan.injected) == {0: 1, 1: 1}


def test_prob_is_seeded_per_rule(make_plan):
    rules = [{"op": "store.read", "error": "EIO", "prob": 0.3}]

    def fired(plan):
        return [plan.pick("store.read", "pe0") is not None for _ in range(400)]

    a, b = fired(make_plan(rules, seed=1)), fired(make_plan(rules, seed=1))
    c = fired(make_plan(rules, seed=2))
    assert a == b and a != c
    assert 60 < sum(a) < 180  # about 30% of 400
    never = make_plan([{"op": "store.read", "error": "EIO", "prob": 0.0}])
    assert not any(fired(never))


def test_prob_and_count_combine(make_plan):
    plan = make_plan([{"op": "channel.pull", "error": "EIO", "prob": 0.5, "count": 5}])
    hits = sum(plan.pick("channel.pull", "de0") is not None for _ in range(200))
    assert hits == 5 and plan.injected[0] == 5


def test_engines_target_one_engine(inner_store, make_plan):
    plan = make_plan([{"op": "store.lookup", "error": "EIO", "engines": ["de1"]}])
    keys, _ = keys_and_blocks(inner_store, 1)
    with pytest.raises(StoreError, match="Input/output error"):
        wrap_store(inner_store, plan, "de1").lookup(keys).result()
    assert wrap_store(inner_store, plan, "pe0").lookup(keys).result() == 0
    assert wrap_store(inner_store, plan, "").lookup(keys).result() == 0


def test_store_delay_does_not_block_the_caller(inner_store, make_plan):
    gate = threading.Event()
    sleep = FakeSleep(gate)
    plan = make_plan([{"op": "store.read", "delay_s": 2.0}], sleep=sleep)
    store = wrap_store(inner_store, plan, "de0")
    keys, blocks = keys_and_blocks(store, 3)
    store.write_full(keys, blocks).result()
    fut = store.read_full(keys)  # returns while the delay is still sleeping
    assert not fut.done()
    gate.set()
    res = fut.result(timeout=10)
    assert res.hits == 3
    np.testing.assert_array_equal(res.stack(), blocks)
    assert sleep.calls == [2.0] and plan.injected[0] == 1


def test_store_delay_then_error(inner_store, make_plan):
    sleep = FakeSleep()
    plan = make_plan([{"op": "store.write", "delay_s": 1.0, "error": "EIO"}], sleep=sleep)
    store = wrap_store(inner_store, plan, "pe0")
    keys, blocks = keys_and_blocks(store, 1)
    with pytest.raises(StoreError, match="injected delay 1s \\+ EIO"):
        store.write_full(keys, blocks).result(timeout=10)
    assert sleep.calls == [1.0]


@pytest.mark.parametrize("rule", [{"hang": True}, {"delay_s": 100.0}])
def test_store_hang_times_out_after_the_store_timeout(inner_store, make_plan, rule):
    sleep = FakeSleep()
    plan = make_plan([{"op": "store.lookup", **rule}], sleep=sleep)
    store = wrap_store(inner_store, plan, "de0")
    keys, _ = keys_and_blocks(store, 1)
    with pytest.raises(StoreError, match="timed out"):
        store.lookup(keys).result(timeout=10)
    assert sleep.calls == [STORE_TIMEOUT_S]  # StoreConfig.timeout_s of the wrapped store
    explicit = wrap_store(inner_store, plan, "de0", timeout_s=0.5)
    with pytest.raises(StoreError, match="within 0.5 s"):
        explicit.lookup(keys).result(timeout=10)
    assert sleep.calls[-1] == 0.5


def test_empty_batches_and_other_methods_pass_through(inner_store, make_plan):
    plan = make_plan([{"op": op, "error": "EIO"} for op in ("store.lookup", "store.write")])
    store = wrap_store(inner_store, plan, "pe0")
    assert store.lookup([]).result() == 0
    assert sum(plan.injected.values()) == 0
    keys, blocks = keys_and_blocks(store, 2)
    inner_store.write_full(keys, blocks, owner="t1").result()
    with store.pinned(keys):
        assert store.stats().pinned == 2
    assert store.fmt is inner_store.fmt and store.cfg is inner_store.cfg
    assert store.release("t1").result() == 2


def test_failed_write_still_claims_for_its_owner(inner_store, make_plan):
    plan = make_plan([{"op": "store.write", "error": "ENOSPC", "count": 1}])
    store = wrap_store(inner_store, plan, "pe0")
    keys, blocks = keys_and_blocks(store, 1)
    with pytest.raises(StoreError):
        store.write_full(keys, blocks, owner="t1").result()
    assert keys[0] in inner_store.index._owned["t1"]


# --- channel faults ---------------------------------------------------------------------------


@pytest.fixture
def channels(fabric, make_plan):
    """`channels(rules)`: (sender, receiver) FaultyChannels "pe0" and "de0" over one plan."""
    made = []

    def make(rules, **kw):
        plan = make_plan(rules, **kw)
        pe = wrap_channel(InProcessChannel(fabric, "pe0"), plan, "pe0")
        de = wrap_channel(InProcessChannel(fabric, "de0"), plan, "de0")
        made.extend([pe, de])
        return plan, pe, de

    yield make
    for ch in made:
        ch.close()


SPEC = [((1, 4, 12), np.uint8)]


def block() -> np.ndarray:
    return np.arange(48, dtype=np.uint8).reshape(1, 4, 12)


def test_channel_without_matching_rules_delegates(channels):
    plan, pe, de = channels([{"op": "channel.pull", "error": "EIO", "engines": ["de9"]}])
    assert isinstance(pe, FaultyChannel) and pe.address.startswith("inproc://pe0")
    pe.offer(7, [block()])
    assert pe.outstanding_offers() == 1
    (got,) = de.pull(pe.address, 7, SPEC, timeout_s=5)
    np.testing.assert_array_equal(np.asarray(got), block())
    assert pe.outstanding_offers() == 0 and de.stats.pulls == 1 and pe.stats.offers == 1


def test_pull_error_raises_transfer_error(channels):
    plan, pe, de = channels([{"op": "channel.pull", "error": "EIO", "count": 1}])
    pe.offer(7, [block()])
    with pytest.raises(TransferError) as e:
        de.pull(pe.address, 7, SPEC, timeout_s=5)
    assert not isinstance(e.value, TransferTimeout)
    assert "injected EIO into channel.pull (rule 0)" in str(e.value)
    assert "Input/output error" in str(e.value) and e.value.__cause__.errno == errno.EIO
    assert de.stats.errors == 1
    # The offer is still there: the next pull (rule spent) gets it.
    assert len(de.pull(pe.address, 7, SPEC, timeout_s=5)) == 1


def test_pull_async_obeys_the_plan(channels):
    plan, pe, de = channels([{"op": "channel.pull", "error": "ECONNRESET"}])
    pe.offer(7, [block()])
    with pytest.raises(TransferError, match="Connection reset by peer"):
        de.pull_async(pe.address, 7, SPEC, timeout_s=5).result(timeout=10)


@pytest.mark.parametrize("rule", [{"hang": True}, {"delay_s": 30.0}])
def test_pull_hang_times_out_after_the_pull_timeout(channels, rule):
    sleep = FakeSleep()
    plan, pe, de = channels([{"op": "channel.pull", **rule}], sleep=sleep)
    pe.offer(7, [block()])
    with pytest.raises(TransferTimeout, match="nothing within 3s"):
        de.pull(pe.address, 7, SPEC, timeout_s=3.0)
    assert sleep.calls == [3.0] and de.stats.timeouts == 1


def test_pull_delay_then_real_pull(channels):
    sleep = FakeSleep()
    plan, pe, de = channels([{"op": "channel.pull", "delay_s": 0.5}], sleep=sleep)
    pe.offer(7, [block()])
    (got,) = de.pull(pe.address, 7, SPEC, timeout_s=5.0)
    np.testing.assert_array_equal(np.asarray(got), block())
    assert sleep.calls == [0.5] and plan.injected[0] == 1


def test_offer_faults(channels):
    sleep = FakeSleep()
    plan, pe, de = channels(
        [
            {"op": "channel.offer", "error": "ENOMEM", "count": 1},
            {"op": "channel.offer", "hang": True, "count": 1},
            {"op": "channel.offer", "delay_s": 0.25, "count": 1},
        ],
        sleep=sleep,
    )
    with pytest.raises(TransferError, match="injected ENOMEM into channel.offer"):
        pe.offer(7, [block()])
    assert pe.outstanding_offers() == 0
    pe.offer(8, [block()])  # hang: accepted, never pullable
    with pytest.raises(TransferTimeout):
        de.pull(pe.address, 8, SPEC, timeout_s=0.05)
    pe.offer(9, [block()])  # delayed, then offered
    assert sleep.calls == [0.25] and pe.outstanding_offers() == 1
    assert len(de.pull(pe.address, 9, SPEC, timeout_s=5)) == 1


def test_close_closes_the_wrapped_channel(fabric, make_plan):
    inner = InProcessChannel(fabric, "pe0")
    ch = wrap_channel(inner, make_plan(), "pe0")
    ch.close()
    assert not fabric.is_alive(inner.address)
    with pytest.raises(TransferError, match="closed"):
        ch.offer(1, [block()])


# --- changing the plan mid-run ----------------------------------------------------------------


def test_rewriting_the_file_changes_behaviour(inner_store, plan_path, make_plan):
    plan = make_plan([])
    store = wrap_store(inner_store, plan, "pe0")
    keys, blocks = keys_and_blocks(store, 1)
    other_keys, other_blocks = keys_and_blocks(store, 1, seed=1)
    assert store.lookup(keys).result() == 0
    write_plan(plan_path, {"rules": [{"op": "store.write", "error": "EROFS"}]})
    with pytest.raises(StoreError, match="Read-only file system"):
        store.write_full(keys, blocks).result()
    write_plan(plan_path, {"rules": [{"op": "store.write", "error": "ENOSPC", "count": 1}]})
    with pytest.raises(StoreError, match="No space left on device"):
        store.write_full(keys, blocks).result()
    assert store.write_full(keys, blocks).result().written == 1
    os.remove(plan_path)  # no file: no faults
    assert store.write_full(other_keys, other_blocks).result().written == 1


def test_the_file_is_checked_at_most_every_check_interval(plan_path, make_plan):
    now = [100.0]
    plan = make_plan([], check_every_s=0.05, clock=lambda: now[0])
    write_plan(plan_path, {"rules": [{"op": "store.read", "error": "EIO"}]})
    assert plan.pick("store.read", "pe0") is None  # not checked yet
    now[0] += 0.06
    assert plan.pick("store.read", "pe0") is not None
    gen = plan.generation
    write_plan(plan_path, {"rules": []})
    plan.refresh()  # on demand, whatever the interval
    assert plan.pick("store.read", "pe0") is None and plan.generation == gen + 1


def test_malformed_rewrite_keeps_the_last_good_plan(inner_store, plan_path, make_plan, caplog):
    plan = make_plan([{"op": "store.lookup", "error": "EIO"}])
    store = wrap_store(inner_store, plan, "de0")
    keys, _ = keys_and_blocks(store, 1)
    with caplog.at_level(logging.WARNING, logger="dualpath_jax.testing.fault_plan"):
        for bad in ('{"rules": [{"op": "store.lookup", "error": "EBOGUS"}]}', '{"rules": [{'):
            write_plan(plan_path, bad)
            for _ in range(3):
                with pytest.raises(StoreError, match="Input/output error"):
                    store.lookup(keys).result()
    bad_logs = [r for r in caplog.records if "keeping the previous fault plan" in r.message]
    assert len(bad_logs) == 2  # one per bad version, not one per check
    assert "EBOGUS" in bad_logs[0].message and "not valid JSON" in bad_logs[1].message
    write_plan(plan_path, {"rules": []})
    assert store.lookup(keys).result() == 0


def test_each_rule_is_logged_once_and_counted(inner_store, make_plan, caplog):
    plan = make_plan(
        [{"op": "store.write", "error": "ENOSPC"}, {"op": "store.lookup", "error": "EIO"}]
    )
    store = wrap_store(inner_store, plan, "pe0")
    keys, blocks = keys_and_blocks(store, 1)
    with caplog.at_level(logging.WARNING, logger="dualpath_jax.testing.fault_plan"):
        for _ in range(3):
            with pytest.raises(StoreError):
                store.write_full(keys, blocks).result()
        with pytest.raises(StoreError):
            store.lookup(keys).result()
    msgs = [r.message for r in caplog.records if r.levelno == logging.WARNING]
    assert len(msgs) == 2
    assert msgs[0].startswith("injected ENOSPC into store.write (rule 0)")
    assert msgs[1].startswith("injected EIO into store.lookup (rule 1)")
    assert dict(plan.injected) == {0: 3, 1: 1}
