"""`InProcessBackend`: the rollout backend without disaggregation (re-exported by
`dualpath_jax.rollout`, whose `Session` and `run_trajectories` run on it unchanged).

What it supports of the `Backend` contract (wire/backend.py): sessions (forks included),
`submit`, `submit_group`, `cancel`, `finish`, `abort`, both params updates, hints (`tool_call`
is accepted and does nothing: every session's KV is in this process's memory already, there is
nothing to prefetch), `stats` and `close`. `pause` and `resume` raise kind "unsupported": a
params update already lands between two decode steps here, with no rounds to hold."""

from __future__ import annotations

import collections
import logging
import pathlib
import threading
from collections.abc import Callable, Sequence
from concurrent import futures
from typing import Any

from dualpath_jax.model.sampling_params import GREEDY, SamplingParams, held_back, min_tokens_problem
from dualpath_jax.results import Logprobs, RoundResult
from dualpath_jax.wire.backend import Backend
from dualpath_jax.wire.client import new_version
from dualpath_jax.wire.client_checks import (
    TOKEN_LIMIT,
    RolloutError,
    RoundFuture,
    check_int,
    check_session,
    check_tokens,
    check_ttl,
)
from dualpath_jax.wire.hints import check_seconds

log = logging.getLogger(__name__)

# `stats()["counters"]`: every backend's (`Backend.stats`) and what each finish reason adds
_COUNTERS = ("requests_done", "aborted", "cancelled", "finished_early", "errors")
_REASON_COUNTERS = {"abort": ("aborted",), "finished": ("finished_early",)}


def _names(x: str | Sequence[str]) -> set[str]:
    return {x} if isinstance(x, str) else {str(v) for v in x}


class InProcessBackend(Backend):
    """The rollout backend without disaggregation: one model in this process, each session's KV
    kept in host memory between rounds and fed back layer by layer (layerwise prefill).

    For quick experiments and RL loops on one device; `Session` and `run_trajectories` work on it
    unchanged. With `slots=1` rounds run synchronously inside `submit` (the returned future is
    already done); with `slots=S` > 1 the rounds submitted meanwhile (by `run_trajectories`,
    several threads, or `step_async`) run together in a worker thread, prefilled in batches and
    decoded S at a time in one decoder whose pages hold `kv_tokens` tokens (0: S x `max_len`),
    a round starting once its pages are free (`dualpath_jax.rollout.inprocess_batch`); `close()` ends
    it. With `slots=1` no round is ever in flight between calls, so `cancel`, `finish` and
    `abort` find nothing to end; with `slots` > 1 they end queued and decoding rounds.
    """

    def __init__(self, model, *, max_len: int = 0, slots: int = 1, kv_tokens: int = 0):
        import numpy as np

        from dualpath_jax.model.runner import ModelRunner

        self.runner = model if isinstance(model, ModelRunner) else ModelRunner(model)
        self.cfg = self.runner.cfg
        self.max_len = max_len or self.cfg.max_seq_len
        self._np = np
        self._sessions: dict[str, tuple[list[int], object]] = {}
        self._lock = threading.Lock()
        # a params swap waits for the batch loop's turn (re-entrant: a round's future answered
        # on the worker thread may run a callback that updates the params)
        self._run_lock = threading.RLock()
        self.params_version = ""
        self.slots = check_int(slots, "slots", 1, 1 << 16)
        # what `stats` reports: rounds in flight and how rounds ended (`_landed`)
        self._counters: collections.Counter[str] = collections.Counter()
        self._in_flight = 0
        self._stats_lock = threading.Lock()
        self._batch = None
        if slots > 1:
            from dualpath_jax.rollout.inprocess_batch import BatchLoop

            self._batch = BatchLoop(self, slots, check_int(kv_tokens, "kv_tokens", 0, 1 << 40))

    def close(self) -> None:
        """Ends the batch worker (`slots` > 1): rounds still queued fail with kind `engine`."""
        if self._batch is not None:
            self._batch.close()

    def stats(self) -> dict:
        """The contract's keys (`Backend.stats`): open `sessions`, rounds `in_flight`, the
        `params_version` served and `counters` (`requests_done`, `aborted`, `cancelled`,
        `finished_early`, `errors`); and `slots` and `queued` (`{"batch": rounds waiting for
        decode slots}`)."""
        with self._lock:
            sessions = len(self._sessions)
        queued = 0 if self._batch is None else self._batch.queued()
        with self._stats_lock:
            counters = {k: self._counters[k] for k in _COUNTERS}
            in_flight = self._in_flight
        return {
            "sessions": sessions,
            "in_flight": in_flight,
            "queued": {"batch": queued},
            "params_version": self.params_version,
            "slots": self.slots,
            "counters": counters,
        }

    def _future(self) -> RoundFuture:
        """A round's future (its `.request` set once the round has an id), counted in flight
        until it resolves (`stats`)."""
        fut = RoundFuture()
        with self._stats_lock:
            self._in_flight += 1
        fut.add_done_callback(self._landed)
        return fut

    def _landed(self, fut: futures.Future[RoundResult]) -> None:
        err = fut.exception()
        if err is None:
            reason = fut.result().finish_reason
            names = ["requests_done", *_REASON_COUNTERS.get(reason, ())]
        else:
            names = ["cancelled" if getattr(err, "kind", "") == "cancelled" else "errors"]
        with self._stats_lock:
            self._in_flight -= 1
            self._counters.update(names)

    def update_params(self, params: Any, version: str | None = None) -> str:
        """Swaps in new parameters (e.g. after an RL update): a `Transformer`, its `nnx.State` or
        a nested dict (`nnx.to_pure_dict` layout), checked against the model first (a wrong tree,
        shape or dtype raises RolloutError and the old params stay). Each session keeps its
        context, but its cached KV is dropped (it was computed with the old params), so the next
        round recomputes it. Returns the new params version."""
        from dualpath_jax.model.checkpoint import model_from_params

        return self._update(lambda: model_from_params(params, self.cfg), version)

    def update_params_from_checkpoint(
        self, path: str | pathlib.Path, version: str | None = None
    ) -> str:
        """`update_params` from a checkpoint directory (see `Client.update_params_from_checkpoint`)."""
        from dualpath_jax.model.checkpoint import load_params

        return self._update(lambda: load_params(path, self.cfg), version)

    def _update(self, load: Callable[[], Any], version: str | None) -> str:
        from dualpath_jax.model.checkpoint import CheckpointError
        from dualpath_jax.wire.params_protocol import check_version

        version = check_version(version or new_version())
        try:
            model = load()
        except CheckpointError as e:
            raise RolloutError(f"params {version!r} refused: {e}", "bad_request") from None
        self._swap(model, version)
        return version

    def _swap(self, model, version: str) -> None:
        with self._run_lock, self._lock:
            self.runner.update_params(model)
            self.params_version = version
            for sid, (context, _) in self._sessions.items():
                self._sessions[sid] = (context, None)

    def open_session(
        self,
        session: str,
        resume: bool = False,
        *,
        priority: int | None = None,
        ttl_s: float | None = None,
        fork_of: str = "",
    ) -> None:
        """Opens a session (`priority` and `ttl_s` are checked and accepted for the `Backend`
        contract; the in-process backend keeps every session's KV until it is closed);
        `fork_of`: it starts with that session's context and KV."""
        check_session(session)
        if priority is not None:
            check_int(priority, "priority", -(2**31), 2**31)
        if ttl_s is not None:
            check_ttl(ttl_s)
        with self._lock:
            if session in self._sessions and not resume:
                raise RolloutError(
                    f"session {session!r} exists; pass resume=True to continue it", "bad_request"
                )
            if fork_of and fork_of not in self._sessions:
                raise RolloutError(f"cannot fork unknown session {fork_of!r}", "bad_request")
            start = self._sessions[fork_of] if fork_of else ([], None)
            self._sessions.setdefault(session, (list(start[0]), start[1]))

    def close_session(self, session: str, release: bool = False) -> None:  # noqa: ARG002 - KV lives here
        with self._lock:
            if self._sessions.pop(session, None) is None:
                raise RolloutError(f"unknown session {session!r}", "bad_request")

    def submit(
        self,
        session: str,
        append: Sequence[int],
        gen: int,
        *,
        sampling: SamplingParams = GREEDY,
        stop_tokens: Sequence[int] = (),
    ) -> futures.Future[RoundResult]:
        """One round (see `Client.submit`): it ends after any of `stop_tokens` (its last token;
        none drawn before `sampling.min_tokens` tokens), else after `gen` tokens."""
        fut = self._future()
        try:
            tokens = self._check_round(append, gen, [sampling], stop_tokens)
            if self._batch is not None:
                self._queue([session], tokens, gen, [sampling], stop_tokens, [fut])
                return fut
            res = self._rounds([session], tokens, gen, [sampling], stop_tokens)[0]
            fut.request = res.request
            fut.set_result(res)
        except RolloutError as e:
            fut.set_exception(e)
        except ValueError as e:
            fut.set_exception(RolloutError(str(e), "bad_request"))
        return fut

    def submit_group(
        self,
        sessions: Sequence[str],
        append: Sequence[int],
        gen: int,
        *,
        samplings: Sequence[SamplingParams],
        stop_tokens: Sequence[int] = (),
    ) -> list[futures.Future[RoundResult]]:
        """One round in each of `sessions` (forks of one session: one context), all appending
        `append` and generating `gen` tokens, round i drawn with `samplings[i]` (group sampling,
        as `Client.submit_group`): the append is prefilled once and the samples decode together
        in one decoder, the others forking the first one's prompt pages (`Decoder.fork`), each
        ending on its own at `stop_tokens` (as `submit`'s). Sessions of different contexts run
        one by one. The futures are already done."""
        futs: list[RoundFuture] = []
        try:
            if not self._one_context(sessions, samplings):  # no prompt to share
                return [
                    self.submit(s, append, gen, sampling=p, stop_tokens=stop_tokens)
                    for s, p in zip(sessions, samplings)
                ]
            futs = [self._future() for _ in sessions]
            tokens = self._check_round(append, gen, list(samplings), stop_tokens)
            if self._batch is not None:
                self._queue(list(sessions), tokens, gen, list(samplings), stop_tokens, futs)
                return futs
            got = self._rounds(list(sessions), tokens, gen, list(samplings), stop_tokens)
            for fut, res in zip(futs, got):
                fut.request = res.request
                fut.set_result(res)
        except (RolloutError, ValueError) as e:
            err = e if isinstance(e, RolloutError) else RolloutError(str(e), "bad_request")
            futs = futs or [self._future() for _ in sessions]
            for fut in futs:
                fut.set_exception(err)
        return futs

    def _one_context(self, sessions: Sequence[str], samplings: Sequence[SamplingParams]) -> bool:
        """Whether `sessions` (open ones, one sampling each, else RolloutError) share one
        context: a group's prompt to prefill once."""
        if not sessions or len(samplings) != len(sessions):
            raise RolloutError(
                f"{len(samplings)} sampling params for {len(sessions)} sessions", "bad_request"
            )
        with self._lock:
            missing = [s for s in sessions if s not in self._sessions]
            if missing:
                raise RolloutError(f"unknown session {missing[0]!r}", "bad_request")
            return len({tuple(self._sessions[s][0]) for s in sessions}) == 1

    def _queue(self, sessions, tokens, gen, samplings, stop_tokens, futs) -> None:
        """Hands a round (or a group's) to the batch worker (`slots` > 1)."""
        from dualpath_jax.rollout.inprocess_batch import Job

        with self._lock:
            missing = [s for s in sessions if s not in self._sessions]
            ids = [f"{s}#{len(self._sessions[s][0])}" for s in sessions if not missing]
            prompt = len(self._sessions[sessions[0]][0]) + len(tokens) if not missing else 0
        if missing:
            raise RolloutError(f"unknown session {missing[0]!r}", "bad_request")
        if not tokens:
            raise RolloutError("a round must append at least one token", "bad_request")
        for fut, request in zip(futs, ids):
            fut.request = request  # what `abort` takes, as a cluster's `RoundFuture.request`
        job = Job(
            list(sessions), tokens, gen, list(samplings), tuple(stop_tokens), futs, ids, prompt
        )
        self._batch.submit(job)

    def abort(
        self,
        requests: str | Sequence[str] = (),
        *,
        sessions: str | Sequence[str] = (),
        all: bool = False,  # noqa: A002 - the natural name (as `Client.abort`)
        timeout_s: float = 30.0,  # noqa: ARG002 - the `Client.abort` signature
    ) -> list[str]:
        """Ends rounds now with the tokens they have, as `Client.abort`: those of `requests` (a
        future's `.request`), of `sessions`, or every one (`all=True`). Their results have
        `finish_reason` "abort": a decoding round its tokens so far, a queued one (a group as a
        whole) none; the append and tokens join the session's context. Returns the request ids
        ended (with `slots=1` none: a round runs inside `submit`, never in flight here)."""
        if self._batch is None:
            return []
        return self._batch.abort(_names(requests), _names(sessions), bool(all))

    def cancel(self, request: str) -> None:
        """Abandons a round (a future's `.request`), as `Client.cancel`: its future fails with
        kind "cancelled" and its session keeps the context it had before the round. A queued
        sample of a group leaves the group; a finished round (every round with `slots=1`) is
        not affected."""
        if self._batch is not None:
            self._batch.cancel(str(request))

    def finish(self, request: str) -> None:
        """Ends a round now with the tokens it has, as `Client.finish` (`finish_reason`
        "finished"; its tokens extend the session); a queued one ends after its first token.
        A finished round (every round with `slots=1`) is not affected."""
        if self._batch is not None:
            self._batch.finish(str(request))

    def tool_call(self, session: str, expected_s: float) -> None:  # noqa: ARG002 - the contract's
        """Accepted and ignored: every session's KV is in this process's memory already, so
        there is nothing to prefetch during the tool call (`expected_s` is checked as a
        cluster checks it)."""
        check_seconds(expected_s)

    def _check_round(
        self, append: Sequence[int], gen: int, samplings: list, stop_tokens: Sequence[int]
    ) -> list[int]:
        """A round's checked append (RolloutError: a bad one, gen, sampling or stop token)."""
        for sampling in samplings:
            if not isinstance(sampling, SamplingParams):
                raise RolloutError(
                    f"sampling must be a SamplingParams, got {sampling!r}", "bad_request"
                )
        tokens = check_tokens(append)
        bad = next((t for t in tokens if t >= self.cfg.vocab_size), None)
        if bad is not None:
            raise RolloutError(
                f"token id {bad} is out of range [0, {self.cfg.vocab_size})", "bad_request"
            )
        check_int(gen, "gen", 1, TOKEN_LIMIT)
        check_tokens(stop_tokens, "stop token")
        for sampling in samplings:
            problem = min_tokens_problem(sampling, gen, stop_tokens)
            if problem:
                raise RolloutError(problem, "bad_request")
        return tokens

    def _rounds(
        self,
        sessions: list[str],
        append: list[int],
        gen: int,
        samplings: list[SamplingParams],
        stop_tokens: Sequence[int] = (),
    ) -> list[RoundResult]:
        """One round of `append` in each of `sessions` (one context, one KV): the append is
        prefilled once; session 0's first token comes from the prefill, the others fork its
        prompt pages and draw theirs in their first decode step, all at position len(prompt).
        Each ends at its first of `stop_tokens` (after `min_tokens`) or after `gen` tokens."""
        import time

        from dualpath_jax.model.decode import Decoder
        from dualpath_jax.model.runner import PrefillBatch, bucket_len
        from dualpath_jax.model.sampler import sample_at

        np, cfg = self._np, self.cfg
        with self._lock:
            missing = [s for s in sessions if s not in self._sessions]
            if missing:
                raise RolloutError(f"unknown session {missing[0]!r}", "bad_request")
            context, kv = self._sessions[sessions[0]]
        if not append:
            raise RolloutError("a round must append at least one token", "bad_request")
        prompt = context + append
        if len(prompt) + gen > self.max_len:
            raise RolloutError(
                f"context of {len(prompt)} + {gen} tokens exceeds the limit of {self.max_len}",
                "bad_request",
            )
        t0 = time.monotonic()
        cached = 0 if kv is None else kv.shape[1]
        batch = PrefillBatch.build(cfg, [prompt[cached:]], [cached], self.runner.min_bucket)
        padded = np.zeros((cfg.num_layers, 1, batch.c_pad, cfg.kv_width), np.dtype(cfg.kv_dtype))
        if cached:
            padded[:, 0, :cached] = kv
        new: dict[int, object] = {}
        res = self.runner.prefill_layerwise(batch, lambda i: padded[i], new.__setitem__)
        n = len(prompt) - cached
        prompt_kv = np.stack([np.asarray(new[i][0, :n]) for i in range(cfg.num_layers)])
        if cached:
            prompt_kv = np.concatenate([kv, prompt_kv], axis=1)
        g = len(sessions)
        lps = [Logprobs() if p.logprobs is not None else None for p in samplings]

        def draw(logits, i: int, pos: int) -> int:
            held = held_back(samplings[i], stop_tokens, pos - len(prompt))
            tokens, entries = sample_at(logits, [samplings[i]], [pos], [held], logprobs=True)
            if lps[i] is not None:
                lps[i].extend(entries[0])
            return int(tokens[0])

        out: list[list[int]] = [[draw(res.last_logits, 0, len(prompt))], *([] for _ in range(1, g))]
        t_first = [time.monotonic()] + [0.0] * (g - 1)
        t_second = list(t_first)
        # the decoder's length in buckets: its programs compile once per bucket, not per round
        need = len(prompt) + gen + 1
        span = max(need, min(bucket_len(need, 64), self.max_len, cfg.max_seq_len))
        dec = Decoder(self.runner, slots=g, max_len=span)
        dec.insert(0, prompt_kv, len(prompt), out[0][0])
        for i in range(1, g):  # the prompt's last token is fed again: its logits draw theirs
            dec.hold(f"fork:{i}", 0, len(prompt))
            dec.fork(i, f"fork:{i}", len(prompt), prompt[-1])
        stops = set(stop_tokens)

        def stopped(i: int) -> bool:
            o = out[i]
            return bool(o) and o[-1] in stops and len(o) > samplings[i].min_tokens

        def going(i: int) -> bool:
            return len(out[i]) < gen and not stopped(i)

        while any(going(i) for i in range(g)):
            logits = np.asarray(dec.step())
            nxt = np.zeros((g,), np.int32)
            for i in range(g):
                if going(i):
                    out[i].append(draw(logits[i : i + 1], i, len(prompt) + len(out[i])))
                    now = time.monotonic()
                    if len(out[i]) == 1:
                        t_first[i] = t_second[i] = now
                    elif len(out[i]) == 2:
                        t_second[i] = now
                nxt[i] = out[i][-1]
            dec.set_next(nxt)
        results = []
        with self._lock:
            for i, session in enumerate(sessions):
                if session in self._sessions:
                    kv_after = dec.rows(i, 0, len(prompt) + len(out[i]) - 1)
                    self._sessions[session] = (prompt + out[i], kv_after)
                results.append(
                    RoundResult.timed(
                        f"{session}#{len(context)}",
                        out[i],
                        t_submit=t0,
                        t_assign=t0,
                        t_first=t_first[i],
                        t_second=t_second[i],
                        t_done=time.monotonic(),
                        cached_tokens=cached if i == 0 else len(prompt) - 1,
                        prompt_tokens=len(prompt),
                        read_path="none" if i == 0 else "fork",
                        finish_reason="stop" if stopped(i) else "length",
                        logprobs=lps[i],
                    )
                )
        return results
