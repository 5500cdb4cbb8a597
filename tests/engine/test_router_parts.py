"""The router's parts, each alone: dispatch fed fake engine registrations and rounds, retention
with a recording store, liveness with recording listeners, and the params part's held rounds.
No router, sockets or model: each part gets an outbox over a recording server, the registry or
session table it reads, and callables where it hands over to another part."""

from __future__ import annotations

import dataclasses

import msgspec
import pytest
from router_rig import BT, CLIENT, DE, DE_ID, PE, PE_ID, Clock, Recorder, config, registration

from dualpath_jax.config import Policy
from dualpath_jax.presets import TINY_QWEN2
from dualpath_jax.router.dispatch import Dispatch
from dualpath_jax.router.liveness import EngineRegistry, Liveness
from dualpath_jax.router.outbox import Outbox
from dualpath_jax.router.params_update import ParamsCoordinator
from dualpath_jax.router.retention import Retention
from dualpath_jax.router.sessions import RequestState, SessionTable
from dualpath_jax.sched.scheduler import GlobalScheduler
from dualpath_jax.sched.types import Request
from dualpath_jax.wire import messages


def register(
    registry: EngineRegistry, engine: int, role: str, ident: bytes, version: str = ""
) -> None:
    registry.add(ident, registration(engine, role, pid=100 + engine, params_version=version))


# ----------------------------------------------------------------------------- dispatch


@dataclasses.dataclass
class DispatchRig:
    dispatch: Dispatch
    server: Recorder
    registry: EngineRegistry
    table: SessionTable
    scheduler: GlobalScheduler
    out: Outbox
    ended: list[tuple[str, str, str]]  # (request, message, kind) of each `end`
    cancelled: list[tuple[str, int]]  # (request, but) of each `cancel`
    stale: list  # the engines handed to `stale` (taken out of rotation)

    def start_round(self, request: str, prompt_len: int = 3 * BT + 5, hit_blocks: int = 2) -> None:
        """A round the sessions part has admitted: `hit_blocks` of its prompt are stored."""
        self.table.open(request, resume=False)
        sub = messages.Submit(request=request, session=request, append=[1] * prompt_len, gen=4)
        req = Request(request, request, 0, prompt_len, hit_blocks * BT, 4)
        keys = [f"k{i}" for i in range(hit_blocks)]
        self.table.start_round(CLIENT, sub, req, list(sub.append), keys, now=0.0)
        self.scheduler.submit(req)

    def fetch(self, engine: int, slots: int = 4) -> None:
        load = messages.Load(hbm_capacity_tokens=10_000, slots=slots)
        ident = PE_ID if engine == PE else DE_ID
        self.dispatch.on_fetch(ident, messages.Fetch(engine=engine, load=load))

    def assign(self) -> list[messages.LoadJobMsg]:
        """A DE fetch then a PE fetch: the jobs the DE got."""
        self.server.sent.clear()
        self.fetch(DE)
        self.fetch(PE)
        return [j for m in self.server.to(DE_ID) if isinstance(m, messages.Work) for j in m.jobs]


def dispatch_rig(followers=None, **cluster) -> DispatchRig:
    cfg = config(**cluster)
    clock = Clock()
    server = Recorder()
    out = Outbox(server, None, clock)  # type: ignore[arg-type]
    registry = EngineRegistry(cfg.cluster, clock, served=lambda: "v7")
    register(registry, PE, "prefill", PE_ID, "v7")
    register(registry, DE, "decode", DE_ID, "v7")
    table = SessionTable(TINY_QWEN2.vocab_size, 256)
    c = cfg.cluster
    scheduler = GlobalScheduler(
        Policy.DUALPATH, block_tokens=BT, de_max_seqs=c.decode_slots + c.decode_queue
    )
    ended: list[tuple[str, str, str]] = []
    cancelled: list[tuple[str, int]] = []
    stale: list = []

    def end(st: RequestState, message: str, kind: str) -> None:
        ended.append((st.id, message, kind))
        table.drop(st)

    dispatch = Dispatch(
        cfg,
        scheduler,
        registry,
        table,
        out,
        clock,
        params_version=lambda: "v7",
        end=end,
        cancel=lambda st, but: cancelled.append((st.id, but)),
        stale=stale.append,
        followers=followers,
    )
    return DispatchRig(dispatch, server, registry, table, scheduler, out, ended, cancelled, stale)


def test_the_de_gets_the_job_first_and_the_pe_once_the_de_is_ready():
    rig = dispatch_rig()
    rig.start_round("r1", hit_blocks=2)
    (job,) = rig.assign()
    assert rig.server.to(PE_ID) == []  # not before DeReady
    assert (job.request, job.keys, job.attempt, job.params_version) == ("r1", ["k0", "k1"], 1, "v7")
    assert (job.pe_engine, job.pe_address, job.de_engine, job.de_address) == (
        PE,
        "inproc://0",
        DE,
        "inproc://1",
    )
    # the hit is split between the two read paths and a recomputed lead, and counted once
    assert job.pe_blocks + job.de_blocks + job.lead_blocks == 2
    counters = rig.out.counters
    assert sum(counters[f"path_{p}"] for p in ("pe", "de", "split", "none")) == 1
    st = rig.table.requests["r1"]
    assert (st.pe, st.de, st.attempts) == (PE, DE, 1)
    rig.dispatch.on_de_ready(DE_ID, messages.DeReady(request="r1", engine=DE, attempt=2))
    assert rig.server.to(PE_ID) == []  # another attempt's readiness
    rig.dispatch.on_de_ready(DE_ID, messages.DeReady(request="r1", engine=DE, attempt=1))
    assert rig.server.to(PE_ID) == [messages.Work(jobs=[job])] and st.job is None


def test_a_fetch_from_an_unknown_engine_is_told_to_register_again():
    rig = dispatch_rig()  # an engine of a router that restarted
    rig.dispatch.on_fetch(b"who", messages.Fetch(engine=9, load=messages.Load()))
    (err,) = rig.server.to(b"who")
    assert err.kind == "rejoin" and err.ref == "9" and "router restarted" in err.message


def test_reads_count_against_the_node_until_they_are_done():
    rig = dispatch_rig()
    rig.start_round("r1", hit_blocks=3)
    (job,) = rig.assign()
    pe_tokens, de_tokens = job.pe_blocks * BT, job.de_blocks * BT
    assert rig.dispatch.node_read_q(PE) == pe_tokens and rig.dispatch.node_read_q(DE) == de_tokens
    rig.dispatch.on_reads_done(PE_ID, messages.ReadsDone(request="r1", engine=PE, attempt=1))
    rig.dispatch.on_reads_done(DE_ID, messages.ReadsDone(request="r1", engine=DE, attempt=1))
    assert rig.dispatch.node_read_q(PE) == 0 and rig.dispatch.node_read_q(DE) == 0
    assert rig.dispatch.read_queues() == {"0": 0, "1": 0}


def test_a_de_at_its_slots_plus_queue_has_no_room():
    rig = dispatch_rig(decode_slots=1, decode_queue=1)
    for k in range(3):
        rig.start_round(f"r{k}", hit_blocks=0)
    rig.fetch(DE, slots=1)
    de = rig.registry[DE]
    held = [st for st in rig.table.requests.values() if st.de == DE]
    assert len(held) == 2
    load = rig.dispatch.engine_load(de)
    assert (load.seq_e, load.free_hbm_tokens) == (2, 0)
    assert rig.dispatch.loads()[str(DE)]["requests"] == 2


def test_a_des_load_counts_the_group_followers_waiting_on_its_rounds():
    """A round's followers (group sampling) wait for its first token outside the queue; once
    the round has a DE they count in that DE's load, as they will decode there."""
    waiting: dict[str, list] = {}
    rig = dispatch_rig(followers=lambda r: waiting.get(r, []))
    rig.start_round("lead", hit_blocks=0)
    rig.table.open("f1", resume=False)
    sub = messages.Submit(request="f1", session="f1", append=[1] * (3 * BT + 5), gen=4)
    req = Request("f1", "f1", 0, 3 * BT + 5, 0, 4)
    waiting["lead"] = [rig.table.start_round(CLIENT, sub, req, list(sub.append), [], now=0.0)]
    waiting["lead"][0].follows = "lead"
    de = rig.registry[DE]
    assert rig.dispatch.engine_load(de).seq_e == 0
    rig.fetch(DE)
    load = rig.dispatch.engine_load(de)
    assert load.seq_e == 2 and load.tok_e == 2 * (3 * BT + 5)  # each attends over the prompt
    # the prompt's whole pages before its last token's are held once (10,000 tokens reported)
    own = (3 * BT + 5 + 4) - 3 * BT
    assert load.free_hbm_tokens == 10_000 - (3 * BT + 5 + 4) - own


def test_forks_whose_round_ended_hold_its_shared_pages_once():
    rig = dispatch_rig()
    prompt = 2 * BT + 1  # its last token starts a page: two pages are shared
    for k in range(3):
        rig.table.open(f"f{k}", resume=False)
        sub = messages.Submit(request=f"f{k}", session=f"f{k}", append=[1] * prompt, gen=4)
        req = Request(f"f{k}", f"f{k}", 0, prompt, 0, 4)
        st = rig.table.start_round(CLIENT, sub, req, list(sub.append), [], now=0.0)
        st.de, st.path, st.follows = DE, "fork", "gone"
    rig.fetch(DE)
    load = rig.dispatch.engine_load(rig.registry[DE])
    assert load.free_hbm_tokens == 10_000 - 3 * (prompt + 4) + 2 * (2 * BT)


def test_a_transfer_failure_is_retried_from_the_head_of_the_queue():
    rig = dispatch_rig(max_attempts=2)
    rig.start_round("r1")
    (job,) = rig.assign()
    failed = messages.Failed(
        request="r1", engine=PE, message="TransferTimeout", kind="transfer", attempt=job.attempt
    )
    rig.dispatch.on_failed(PE_ID, failed)
    st = rig.table.requests["r1"]
    assert rig.cancelled == [("r1", PE)] and rig.ended == []  # the DE drops its half
    assert (st.pe, st.de, st.job) == (-1, -1, None)
    assert [r.id for r in rig.scheduler.queued_requests()] == ["r1"]
    assert rig.out.counters["requeued"] == 1 and rig.out.counters["failed"] == 1
    (job,) = rig.assign()
    assert job.attempt == 2
    rig.dispatch.on_failed(PE_ID, msgspec.structs.replace(failed, attempt=1))  # a stale report
    assert rig.ended == [] and rig.table.requests["r1"].attempts == 2


def test_the_last_attempt_ends_the_round_with_its_cause():
    rig = dispatch_rig(max_attempts=1)
    rig.start_round("r1")
    (job,) = rig.assign()
    rig.dispatch.on_failed(
        DE_ID, messages.Failed(request="r1", engine=DE, message="stall", kind="transfer", attempt=1)
    )
    ((request, message, kind),) = rig.ended
    assert (request, kind) == ("r1", "transfer")
    assert message == "gave up after 1 attempts; last failure: decode engine 1: stall"
    assert rig.out.counters["requeued"] == 0


@pytest.mark.parametrize("kind", ["store", "engine", "unheard-of"])
def test_other_failures_end_the_round_at_once(kind):
    rig = dispatch_rig(max_attempts=3)
    rig.start_round("r1")
    rig.assign()
    rig.dispatch.on_failed(
        PE_ID, messages.Failed(request="r1", engine=PE, message="disk full", kind=kind, attempt=1)
    )
    assert rig.ended == [
        ("r1", "prefill engine 0: disk full", "engine" if kind != "store" else kind)
    ]


def test_a_dead_engines_rounds_are_cancelled_on_the_other_and_requeued():
    rig = dispatch_rig(max_attempts=2)
    rig.start_round("r1")
    rig.start_round("r2")  # still queued: not the dead engine's
    rig.assign()
    on_de = [st.id for st in rig.table.requests.values() if st.de == DE]
    assert on_de
    de = rig.registry[DE]
    rig.registry.mark_dead(de)
    rig.dispatch.engine_died(de)
    assert rig.cancelled == [(r, DE) for r in on_de]
    for r in on_de:
        st = rig.table.requests[r]
        assert st.de == -1 and st.last_kind == "engine"
        assert st.last_error == "decode engine 1 (pid 101) stopped heartbeating"
    assert {r.id for r in rig.scheduler.queued_requests()} == {"r1", "r2"}


# ----------------------------------------------------------------------------- retention


class Store:
    """Records the retention the router's store is told."""

    def __init__(self) -> None:
        self.told: list[tuple[str, str, int, float]] = []

    def retain(self, session: str, state: str, priority: int, ttl_s: float) -> None:
        self.told.append((session, state, priority, ttl_s))


def retention_rig() -> tuple[Retention, Store, Recorder, EngineRegistry, Clock]:
    clock = Clock()
    server = Recorder()
    registry = EngineRegistry(config().cluster, clock)
    register(registry, PE, "prefill", PE_ID)
    register(registry, DE, "decode", DE_ID)
    store = Store()
    retention = Retention(store, 60.0, registry, Outbox(server, None, clock), clock)  # type: ignore[arg-type]
    return retention, store, server, registry, clock


def test_a_sessions_retention_follows_its_rounds():
    retention, store, server, _, clock = retention_rig()
    retention.opened("s", priority=2, ttl_s=-1.0, resume=False)
    assert store.told == [] and server.sent == []  # nothing to keep yet
    retention.round_started("s", priority=None, ttl_s=None)
    active = messages.Retain(session="s", state="active", priority=2, ttl_s=60.0)
    assert store.told == [("s", "active", 2, 60.0)] and server.sent == [(DE_ID, active)]
    clock.t = 5.0
    retention.round_ended("s")
    assert store.told[-1] == ("s", "idle", 2, 60.0) and retention["s"].retained_until == 65.0
    retention.round_started("s", priority=7, ttl_s=10.0)  # a round's own settings stay
    retention.round_ended("s")
    assert store.told[-1] == ("s", "idle", 7, 10.0)
    server.sent.clear()
    retention.closed("s")
    assert server.sent == [(DE_ID, messages.Retain(session="s", state="ended"))]
    retention.round_ended("s")  # a round ending after its session closed changes nothing
    assert len(server.sent) == 1 and store.told[-1][:2] == ("s", "ended")


def test_a_decode_engine_that_joins_learns_where_each_session_stands():
    retention, store, server, registry, clock = retention_rig()
    for s in ("busy", "idle", "over", "new"):
        retention.opened(s, priority=1, ttl_s=30.0, resume=False)
    for s in ("busy", "idle", "over"):
        retention.round_started(s, priority=None, ttl_s=None)
    retention.round_ended("over")
    clock.t = 20.0
    retention.round_ended("idle")
    clock.t = 40.0  # "over"'s TTL has passed, "idle" has 10 s left
    server.sent.clear()
    told = len(store.told)
    register(registry, 2, "decode", b"de2")
    retention.engine_joined(registry[2], registration(2, "decode"))
    assert server.sent == [
        (b"de2", messages.Retain(session="busy", state="active", priority=1, ttl_s=30.0)),
        (b"de2", messages.Retain(session="idle", state="idle", priority=1, ttl_s=10.0)),
    ]
    assert len(store.told) == told  # only the new engine is told
    server.sent.clear()
    retention.engine_joined(registry[PE], registration(PE, "prefill"))
    assert server.sent == []  # a PE keeps no sessions' blocks


def test_resuming_a_session_restates_its_retention():
    retention, store, server, _, _ = retention_rig()
    retention.opened("s", priority=0, ttl_s=-1.0, resume=False)
    retention.round_started("s", priority=None, ttl_s=None)
    server.sent.clear()
    retention.opened("s", priority=4, ttl_s=100.0, resume=True)
    assert server.sent == [
        (DE_ID, messages.Retain(session="s", state="active", priority=4, ttl_s=100.0))
    ]


# ----------------------------------------------------------------------------- liveness


@dataclasses.dataclass
class LivenessRig:
    liveness: Liveness
    registry: EngineRegistry
    server: Recorder
    out: Outbox
    clock: Clock
    heard: list[tuple]  # what the listeners heard, in order


def liveness_rig() -> LivenessRig:
    cfg = config()
    clock = Clock()
    server = Recorder()
    out = Outbox(server, None, clock)  # type: ignore[arg-type]
    registry = EngineRegistry(cfg.cluster, clock)
    heard: list[tuple] = []
    liveness = Liveness(
        registry,
        out,
        joined=[
            lambda e, msg: heard.append(("first", e.engine, list(server.sent))),
            lambda e, msg: heard.append(("second", e.engine)),
        ],
        died=[
            lambda e: heard.append(("died", e.engine, e.alive)),
            lambda e: heard.append(("then", e.engine)),
        ],
        no_engine=lambda why: heard.append(("no_engine", why)),
    )
    return LivenessRig(liveness, registry, server, out, clock, heard)


def test_a_registered_engine_is_answered_before_the_other_parts_hear_of_it():
    rig = liveness_rig()
    rig.liveness.on_register(PE_ID, registration(PE, "prefill"))
    ack = (PE_ID, messages.Ack(ref=str(PE)))
    assert rig.heard == [("first", PE, [ack]), ("second", PE)]
    assert rig.registry[PE].ident == PE_ID and rig.registry[PE].alive


def test_a_live_id_from_another_process_is_refused_and_nobody_hears_of_it():
    rig = liveness_rig()
    rig.liveness.on_register(PE_ID, registration(PE, "prefill", pid=7))
    rig.heard.clear()
    rig.server.sent.clear()
    rig.liveness.on_register(b"rogue", registration(PE, "prefill", pid=8))
    ((ident, err),) = rig.server.sent
    assert ident == b"rogue" and err.kind == "stop" and "already registered by pid 7" in err.message
    assert rig.heard == [] and rig.out.counters["refused_frames"] == 1
    assert rig.registry[PE].pid == 7
    rig.liveness.on_register(b"x", registration(5, "router"))
    assert rig.server.sent[-1][1].kind == "stop" and 5 not in rig.registry


def test_an_unusable_cost_model_is_dropped_at_registration():
    rig = liveness_rig()
    bad = messages.PrefillCost(prefill=(0.01, float("nan"), 0.0), calibrated=True)
    rig.liveness.on_register(PE_ID, registration(PE, "prefill", prefill_cost=bad))
    good = messages.PrefillCost(prefill=(0.01, 1e-4, 0.0), calibrated=True)
    rig.liveness.on_register(b"pe2", registration(2, "prefill", prefill_cost=good))
    assert rig.registry[PE].prefill_cost is None and rig.registry[2].prefill_cost == good


def test_a_silent_engine_dies_and_a_role_with_none_fails_rounds_after_its_timeout():
    rig = liveness_rig()
    cluster = rig.registry.cluster
    rig.liveness.on_register(PE_ID, registration(PE, "prefill"))
    rig.liveness.on_register(DE_ID, registration(DE, "decode"))
    rig.heard.clear()
    rig.clock.t = cluster.heartbeat_timeout_s + 1
    rig.registry.heard_from(DE_ID, messages.Heartbeat(engine=DE))  # the DE lives on
    rig.liveness.check(rig.clock())
    assert rig.heard == [("died", PE, False), ("then", PE)]
    assert rig.out.counters["engine_deaths"] == 1
    rig.heard.clear()
    rig.clock.t += cluster.no_engine_timeout_s + 1
    rig.registry.heard_from(DE_ID, messages.Heartbeat(engine=DE))
    rig.liveness.check(rig.clock())
    ((what, why),) = rig.heard
    assert what == "no_engine" and "no live prefill engine" in why
    rig.liveness.stop_all()
    assert rig.server.sent[-1] == (DE_ID, messages.Stop())


# ----------------------------------------------------------------------------- params


def test_a_resuming_router_serves_the_recorded_params_and_a_fresh_one_forgets_them(tmp_path):
    cfg = config()
    clock = Clock()
    out = Outbox(Recorder(), None, clock)  # type: ignore[arg-type]
    registry = EngineRegistry(cfg.cluster, clock)
    record = tmp_path / "served_params.json"
    record.write_text('{"version": "step-3", "path": "/ckpt/step-3"}')

    def coordinator(resume: bool) -> ParamsCoordinator:
        return ParamsCoordinator(
            cfg, registry, out, clock, in_flight=lambda: 0, served_file=record, resume=resume
        )

    resumed = coordinator(resume=True)
    assert (resumed.version, resumed.path) == ("step-3", "/ckpt/step-3")
    fresh = coordinator(resume=False)  # a new cluster in the same workdir
    assert fresh.version == "" and not record.exists()


def test_rounds_held_during_an_update_are_released_in_order_once_it_ends():
    cfg = config()
    clock = Clock()
    server = Recorder()
    out = Outbox(server, None, clock)  # type: ignore[arg-type]
    registry = EngineRegistry(cfg.cluster, clock)
    register(registry, PE, "prefill", PE_ID)
    in_flight = [1]
    params = ParamsCoordinator(cfg, registry, out, clock, in_flight=lambda: in_flight[0])
    sub = [messages.Submit(request=f"r{k}", session=f"s{k}", append=[1], gen=1) for k in range(3)]
    assert not params.hold(CLIENT, sub[0])  # no update: the round runs
    params.on_update(b"admin", messages.UpdateParams(version="v1", path="/p"))
    assert all(params.hold(CLIENT, s) for s in sub)
    assert params.holds_round_of(CLIENT, "s1") and not params.holds_round_of(b"other", "s1")
    assert not params.cancel_held(b"other", messages.CancelRound(request="r1"))
    assert params.cancel_held(CLIENT, messages.CancelRound(request="r1"))
    assert server.sent[-1] == (
        CLIENT,
        messages.Error(ref="r1", message="cancelled by the client", kind="cancelled"),
    )
    params.advance()  # a round still drains: nothing loads
    assert server.to(PE_ID) == [] and params.take_released() == []
    in_flight[0] = 0
    params.advance()
    assert server.to(PE_ID) == [messages.LoadParams(version="v1", path="/p")]
    params.on_loaded(PE_ID, messages.ParamsLoaded(engine=PE, version="v1", ok=True))
    assert params.version == "v1" and server.sent[-1] == (b"admin", messages.Ack(ref="params:v1"))
    assert params.take_released() == [(CLIENT, sub[0]), (CLIENT, sub[2])]
    assert params.take_released() == []
