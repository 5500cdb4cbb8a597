"""Assigning rounds to engines, the router's dispatch part: the GlobalScheduler's shell.

Request lifecycle on the engines: queued (scheduler) -> assigned (PE, DE, read path; the DE gets
the job) -> DE ready (its buffer reserved, reads issued; now the PE gets the job) -> prefilled
(first token, forwarded to the DE) -> decoded (tokens, blocks persisted) -> answered.

`Dispatch` handles the leader engines' `Fetch` (pull based: report the engine's capacity, feed
the scheduler the router's own loads, turn its assignments into `LoadJobMsg` jobs), `DeReady`
(the PE's half of the job goes out), `ReadsDone` (the node's read queue shrinks; where the
storage NIC is not emulated, load or recompute prices reads at the rate they took, `ReadRate`)
and `Failed`.
Admission: no DE holds more than its slots plus `cluster.decode_queue` requests. Only engines
in rotation (`EngineRegistry.serving`: serving the cluster's params version) are fed to the
scheduler; one out of rotation that fetches gets nothing, and one that leaves rotation
(`engine_left`) is forgotten by the scheduler as a dead one is. A fetch from an engine liveness
declared dead (paused, or cut off, beyond `cluster.heartbeat_timeout_s`) is answered
`Error(kind="rejoin")`: its rounds were requeued, so it drops what it holds and registers again.

Failures (docs/failures.md): an engine's `Failed` of kind `transfer` is retried up to
`cluster.max_attempts` (`requeue`: back at the head of the queue as if never assigned); so is
kind `params` (the engine does not serve the job's params version), and that engine leaves
rotation until it is caught up (`stale`, the params part's); `store` and `engine` failures end
the round with that kind and the engine's text. When liveness declares an engine dead
(`engine_died`), the scheduler forgets it and every unfinished round it touched is cancelled on
the surviving engine and requeued (its persisted blocks are still in the store, so the retry is
a normal, possibly shorter, hit).

It also sets the scheduler's beta from the live PEs' cost models (`update_beta`) as PEs
register and die. Rounds end through the `end(st, message, kind)` and `cancel(st, but)` it is
given (the sessions part's).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

from dualpath_jax.config import ExperimentConfig
from dualpath_jax.router.liveness import EngineInfo, EngineRegistry
from dualpath_jax.router.outbox import Outbox
from dualpath_jax.router.sessions import RequestState, SessionTable
from dualpath_jax.sched.cost import FittedCostModel, engines_beta
from dualpath_jax.sched.scheduler import GlobalScheduler
from dualpath_jax.sched.types import Assignment, EngineLoad, ReadPath
from dualpath_jax.wire import messages

log = logging.getLogger(__name__)

FAILURE_KINDS = ("transfer", "store", "engine", "params")


def load_job(
    st: RequestState,
    a: Assignment,
    pe: EngineInfo,
    de: EngineInfo,
    *,
    reads: bool,
    layerwise: bool,
    params_version: str,
) -> messages.LoadJobMsg:
    """Round `st`'s job on assignment `a`'s PE and DE. Without `reads` (the oracle policy) the
    PE loads the whole hit itself and nothing is recomputed first."""
    n = len(st.keys)
    oracle = not reads
    return messages.LoadJobMsg(
        **_round_fields(st, de, params_version),
        keys=st.keys,
        pe_blocks=n if oracle else a.pe_read_blocks,
        de_blocks=0 if oracle else a.de_read_blocks,
        pe_engine=pe.engine,
        pe_node=pe.node,
        pe_address=pe.address,
        oracle=oracle,
        layerwise=layerwise,
        pe_pieces=pe.kv_pieces,
        pe_piece_addresses=list(pe.kv_piece_addresses),
        pe_piece_holders=[list(h) for h in pe.kv_piece_holders],
        lead_blocks=0 if oracle else a.recompute_blocks,  # the PE computes these first
    )


def fork_job(st: RequestState, de: EngineInfo, *, params_version: str) -> messages.LoadJobMsg:
    """Round `st`'s job as a fork on `de` of the round of the same prompt it follows (group
    sampling, `Submit.follows`): the DE starts it from that round's prompt pages, so nothing is
    read or prefilled for it."""
    return messages.LoadJobMsg(
        **_round_fields(st, de, params_version),
        keys=[],
        pe_blocks=0,
        de_blocks=0,
        pe_engine=-1,
        pe_node=-1,
        pe_address="",
        oracle=False,
        layerwise=False,
    )


def _round_fields(st: RequestState, de: EngineInfo, params_version: str) -> dict:
    """What every job of round `st` on DE `de` carries: the round and its decode engine."""
    return {
        "request": st.id,
        "prompt": st.prompt,
        "gen": st.gen,
        "de_engine": de.engine,
        "de_node": de.node,
        "de_address": de.address,
        "params_version": params_version,
        "attempt": st.attempts,
        "sampling": st.sampling,
        "stop_tokens": st.stop_tokens,
        "stream": st.stream,
        "session": st.session,
    }


class ReadRate:
    """The storage read rate the router measures, in hit tokens per second: each finished read's
    tokens (`ReadsDone`: a side's blocks read from the store, not those a prefetch held) over
    its seconds, both summed with weight `decay` per read so the rate follows the store as its
    cache warms or its load changes. A read's seconds include waiting behind the engine's
    other reads, so under load the rate errs low (towards recomputing). 0 until a read."""

    def __init__(self, decay: float = 0.9):
        self.decay = decay
        self.tokens = 0.0
        self.seconds = 0.0

    def add(self, tokens: int, seconds: float) -> None:
        if tokens > 0 and seconds > 0:
            self.tokens = self.tokens * self.decay + tokens
            self.seconds = self.seconds * self.decay + seconds

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


class Dispatch:
    """Assigns `table`'s rounds to `registry`'s engines in rotation through `scheduler`.
    `params_version()` is the version jobs run with; `stale(e)` takes engine `e`, which refused
    a job of it, out of rotation (the params part)."""

    def __init__(
        self,
        cfg: ExperimentConfig,
        scheduler: GlobalScheduler,
        registry: EngineRegistry,
        table: SessionTable,
        out: Outbox,
        clock: Callable[[], float],
        *,
        params_version: Callable[[], str],
        end: Callable[[RequestState, str, str], None],
        cancel: Callable[[RequestState, int], None],
        stale: Callable[[EngineInfo], None],
        assigned: Callable[[Assignment], None] | None = None,
        followers: Callable[[str], list[RequestState]] | None = None,
    ):
        self.cfg = cfg
        self.bt = cfg.store.block_tokens
        self.scheduler = scheduler
        self.registry = registry
        self.table = table
        self.out = out
        self.clock = clock
        self.params_version = params_version
        self.end = end
        self.cancel = cancel
        self.stale = stale
        self.assigned = assigned  # told of each assignment (the tool-gap prefetches)
        # a round's group followers waiting for its first token: its DE's load once it has one
        self.followers = followers
        # Load or recompute prices reads at the storage NIC's rate where it is emulated (the
        # experiment's), else at the rate measured here: never an emulated rate by accident.
        self.read_rate = ReadRate()
        self.reads_measured = not cfg.hardware.snic_bytes_per_s

    # ------------------------------------------------------------------ fetches

    def on_fetch(self, ident: bytes, msg: messages.Fetch) -> None:
        e = self.registry.live_one(msg.engine)
        if e is None:  # declared dead, yet it fetches (it was paused), or this router restarted
            return self.rejoin(ident, msg.engine)
        self.registry.report(e, msg.load, msg.links)
        if e.params_version != self.params_version():
            return  # out of rotation: no work until it serves the cluster's params
        loads = [self.engine_load(x) for x in self.registry.serving(e.role, e.group)]
        if e.role == "prefill":  # every DE node's read queue as of now, for the read-path choice
            des = self.registry.serving("decode")
            self.scheduler.report([self.engine_load(x) for x in des], "de")
        if e.role == "decode":
            for r, de in self.scheduler.fetch_de(e.group, loads):
                self.table.requests[r.id].de = de
            return
        for a in self.scheduler.fetch_pe(e.group, loads):
            self.assign(a)

    def rejoin(self, ident: bytes, engine: int) -> None:
        """Tells engine `engine`, declared dead but fetching (the connection that registered
        it: `EngineRegistry.heard_from` checked), to drop its work and register again: its
        rounds were requeued when it was declared dead. An engine this router never registered
        registered with its predecessor (the router restarted): it registers again too, and
        whatever it holds belongs to rounds that failed with the old router."""
        timeout = self.cfg.cluster.heartbeat_timeout_s
        self.out.count("rejoin_orders")
        self.out.event("rejoin_order", engine=engine)
        if engine in self.registry:
            why = (
                f"engine {engine} was declared dead (silent for over {timeout:g} s) and its "
                "rounds requeued: drop them and register again"
            )
        else:
            why = f"engine {engine} is not registered here (the router restarted): register again"
        self.out.send(ident, messages.Error(ref=str(engine), message=why, kind="rejoin"))

    def assign(self, a: Assignment) -> None:
        """A new attempt of `a`'s round: the DE gets the job (the PE's part waits for DeReady)."""
        st = self.table.requests[a.request.id]
        st.assign(a, self.clock(), self.bt)
        policy = self.scheduler.policy
        self.out.count(f"path_{a.path.value}")
        if a.recompute_blocks:
            self.out.count("recompute_hits")
            self.out.count("recompute_lead_hits", a.path is not ReadPath.NONE)
            self.out.count("recompute_hit_blocks", a.recompute_blocks)
        if policy.reads:
            self.out.count("read_blocks_pe", a.pe_read_blocks)
            self.out.count("read_blocks_de", a.de_read_blocks)
        pe, de = self.registry[a.pe], self.registry[a.de]
        job = load_job(
            st,
            a,
            pe,
            de,
            reads=policy.reads,
            layerwise=policy.layerwise,
            params_version=self.params_version(),
        )
        self.out.event(
            "assign",
            request=st.id,
            pe=a.pe,
            de=a.de,
            path=a.path.value,
            pe_blocks=job.pe_blocks,
            de_blocks=job.de_blocks,
        )
        st.job = job
        if self.assigned is not None:
            self.assigned(a)
        self.out.send(de.ident, messages.Work(jobs=[job]))
        if st.finish_requested:
            self.out.send(de.ident, messages.Finish(request=st.id, reason=st.finish_as))

    def on_de_ready(self, ident: bytes, msg: messages.DeReady) -> None:
        """The DE half of a job runs: now the PE may start (it never waits on a DE that is not
        ready, e.g. one whose buffer is full)."""
        st = self.table.requests.get(msg.request)
        if st is None or st.de != msg.engine or msg.attempt != st.attempts or st.job is None:
            return
        pe = self.registry.live_one(st.pe)
        if pe is not None:
            self.out.send(pe.ident, messages.Work(jobs=[st.job]))
        st.job = None

    def on_reads_done(self, ident: bytes, msg: messages.ReadsDone) -> None:
        st = self.table.requests.get(msg.request)
        if st is None or msg.attempt != st.attempts:
            return  # a finished request or an older attempt
        # (engine ids are unique across roles: the reads are the PE's or the DE's)
        if msg.engine == st.pe:
            st.pe_reads_done, side, tokens = True, "pe", st.pe_read_tokens
        elif msg.engine == st.de:
            st.de_reads_done, side, tokens = True, "de", st.de_read_tokens
        else:
            return  # not an engine of this attempt
        self.read_rate.add(tokens, msg.read_s)
        if self.reads_measured and self.read_rate.tokens_per_s:
            self.scheduler.set_read_rate(self.read_rate.tokens_per_s)
        self.out.event(
            f"{side}_reads",
            request=st.id,
            engine=msg.engine,
            read_s=msg.read_s,
            held_blocks=msg.held_blocks,
        )

    # ------------------------------------------------------------------ loads

    def node_read_q(self, node: int) -> int:
        """Hit tokens assigned to be read on `node` whose reads have not finished: the router's
        own view of the node's storage read queue, exact up to one `ReadsDone` message in flight
        (requests waiting for compute after their reads no longer count against the NIC)."""
        q = 0
        for r in self.table.requests.values():
            if r.pe < 0 or not math.isnan(r.t_first):
                continue
            if not r.pe_reads_done and self.registry[r.pe].node == node:
                q += r.pe_read_tokens
            if not r.de_reads_done and r.de >= 0 and self.registry[r.de].node == node:
                q += r.de_read_tokens
        return q

    def engine_load(self, e: EngineInfo) -> EngineLoad:
        """Loads from the router's own in-flight tracking (exact, unlike delayed reports); a DE
        counts the group followers waiting on its rounds (they will decode there), the prompt
        pages a group shares once in its free memory (its tokens each time: each attends over
        them)."""
        mine = [
            r
            for r in self.table.requests.values()
            if (r.pe == e.engine and e.role == "prefill" and math.isnan(r.t_first))
            or (r.de == e.engine and e.role == "decode")
        ]
        if e.role == "decode" and self.followers is not None:
            mine += [f for r in list(mine) for f in self.followers(r.id)]
        tok = sum(r.request.tokens for r in mine)
        free = 0
        if e.role == "decode":
            free = max(0, e.hbm_tokens - self._held_tokens(mine))
            if len(mine) >= e.slots + self.cfg.cluster.decode_queue:
                free = 0
        return EngineLoad(e.engine, e.node, e.group, len(mine), tok, self.node_read_q(e.node), free)

    def _held_tokens(self, rounds: list[RequestState]) -> int:
        """The KV tokens `results` hold on a DE once decoded: a fork shares the whole pages of
        its prompt before its last token's with the round it forks and its other forks."""
        bt, held, ids, shared = self.cfg.store.block_tokens, 0, {r.id for r in rounds}, set()
        for r in rounds:
            held += r.request.hbm_tokens
            if r.follows in ids or r.follows in shared:
                held -= (len(r.prompt) - 1) // bt * bt
            elif r.follows:
                shared.add(r.follows)  # (its leader gone: it holds them for the others)
        return held

    def loads(self) -> dict[str, dict]:
        """Each live engine's load, as `stats()["loads"]`."""
        out = {}
        for e in self.registry.live():
            ld = self.engine_load(e)
            out[str(e.engine)] = {
                "role": e.role,
                "node": e.node,
                "requests": ld.seq_e,
                "tokens": ld.tok_e,
                "batch": e.batch,
                "free_hbm_tokens": ld.free_hbm_tokens if e.role == "decode" else 0,
            }
        return out

    def read_queues(self) -> dict[str, int]:
        """Each node with a live engine: its read queue in tokens (`node_read_q`)."""
        nodes = sorted({e.node for e in self.registry.live()})
        return {str(n): self.node_read_q(n) for n in nodes}

    # ------------------------------------------------------------------ failures

    def on_failed(self, ident: bytes, msg: messages.Failed) -> None:
        """An engine's part of a request failed: `transfer` is retried (bounded by
        `cluster.max_attempts`), anything else ends the round with the engine's text."""
        st = self.table.requests.get(msg.request)
        if st is None or msg.engine not in (st.pe, st.de):
            return
        if msg.attempt and msg.attempt != st.attempts:
            return  # an older attempt's report
        kind = msg.kind if msg.kind in FAILURE_KINDS else "engine"
        role = "prefill" if msg.engine == st.pe else "decode"
        text = f"{role} engine {msg.engine}: {msg.message}"
        self.out.count("failed")
        self.out.event(
            "failed", request=st.id, engine=msg.engine, failure=kind, message=msg.message
        )
        log.warning("request %s failed (%s) on %s", st.id, kind, text)
        st.last_error, st.last_kind = text, kind
        self.cancel(st, msg.engine)
        if kind == "params":
            # The engine serves other params than it was taken for: out of rotation until it
            # is caught up, and the round runs on another engine (a client sees kind engine).
            e = self.registry.live_one(msg.engine)
            if e is not None:
                self.stale(e)
            st.last_kind = "engine"
            self.requeue([st])
            return
        if kind == "transfer":
            # A peer vanished or stalled: retry; liveness checks retire a dead engine meanwhile.
            self.requeue([st])
            return
        self.end(st, text, kind)

    def requeue(self, states: list[RequestState]) -> None:
        """Puts requests back at the head of the queue as if never assigned; one that has used up
        `cluster.max_attempts` ends instead, with its last failure's kind and text."""
        limit = self.cfg.cluster.max_attempts
        for st in [x for x in states if x.attempts >= limit]:
            states.remove(st)
            last = st.last_error or "its engines stopped"
            self.end(
                st,
                f"gave up after {st.attempts} attempts; last failure: {last}",
                st.last_kind or "engine",
            )
        queued = {r.id for r in self.scheduler.queued_requests()}
        for st in states:
            st.unassign()
            self.out.count("requeued")
            self.out.event("requeue", request=st.id, attempts=st.attempts)
        self.scheduler.requeue([st.request for st in states if st.id not in queued])

    # ------------------------------------------------------------------ engines

    def engine_joined(self, e: EngineInfo, msg: messages.Register) -> None:
        if e.role == "prefill":  # its cost model, or none, replaces the one it had
            self.update_beta()

    def engine_left(self, e: EngineInfo) -> None:
        """Engine `e` left rotation (it serves other params than the cluster): the scheduler
        forgets it, as a dead one (requests waiting for a PE with it as their DE, a private
        queue of a group left with no DE in rotation, go back to the global queue). Its rounds
        in flight, if any, fail with kind `params` and are retried (`on_failed`)."""
        self.scheduler.remove_engines([e.engine])

    def engine_died(self, e: EngineInfo) -> None:
        """The scheduler forgets `e`; its unfinished rounds are cancelled and requeued."""
        self.scheduler.remove_engines([e.engine])
        if e.role == "prefill" and e.prefill_cost is not None:
            self.update_beta()
        back = self.table.on_engine(e.engine)
        for st in back:
            # Even after the first token the DE may still be receiving the PE's layers, so a dead
            # PE's requests are retried too (the tokens come out the same).
            self.cancel(st, e.engine)
            st.last_error = f"{e.role} engine {e.engine} (pid {e.pid}) stopped heartbeating"
            st.last_kind = "engine"
        self.requeue(back)

    def prefill_costs(self) -> dict[int, FittedCostModel]:
        """The live PEs' reported cost models, by engine."""
        return {
            e.engine: FittedCostModel(prefill=e.prefill_cost.prefill)
            for e in self.registry.live("prefill")
            if e.prefill_cost is not None
        }

    def update_beta(self) -> None:
        """Sets the scheduler's beta from the live PEs' cost models (the slowest PE's beta,
        `sched.cost.engines_beta`); with none reported, `scheduler.beta_tokens` or infinite.
        Runs when a PE registers or dies; until the first one registers, the scheduler keeps the
        beta it was built with (`run_router`: the same fallback)."""
        costs = self.prefill_costs()
        beta = engines_beta(
            self.cfg.scheduler, costs.values(), max_batch=self.cfg.cluster.prefill_max_batch or 256
        )
        if costs:  # load or recompute: by the slowest PE's cost model
            slowest = tuple(max(c.prefill[i] for c in costs.values()) for i in range(3))
            self.scheduler.set_prefill_cost(slowest)
        if beta != self.scheduler.beta:
            self.scheduler.beta = beta
            self.out.event("beta", beta=beta, engines=sorted(costs))
            log.info("beta %.6g tokens (from the cost models of PEs %s)", beta, sorted(costs))
