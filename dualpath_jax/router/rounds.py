"""Sessions and their rounds, the router's sessions part: from `Submit` to `RoundResult` or `Error`.

`Rounds` handles what clients send about their sessions and rounds (`OpenSession`,
`CloseSession`, `Submit`, `CancelRound`, `FinishRound`) and what engines report of a round's
progress on its way to the client (`PrefillDone`, `TokensOut`, `DecodeDone`). It owns the
session table (router/sessions.py), which the dispatch part reads and assigns rounds in.

Admission (`on_submit`): a round is checked (its session, its tokens and sampling, its
retention), refused with kind `engine` while a role has had no live engine too long, refused if
no decode engine's KV pool could ever hold it, and looked up in the store: the hit is its
stored prefix in whole blocks, keeping at least one new token to produce logits. Then it joins
the scheduler's queue (`scheduler.max_queue` beyond which it is refused as `overloaded`).
A round that `follows` another round of the same prompt (group sampling, router/followers.py)
whose first token has not come yet is not queued: it waits on that round and goes with its
first token to its DE as a fork of its prompt pages (`fork_jobs`); if that round ends first, it
joins the queue. Its store lookup only tells the hit it would read then.

The store is never waited on for long on the router's loop: a lookup (or a close's release)
answered within `QUICK_WAIT_S` goes on at once, a slower one waits in `waiting` while the loop
serves everything else, and `poll_store` (called by the loop) goes on with it when its answer
comes, or fails it with kind `store` at `store.timeout_s`. A slow store slows its own rounds,
never heartbeats, pings or other sessions.

Sessions idle for `cluster.session_idle_timeout_s` (no round running or being admitted) are
closed on the loop's tick (`expire_idle`) as a `CloseSession` without release would close them.

A round leaves by `finish` (its tokens extend the session; the client gets a `RoundResult`) or by
`end` (unfinished: it leaves every queue and the client gets `Error(kind)`). Either way its
session is free again and idle for its retention TTL (router/retention.py).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable
from concurrent import futures
from typing import Any

import msgspec

from dualpath_jax.config import ExperimentConfig
from dualpath_jax.kvstore.identity import block_keys
from dualpath_jax.kvstore.store import BlockStore
from dualpath_jax.results import Logprobs
from dualpath_jax.router.dispatch import fork_job
from dualpath_jax.router.followers import Followers, lookup_failed
from dualpath_jax.router.liveness import EngineInfo, EngineRegistry
from dualpath_jax.router.outbox import Outbox
from dualpath_jax.router.params_update import ParamsCoordinator
from dualpath_jax.router.retention import Retention, retention_problem
from dualpath_jax.router.sessions import RequestState, SessionTable
from dualpath_jax.sched.scheduler import GlobalScheduler, QueueFull
from dualpath_jax.sched.types import Request
from dualpath_jax.wire import messages

log = logging.getLogger(__name__)

# How long the loop waits for the store in line: a local store answers a lookup in about a
# millisecond, so most rounds go on at once; slower answers are taken up by `poll_store`.
QUICK_WAIT_S = 0.005


@dataclasses.dataclass
class StoreWait:
    """A store call the loop goes on with when it is answered (`done(result)`), or fails
    (`failed(error)`) at `deadline`."""

    future: futures.Future
    deadline: float
    done: Callable[[Any], None]
    failed: Callable[[Exception], None]


class Rounds:
    """Runs `table`'s sessions and rounds. `publish_kv()` publishes the KV events posted so far
    (a release's `BlockRemoved` go out before its `Ack`)."""

    def __init__(
        self,
        cfg: ExperimentConfig,
        table: SessionTable,
        store: BlockStore,
        scheduler: GlobalScheduler,
        registry: EngineRegistry,
        retention: Retention,
        params: ParamsCoordinator,
        out: Outbox,
        clock: Callable[[], float],
        publish_kv: Callable[[], None],
        quick_wait_s: float = QUICK_WAIT_S,
    ):
        self.table = table
        self.store = store
        self.store_timeout_s = cfg.store.timeout_s
        self.bt = cfg.store.block_tokens
        self.scheduler = scheduler
        self.registry = registry
        self.retention = retention
        self.params = params
        self.out = out
        self.clock = clock
        self.publish_kv = publish_kv
        self.quick_wait_s = quick_wait_s
        self.idle_timeout_s = cfg.cluster.session_idle_timeout_s
        self.waiting: list[StoreWait] = []
        self.finish_asked: set[str] = set()  # FinishRound came while it was being admitted
        self.group = Followers(cfg.scheduler.fork_identical)  # group sampling
        self.abort_asked: set[str] = set()  # AbortRounds came while it was being admitted

    # ------------------------------------------------------------------ the store, off the loop

    def after_store(
        self,
        future: futures.Future,
        done: Callable[[Any], None],
        failed: Callable[[Exception], None],
    ) -> None:
        """Goes on with `done(result)` once `future` is answered (at once if it is within
        `quick_wait_s`), or `failed(error)` if it fails or is not answered within
        `store.timeout_s`."""
        futures.wait([future], timeout=self.quick_wait_s)
        if future.done():
            return self._settle(future, done, failed)
        deadline = self.clock() + self.store_timeout_s
        self.waiting.append(StoreWait(future, deadline, done, failed))

    def poll_store(self) -> None:
        """Goes on with the store calls answered since, and fails those past their deadline."""
        if not self.waiting:
            return
        now = self.clock()
        pending, self.waiting = self.waiting, []
        for w in pending:
            if w.future.done():
                self._settle(w.future, w.done, w.failed)
            elif now >= w.deadline:
                w.future.cancel()
                w.failed(TimeoutError(f"no answer in {self.store_timeout_s:g} s"))
            else:
                self.waiting.append(w)

    @staticmethod
    def _settle(future: futures.Future, done, failed) -> None:
        try:
            result = future.result(0)
        except Exception as e:  # noqa: BLE001 - the store's failure is its caller's error
            return failed(e)
        done(result)

    # ------------------------------------------------------------------ idle sessions

    def expire_idle(self) -> None:
        """Closes the sessions idle for `cluster.session_idle_timeout_s` (none if 0): their
        retention ends and their claims are dropped, their blocks stay for other hits."""
        if not self.idle_timeout_s:
            return
        for s in self.table.idle(self.idle_timeout_s):
            if self.params.holds_session(s):  # a round of it waits for a params update
                continue
            self.retention.closed(s)
            self.table.expire(s, self.idle_timeout_s)
            self.store.disown(s)
            self.out.count("sessions_expired")
            self.out.event("session_expired", session=s, idle_s=self.idle_timeout_s)

    # ------------------------------------------------------------------ sessions

    def on_open(self, ident: bytes, msg: messages.OpenSession) -> None:
        s = msg.session
        problem = retention_problem(msg.priority, msg.ttl_s)
        if problem:
            return self.out.fail(ident, s, problem)
        source = None
        if msg.fork_of:
            source = self.table.get(msg.fork_of)
            if source is None:
                return self.out.fail(ident, s, f"cannot fork unknown session {msg.fork_of!r}")
            if source.busy:
                return self.out.fail(
                    ident, s, f"cannot fork session {msg.fork_of!r}: it has a round running"
                )
        if not self.table.open(s, msg.resume, source):
            return self.out.fail(ident, s, f"session {s!r} exists; pass resume=True to continue it")
        self.retention.opened(s, msg.priority, msg.ttl_s, resume=msg.resume)
        self.out.send(ident, messages.Ack(ref=s))

    def on_close(self, ident: bytes, msg: messages.CloseSession) -> None:
        """Ends a session; `release` also deletes its stored blocks that no live session claims."""
        s = self.table.get(msg.session)
        if s is None:
            return self.out.send(
                ident, messages.Error(ref=msg.session, message=f"unknown session {msg.session!r}")
            )
        if msg.release and (s.busy or self.params.holds_round_of(ident, s.id)):
            return self.out.fail(
                ident,
                msg.session,
                f"session {s.id!r} has a round running; close it when it is done",
            )
        self.retention.closed(msg.session)
        self.table.close(msg.session)
        if not msg.release:
            self.store.disown(msg.session)  # its blocks stay; the index forgets the session
            return self.out.send(ident, messages.Ack(ref=msg.session))

        def released(n: int) -> None:
            self.out.event("release", session=msg.session, blocks=n)
            self.publish_kv()
            self.out.send(ident, messages.Ack(ref=msg.session))

        def failed(e: Exception) -> None:  # the session is closed either way
            self.out.fail(
                ident, msg.session, f"releasing the session's blocks failed: {e}", kind="store"
            )

        self.after_store(self.store.release(msg.session), released, failed)

    # ------------------------------------------------------------------ admission

    def on_submit(self, ident: bytes, msg: messages.Submit) -> bool:
        """Admits a round (True), or refuses it, its client told why."""
        fail = self.out.fail
        problem = self.table.session_problem(msg)
        if problem:
            return fail(ident, msg.request, problem)
        missing = self.registry.missing_role()
        if missing:
            return fail(ident, msg.request, missing, kind="engine")
        problem = self.table.round_problem(msg) or retention_problem(msg.priority, msg.ttl_s)
        if problem:
            return fail(ident, msg.request, problem)
        prompt = self.table.prompt(msg)
        room = self.registry.decode_capacity()
        if room and len(prompt) + msg.gen > room:  # no DE's KV pool could ever admit it
            return fail(
                ident,
                msg.request,
                f"context of {len(prompt)} + {msg.gen} tokens exceeds the decode engines'"
                f" KV budget of {room} tokens",
            )
        keys = block_keys(prompt, self.bt, self.params.fingerprint)
        session = self.table[msg.session]
        ticket = self.table.begin_admission(ident, msg)
        named = self.group.named(msg, prompt)

        def looked_up(hit: int) -> None:
            if not self._admission_ended(ident, msg, session, ticket):
                self._admit(ident, msg, prompt, keys, hit)
            self._admitted(msg.request)

        def failed(e: Exception) -> None:  # store failures become the request's error
            if not self._admission_ended(ident, msg, session, ticket):
                self.abort_asked.discard(msg.request)
                fail(ident, msg.request, f"store unavailable: {e}", kind="store")
            self._admitted(msg.request)

        def go_on() -> None:  # (its leader, if any, admitted or not)
            leader = self.table.requests.get(named) if named else None
            if not self.group.followable(leader, prompt):
                return self.after_store(self.store.lookup(keys), looked_up, failed)
            if not self._admission_ended(ident, msg, session, ticket):
                st = self._admit(ident, msg, prompt, keys, 0, leader)
                if st is not None:  # the hit it reads if its leader ends first
                    self.after_store(
                        self.store.lookup(keys),
                        lambda hit: self._follower_hit(st, keys, hit),
                        lookup_failed,
                    )
            self._admitted(msg.request)

        if named in self.table.admitting:
            self.group.park(named, go_on)
        else:
            go_on()
        return True

    def _admitted(self, request: str) -> None:
        self.group.admitted(request, request in self.table.requests)

    def _follower_hit(self, st: RequestState, keys: list[str], hit: int) -> None:
        """A follower's lookup answered while it waits on its leader: were it to run on its
        own, it reads `hit` blocks of its prompt (`keys`)."""
        if st.id in self.group.following and self.table.requests.get(st.id) is st:
            hit, r = self._usable_hit(hit, len(st.prompt)), st.request
            st.keys, st.request = (
                keys[:hit],
                Request(r.id, r.trajectory, r.turn, r.prompt_tokens, hit * self.bt, r.gen_tokens),
            )

    def _usable_hit(self, hit: int, prompt: int) -> int:
        """At least one new token is left to produce logits."""
        return hit - 1 if hit * self.bt >= prompt else hit

    def _admission_ended(
        self, ident: bytes, msg: messages.Submit, session: Any, ticket: tuple
    ) -> bool:
        """The lookup of `msg` answered: True if the round ends here (cancelled meanwhile, its
        client answered then; or its session closed, the client told so now)."""
        if self.table.admitting.get(msg.request) is not ticket:
            return True
        s = self.table.end_admission(msg.request)
        if s is None or s is not session:
            self.finish_asked.discard(msg.request)
            self.abort_asked.discard(msg.request)
            self.out.fail(ident, msg.request, f"session {msg.session!r} was closed")
            return True
        return False

    def _admit(
        self,
        ident: bytes,
        msg: messages.Submit,
        prompt: list[int],
        keys: list[str],
        hit: int,
        leader: RequestState | None = None,
    ) -> RequestState | None:
        """Queues `msg`'s round, whose stored prefix is `hit` blocks of `keys`, or has it wait
        on `leader`; returns it unless it ended here."""
        finish = msg.request in self.finish_asked
        self.finish_asked.discard(msg.request)
        hit = self._usable_hit(hit, len(prompt))
        req = Request(msg.request, msg.session, 0, len(prompt), hit * self.bt, msg.gen)
        if msg.request in self.abort_asked:  # aborted while admitted: it ends with no token
            self.abort_asked.discard(msg.request)
            st = self.table.start_round(ident, msg, req, prompt, keys[:hit], self.clock())
            self.retention.round_started(msg.session, msg.priority, msg.ttl_s)
            self.finish(st, [], finish_reason="abort")
            return None
        if leader is None:
            try:
                self.scheduler.submit(req)
            except QueueFull as e:
                self.out.count("overloaded")
                self.out.fail(ident, msg.request, f"overloaded: {e}", kind="overloaded")
                return None
        st = self.table.start_round(ident, msg, req, prompt, keys[:hit], self.clock())
        if leader is not None:
            self.group.add(leader, st)
        self.retention.round_started(msg.session, msg.priority, msg.ttl_s)
        self.out.event(
            "submit",
            request=msg.request,
            prompt=len(prompt),
            cached=hit * self.bt,
            gen=msg.gen,
            **({"follows": leader.id} if leader is not None else {}),
        )
        if finish:
            st.finish_requested = True
        return st

    # ------------------------------------------------------------------ progress

    def on_prefill_done(self, ident: bytes, msg: messages.PrefillDone) -> None:
        st = self.table.requests.get(msg.request)
        if st is None or st.pe != msg.engine or (msg.attempt and msg.attempt != st.attempts):
            return  # a cancelled attempt (also of an engine that was declared dead, then rejoined)
        st.t_first = self.clock()
        st.first_token = msg.first_token
        st.hit_blocks = msg.hit_blocks
        st.recomputed_blocks += msg.recomputed_blocks + msg.lead_blocks  # unreadable or chosen
        self.out.count("recomputed_blocks", msg.recomputed_blocks)
        self.out.count("hit_blocks", msg.hit_blocks)
        self.out.event(
            "first_token",
            request=st.id,
            hit_blocks=msg.hit_blocks,
            recomputed=msg.recomputed_blocks,
            read_s=msg.read_s,
            prefill_s=msg.prefill_s,
        )
        de = self.registry.live_one(st.de)
        if de is not None:
            forks = self.fork_jobs(st, de)
            self.out.send(
                de.ident,
                # the prompt's blocks the store holds (the DE persists those after them)
                messages.FirstToken(
                    request=st.id,
                    token=msg.first_token,
                    hit_blocks=msg.lead_blocks + msg.hit_blocks,
                    logprobs=msg.first_logprobs,
                    params_version=msg.params_version,
                    forks=forks,
                ),
            )
            for job in forks:
                f = self.table.requests[job.request]
                if f.finish_requested:
                    self.out.send(de.ident, messages.Finish(request=f.id, reason=f.finish_as))
        if st.stream:
            first = messages.RoundTokens(
                request=st.id, start=0, tokens=[msg.first_token], logprobs=msg.first_logprobs
            )
            self.out.send(st.client, messages.Partial(rounds=[first]))

    def fork_jobs(self, st: RequestState, de: EngineInfo) -> list[messages.LoadJobMsg]:
        """The jobs of `st`'s followers still waiting: forks of its prompt on its DE `de`."""
        jobs, now = [], self.clock()
        for f in self.group.take(st, self.table.requests):
            f.pe, f.de, f.t_assign, f.path = -1, de.engine, now, "fork"
            f.attempts += 1
            f.hit_blocks = st.hit_blocks
            jobs.append(fork_job(f, de, params_version=self.params.version))
            self.out.count("forks")
            self.out.event("fork", request=f.id, source=st.id, de=de.engine)
        return jobs

    def waiting_followers(self, request: str) -> list[RequestState]:
        """Round `request`'s followers still waiting for its first token (they will decode on
        its DE: the dispatch part counts them in that DE's load)."""
        return self.group.waiting(request, self.table.requests)

    def release_followers(self, st: RequestState) -> None:
        """`st` ended before its first token: its waiting followers run on their own."""
        back = self.group.release(st, self.table.requests)
        if back:
            self.scheduler.requeue([f.request for f in back])

    def on_tokens(self, ident: bytes, msg: messages.TokensOut) -> None:
        """A DE step's new tokens: a round's second one times TTST (a fork's first one its
        TTFT); each client gets its streamed rounds' entries in one `Partial`."""
        now = self.clock()
        streams: dict[bytes, list[messages.RoundTokens]] = {}
        for new in msg.rounds:
            st = self.table.requests.get(new.request)
            if st is None:
                continue
            if st.first_token < 0 and new.start == 0 and new.tokens:  # a fork drew it on the DE
                st.t_first, st.first_token = now, new.tokens[0]
            if math.isnan(st.t_second) and new.start + len(new.tokens) >= 2:
                st.t_second = now
            if st.stream:
                streams.setdefault(st.client, []).append(new)
        for client, rounds in streams.items():
            self.out.send(client, messages.Partial(rounds=rounds))

    def on_decode_done(self, ident: bytes, msg: messages.DecodeDone) -> None:
        st = self.table.requests.get(msg.request)
        if st is None or st.de != msg.engine or (msg.attempt and msg.attempt != st.attempts):
            return  # a cancelled attempt (also of an engine that was declared dead, then rejoined)
        self.out.event("decoded", request=st.id, persisted_blocks=msg.persisted_blocks)
        self.finish(
            st,
            list(msg.tokens),
            msg.persist_error,
            msg.finish_reason,
            msg.logprobs,
            [tuple(v) for v in msg.params_versions],
        )

    # ------------------------------------------------------------------ the client's say

    def on_cancel(self, ident: bytes, msg: messages.CancelRound) -> None:
        if msg.request in self.table.admitting:  # ends now; its lookup's answer is ignored
            if self.table.admitting_client(msg.request) == ident:
                self.table.end_admission(msg.request)
                self.finish_asked.discard(msg.request)
                self.abort_asked.discard(msg.request)
                self.out.count("cancelled")
                self.out.event("cancel", request=msg.request)
                self.out.fail(ident, msg.request, "cancelled by the client", kind="cancelled")
            return
        st = self.table.requests.get(msg.request)
        if st is None or st.client != ident:
            return
        self.out.count("cancelled")
        self.out.event("cancel", request=st.id)
        self.cancel_on_engines(st)
        self.end(st, "cancelled by the client", "cancelled")

    def on_finish(self, ident: bytes, msg: messages.FinishRound) -> None:
        """Completes a round now with the tokens it has; a round not yet at a DE finishes as
        soon as its first token is there (the request is remembered for every attempt)."""
        if msg.request in self.table.admitting:
            if self.table.admitting_client(msg.request) == ident:
                self.finish_asked.add(msg.request)
            return
        st = self.table.requests.get(msg.request)
        if st is None or st.client != ident or st.finish_requested:
            return
        st.finish_requested = True
        self.out.count("finished_early")
        self.out.event("finish_early", request=st.id)
        de = self.registry.live_one(st.de) if st.de >= 0 else None
        if de is not None:
            self.out.send(de.ident, messages.Finish(request=st.id))

    def on_abort(self, ident: bytes, msg: messages.AbortRounds) -> list[str]:
        """Ends the rounds `msg` names (`abort`); those being admitted end once their lookup
        answers. Returns their request ids."""
        named, sessions = set(msg.requests), set(msg.sessions)

        def chosen(request: str, session: str) -> bool:
            return msg.all or request in named or session in sessions

        out = []
        for rid, (session, _) in self.table.admitting.items():
            if chosen(rid, session):
                self.abort_asked.add(rid)
                out.append(rid)
        for st in list(self.table.requests.values()):
            if chosen(st.id, st.session):
                self.abort(st)
                out.append(st.id)
        return out

    def abort(self, st: RequestState) -> None:
        """Ends a round now with the tokens it has (`finish_reason="abort"`): one whose first
        token is at its live DE completes there (the DE reports its tokens, KV persisted);
        any other ends here with none (its engines drop it)."""
        if st.finish_as == "abort":
            return  # asked before
        self.out.count("aborted")
        self.out.event("abort", request=st.id)
        de = self.registry.live_one(st.de) if st.de >= 0 else None
        if st.first_token >= 0 and de is not None:
            st.finish_requested, st.finish_as = True, "abort"
            self.out.send(de.ident, messages.Finish(request=st.id, reason="abort"))
            return
        self.cancel_on_engines(st)
        self.scheduler.withdraw([st.id])
        self.finish(st, [], finish_reason="abort")

    # ------------------------------------------------------------------ how rounds leave

    def finish(
        self,
        st: RequestState,
        tokens: list[int],
        persist_error: str = "",
        finish_reason: str = "length",
        logprobs: Logprobs | None = None,
        params_versions: list[tuple[int, str]] | None = None,
    ) -> None:
        now = self.clock()
        self.release_followers(st)
        self.table.complete(st, tokens)
        self.retention.round_ended(st.session)
        # The session claims the blocks its DE persisted (and the hit it read), so closing it
        # with release=True can delete them (a session closed meanwhile claims nothing).
        if st.session in self.table:
            # with no token (aborted early) only its hit is stored
            keys = (
                block_keys(st.prompt + tokens[:-1], self.bt, self.params.fingerprint)
                if tokens
                else st.keys
            )
            self.store.claim(st.session, keys)
        res = st.result(
            tokens, now, self.bt, persist_error, finish_reason, logprobs, params_versions or []
        )
        if persist_error:
            self.out.count("persist_errors")
            log.warning("request %s: its blocks were not persisted: %s", st.id, persist_error)
            self.out.event("persist_failed", request=st.id, engine=st.de, message=persist_error)
        self.out.count("requests_done")
        self.out.event(
            "done",
            **{
                k: v
                for k, v in msgspec.structs.asdict(res).items()
                if k not in ("tokens", "logprobs", "params_versions")
            },
        )
        self.out.send(st.client, res)

    def end(self, st: RequestState, message: str, kind: str) -> None:
        """Ends a round unfinished: it leaves every queue, its session is free again, and its
        client gets `Error(kind)`."""
        self.scheduler.withdraw([st.id])
        self.release_followers(st)
        self.table.drop(st)
        self.retention.round_ended(st.session)
        self.out.fail(st.client, st.id, message, kind=kind)

    def end_all(self, why: str) -> None:
        """Ends every round in flight with kind `engine` (no round can run: `why`)."""
        if not self.table.requests:
            return
        log.warning("%s: failing %d rounds", why, len(self.table.requests))
        for st in list(self.table.requests.values()):
            self.cancel_on_engines(st)
            self.end(st, why, "engine")

    def cancel_on_engines(self, st: RequestState, but: int = -1) -> None:
        """Tells the round's live engines (but engine `but`) to drop their part of it."""
        for e in {st.pe, st.de} - {but, -1}:
            info = self.registry.live_one(e)
            if info is not None:
                self.out.send(info.ident, messages.Cancel(request=st.id))
