"""The event loop and the simulated links (real LinkArbiter on a virtual clock)."""

from __future__ import annotations

import pytest

from dualpath_jax.sim.core import EventLoop
from dualpath_jax.sim.network import SimNetwork
from dualpath_jax.transfer.links import LinkId, LinkKind, TrafficClass


def test_loop_orders_by_time_then_fifo_and_skips_cancelled():
    loop, seen = EventLoop(), []
    loop.at(2.0, seen.append, "c")
    loop.at(1.0, seen.append, "a")
    loop.at(1.0, seen.append, "b")
    loop.at(1.5, seen.append, "x").cancel()
    loop.after(0.5, lambda: loop.soon(seen.append, "soon"))
    assert loop.run() == 5
    assert seen == ["soon", "a", "b", "c"]
    assert loop.now == 2.0 and loop.events == 5


def test_loop_until_and_bad_times():
    loop, seen = EventLoop(), []
    loop.at(5.0, seen.append, 1)
    loop.run(until=3.0)
    assert seen == [] and loop.now == 3.0
    with pytest.raises(ValueError):
        loop.after(-1.0, print)
    loop.run()
    assert seen == [1]


SNIC = LinkId(LinkKind.SNIC_RX, "node0")
DRAM = LinkId(LinkKind.DRAM, "node0")


def _net(loop, rates):
    return SimNetwork(loop, lambda lid: rates.get(lid, 0.0), quantum_s=0.01, window_s=0.5)


def test_transfer_takes_bytes_over_rate_on_the_slowest_link():
    loop = EventLoop()
    net = _net(loop, {SNIC: 1e6, DRAM: 4e6})
    done = []
    net.transfer([SNIC, DRAM], 2_000_000, TrafficClass.LOW, lambda: done.append(loop.now))
    loop.run()
    assert done == [pytest.approx(2.0)]
    assert net.totals() == {SNIC.name: 2_000_000, DRAM.name: 2_000_000}
    series = dict((t, b) for t, b in net.link(SNIC).window_series())
    assert series == {
        0.0: pytest.approx(5e5),
        0.5: pytest.approx(5e5),
        1.0: pytest.approx(5e5),
        1.5: pytest.approx(5e5),
    }


def test_high_class_gets_its_weighted_share_and_low_never_starves():
    loop = EventLoop()
    net = _net(loop, {SNIC: 1e6})
    done = {}
    net.transfer([SNIC], 3_000_000, TrafficClass.LOW, lambda: done.setdefault("low", loop.now))
    net.transfer([SNIC], 990_000, TrafficClass.HIGH, lambda: done.setdefault("high", loop.now))
    loop.run()
    # LOW's first 64 KiB chunk was already on the wire; then HIGH gets ~99% of the link.
    assert done["high"] == pytest.approx(65536 / 1e6 + 0.99, abs=0.02)
    assert done["low"] == pytest.approx(3.99, abs=1e-6)


def test_unlimited_link_only_counts():
    loop = EventLoop()
    net = _net(loop, {})
    done = []
    net.transfer([SNIC], 10**12, TrafficClass.HIGH, lambda: done.append(loop.now))
    loop.run()
    assert done == [0.0] and net.totals()[SNIC.name] == 10**12


def _random_transfers(fast: bool, seed: int) -> tuple[list[tuple[int, float]], dict, dict]:
    import random

    rng = random.Random(seed)
    links = [LinkId(k, f"node{n}") for k in (LinkKind.SNIC_RX, LinkKind.DRAM) for n in range(2)]
    rates = {lid: rng.choice([1e5, 4e5, 1e6]) for lid in links}
    loop = EventLoop()
    net = SimNetwork(loop, lambda lid: rates.get(lid, 0.0), quantum_s=0.01, window_s=0.5, fast=fast)
    pool = [*links, LinkId(LinkKind.H2D, "pe0")]

    def pick():
        path = rng.sample(pool, rng.randint(1, 3))
        return path, rng.choice([100, 2_000, 20_000, 300_000]), rng.choice(list(TrafficClass))

    return _replay(loop, net, rng, pick)[:3]


def _replay(loop, net, rng, pick):
    """Schedules 300 transfers `pick() -> (path, nbytes, cls)` at random times in [0, 5) s and
    runs them: (sorted (index, completion time), link totals, link windows, events)."""
    done: list[tuple[int, float]] = []
    for i in range(300):
        path, nbytes, cls = pick()
        loop.at(
            rng.uniform(0, 5),
            net.transfer,
            path,
            nbytes,
            cls,
            lambda i=i: done.append((i, loop.now)),
        )
    loop.run()
    windows = {ln.id.name: ln.window_series() for ln in net.links.values()}
    return sorted(done), net.totals(), windows, loop.events


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_one_event_per_uncontended_transfer_changes_no_timing(seed):
    # Busy and idle links, both classes, single and multi-link paths, one chunk or many.
    slow, fast = _random_transfers(False, seed), _random_transfers(True, seed)
    assert [i for i, _ in fast[0]] == [i for i, _ in slow[0]]
    assert [t for _, t in fast[0]] == pytest.approx([t for _, t in slow[0]], abs=1e-9)
    assert fast[1] == slow[1]
    for name, series in slow[2].items():
        assert [b for _, b in fast[2][name]] == pytest.approx([b for _, b in series])


def _one_class_transfers(mode: str, seed: int) -> tuple[list[tuple[int, float]], dict, dict, int]:
    """Random transfers where every link carries one class (SNIC LOW, H2D HIGH) and DRAM both.
    mode: "chunks" (one event per chunk per link) or "fast" (one-class links FIFO)."""
    import random

    rng = random.Random(seed)
    snic = [LinkId(LinkKind.SNIC_RX, f"node{n}") for n in range(2)]
    h2d = [LinkId(LinkKind.H2D, f"pe{n}") for n in range(2)]
    dram = [LinkId(LinkKind.DRAM, f"node{n}") for n in range(2)]
    rates = {lid: rng.choice([1e5, 4e5, 1e6]) for lid in (*snic, *h2d)}
    rates.update({lid: 5e6 for lid in dram})
    loop = EventLoop()
    net = SimNetwork(
        loop,
        lambda lid: rates.get(lid, 0.0),
        quantum_s=0.01,
        window_s=0.5,
        fast=mode != "chunks",
        fifo=("snic_rx", "h2d"),
    )

    def pick():
        n = rng.randrange(2)
        if rng.random() < 0.5:
            path, cls = [snic[n], dram[n]], TrafficClass.LOW
        else:
            path, cls = [dram[n], h2d[n]], TrafficClass.HIGH
        return path, rng.choice([100, 2_000, 20_000, 300_000]), cls

    return _replay(loop, net, rng, pick)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_one_class_links_served_fifo_keep_the_arbiters_timing(seed):
    # Weighted fair queueing with one class is FIFO: granting each transfer at once behind the
    # bytes before it completes every transfer when the per-chunk arbiter does.
    chunks, fast = _one_class_transfers("chunks", seed), _one_class_transfers("fast", seed)
    assert [t for _, t in fast[0]] == pytest.approx([t for _, t in chunks[0]], abs=1e-9)
    assert [i for i, _ in fast[0]] == [i for i, _ in chunks[0]]
    assert fast[1] == chunks[1]
    for name, series in chunks[2].items():
        assert [b for _, b in fast[2][name]] == pytest.approx([b for _, b in series])
    assert fast[3] < chunks[3]


@pytest.mark.parametrize("fast", [False, True])
def test_timed_transfers_learn_the_completion_time_no_later_than_it(fast):
    """`transfer_timed` reports each transfer's completion time (the one `transfer` runs its
    callback at) at or before that time; on fast links without an event of its own."""
    import random

    def run(timed: bool):
        rng = random.Random(7)
        links = [SNIC, DRAM, LinkId(LinkKind.H2D, "pe0")]
        loop = EventLoop()
        net = SimNetwork(loop, lambda lid: 1e6, quantum_s=0.01, fast=fast, fifo=("snic_rx", "h2d"))
        out: dict[int, tuple[float, float]] = {}

        def start(i, path, nbytes, cls):
            if timed:
                net.transfer_timed(path, nbytes, cls, lambda t: out.setdefault(i, (t, loop.now)))
            else:
                net.transfer(path, nbytes, cls, lambda: out.setdefault(i, (loop.now, loop.now)))

        for i in range(200):
            path = rng.sample(links, rng.randint(1, 3))
            cls = TrafficClass.HIGH if LinkId(LinkKind.H2D, "pe0") in path else TrafficClass.LOW
            if SNIC in path and cls is TrafficClass.HIGH:
                path.remove(SNIC)
            loop.at(rng.uniform(0, 2), start, i, path, rng.choice([500, 8_000, 40_000]), cls)
        loop.run()
        return out, loop.events

    (ref, ref_events), (timed, timed_events) = run(False), run(True)
    assert sorted(timed) == sorted(ref) == list(range(200))
    for i, (t, _) in ref.items():
        assert timed[i][0] == t  # the same completion time
        assert timed[i][1] <= t  # known no later than it
    assert timed_events < ref_events if fast else timed_events == ref_events


def test_one_class_link_refuses_the_other_class():
    loop = EventLoop()
    net = SimNetwork(loop, lambda lid: 1e6, fifo=("snic_rx",))
    net.transfer([SNIC], 1000, TrafficClass.LOW, lambda: None)
    with pytest.raises(ValueError, match="both traffic classes"):
        net.transfer([SNIC], 1000, TrafficClass.HIGH, lambda: None)


def test_grant_alone_matches_enqueue_and_grant():
    import random

    from dualpath_jax.transfer.links import LinkArbiter, LinkRequest

    rng = random.Random(0)
    a, b = (LinkArbiter(1e6, chunk_bytes=50_000) for _ in range(2))
    now = 0.0
    for _ in range(200):
        n, cls = rng.randint(1, 50_000), rng.choice(list(TrafficClass))
        now = max(now, a.t_free) + rng.choice([0.0, 0.01])
        a.enqueue(LinkRequest(n, cls, None))
        g = a.grant(now)
        assert b.grant_alone(n, cls, now) == (g.start, g.end)
        state = ("_vtime", "_last_tag", "t_free", "_backlogged", "_head_tag")
        assert [getattr(a, k) for k in state] == [getattr(b, k) for k in state]
        if rng.random() < 0.3:  # a contended spell through the ordinary calls, on both
            for arb in (a, b):
                arb.enqueue(LinkRequest(120_000, TrafficClass.LOW, None))
                arb.enqueue(LinkRequest(60_000, TrafficClass.HIGH, None))
                t = now
                while arb.pending():
                    t = arb.grant(max(t, arb.ready_at())).end
            now = a.t_free


def test_new_link_id_objects_reach_the_same_link_and_the_lookup_stays_bounded():
    """Paths normally repeat cached LinkId objects; equal new ones still find the link, and the
    identity lookup does not grow with them."""
    loop = EventLoop()
    net = SimNetwork(loop, lambda lid: 1e9, fifo=("snic_rx",))
    done: list[float] = []
    for _ in range(5000):
        lid = LinkId(LinkKind.SNIC_RX, "node0")
        net.transfer([lid], 1000, TrafficClass.LOW, lambda: done.append(loop.now))
    loop.run()
    assert len(net.links) == 1 and len(done) == 5000
    assert done[-1] == pytest.approx(5000 * 1000 / 1e9)  # one FIFO link, back to back
    assert len(net._by_ref) <= 4 * len(net.links) + 1025
