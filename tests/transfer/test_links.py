"""Links and the TrafficManager: arbitration shares, pacing, accounting of every data path."""

from __future__ import annotations

import concurrent.futures
import json
import threading
import time

import pytest

from dualpath_jax.config import HardwareConfig
from dualpath_jax.transfer.links import (
    DEFAULT_BURST_S,
    DEFAULT_CHUNK_BYTES,
    LinkArbiter,
    LinkId,
    LinkKind,
    LinkRequest,
    TrafficClass,
    link_rate,
)
from dualpath_jax.transfer.paths import (
    STEP_CLASSES,
    STEP_NAMES,
    d2h_path,
    engine_to_engine_path,
    expected_link_bytes,
    h2d_path,
    persist_path,
    request_path,
    request_paths,
    request_steps,
    step_bytes,
    store_read_path,
    store_write_path,
)
from dualpath_jax.transfer.traffic import LinkClosedError, TrafficManager

HIGH, LOW = TrafficClass.HIGH, TrafficClass.LOW
K = LinkKind
IDS = dict(pe="pe0", de="de0", pe_node="pe-node0", de_node="de-node0")


class FakeClock:
    """A clock that only `sleep` moves. Use it with a single paced link (one pacing thread)."""

    def __init__(self, t: float = 1000.0):
        self.t = t
        self.sleeps = 0
        self._lock = threading.Lock()

    def __call__(self) -> float:
        with self._lock:
            return self.t

    def sleep(self, dt: float) -> None:
        with self._lock:
            self.sleeps += 1
            self.t += dt


def no_sleep(dt: float) -> None:
    raise AssertionError(f"an unlimited link slept {dt}")


def lid(kind: LinkKind, owner: str) -> LinkId:
    return LinkId(kind, owner)


# --------------------------------------------------------------------------- names and paths


def test_link_ids_names_and_rates():
    x = LinkId(K.SNIC_RX, "pe-node0")
    assert x.name == str(x) == "snic_rx:pe-node0"
    assert LinkId.parse("cnic_tx:de1") == LinkId(K.CNIC_TX, "de1")
    with pytest.raises(ValueError):
        LinkId(K.DRAM, "")
    with pytest.raises(ValueError):
        LinkId.parse("dram")
    hw = HardwareConfig(
        snic_bytes_per_s=1,
        cnic_bytes_per_s=2,
        h2d_bytes_per_s=3,
        d2h_bytes_per_s=4,
        dram_bytes_per_s=5,
    )
    rates = {k: link_rate(hw, k) for k in LinkKind}
    assert rates == {
        K.SNIC_RX: 1,
        K.SNIC_TX: 1,
        K.CNIC_RX: 2,
        K.CNIC_TX: 2,
        K.H2D: 3,
        K.D2H: 4,
        K.DRAM: 5,
    }


def test_path_functions_list_exact_links():
    assert store_read_path("n0") == [lid(K.SNIC_RX, "n0"), lid(K.DRAM, "n0")]
    assert store_write_path("n0") == [lid(K.DRAM, "n0"), lid(K.SNIC_TX, "n0")]
    assert h2d_path("e0", "n0") == [lid(K.DRAM, "n0"), lid(K.H2D, "e0")]
    assert h2d_path("e0", "n0", cnic_assisted=True) == [
        lid(K.DRAM, "n0"),
        lid(K.CNIC_TX, "e0"),
        lid(K.CNIC_RX, "e0"),
        lid(K.H2D, "e0"),
    ]
    assert d2h_path("e0", "n0") == [lid(K.D2H, "e0"), lid(K.DRAM, "n0")]
    # PE device -> DE buffer: GPUDirect out of the PE, into the DE node's DRAM.
    assert engine_to_engine_path("pe0", "de0", "pn", "dn", True, False) == [
        lid(K.CNIC_TX, "pe0"),
        lid(K.CNIC_RX, "de0"),
        lid(K.DRAM, "dn"),
    ]
    # DE buffer -> PE device: out of the DE node's DRAM, GPUDirect into the PE (no PE H2D).
    assert engine_to_engine_path("de0", "pe0", "dn", "pn", False, True) == [
        lid(K.DRAM, "dn"),
        lid(K.CNIC_TX, "de0"),
        lid(K.CNIC_RX, "pe0"),
    ]
    assert persist_path("de0", "dn") == [
        lid(K.D2H, "de0"),
        lid(K.DRAM, "dn"),
        lid(K.DRAM, "dn"),
        lid(K.SNIC_TX, "dn"),
    ]
    assert store_read_path(3) == [lid(K.SNIC_RX, "3"), lid(K.DRAM, "3")]  # int ids as str
    with pytest.raises(ValueError, match="within one engine"):
        engine_to_engine_path("e0", "e0", "n", "n", True, True)


# --------------------------------------------------------------------------- arbitration core


def drain(arb: LinkArbiter, grants: int) -> list:
    """Grants `grants` chunks back to back, each as soon as the bucket allows."""
    out = []
    now = 0.0
    for _ in range(grants):
        now = max(now, arb.ready_at())
        out.append(arb.grant(now))
    return out


def test_arbiter_gives_high_99_percent_when_both_saturated():
    arb = LinkArbiter(1e6, high_weight=99, low_weight=1, chunk_bytes=1000)
    arb.enqueue(LinkRequest(10**9, LOW))
    arb.enqueue(LinkRequest(10**9, HIGH))
    grants = drain(arb, 10_000)
    low = sum(g.nbytes for g in grants if g.request.cls is LOW)
    assert low == 100 * 1000  # exactly 1 chunk in 100
    # LOW is spread out, never starved for long: one LOW chunk per ~100 grants.
    idx = [i for i, g in enumerate(grants) if g.request.cls is LOW]
    assert max(b - a for a, b in zip(idx, idx[1:], strict=False)) <= 101


@pytest.mark.parametrize("weights,share", [((3, 1), 0.75), ((1, 1), 0.5), ((1, 3), 0.25)])
def test_arbiter_shares_follow_the_weights(weights, share):
    arb = LinkArbiter(1e6, high_weight=weights[0], low_weight=weights[1], chunk_bytes=512)
    arb.enqueue(LinkRequest(10**9, HIGH))
    arb.enqueue(LinkRequest(10**9, LOW))
    grants = drain(arb, 4000)
    high = sum(g.nbytes for g in grants if g.request.cls is HIGH)
    assert high / (4000 * 512) == pytest.approx(share, abs=1 / 4000)


def test_arbiter_idle_high_leaves_the_link_to_low_and_preempts_on_arrival():
    arb = LinkArbiter(1e6, chunk_bytes=100)
    low = LinkRequest(100_000, LOW)
    arb.enqueue(low)
    grants = drain(arb, 50)
    assert all(g.request is low for g in grants)  # LOW alone gets every chunk
    high = LinkRequest(1000, HIGH)
    arb.enqueue(high)
    nxt = drain(arb, 11)
    assert [g.request.cls for g in nxt] == [HIGH] * 10 + [LOW]  # HIGH served at once, then LOW
    assert high.remaining == 0


def test_arbiter_low_progresses_under_a_stream_of_high_requests():
    arb = LinkArbiter(1e6, chunk_bytes=1000)
    arb.enqueue(LinkRequest(10**9, LOW))
    low = 0
    for _ in range(2000):  # HIGH keeps arriving in small requests, never idle
        arb.enqueue(LinkRequest(1000, HIGH))
        for g in drain(arb, 1):
            low += g.nbytes if g.request.cls is LOW else 0
        if arb.pending_bytes(HIGH) == 0:
            arb.enqueue(LinkRequest(1000, HIGH))
    assert 10_000 <= low <= 30_000  # ~1% of 2000 chunks


def test_arbiter_time_accounting_is_exact_with_a_small_burst():
    rate, chunk = 1e6, 1000
    arb = LinkArbiter(rate, chunk_bytes=chunk, burst_bytes=3000)
    arb.enqueue(LinkRequest(10_500, HIGH))
    # An idle link passes one burst plus one chunk at once...
    at_once = []
    while arb.can_grant(5.0):
        at_once.append(arb.grant(5.0))
    assert [g.nbytes for g in at_once] == [1000] * 4
    # ...then grants at the rate: every chunk occupies [start, end) back to back.
    rest = drain(arb, 7)
    grants = at_once + rest
    assert [g.nbytes for g in grants] == [1000] * 10 + [500]
    for a, b in zip(grants, grants[1:], strict=False):
        assert b.start == pytest.approx(a.end)
    assert grants[-1].end == pytest.approx(5.0 + 10_500 / rate)
    assert not arb.pending()


def test_arbiter_late_pacer_loses_no_link_time_while_backlogged():
    arb = LinkArbiter(1e6, chunk_bytes=1000, burst_bytes=1000, max_lag_s=0.1)
    arb.enqueue(LinkRequest(4000, LOW))
    arb.grant(0.0), arb.grant(0.0)  # busy until 0.002
    late = arb.grant(0.05)  # the pacer overslept 48 ms with bytes still queued
    assert (late.start, late.end) == pytest.approx((0.002, 0.003))
    arb.grant(0.05)  # the backlog empties: a later arrival finds a really idle link
    arb.enqueue(LinkRequest(3000, HIGH))
    assert arb.grant(1.0).start == 1.0
    assert arb.grant(1.0).start == pytest.approx(1.001)
    assert arb.grant(5.0).start == 5.0  # a stall longer than max_lag_s is not caught up


def test_arbiter_rejects_starving_weights_and_bad_rates():
    with pytest.raises(ValueError, match="never starve"):
        LinkArbiter(1e6, low_weight=0)
    with pytest.raises(ValueError):
        LinkArbiter(0)
    with pytest.raises(ValueError):
        TrafficManager(HardwareConfig(snic_bytes_per_s=1e6, low_weight=0))


# --------------------------------------------------------------------------- paced links


def test_paced_link_on_a_fake_clock_is_exact():
    clock = FakeClock()
    hw = HardwareConfig(snic_bytes_per_s=1e6, emulated=True)
    tm = TrafficManager(hw, clock, clock.sleep)
    link = lid(K.SNIC_RX, "n0")
    t0, n = clock(), 1_000_000
    tm.transfer([link], n, LOW)
    burst = max(64 * 1024, 1e6 * 0.005)
    assert t0 + (n - burst - 64 * 1024) / 1e6 <= clock() <= t0 + n / 1e6
    assert tm.bytes(link) == tm.bytes(link, LOW) == n and tm.bytes(link, HIGH) == 0
    util = tm.utilisation(link, 0.1)
    assert [t for t, _ in util] == pytest.approx([0.1 * i for i in range(len(util))])
    assert sum(f for _, f in util) * 1e6 * 0.1 == pytest.approx(n)
    assert all(f <= 1 + 1e-9 for _, f in util)
    assert [f for _, f in util[:10]] == pytest.approx([1.0] * 10)  # saturated for exactly 1 s
    assert sum(b for _, b in tm.window_bytes(link, 0.2)) == pytest.approx(n)
    assert tm.snapshot()["links"][link.name]["busy_s"] == pytest.approx(1.0)
    with pytest.raises(ValueError, match="multiple"):
        tm.utilisation(link, 0.15)
    tm.close()


def test_unlimited_links_never_wait_but_count():
    clock = FakeClock()
    with TrafficManager(HardwareConfig(), clock, no_sleep) as tm:
        path = store_read_path("n0")
        for _ in range(3):
            tm.transfer(path, 10**9, LOW)
        assert tm.submit(path, 5, HIGH).result(timeout=10) is None
        for x in path:
            assert tm.bytes(x) == 3 * 10**9 + 5 and tm.bytes(x, HIGH) == 5
        assert sum(b for _, b in tm.window_bytes(path[0])) == 3 * 10**9 + 5
        with pytest.raises(ValueError, match="unlimited"):
            tm.utilisation(path[0])
        assert clock.sleeps == 0
        snap = tm.snapshot()["links"]["snic_rx:n0"]
        assert snap["utilisation"] is None and snap["rate_bytes_per_s"] == 0


def test_a_long_run_keeps_a_bounded_series_at_a_coarser_step():
    """A server running for days: past `max_windows` the link merges neighbouring windows
    (the step doubles), so its series stays bounded and every byte stays counted."""
    clock = FakeClock()
    with TrafficManager(HardwareConfig(), clock, no_sleep) as tm:
        path = store_read_path("n0")
        link = tm.link(path[0])
        link.max_windows = 64
        step = link.window_s
        for _ in range(1000):  # 1,000 windows' worth of time, 7 bytes in each
            clock.t += step
            tm.transfer(path, 7, LOW)
        series = link.window_bytes()
        assert len(series) <= 64 and link.window_s == step * 16  # folded four times
        assert sum(b for _, b in series) == 7000 == tm.bytes(path[0])
        t = [t for t, _ in series]
        assert t == sorted(t) and t[1] - t[0] == link.window_s


def test_real_time_link_never_runs_faster_than_its_rate():
    # On the real clock only the ceiling is checked (a loaded host makes it slower, never faster);
    # that a saturated link grants exactly its rate is test_paced_link_on_a_fake_clock_is_exact.
    rate = 16e6
    with TrafficManager(HardwareConfig(snic_bytes_per_s=rate, emulated=True)) as tm:
        link = lid(K.SNIC_RX, "n0")
        n, per = 12_000_000, 3_000_000
        t0 = time.monotonic()
        futs = [tm.submit([link], per, HIGH if i % 2 else LOW) for i in range(n // per)]
        done, _ = concurrent.futures.wait(futs, timeout=120)
        elapsed = time.monotonic() - t0
        assert len(done) == len(futs) and all(f.result() is None for f in futs)
        assert tm.bytes(link) == n
        burst = max(DEFAULT_CHUNK_BYTES, rate * DEFAULT_BURST_S) + DEFAULT_CHUNK_BYTES
        assert n <= rate * elapsed + burst, f"{n} bytes in {elapsed:.3f} s at {rate:.4g} B/s"


def test_real_time_priority_shares():
    rate = 16e6
    hw = HardwareConfig(cnic_bytes_per_s=rate, emulated=True)
    tm = TrafficManager(hw, chunk_bytes=4096)
    link = lid(K.CNIC_TX, "pe0")
    high_n = 8_000_000
    high = tm.submit([link], high_n, HIGH)
    low = tm.submit([link], 10**9, LOW)  # saturating LOW: never finishes on its own
    high.result(timeout=30)
    low_during = tm.bytes(link, LOW)
    assert high_n / (high_n + low_during) >= 0.95  # HIGH gets ~99% while both are saturated
    assert low_during > 0  # LOW is not starved
    # HIGH idle: LOW goes on (its exact share is test_arbiter_idle_high_leaves_the_link_to_low...).
    t1, b1 = time.monotonic(), tm.bytes(link, LOW)
    time.sleep(0.25)
    t2, b2 = time.monotonic(), tm.bytes(link, LOW)
    assert 0 < b2 - b1 <= rate * (t2 - t1) + max(4096, rate * DEFAULT_BURST_S) + 4096
    tm.close()
    with pytest.raises(LinkClosedError):
        low.result(timeout=10)
    with pytest.raises(LinkClosedError):
        tm.transfer([link], 1, HIGH)


def test_concurrent_transfers_on_overlapping_paths_complete():
    hw = HardwareConfig(cnic_bytes_per_s=400e6, dram_bytes_per_s=400e6, emulated=True)
    a, b, c = lid(K.CNIC_TX, "e0"), lid(K.CNIC_RX, "e1"), lid(K.DRAM, "n0")
    paths = [[a, b], [b, c], [c, a], [a, b, c], [c, b, a], [b], [c, c]]
    counts = {a: 0, b: 0, c: 0}
    with TrafficManager(hw, chunk_bytes=16 * 1024) as tm:
        jobs = []
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            for i in range(42):
                path, n = paths[i % len(paths)], 200_000 + 1000 * i
                for x in path:
                    counts[x] += n
                cls = HIGH if i % 3 else LOW
                if i % 2:
                    jobs.append(pool.submit(tm.transfer, path, n, cls))
                else:
                    jobs.append(tm.submit(path, n, cls))
            for j in jobs:
                assert j.result(timeout=60) is None
        assert {x: tm.bytes(x) for x in counts} == counts


def test_read_queue_counters_are_thread_safe():
    tm = TrafficManager(HardwareConfig())

    def work(node: str) -> None:
        for _ in range(1000):
            tm.read_queue_add(node, 64)
            tm.read_queue_done(node, 32)

    threads = [threading.Thread(target=work, args=(f"n{i % 2}",)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert tm.read_q("n0") == tm.read_q("n1") == 4 * 1000 * 32
    assert tm.read_q("never") == 0
    tm.read_queue_done("n0", 4 * 1000 * 32)
    assert tm.read_q("n0") == 0
    with pytest.raises(ValueError, match="only 0 queued"):
        tm.read_queue_done("n0", 1)
    with pytest.raises(ValueError):
        tm.read_queue_add("n0", -1)
    tm.read_queue_add(7, 5)
    assert tm.read_q("7") == tm.read_q(7) == 5
    assert tm.snapshot()["read_q"] == {"7": 5, "n0": 0, "n1": 128_000}


def test_bad_transfers_are_rejected():
    with TrafficManager(HardwareConfig()) as tm:
        with pytest.raises(ValueError, match="non-empty"):
            tm.transfer([], 1, HIGH)
        with pytest.raises(ValueError, match="non-empty"):
            tm.transfer(lid(K.DRAM, "n"), 1, HIGH)
        with pytest.raises(ValueError, match="nbytes"):
            tm.transfer(store_read_path("n"), -1, HIGH)
        with pytest.raises(TypeError):
            tm.transfer(["dram:n"], 1, HIGH)


def test_submit_callbacks_may_start_transfers():
    clock = FakeClock()
    with TrafficManager(HardwareConfig(), clock, no_sleep) as tm:
        done = threading.Event()
        path = h2d_path("e0", "n0")
        fut = tm.submit(path, 10, HIGH)
        fut.add_done_callback(lambda f: (tm.transfer(path, 5, HIGH), done.set()))
        assert done.wait(10)
        assert not fut.cancel()
        assert tm.bytes(path[1]) == 15


# --------------------------------------------------------------------------- accounting per path

H, M = 1000, 30  # hit bytes, miss bytes of one request
P, D = 600, 400  # split: hit bytes read by the PE node / by the DE node

EXPECTED = {
    "pe": {
        "snic_rx:pe-node0": H,
        "dram:pe-node0": 2 * H,  # store write + per-layer read to the PE device
        "h2d:pe0": H,
        "cnic_tx:pe0": H + M,
        "cnic_rx:de0": H + M,
        "dram:de-node0": 2 * (H + M),  # KV arrives in the DE buffer + decode read
        "h2d:de0": H + M,
    },
    "de": {
        "snic_rx:de-node0": H,
        "dram:de-node0": H + H + M + (H + M),  # store write, read to PE, miss write, decode read
        "cnic_tx:de0": H,
        "cnic_rx:pe0": H,
        "cnic_tx:pe0": M,
        "cnic_rx:de0": M,
        "h2d:de0": H + M,
    },
    "split": {
        "snic_rx:pe-node0": P,
        "dram:pe-node0": 2 * P,
        "h2d:pe0": P,
        "snic_rx:de-node0": D,
        "cnic_tx:de0": D,
        "cnic_rx:pe0": D,
        "cnic_tx:pe0": P + M,
        "cnic_rx:de0": P + M,
        "dram:de-node0": D + D + (P + M) + (H + M),
        "h2d:de0": H + M,
    },
    "none": {"cnic_tx:pe0": M, "cnic_rx:de0": M, "dram:de-node0": 2 * M, "h2d:de0": M},
}


@pytest.mark.parametrize("read_path", sorted(EXPECTED))
def test_each_path_charges_the_hand_written_bytes(read_path):
    hit = 0 if read_path == "none" else H
    kw = dict(IDS, de_hit_bytes=D if read_path == "split" else None)
    expected = EXPECTED[read_path]
    assert expected_link_bytes(read_path, hit, M, **kw) == dict(sorted(expected.items()))
    with TrafficManager(HardwareConfig(), FakeClock(), no_sleep) as tm:
        steps = request_steps(read_path, hit, M, **kw)
        for step in steps:
            tm.transfer(step.path, step.nbytes, step.cls)
        links = tm.snapshot()["links"]
        assert {name: v["bytes"] for name, v in links.items()} == expected
        # Only the storage reads are prefetch (LOW); the rest feeds the running forward.
        low = {name: v["bytes_low"] for name, v in links.items() if v["bytes_low"]}
        reads = {"pe": {"pe-node0": H}, "de": {"de-node0": H}, "none": {}}
        reads["split"] = {"pe-node0": P, "de-node0": D}
        want_low = {}
        for node, n in reads[read_path].items():
            want_low[f"snic_rx:{node}"] = n
            want_low[f"dram:{node}"] = n
        assert low == want_low


def test_steps_name_the_paper_copies_and_reject_bad_input():
    names = [s.name for s in request_steps("de", H, M, **IDS)]
    assert names == [
        "de_store_read",
        "de_buffer_to_pe_device",
        "pe_device_to_de_buffer",
        "de_buffer_to_de_device",
    ]
    assert "de_buffer_to_de_device" not in [
        s.name for s in request_steps("pe", H, M, **IDS, decode=False)
    ]
    from dualpath_jax.sched.types import ReadPath

    assert expected_link_bytes(ReadPath.DE, H, M, **IDS) == expected_link_bytes("de", H, M, **IDS)
    with pytest.raises(ValueError, match="reads nothing"):
        request_steps("none", 1, M, **IDS)
    with pytest.raises(ValueError, match="de_hit_bytes"):
        request_steps("split", H, M, **IDS)
    with pytest.raises(ValueError, match="unknown read path"):
        request_steps("both", H, M, **IDS)


@pytest.mark.parametrize("read_path", ["pe", "de", "split"])
def test_steps_are_paths_per_engine_pair_times_bytes_per_request(read_path):
    """`request_steps` = `request_path` of each copy (links between two engines) with
    `step_bytes` (bytes of one request), the two halves the simulator keeps apart."""
    paths = request_paths(**IDS)
    assert paths == tuple(request_path(i, **IDS) for i in range(len(STEP_NAMES)))
    nbytes = step_bytes(read_path, H, M, H // 3)
    steps = request_steps(read_path, H, M, **IDS, de_hit_bytes=H // 3)
    want = [
        (STEP_NAMES[i], tuple(paths[i]), nbytes[i], STEP_CLASSES[i])
        for i in range(len(STEP_NAMES))
        if nbytes[i] > 0
    ]
    assert [(s.name, s.path, s.nbytes, s.cls) for s in steps] == want
    with pytest.raises(ValueError, match="step"):
        request_path(len(STEP_NAMES), **IDS)
    with pytest.raises(ValueError, match="reads nothing"):
        step_bytes("none", 1, M)


def test_persist_path_charges_dram_twice():
    with TrafficManager(HardwareConfig(), FakeClock(), no_sleep) as tm:
        tm.transfer(persist_path("de0", "de-node0"), 4096, LOW)
        links = tm.snapshot()["links"]
        assert {k: v["bytes_low"] for k, v in links.items()} == {
            "d2h:de0": 4096,
            "dram:de-node0": 8192,
            "snic_tx:de-node0": 4096,
        }


def test_cnic_assisted_loads_match_the_bottleneck_free_analysis():
    """Paper 4.2 per PE-DE pair with T_p on the PE read path and T_c on the DE read path: PE CNIC
    read 2T_p, write T_p+T_c; DE CNIC read T_p+2T_c, write 2T_p+T_c; PE DRAM 2T_p; DE DRAM
    2T_p+3T_c (NIC "read" = send direction incl. loopback, "write" = receive direction)."""
    tp, tc = 7, 1000
    load: dict[str, int] = {}
    for path, hit in (("pe", tp), ("de", tc)):
        for k, v in expected_link_bytes(path, hit, 0, **IDS, cnic_assisted=True).items():
            load[k] = load.get(k, 0) + v
    assert load["cnic_tx:pe0"] == 2 * tp
    assert load["cnic_rx:pe0"] == tp + tc
    assert load["cnic_tx:de0"] == tp + 2 * tc
    assert load["cnic_rx:de0"] == 2 * tp + tc
    assert load["dram:pe-node0"] == 2 * tp
    assert load["dram:de-node0"] == 2 * tp + 3 * tc


def test_snapshot_is_json_ready():
    hw = HardwareConfig(snic_bytes_per_s=1e6, emulated=True)
    clock = FakeClock()
    with TrafficManager(hw, clock, clock.sleep) as tm:
        tm.transfer(store_read_path("n0"), 100_000, LOW)
        tm.read_queue_add("n0", 64)
        snap = json.loads(json.dumps(tm.snapshot()))
    assert snap["emulated"] is True and snap["read_q"] == {"n0": 64}
    assert snap["links"]["snic_rx:n0"] == {
        "kind": "snic_rx",
        "owner": "n0",
        "rate_bytes_per_s": 1e6,
        "bytes": 100_000,
        "bytes_high": 0,
        "bytes_low": 100_000,
        "busy_s": pytest.approx(0.1),
        "utilisation": pytest.approx(0.1 / max(0.1, snap["elapsed_s"])),
    }
    assert snap["links"]["dram:n0"]["utilisation"] is None
    assert [x.name for x in tm.links()] == ["dram:n0", "snic_rx:n0"]
