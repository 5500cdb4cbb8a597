"""The rollout backend contract: every method a rollout calls, in one abstract class.

`Backend` is what `dualpath_jax.rollout` (`Session`, `step_group`, `run_trajectories`) drives
and what every backend implements: `Client` (a cluster's router, wire/client.py) and
`InProcessBackend` (one model in this process, rollout/inprocess.py). Three methods are
abstract (a session's life: `open_session`, `submit`, `close_session`); every other one has a
default here: `submit_group` runs the rounds one by one, `hint` maps a hint onto the session
methods (`wire.hints`), `close` has nothing to end, and the rest raise
`RolloutError(kind="unsupported")` naming the backend and the method. A backend overrides what
it can do and documents what it leaves unsupported; callers call, they never probe.

Lifecycle: a backend is made ready to serve, sessions are opened, stepped and closed on it, and
`close()` (or leaving its `with` block) ends it; calls after that fail with a `RolloutError`.
"""

from __future__ import annotations

import abc
import pathlib
import uuid
from collections.abc import Sequence
from concurrent import futures
from typing import Any

from dualpath_jax.model.sampling_params import GREEDY, SamplingParams
from dualpath_jax.results import RoundResult
from dualpath_jax.wire import hints
from dualpath_jax.wire.client_checks import RolloutError, RoundFuture, check_session

UNSUPPORTED = "unsupported"  # the `RolloutError.kind` of a method a backend cannot run


class Backend(abc.ABC):
    """Runs rounds of sessions (module docstring). Subclasses implement `open_session`,
    `submit` and `close_session`, and override each other method they support."""

    def unsupported(self, method: str, why: str = "") -> RolloutError:
        """The error a method this backend cannot run raises: kind "unsupported", naming the
        backend and the method (and `why`, when given)."""
        why = f": {why}" if why else ""
        return RolloutError(f"{type(self).__name__} does not support {method}{why}", UNSUPPORTED)

    # ------------------------------------------------------------------ sessions

    @abc.abstractmethod
    def open_session(
        self,
        session: str,
        resume: bool = False,
        *,
        priority: int | None = None,
        ttl_s: float | None = None,
        fork_of: str = "",
    ) -> None:
        """Opens `session`; one that is open already is an error unless `resume=True`.
        `priority` / `ttl_s`: its stored KV's retention (None: the defaults, or what a resumed
        session had); `fork_of`: it starts with that open, idle session's context."""

    @abc.abstractmethod
    def close_session(self, session: str, release: bool = False) -> None:
        """Ends `session`; `release=True` also drops its stored KV that no open session uses."""

    # ------------------------------------------------------------------ rounds

    @abc.abstractmethod
    def submit(
        self,
        session: str,
        append: Sequence[int],
        gen: int,
        *,
        sampling: SamplingParams = GREEDY,
        stop_tokens: Sequence[int] = (),
    ) -> RoundFuture:
        """One round: appends `append` to the session's context and generates `gen` tokens
        (fewer when one of `stop_tokens` ends it), drawn with `sampling`. The future resolves to
        a `RoundResult` or raises `RolloutError`; bad input fails it at once (kind
        "bad_request") and the backend keeps serving. It is a `RoundFuture`: its `.request`
        names the round for `cancel`, `finish` and `abort` ("" for a round refused at once)."""

    def submit_group(
        self,
        sessions: Sequence[str],
        append: Sequence[int],
        gen: int,
        *,
        samplings: Sequence[SamplingParams],
        stop_tokens: Sequence[int] = (),
    ) -> list[futures.Future[RoundResult]]:
        """One round in each of `sessions` (forks of one context), all appending `append`,
        round i drawn with `samplings[i]` (group sampling). This default submits them one by
        one; a backend that can prefill the prompt once overrides it."""
        if len(samplings) != len(sessions):
            raise RolloutError(
                f"{len(samplings)} sampling params for {len(sessions)} sessions", "bad_request"
            )
        return [
            self.submit(s, append, gen, sampling=p, stop_tokens=stop_tokens)
            for s, p in zip(sessions, samplings)
        ]

    def cancel(self, request: str) -> None:
        """Abandons a round (a future's `.request`): its future fails with kind "cancelled" and
        its session is free for the next round; a finished round is not affected."""
        raise self.unsupported("cancel")

    def finish(self, request: str) -> None:
        """Ends a round now with the tokens it has (`finish_reason` "finished"); they extend
        the session as a round that ran to its end does. A finished round is not affected."""
        raise self.unsupported("finish")

    def abort(
        self,
        requests: str | Sequence[str] = (),
        *,
        sessions: str | Sequence[str] = (),
        all: bool = False,  # noqa: A002 - the natural name
        timeout_s: float = 30.0,
    ) -> list[str]:
        """Ends the rounds of `requests`, of `sessions`, or every one (`all=True`) now with the
        tokens they have (`finish_reason` "abort"); returns the request ids ended."""
        raise self.unsupported("abort")

    def pause(self, mode: str = "wait", timeout_s: float = 600.0) -> None:
        """Holds the rounds submitted from now on until `resume` ("wait": the rounds in flight
        finish first; "abort": they end now; "keep": they halt where they are)."""
        raise self.unsupported("pause")

    def resume(self, timeout_s: float = 30.0) -> None:
        """Starts the rounds held since `pause`, in the order submitted."""
        raise self.unsupported("resume")

    # ------------------------------------------------------------------ parameters

    def update_params(self, params: Any, version: str | None = None) -> str:
        """Serves new parameters (a `Transformer`, its `nnx.State` or a nested dict), checked
        first: refused ones raise `RolloutError` and the old ones keep serving. Returns the
        new params version."""
        raise self.unsupported("update_params")

    def update_params_from_checkpoint(
        self, path: str | pathlib.Path, version: str | None = None
    ) -> str:
        """`update_params` from a checkpoint directory (orbax or Hugging Face)."""
        raise self.unsupported("update_params_from_checkpoint")

    # ------------------------------------------------------------------ hints and state

    def hint(self, session: str, hint: str | dict | hints.SessionHint) -> str:
        """A session hint (`wire.hints`: `"tool_call:12"`, `"ttl:600"`, `"pin"`, `"release"`,
        `"fork"`, or their object forms); unknown ones raise RolloutError("bad_request").
        Retention hints re-open the session with new settings, `release` closes it, `tool_call`
        also calls `tool_call`, `fork` opens a new session from it. Returns the session the
        hint leaves: a fork's new one, else `session`."""
        h = hints.parse_hint(hint)
        if h.kind == "fork":
            child = h.session or f"{session}/{uuid.uuid4().hex[:6]}"
            self.open_session(child, fork_of=session)
            return child
        hints.apply_hint(self, check_session(session), h)
        return session

    def tool_call(self, session: str, expected_s: float) -> None:
        """`session`'s last round ended with a tool call expected to take `expected_s`
        seconds: a backend may read the session's KV closer meanwhile (prefetch)."""
        raise self.unsupported("tool_call")

    def stats(self) -> dict:
        """Counters and state as JSON-ready data. Every backend's has at least `sessions`
        (open sessions), `in_flight` (rounds submitted and not yet answered), `params_version`
        (served) and `counters` with `requests_done` (rounds answered with a result),
        `aborted`, `cancelled` and `finished_early`."""
        raise self.unsupported("stats")

    def close(self) -> None:  # noqa: B027 - a real default: a backend may hold nothing
        """Ends the backend: what it runs stops (rounds still queued fail). This default holds
        nothing to end."""

    def __enter__(self) -> Backend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
