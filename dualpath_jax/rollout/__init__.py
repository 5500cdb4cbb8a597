"""The RL-facing API: sessions of multi-turn trajectories, sync or async, and batch rollout.

    with LocalCluster(cfg, workdir) as cluster:
        session = Session(cluster.client(), "traj-0")
        tokens = session.step(append_tokens, gen_tokens)   # exactly gen_tokens new tokens

`run_trajectories(client, trajectories)` replays many trajectories concurrently (each one's
rounds in order, appendix A.3) with a progress bar. The same API runs over `InProcessBackend`
(one model in this process, no disaggregation) for quick experiments.

Sampling: each round is drawn with one `SamplingParams` (`dualpath_jax.model.sampling_params`), which
the keywords `temperature`, `top_p` and `key` build (`round_sampling`): `temperature=0` is
greedy; above 0 pass an explicit JAX key (`Session.step(..., temperature=1.0, key=key)`), which
gives the round's seed; a round's tokens depend only on the params, the context and the key.
Every round's outcome is a `RoundResult`; with `logprobs=True` (or k, for k alternatives per
token) it carries each token's log-probabilities (`RoundResult.logprobs`, a `Logprobs`), and
`Session.step` returns a `Step` (tokens and logprobs) instead of the bare ids. RL loops push new params between iterations with
`update_params(params)` or `update_params_from_checkpoint(path)` on either backend (see
docs/rl.md).
"""

from __future__ import annotations

import dataclasses
import logging
import numbers
import threading
import time
import uuid
from collections.abc import Iterable, Sequence
from concurrent import futures
from typing import Any

import msgspec

from dualpath_jax.model.sampling_params import SamplingParams
from dualpath_jax.results import Logprobs, RoundResult
from dualpath_jax.wire.client import (
    Backend,
    RolloutError,
    _check_int,
    key_to_seed,
)
from dualpath_jax.wire.hints import apply_hint, parse_hint

log = logging.getLogger(__name__)

__all__ = ["Backend", "InProcessBackend", "Logprobs", "RolloutError", "RoundResult", "SamplingParams",
           "Session", "Step", "TrajectoryOutput", "round_sampling", "run_trajectories", "step_group",
           "workload_trajectories"]  # fmt: skip


def round_sampling(
    temperature: float = 0.0, top_p: float = 1.0, key: Any = None, logprobs: bool | int = False
) -> SamplingParams:
    """The `SamplingParams` the rollout keywords describe: `temperature` and `top_p` as given,
    the seed drawn from the JAX `key` (`key_to_seed`). Sampling (temperature > 0) needs a key,
    so that no round samples with a seed nobody chose. `logprobs`: False (none), True (each
    token's) or k (and its k most likely alternatives; `SamplingParams.logprobs`). Raises
    ValueError (a `SamplingError` for a field out of range)."""
    asked = None if logprobs is False else (0 if logprobs is True else logprobs)
    params = SamplingParams(temperature=temperature, top_p=top_p, logprobs=asked)
    if key is None and not params.greedy:
        raise ValueError("sampling with temperature > 0 needs a PRNG key")
    return params if key is None else msgspec.structs.replace(params, seed=key_to_seed(key))


@dataclasses.dataclass(frozen=True)
class Step:
    """`Session.step(..., logprobs=...)`'s answer: the round's tokens, their `Logprobs`, why it
    ended and its `RoundResult`."""

    tokens: list[int]
    logprobs: Logprobs
    finish_reason: str
    result: RoundResult


def workload_trajectories(
    cfg: Any,
) -> tuple[list[tuple[str, list[tuple[list[int], int]]]], list[float]]:
    """The config's workload as `run_trajectories` input: one trajectory per agent (the Table 2
    preset or trace file of `cfg.workload`, scaled and materialized to token ids), and each
    agent's start time in seconds (all 0 offline; Poisson arrivals online)."""
    from dualpath_jax.workload.arrivals import as_rounds, build_trajectories

    trajs, arrivals = build_trajectories(cfg)
    return as_rounds(trajs), arrivals


class Session:
    """One trajectory: each `step` appends tokens and generates exactly `gen` tokens.

    A `session_id` that is already open is an error unless `resume=True`, which continues that
    session's context. `priority` and `ttl_s` set the retention of its stored KV under capacity
    pressure (`store.eviction="retention"`): kept while a round runs and `ttl_s` seconds after
    each (-1: `store.retention_ttl_s`), lower priorities evicted first."""

    def __init__(
        self,
        backend: Backend,
        session_id: str | None = None,
        *,
        resume: bool = False,
        priority: int = 0,
        ttl_s: float = -1.0,
        fork_of: str = "",
    ):
        self.backend = backend
        self.id = session_id or uuid.uuid4().hex
        retention = {"priority": priority, "ttl_s": ttl_s} if (priority, ttl_s) != (0, -1) else {}
        if fork_of:
            retention["fork_of"] = fork_of
        backend.open_session(self.id, resume=resume, **retention)
        self.results: list[RoundResult] = []

    def step_async(
        self,
        append: Sequence[int],
        gen: int,
        *,
        temperature: float = 0.0,
        key: Any = None,
        top_p: float = 1.0,
        logprobs: bool | int = False,
        stop_tokens: Sequence[int] = (),
    ) -> futures.Future[RoundResult]:
        """Submits one round, drawn with `round_sampling(temperature, top_p, key, logprobs)`:
        sampling with `temperature > 0` needs an explicit JAX `key` (`top_p < 1`: from the
        nucleus of that probability mass); `logprobs` puts the tokens' log-probabilities in the
        result. Bad sampling keywords raise ValueError here. The round ends after any of
        `stop_tokens` (an end-of-turn id: its last token, `finish_reason` "stop"; the session's
        context then ends there), else after `gen` tokens."""
        sampling = round_sampling(temperature, top_p, key, logprobs)
        stops = {"stop_tokens": list(stop_tokens)} if stop_tokens else {}
        fut = self.backend.submit(self.id, append, gen, sampling=sampling, **stops)
        fut.add_done_callback(lambda f: f.exception() is None and self.results.append(f.result()))
        return fut

    def step(
        self,
        append: Sequence[int],
        gen: int,
        timeout_s: float | None = None,
        *,
        temperature: float = 0.0,
        key: Any = None,
        top_p: float = 1.0,
        logprobs: bool | int = False,
        stop_tokens: Sequence[int] = (),
    ) -> list[int] | Step:
        """Appends `append`, generates `gen` tokens (fewer when one of `stop_tokens` ends the
        round, see `step_async`) and returns them; with `logprobs` (True, or k alternatives per
        token) a `Step` with their log-probabilities. A round that takes longer than
        `timeout_s` is cancelled (the session can step again) and raises TimeoutError."""
        fut = self.step_async(
            append, gen, temperature=temperature, key=key, top_p=top_p, logprobs=logprobs,
            stop_tokens=stop_tokens,
        )  # fmt: skip
        try:
            return _answer(fut.result(timeout_s), logprobs)
        except futures.TimeoutError:
            cancel = getattr(self.backend, "cancel", None)
            if cancel is not None and getattr(fut, "request", ""):
                cancel(fut.request)
            raise

    def close(self, release: bool = False) -> None:
        self.backend.close_session(self.id, release)

    def hint(self, kind: str, **params: Any) -> Session | None:
        """A session hint (`wire.hints`): `tool_call(expected_s=)`, `pin`, `ttl(ttl_s=)`,
        `release`, or `fork(session="")`, which returns the subagent's new `Session`."""
        h = parse_hint({"kind": kind, **params})
        if h.kind == "fork":
            return Session(self.backend, h.session or f"{self.id}/{uuid.uuid4().hex[:6]}", fork_of=self.id)  # fmt: skip
        apply_hint(self.backend, self.id, h)
        return None

    def fork(self, n: int) -> list[Session]:
        """`n` new sessions that start with this one's context (an idle session's), each its
        own trajectory from then on: the continuations of a group (`step_group`). Nothing is
        computed: they share the context's stored KV."""
        n = _check_int(n, "n", 1, 1 << 16)
        return [Session(self.backend, f"{self.id}/{i}-{uuid.uuid4().hex[:6]}", fork_of=self.id)
                for i in range(n)]  # fmt: skip


def step_group(
    sessions: Sequence[Session],
    append: Sequence[int],
    gen: int,
    *,
    temperature: float = 0.0,
    key: Any = None,
    top_p: float = 1.0,
    logprobs: bool | int = False,
    timeout_s: float | None = None,
    stop_tokens: Sequence[int] = (),
) -> list[list[int] | Step]:
    """One round in each of `sessions` (forks of one session, `Session.fork`), all appending
    `append` and generating `gen` tokens: GRPO's group of G samples of one prompt. Choice i is
    drawn with `fold_in(key, i)` (distinct and reproducible). On a cluster the prompt is
    prefilled once and the other samples fork its pages on its decode engine
    (`Client.submit_group`); on the in-process backend the append is prefilled once and the
    samples decode together (`InProcessBackend.submit_group`); elsewhere the rounds run one by
    one. Each round ends on its own at `stop_tokens` (see `Session.step_async`). Returns each
    round's tokens (with `logprobs`, its `Step`), in order."""
    import jax

    if not sessions:
        return []
    keys = [None if key is None else jax.random.fold_in(key, i) for i in range(len(sessions))]
    samplings = [round_sampling(temperature, top_p, k, logprobs) for k in keys]
    backend = sessions[0].backend
    stops = {"stop_tokens": list(stop_tokens)} if stop_tokens else {}
    if hasattr(backend, "submit_group"):
        ids = [x.id for x in sessions]
        futs = backend.submit_group(ids, append, gen, samplings=samplings, **stops)
    else:
        futs = [
            backend.submit(x.id, append, gen, sampling=p, **stops)
            for x, p in zip(sessions, samplings)
        ]
    out = []
    for x, fut in zip(sessions, futs):
        res = fut.result(timeout_s)
        x.results.append(res)
        out.append(_answer(res, logprobs))
    return out


def _answer(res: RoundResult, logprobs: bool | int) -> list[int] | Step:
    """What a step returns: the tokens, or with `logprobs` asked for, their `Step`."""
    if logprobs is False:
        return list(res.tokens)
    return Step(list(res.tokens), res.logprobs or Logprobs(), res.finish_reason, res)


@dataclasses.dataclass
class TrajectoryOutput:
    id: str
    rounds: list[list[int]]
    results: list[RoundResult]
    error: str = ""


def run_trajectories(
    backend: Backend,
    trajectories: Iterable[tuple[str, Sequence[tuple]]],
    *,
    max_concurrent: int = 0,
    arrivals: Sequence[float] | None = None,
    progress: bool = True,
    timeout_s: float | None = None,
    temperature: float = 0.0,
    key: Any = None,
    top_p: float = 1.0,
    logprobs: bool | int = False,
    release: bool = False,
    priority: int | Sequence[int] = 0,
    ttl_s: float = -1.0,
    tool_calls: bool = False,
    stop_tokens: Sequence[int] = (),
) -> list[TrajectoryOutput]:
    """Replays trajectories `(id, [(append tokens, gen), ...])` concurrently, rounds in order.
    A round `(append tokens, gen, gap_s)` is submitted `gap_s` seconds after the previous one
    finished (a tool call); with `tool_calls` the session gets a `tool_call` hint of `gap_s`
    as the gap begins (its KV may be prefetched meanwhile, `scheduler.prefetch`). A round
    `(append tokens, gen, gap_s, waits_for)` also waits until every trajectory of this call
    whose id is in `waits_for` has ended (its subagents; finished or failed), and its gap then
    counts from the last of those ends (`workload.trace.submit_time`; ids not in the call are
    ignored, a cycle of waits is a ValueError). A fifth field `False`
    (`(append tokens, gen, gap_s, waits_for, False)`) says the gap is a user's think time, not a
    tool call: no hint. A trajectory `(id, rounds, (parent id, round index, delay_s))` starts
    `delay_s` seconds after that round of the trajectory `parent id` of this call ended (a
    subagent its parent's round called; `workload.trace.Trajectory.after`), or when that
    trajectory ends without it; a parent not in the call leaves it to its arrival. A round
    waiting for a trajectory that starts after it, directly or not, is a ValueError.

    `max_concurrent` bounds how many trajectories run at once (0: all; with it, a trajectory may
    wait only for earlier ones, which hold their slots first); `arrivals` gives each
    trajectory's start time in seconds after the call (online replay; default: all at once).
    With `temperature > 0`, round i of trajectory k is sampled with `fold_in(fold_in(key, k), i)`
    (and `top_p`; `round_sampling`); with `logprobs` each round's result carries its tokens'
    log-probabilities (`RoundResult.logprobs`); `stop_tokens` end any round early
    (`Session.step_async`). `priority` (one for all, or one per trajectory)
    and `ttl_s` set each session's KV retention (`Session`).
    Each trajectory's session is closed when it ends (its stored blocks are the first to go
    under capacity pressure). With `release=True` the sessions are closed together at the end
    instead, deleting their stored blocks (until then later trajectories can hit prefixes they
    share with earlier ones). Returns one output per trajectory, in input order; a failed round
    ends its trajectory with `error` set.
    """
    round_sampling(temperature, top_p, key, logprobs)  # bad keywords fail the call
    from tqdm.auto import tqdm

    given = list(trajectories)
    trajs = [(t[0], t[1]) for t in given]
    outputs = [TrajectoryOutput(tid, [], []) for tid, _ in trajs]
    if arrivals is not None and len(arrivals) != len(trajs):
        raise ValueError(f"{len(arrivals)} arrival times for {len(trajs)} trajectories")
    if isinstance(priority, numbers.Integral):
        priorities = [int(priority)] * len(trajs)
    else:
        priorities = [int(p) for p in priority]
    if len(priorities) != len(trajs):
        raise ValueError(f"{len(priorities)} priorities for {len(trajs)} trajectories")
    waits_of = _waits(trajs, max_concurrent)
    # (k, i) -> the trajectories that start after round i of trajectory k, with their delays
    spawns = _spawns(given, max_concurrent)
    spawned = {c for started in spawns.values() for c, _ in started}
    # When each trajectory ended (monotonic s), and the rounds waiting for ones still running.
    ended: list[float | None] = [None] * len(trajs)
    waiting: dict[int, list[tuple[int, int]]] = {}
    pending: dict[tuple[int, int], list] = {}  # (k, i) -> [ends awaited, ready at]
    total = sum(len(r) for _, r in trajs)
    bar = tqdm(total=total, desc="rounds", disable=not progress, unit="round")
    lock = threading.Lock()
    limit = threading.Semaphore(max_concurrent or max(1, len(trajs)))
    done_all = threading.Event()
    stopped = threading.Event()  # timed out: no new round starts, late rounds are dropped
    remaining = [len(trajs)]
    sessions: dict[int, Session] = {}
    # Closing blocks on the router's answer: never on the client's thread (the callbacks').
    closer = futures.ThreadPoolExecutor(1, thread_name_prefix="rollout-close")
    timers: list[threading.Timer] = []

    def close(k: int) -> None:
        try:
            sessions[k].close(release=release)
        except Exception as e:  # noqa: BLE001 - reported on the trajectory, others go on
            outputs[k].error = outputs[k].error or f"closing the session failed: {e}"

    def hint_tool_call(k: int, session: Session, gap_s: float) -> None:
        try:
            session.hint("tool_call", expected_s=gap_s)
        except Exception as e:  # noqa: BLE001 - a hint that fails costs its prefetch only
            log.warning("trajectory %s: the tool_call hint failed: %s", trajs[k][0], e)

    def start(k: int) -> None:
        """Trajectory k starts: its session opens and its first round gets ready."""
        limit.acquire()
        try:
            sessions[k] = Session(backend, trajs[k][0], priority=priorities[k], ttl_s=ttl_s)
            advance(k, sessions[k], 0)
        except Exception as e:  # noqa: BLE001
            outputs[k].error = str(e)
            finish_one(k)

    def spawn(k: int, upto: int) -> None:
        """Starts the trajectories waiting on round `upto` (and earlier ones) of trajectory k,
        each after its delay."""
        with lock:
            keys = [x for x in spawns if x[0] == k and x[1] <= upto]
            started = [c for x in keys for c in spawns.pop(x)]
        for c, delay in started:
            if stopped.is_set():
                return
            timer = threading.Timer(delay, start, (c,))
            timer.daemon = True
            with lock:
                timers.append(timer)
            timer.start()

    def finish_one(k: int) -> None:
        if spawns:  # it ended before the rounds others start after: they start now
            spawn(k, len(trajs[k][1]))
        now = time.monotonic()
        go = []
        with lock:
            ended[k] = now
            for w, i in waiting.pop(k, ()):
                pending[w, i][0] -= 1
                if pending[w, i][0] == 0:
                    go.append((w, i, pending.pop((w, i))[1]))
        for w, i, ready in go:  # every trajectory they wait for has ended
            submit_after(w, i, _delay(trajs[w][1], w, i, ready, now, waits_of, ended))
        if k in sessions:
            if stopped.is_set():
                return  # timed out: the call closes every session
            if not release:
                closer.submit(close, k)
        limit.release()
        with lock:
            remaining[0] -= 1
            if remaining[0] == 0:
                done_all.set()

    def round_key(k: int, i: int) -> Any:
        import jax

        return None if key is None else jax.random.fold_in(jax.random.fold_in(key, k), i)

    def advance(k: int, session: Session, i: int) -> None:
        """Round i of trajectory k is ready: its previous round ended (or it arrived)."""
        rounds = trajs[k][1]
        if i == len(rounds):
            finish_one(k)
            return
        if stopped.is_set():
            return
        now = time.monotonic()
        with lock:
            running = [w for w in waits_of.get((k, i), ()) if ended[w] is None]
            if running:  # it goes when the last of them ends (`finish_one`)
                pending[k, i] = [len(running), now]
                for w in running:
                    waiting.setdefault(w, []).append((k, i))
                return
            delay = _delay(rounds, k, i, now, now, waits_of, ended)
        submit_after(k, i, delay)

    def submit_after(k: int, i: int, delay: float) -> None:
        """Submits round i of trajectory k after `delay` seconds: on a timer, the gap before it
        a tool call (with `tool_calls`, hinted as it begins), or at once."""
        if stopped.is_set():
            return
        rd = trajs[k][1][i]
        session, (append, gen, *_) = sessions[k], rd
        if delay <= 0:
            step(k, session, i, append, gen)
            return
        if tool_calls and i and (len(rd) < 5 or rd[4]):  # (a think time gets no hint)
            # (its answer is awaited on the helper thread, not this one)
            closer.submit(hint_tool_call, k, session, delay)
        timer = threading.Timer(delay, step, (k, session, i, append, gen))
        timer.daemon = True
        with lock:
            timers.append(timer)
        timer.start()

    def step(k: int, session: Session, i: int, append: Sequence[int], gen: int) -> None:
        def on_done(f: futures.Future) -> None:
            if stopped.is_set():  # after the timeout: the call has returned its outputs
                return
            try:
                res = f.result()
            except Exception as e:  # noqa: BLE001
                outputs[k].error = str(e)
                finish_one(k)
                return
            outputs[k].rounds.append(list(res.tokens))
            outputs[k].results.append(res)
            with lock:
                bar.update(1)
            if spawns:
                spawn(k, i)
            advance(k, session, i + 1)

        try:
            fut = session.step_async(
                append,
                gen,
                temperature=temperature,
                key=round_key(k, i),
                top_p=top_p,
                logprobs=logprobs,
                stop_tokens=stop_tokens,
            )
        except Exception as e:  # noqa: BLE001 - e.g. bad input in a later round
            outputs[k].error = str(e)
            finish_one(k)
            return
        fut.add_done_callback(on_done)

    if not trajs:
        return outputs
    t0 = time.monotonic()
    for k in range(len(trajs)):
        if k in spawned:
            continue  # it starts after another trajectory's round (`spawn`)
        if arrivals is not None:
            wait = t0 + arrivals[k] - time.monotonic()
            if wait > 0:
                time.sleep(wait)
        start(k)
    finished = done_all.wait(timeout_s)
    with lock:
        stopped.set()
    bar.close()
    with lock:
        for timer in timers:
            timer.cancel()
    if not finished:
        for o, (_, rounds) in zip(outputs, trajs):
            if not o.error and len(o.rounds) < len(rounds):
                o.error = f"timed out after {timeout_s} s with {len(o.rounds)} of {len(rounds)} rounds done"
    closer.shutdown(wait=True)
    # Sessions still open: all of them with `release` (the blocks go now), else the unfinished
    # trajectories' after a timeout (their late rounds are dropped).
    for k, (o, (_, rounds)) in enumerate(zip(outputs, trajs)):
        timed_out = len(o.rounds) < len(rounds) and o.error.startswith("timed out")
        if k in sessions and (release or timed_out):
            close(k)
    return outputs


def _waits(trajs: Sequence[tuple[str, Sequence[tuple]]], max_concurrent: int) -> dict:
    """`(trajectory k, round i) -> [indices of the trajectories it waits for]` of
    `run_trajectories`' rounds (their fourth field), checked: no cycle, and with
    `max_concurrent` only earlier trajectories."""
    from dualpath_jax.workload.order import wait_cycle

    index: dict[str, list[int]] = {}
    for k, (tid, _) in enumerate(trajs):
        index.setdefault(tid, []).append(k)
    out: dict[tuple[int, int], list[int]] = {}
    edges: dict[str, set[str]] = {tid: set() for tid in index}
    for k, (tid, rounds) in enumerate(trajs):
        for i, rd in enumerate(rounds):
            named = rd[3] if len(rd) > 3 else ()
            if isinstance(named, str):
                raise ValueError(f"round {i} of {tid!r}: waits_for must be a sequence of ids")
            ws = sorted({w for name in named for w in index.get(name, ())})
            if not ws:
                continue
            if max_concurrent and ws[-1] >= k:
                raise ValueError(
                    f"round {i} of {tid!r} waits for a later trajectory; with max_concurrent"
                    " the one it waits for might never get a slot"
                )
            out[k, i] = ws
            edges[tid].update(trajs[w][0] for w in ws)
    cycle = wait_cycle(edges)
    if cycle:
        raise ValueError(f"trajectories wait for each other in a cycle: {' -> '.join(cycle)}")
    return out


def _spawns(trajs: Sequence[tuple], max_concurrent: int) -> dict:
    """`(trajectory k, round i) -> [(trajectory c, delay_s), ...]`: the trajectories of
    `run_trajectories` that start after round i of trajectory k (their third field), checked:
    no round waits for one that starts after it, none with `max_concurrent`."""
    from dualpath_jax.workload.order import round_cycle
    from dualpath_jax.workload.trace import after_problem

    index: dict[str, int] = {}
    for k, t in enumerate(trajs):
        index.setdefault(t[0], k)
    afters = [tuple(t[2]) if len(t) > 2 and t[2] else () for t in trajs]
    out: dict[tuple[int, int], list[tuple[int, float]]] = {}
    for c, (t, after) in enumerate(zip(trajs, afters)):
        if not after:
            continue
        problem = after_problem(after)
        if problem:
            raise ValueError(f"trajectory {t[0]!r}: {problem}")
        k = index.get(after[0])
        if k is None:
            continue  # not in the call: it starts at its arrival
        if k == c:
            raise ValueError(f"trajectory {t[0]!r} starts after a round of its own")
        out.setdefault((k, min(after[1], len(trajs[k][1]) - 1)), []).append((c, float(after[2])))
    if out and max_concurrent:
        raise ValueError(
            "trajectories that start after another's round need max_concurrent=0: a slot held"
            " by the one they start after might never be freed"
        )
    if out:
        waits = [(t[0], [rd[3] if len(rd) > 3 else () for rd in t[1]], after)
                 for t, after in zip(trajs, afters)]  # fmt: skip
        cycle = round_cycle(waits)
        if cycle:
            raise ValueError(f"rounds wait for each other in a cycle: {' -> '.join(cycle)}")
    return out


def _delay(
    rounds: Sequence[tuple],
    k: int,
    i: int,
    ready: float,
    now: float,
    waits_of: dict,
    ended: list,
) -> float:
    """Seconds from `now` until round i of trajectory k goes, ready (its previous round ended,
    or it arrived) at `ready` and every trajectory it waits for ended
    (`workload.trace.submit_time`; counted from `now` so that a plain gap stays exact)."""
    from dualpath_jax.workload.trace import submit_time

    gap = float(rounds[i][2]) if len(rounds[i]) > 2 else 0.0
    ends = [ended[w] - now for w in waits_of.get((k, i), ())]
    return submit_time(ready - now, gap, ends, first=i == 0)


# (defined in its own module; part of this API)
from dualpath_jax.rollout.inprocess import InProcessBackend  # noqa: E402

# The name before this release (docs/api.md, "Renamed"); kept for one release.
InProcessEngine = InProcessBackend
