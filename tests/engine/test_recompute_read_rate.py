"""Load or recompute on the router prices reads at the right rate: the emulated storage NIC's
where the config emulates it (the experiment's), the rate the router measured from finished
reads where every link runs at the host's speed (`configs/serve.py`), never an emulated one by
accident; and it picks the faster path under each.

The router's dispatch part alone, with the scheduler `build_router` makes (`router_scheduler`),
a PE reporting the tiny model's CPU cost model and a DE, fed rounds whose earlier turns' blocks
are stored (no sockets, no model)."""

from __future__ import annotations

import dataclasses

import pytest
from router_rig import CLIENT, DE, DE_ID, PE, PE_ID, Clock, Recorder, registration

from dualpath_jax import load_config
from dualpath_jax.config import ExperimentConfig, apply_overrides
from dualpath_jax.model.layout import kv_bytes_per_token
from dualpath_jax.presets import TINY_CPU_PREFILL_COST
from dualpath_jax.router.dispatch import Dispatch, ReadRate
from dualpath_jax.router.liveness import EngineRegistry
from dualpath_jax.router.outbox import Outbox
from dualpath_jax.router.sessions import SessionTable
from dualpath_jax.runtimes.build import router_scheduler
from dualpath_jax.sched.types import Request
from dualpath_jax.wire import messages

HIT_BLOCKS = 8  # a later turn's stored blocks: 128 tokens of 16-token blocks
NEW = 5  # its new tokens
# The tiny model on a CPU: recomputing 128 tokens costs about 6 ms more than reading them
# would at no cost; the emulated 0.5 MB/s storage NIC takes about 0.2 s to read them.
COST = messages.PrefillCost(prefill=TINY_CPU_PREFILL_COST.prefill, calibrated=False)


@dataclasses.dataclass
class _Rig:
    dispatch: Dispatch
    server: Recorder
    table: SessionTable
    bt: int

    def round(self, request: str) -> messages.LoadJobMsg:
        """A later turn of session `request` (its first `HIT_BLOCKS` blocks stored), assigned:
        the job its DE got."""
        bt, prompt = self.bt, HIT_BLOCKS * self.bt + NEW
        self.table.open(request, resume=False)
        sub = messages.Submit(request=request, session=request, append=[1] * prompt, gen=4)
        req = Request(request, request, 0, prompt, HIT_BLOCKS * bt, 4)
        keys = [f"{request}-{i}" for i in range(HIT_BLOCKS)]
        self.table.start_round(CLIENT, sub, req, list(sub.append), keys, now=0.0)
        self.dispatch.scheduler.submit(req)
        self.server.sent.clear()
        for engine, ident in ((DE, DE_ID), (PE, PE_ID)):
            load = messages.Load(hbm_capacity_tokens=100_000, slots=8)
            self.dispatch.on_fetch(ident, messages.Fetch(engine=engine, load=load))
        (job,) = [j for m in self.server.to(DE_ID) if isinstance(m, messages.Work) for j in m.jobs]
        return job

    def reads_took(self, request: str, seconds: float) -> None:
        """The engine that read `request`'s blocks reports they took `seconds`."""
        st = self.table.requests[request]
        engine, ident = (PE, PE_ID) if st.pe_read_tokens else (DE, DE_ID)
        msg = messages.ReadsDone(request=request, engine=engine, attempt=1, read_s=seconds)
        self.dispatch.on_reads_done(ident, msg)

    @property
    def rate(self) -> float:
        """The read rate load or recompute prices reads by, in tokens per second."""
        return self.dispatch.scheduler.recompute.read_tokens_per_s


def _rig(cfg: ExperimentConfig) -> _Rig:
    clock, server = Clock(), Recorder()
    registry = EngineRegistry(cfg.cluster, clock, served=lambda: "")
    registry.add(PE_ID, registration(PE, "prefill", prefill_cost=COST))
    registry.add(DE_ID, registration(DE, "decode"))
    table = SessionTable(cfg.model.vocab_size, cfg.cluster.decode_max_len)
    dispatch = Dispatch(
        cfg,
        router_scheduler(cfg),
        registry,
        table,
        Outbox(server, None, clock),  # type: ignore[arg-type]
        clock,
        params_version=lambda: "",
        end=lambda st, message, kind: table.drop(st),
        cancel=lambda st, but: None,
        stale=lambda e: None,
    )
    dispatch.update_beta()  # as the router does when a PE registers: its cost model
    return _Rig(dispatch, server, table, cfg.store.block_tokens)


def _loaded(job: messages.LoadJobMsg) -> bool:
    return job.lead_blocks == 0 and job.pe_blocks + job.de_blocks == HIT_BLOCKS


def _recomputed(job: messages.LoadJobMsg) -> bool:
    return job.lead_blocks == HIT_BLOCKS and job.pe_blocks + job.de_blocks == 0


def test_emulated_links_price_reads_at_the_emulated_rate_and_recompute():
    cfg = apply_overrides(load_config("configs/cpu_1p1d.py:tiny"), ["scheduler.recompute=auto"])
    rig = _rig(cfg)
    emulated = cfg.hardware.snic_bytes_per_s / kv_bytes_per_token(cfg.model)
    assert rig.rate == emulated  # 651 tokens/s: 128 tokens take 0.2 s
    assert _recomputed(rig.round("a"))  # 6 ms of compute beats 0.2 s of reading
    # At most 4 blocks recomputed, the other 4 are read: however fast those reads finish, the
    # rule keeps the rate the experiment emulates.
    capped = _rig(apply_overrides(cfg, ["scheduler.recompute_max_blocks=4"]))
    job = capped.round("a")
    assert (job.lead_blocks, job.pe_blocks + job.de_blocks) == (4, 4)
    capped.reads_took("a", 0.001)
    assert capped.dispatch.read_rate.tokens_per_s == pytest.approx(4 * capped.bt / 0.001)
    assert capped.rate == emulated


def test_links_at_the_host_speed_load_until_reads_are_measured_then_use_the_measure():
    cfg = load_config("configs/serve.py:tiny")
    assert cfg.scheduler.recompute == "auto" and cfg.hardware.snic_bytes_per_s == 0
    rig = _rig(cfg)
    assert rig.rate == 0.0  # no emulated rate, none measured yet: reads are not priced
    first = rig.round("a")
    assert _loaded(first)
    rig.reads_took("a", 0.001)  # 128 tokens in 1 ms: the store is fast
    assert rig.rate == pytest.approx(HIT_BLOCKS * rig.bt / 0.001)
    assert _loaded(rig.round("b"))  # 1 ms of reading beats 6 ms of compute
    rig.reads_took("b", 2.0)  # the store slowed down (a loaded disk, a remote store)
    assert rig.rate == pytest.approx((128 * 0.9 + 128) / (0.001 * 0.9 + 2.0))
    assert _recomputed(rig.round("c"))  # 1 s of reading loses to 6 ms of compute
    assert rig.dispatch.read_rate.tokens_per_s == rig.rate


def test_the_read_rate_decays_old_reads_and_ignores_empty_ones():
    r = ReadRate(decay=0.5)
    assert r.tokens_per_s == 0.0
    r.add(0, 1.0)  # a side that read nothing (its blocks were held in memory)
    r.add(100, 0.0)  # no time measured
    assert r.tokens_per_s == 0.0
    r.add(100, 1.0)
    r.add(100, 0.1)
    assert r.tokens_per_s == pytest.approx((50 + 100) / (0.5 + 0.1))
