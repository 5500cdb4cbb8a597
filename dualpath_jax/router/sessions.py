"""The router's session table and round bookkeeping.

A session is a trajectory's context (`A_1 G_1 ...`, appendix A.3) and whether one of its rounds
is running; a round in flight is a `RequestState`, from the `Submit` that created it to its
`RoundResult` or `Error`. Pure bookkeeping: nothing here sends, stores or schedules. The sessions
part (router/rounds.py) asks `session_problem` / `round_problem` whether a `Submit` may run
(their texts are the client's error messages), records it with `start_round`, and takes it out
again with `complete` (its tokens extend the session) or `drop` (it ended unfinished). The
dispatch part (router/dispatch.py) records each assignment to engines on the round
(`RequestState.assign`), and undoes it with `unassign` for a retry.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import time
from collections.abc import Callable

from dualpath_jax.model.sampling_params import GREEDY, SamplingParams, min_tokens_problem
from dualpath_jax.results import Logprobs
from dualpath_jax.sched.types import Assignment, ReadPath, Request
from dualpath_jax.wire import messages


@dataclasses.dataclass
class SessionState:
    id: str
    context: list[int] = dataclasses.field(default_factory=list)  # A_1 G_1 ... (appendix A.3)
    busy: bool = False  # a round runs, or is being admitted
    last_active: float = 0.0  # when it opened, or a round of it started or ended (table clock)


@dataclasses.dataclass
class RequestState:
    id: str
    session: str
    client: bytes
    request: Request
    prompt: list[int]
    keys: list[str]
    gen: int
    t_submit: float
    t_assign: float = math.nan
    t_first: float = math.nan
    t_second: float = math.nan
    pe: int = -1
    de: int = -1
    path: str = ""
    follows: str = ""  # group sampling: the round whose prompt pages it forks (or waits on)
    hit_blocks: int = 0
    recomputed_blocks: int = 0
    attempts: int = 0
    first_token: int = -1
    pe_read_tokens: int = 0  # hit tokens read on the PE's node, until its reads finish
    de_read_tokens: int = 0  # hit tokens read on the DE's node, until its reads finish
    pe_reads_done: bool = False
    de_reads_done: bool = False
    sampling: SamplingParams = GREEDY
    stop_tokens: list[int] = dataclasses.field(default_factory=list)
    stream: bool = False  # its client gets `Partial` tokens as they come
    finish_requested: bool = False  # FinishRound: each attempt's DE is told to finish now
    finish_as: str = "finished"  # ... with this finish_reason ("abort": AbortRounds)
    job: messages.LoadJobMsg | None = (
        None  # the current attempt's job, sent to the PE once the DE is ready
    )
    last_error: str = ""  # the last engine failure's text and kind (for the final error)
    last_kind: str = ""

    def assign(self, a: Assignment, now: float, block_tokens: int) -> None:
        """A new attempt on `a`'s PE and DE, reading `a`'s split of the hit."""
        self.pe, self.de, self.t_assign = a.pe, a.de, now
        self.path = a.path.value
        self.attempts += 1
        # blocks a tool-gap prefetch holds in the reading side's memory are not read (not queued)
        on_pe = a.path is ReadPath.PE
        self.pe_read_tokens = (a.pe_read_blocks - (a.held_blocks if on_pe else 0)) * block_tokens
        self.de_read_tokens = (a.de_read_blocks - (0 if on_pe else a.held_blocks)) * block_tokens
        self.pe_reads_done = self.de_reads_done = False

    def unassign(self) -> None:
        """Back to queued, as if never assigned (the attempt count stays)."""
        self.pe = self.de = -1
        self.t_first = self.t_second = math.nan
        self.first_token = -1
        self.job = None

    def result(
        self,
        tokens: list[int],
        now: float,
        block_tokens: int,
        persist_error: str = "",
        finish_reason: str = "length",
        logprobs: Logprobs | None = None,
        params_versions: list[tuple[int, str]] | None = None,
    ) -> messages.RoundResult:
        """The client's answer: the round's tokens and its timings."""
        return messages.RoundResult.timed(
            self.id,
            tokens,
            t_submit=self.t_submit,
            t_assign=self.t_assign,
            t_first=self.t_first,
            t_second=self.t_second,
            t_done=now,
            # a fork computed its prompt's last token only
            cached_tokens=(
                len(self.prompt) - 1 if self.path == "fork" else self.hit_blocks * block_tokens
            ),
            prompt_tokens=len(self.prompt),
            read_path=self.path,
            recomputed_blocks=self.recomputed_blocks,
            finish_reason=finish_reason,
            persist_error=persist_error,
            logprobs=logprobs,
            params_versions=params_versions or [],
        )


# Expired sessions remembered to name the expiry in the error of their next round.
EXPIRED_REMEMBERED = 4096


class SessionTable:
    """Sessions by id (`table[id]`, `id in table`) and the rounds in flight (`requests`, by
    request id); `admitting` the rounds between their checks and their store lookup's answer
    (request id -> session and client). `vocab_size` and `max_len` (prompt + generated tokens) bound a
    round."""

    def __init__(self, vocab_size: int, max_len: int, clock: Callable[[], float] = time.monotonic):
        self.vocab_size = vocab_size
        self.max_len = max_len
        self.clock = clock
        self.sessions: dict[str, SessionState] = {}
        self.requests: dict[str, RequestState] = {}
        self.admitting: dict[str, tuple[str, bytes]] = {}  # request -> (session, client)
        self.expired: collections.OrderedDict[str, float] = collections.OrderedDict()

    def __getitem__(self, session: str) -> SessionState:
        return self.sessions[session]

    def __contains__(self, session: object) -> bool:
        return session in self.sessions

    def get(self, session: str) -> SessionState | None:
        return self.sessions.get(session)

    # ------------------------------------------------------------------ sessions

    def open(self, session: str, resume: bool, fork_of: SessionState | None = None) -> bool:
        """Opens `session` (with `fork_of`'s context), or continues it if `resume`; False if it
        exists and not `resume`."""
        if session in self.sessions and not resume:
            return False
        state = self.sessions.setdefault(session, SessionState(session))
        if fork_of is not None:
            state.context = list(fork_of.context)
        state.last_active = self.clock()
        self.expired.pop(session, None)
        return True

    def close(self, session: str) -> None:
        del self.sessions[session]

    def idle(self, timeout_s: float) -> list[str]:
        """Sessions with no round running or being admitted for `timeout_s` or longer."""
        since = self.clock() - timeout_s
        return [s.id for s in self.sessions.values() if not s.busy and s.last_active <= since]

    def expire(self, session: str, timeout_s: float) -> None:
        """Closes `session` for being idle `timeout_s`, remembering it (a bounded number) so
        its client's next round is told why."""
        self.close(session)
        self.expired[session] = timeout_s
        while len(self.expired) > EXPIRED_REMEMBERED:
            self.expired.popitem(last=False)

    def admitting_client(self, request: str) -> bytes | None:
        got = self.admitting.get(request)
        return None if got is None else got[1]

    def begin_admission(self, client: bytes, msg: messages.Submit) -> tuple[str, bytes]:
        """`msg` passed its checks and waits for its store lookup: its session is busy and its
        request id taken until `end_admission`. Returns this admission's entry: a new object
        each time, so `admitting.get(request) is entry` tells whether it is still the one
        waiting (not ended, e.g. cancelled, and not another under the same id since)."""
        self.sessions[msg.session].busy = True
        entry = self.admitting[msg.request] = (msg.session, client)
        return entry

    def end_admission(self, request: str) -> SessionState | None:
        """The lookup answered (or failed): the session (None if it was closed meanwhile) is
        free again until `start_round`."""
        session, _ = self.admitting.pop(request, ("", b""))
        s = self.sessions.get(session)
        if s is not None:
            s.busy = False
        return s

    # ------------------------------------------------------------------ rounds

    def session_problem(self, msg: messages.Submit) -> str:
        """Why `msg`'s session cannot take a round now ("" if it can)."""
        s = self.sessions.get(msg.session)
        if s is None and msg.session in self.expired:
            return (
                f"session {msg.session!r} expired after {self.expired[msg.session]:g} s without"
                " a round (cluster.session_idle_timeout_s); open a new session"
            )
        if s is None:
            return f"unknown session {msg.session!r}"
        if s.busy:
            return f"session {msg.session!r} already has a round running"
        return ""

    def round_problem(self, msg: messages.Submit) -> str:
        """What is wrong with the round itself ("" if nothing); its session must exist."""
        if msg.request in self.requests or msg.request in self.admitting:
            return f"duplicate request id {msg.request!r}"
        if msg.gen <= 0:
            return f"gen must be > 0, got {msg.gen}"
        if not msg.append:
            return "a round must append at least one token"
        bad = next((t for t in msg.append if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            return f"token id {bad} is out of range [0, {self.vocab_size})"
        bad = next((t for t in msg.stop_tokens if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            return f"stop token {bad} is out of range [0, {self.vocab_size})"
        problem = min_tokens_problem(msg.sampling, msg.gen, msg.stop_tokens)
        if problem:
            return problem
        have = len(self.sessions[msg.session].context)
        if not -1 <= msg.keep <= have:
            return f"keep={msg.keep} is outside the session's context of {have} tokens (-1: all)"
        n = len(self.prompt(msg))
        if n + msg.gen > self.max_len:
            return f"context of {n} + {msg.gen} tokens exceeds the limit of {self.max_len}"
        return ""

    def prompt(self, msg: messages.Submit) -> list[int]:
        """The round's prompt: its session's context (its first `keep` tokens if `keep >= 0`),
        then the tokens it appends."""
        context = self.sessions[msg.session].context
        return (context if msg.keep < 0 else context[: msg.keep]) + list(msg.append)

    def start_round(
        self,
        client: bytes,
        msg: messages.Submit,
        request: Request,
        prompt: list[int],
        keys: list[str],
        now: float,
    ) -> RequestState:
        """Records a queued round (`keys`: its hit's block keys); its session is busy."""
        self.sessions[msg.session].busy = True
        self.sessions[msg.session].last_active = now
        st = RequestState(
            msg.request,
            msg.session,
            client,
            request,
            prompt,
            keys,
            msg.gen,
            now,
            sampling=msg.sampling,
            stop_tokens=list(msg.stop_tokens),
            stream=msg.stream,
        )
        self.requests[msg.request] = st
        return st

    def complete(self, st: RequestState, tokens: list[int]) -> None:
        """A round produced `tokens`: its session's context grows by them and is free again."""
        s = self.sessions.get(st.session)
        if s is not None:
            s.context = st.prompt + tokens
            s.busy = False
            s.last_active = self.clock()
        self.requests.pop(st.id, None)

    def drop(self, st: RequestState) -> None:
        """A round ended unfinished: its session is free again, its context unchanged."""
        s = self.sessions.get(st.session)
        if s is not None:
            s.busy = False
            s.last_active = self.clock()
        self.requests.pop(st.id, None)

    def on_engine(self, engine: int) -> list[RequestState]:
        """The rounds whose current attempt runs on `engine` (as PE or DE)."""
        return [st for st in self.requests.values() if engine in (st.pe, st.de)]
