"""One trajectory on a backend: `Session` (its rounds, sync or async), `step_group` (G samples of
one prompt), `round_sampling` (the keywords -> one `SamplingParams`) and `Step` (a round's tokens
with their log-probabilities). Re-exported by `dualpath_jax.rollout`."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Sequence
from concurrent import futures
from typing import Any

import msgspec

from dualpath_jax.model.sampling_params import SamplingParams
from dualpath_jax.results import Logprobs, RoundResult
from dualpath_jax.wire.backend import UNSUPPORTED, Backend
from dualpath_jax.wire.client import key_to_seed
from dualpath_jax.wire.client_checks import RolloutError, check_int
from dualpath_jax.wire.hints import parse_hint


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


def check_backend(backend: Any) -> Backend:
    """`backend` if it implements the rollout contract (`Backend`), else a TypeError saying so."""
    if not isinstance(backend, Backend):
        raise TypeError(
            f"a rollout backend is a dualpath_jax.rollout.Backend (Client, InProcessBackend, or a "
            f"subclass), got {type(backend).__name__}"
        )
    return backend


class Session:
    """One trajectory: each `step` appends tokens and generates exactly `gen` tokens.

    A `session_id` that is already open is an error unless `resume=True`, which continues that
    session's context. `priority` and `ttl_s` set the retention of its stored KV under capacity
    pressure (`store.eviction="retention"`): kept while a round runs and `ttl_s` seconds after
    each (-1: `store.retention_ttl_s`), lower priorities evicted first. Lifecycle: opened on the
    backend when made, stepped any number of times (one round at a time), ended by `close`."""

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
        self.backend = check_backend(backend)
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
        `timeout_s` is cancelled (`Backend.cancel`; the session can step again) and raises
        TimeoutError."""
        fut = self.step_async(
            append, gen, temperature=temperature, key=key, top_p=top_p, logprobs=logprobs,
            stop_tokens=stop_tokens,
        )  # fmt: skip
        try:
            return _answer(fut.result(timeout_s), logprobs)
        except futures.TimeoutError:
            if fut.request:  # (a `RoundFuture`: "" when the round got no id)
                try:
                    self.backend.cancel(fut.request)
                except RolloutError as e:
                    if e.kind != UNSUPPORTED:  # a backend that cannot cancel: the round runs on
                        raise
            raise

    def close(self, release: bool = False) -> None:
        """Ends the session; `release=True` also deletes its stored KV no other session uses."""
        self.backend.close_session(self.id, release)

    def hint(self, kind: str, **params: Any) -> Session | None:
        """A session hint (`wire.hints`, `Backend.hint`): `tool_call(expected_s=)`, `pin`,
        `ttl(ttl_s=)`, `release`, or `fork(session="")`, which returns the subagent's new
        `Session`."""
        h = parse_hint({"kind": kind, **params})
        if h.kind == "fork":
            child = h.session or f"{self.id}/{uuid.uuid4().hex[:6]}"
            return Session(self.backend, child, fork_of=self.id)
        self.backend.hint(self.id, h)
        return None

    def fork(self, n: int) -> list[Session]:
        """`n` new sessions that start with this one's context (an idle session's), each its
        own trajectory from then on: the continuations of a group (`step_group`). Nothing is
        computed: they share the context's stored KV."""
        n = check_int(n, "n", 1, 1 << 16)
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
    drawn with `fold_in(key, i)` (distinct and reproducible). The backend's `submit_group` runs
    them: on a cluster the prompt is prefilled once and the other samples fork its pages on its
    decode engine (`Client.submit_group`); on the in-process backend the append is prefilled
    once and the samples decode together (`InProcessBackend.submit_group`); a backend without
    its own runs the rounds one by one (`Backend.submit_group`). Each round ends on its own at
    `stop_tokens` (see `Session.step_async`). Returns each round's tokens (with `logprobs`, its
    `Step`), in order."""
    import jax

    if not sessions:
        return []
    keys = [None if key is None else jax.random.fold_in(key, i) for i in range(len(sessions))]
    samplings = [round_sampling(temperature, top_p, k, logprobs) for k in keys]
    backend = sessions[0].backend
    stops = {"stop_tokens": list(stop_tokens)} if stop_tokens else {}
    futs = backend.submit_group([x.id for x in sessions], append, gen, samplings=samplings, **stops)
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
