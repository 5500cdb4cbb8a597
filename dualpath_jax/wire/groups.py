"""Group sampling on a cluster (`Client.submit_group`): one round in each of G sessions of one
context, the prompt prefilled once.

Two ways to share the prompt (`share`):

- `"fork"` (the default): the first session's round runs as any round does; the others are
  submitted right behind it naming it (`Submit.follows`). The router holds them until its
  prefill reports the first token and sends them with it to its decode engine, which starts
  each one from the prompt's pages in its KV pool (whole pages shared, the last one copied) and
  draws its first token in its first decode step: one read of the prompt's stored KV, one
  prefill, one transfer to one DE, whatever G is. A follower that cannot fork (its leader
  ended first, or its DE dropped it) runs on its own.
- `"store"`: a first round on a fork of the first session computes the prompt and stores its KV
  (it generates one token, discarded; the fork is closed and its blocks stay); then each
  session's round reads the prompt's whole blocks from the store (the block keys are the same:
  a hash chain of the tokens) and computes only the tail after the last whole block and its own
  first token, on whichever engines the scheduler picks (G samples spread over DEs). Its
  orchestration runs on a thread of its own, so the call returns the futures at once.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Sequence
from concurrent import futures
from typing import Any

from dualpath_jax.model.sampling_params import SamplingParams
from dualpath_jax.wire.client_checks import (
    RolloutError,
    RoundFuture,
    check_session,
    check_tokens,
)

SHARES = ("fork", "store")


class GroupFutures(list):
    """`Client.submit_group`'s futures, one per session, and `prefix`: the prompt's round
    (`share="store"`; None with `"fork"`, where the first session's round is the prompt's)."""

    prefix: futures.Future | None = None


def _chain(src: futures.Future, dst: futures.Future) -> None:
    """Resolves `dst` as `src` resolves."""

    def done(f: futures.Future) -> None:
        if f.exception() is not None:
            dst.set_exception(f.exception())
        else:
            dst.set_result(f.result())

    src.add_done_callback(done)


def submit_group(
    client: Any,  # a Client
    sessions: Sequence[str],
    append: Sequence[int],
    gen: int,
    *,
    samplings: Sequence[SamplingParams],
    stop_tokens: Sequence[int] = (),
    timeout_s: float = 600.0,
    share: str = "fork",
    on_tokens: Sequence[Callable[..., None]] | None = None,
) -> GroupFutures:
    """One round in each of `sessions` (open, idle, with one context: forks of one session,
    `open_session(fork_of=...)`, or fresh ones), all appending `append` and generating `gen`
    tokens, round i drawn with `samplings[i]` (group sampling: GRPO's G completions of one
    prompt), the prompt prefilled once, shared by forking it on one decode engine (`share=
    "fork"`) or through the store (`"store"`; see the module docstring). Returns one future per
    session (`RoundFuture`s, as `Client.submit`'s); with `"store"` the prefix round's future is
    `.prefix` and a failed prefix round fails them all. `on_tokens`: one callback per session,
    streaming its round's tokens as `Client.submit`'s does. `Client.submit_group` is this
    function."""
    sessions = [check_session(x) for x in sessions]
    if not sessions or len(samplings) != len(sessions):
        raise RolloutError(
            f"{len(samplings)} sampling params for {len(sessions)} sessions", "bad_request"
        )
    if share not in SHARES:
        raise RolloutError(f"share must be one of {SHARES}, got {share!r}", "bad_request")
    streams = list(on_tokens) if on_tokens is not None else [None] * len(sessions)
    if len(streams) != len(sessions):
        raise RolloutError(
            f"{len(streams)} token callbacks for {len(sessions)} sessions", "bad_request"
        )
    append = check_tokens(append)
    if share == "fork":
        outs = GroupFutures()
        for sid, sampling, stream in zip(sessions, samplings, streams):
            follows = {"follows": outs[0].request} if outs else {}
            outs.append(
                client.submit(
                    sid, append, gen, sampling=sampling, stop_tokens=stop_tokens,
                    on_tokens=stream, **follows,
                )
            )  # fmt: skip
        return outs
    outs = GroupFutures(RoundFuture() for _ in sessions)
    outs.prefix = futures.Future()

    def run() -> None:
        fork = f"{sessions[0]}~group-{uuid.uuid4().hex[:8]}"
        try:
            client.open_session(fork, fork_of=sessions[0])
            try:
                res = client.submit(fork, append, 1).result(timeout_s)
            finally:
                client.close_session(fork)  # its blocks stay for the group to read
            outs.prefix.set_result(res)
        except BaseException as e:  # noqa: BLE001 - the group fails with it
            err = e if isinstance(e, RolloutError) else RolloutError(str(e), "engine")
            outs.prefix.set_exception(err)
            for out in outs:
                out.set_exception(err)
            return
        for sid, sampling, stream, out in zip(sessions, samplings, streams, outs):
            fut = client.submit(
                sid, append, gen, sampling=sampling, stop_tokens=stop_tokens, on_tokens=stream
            )
            out.request = fut.request
            _chain(fut, out)

    threading.Thread(target=run, name="submit-group", daemon=True).start()
    return outs
