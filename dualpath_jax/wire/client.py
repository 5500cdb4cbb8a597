"""The client of a router: rounds as futures, sessions' wire protocol, liveness and cancelling.

`Client(address, secret)` talks to any router (a `LocalCluster`'s or a multi-host one,
docs/multihost.md); `dualpath_jax.rollout.Session` and `run_trajectories` drive it. Token ids and
integer arguments are checked here (`check_tokens`), before anything is sent: bad input is a
`RolloutError(kind="bad_request")` and the cluster keeps serving.
"""

from __future__ import annotations

import itertools
import json
import logging
import pathlib
import queue
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent import futures
from typing import Any

from dualpath_jax.model.sampling_params import GREEDY, SamplingParams
from dualpath_jax.wire import frames, groups, hints, messages
from dualpath_jax.wire.backend import Backend
from dualpath_jax.wire.client_checks import (  # noqa: F401 - re-exported: the client's API
    TOKEN_LIMIT,
    RolloutError,
    RoundFuture,
    check_int,
    check_session,
    check_tokens,
    check_ttl,
)

log = logging.getLogger(__name__)


def key_to_seed(key: Any) -> int:
    """The uint32 seed a round's sampling is keyed by, drawn from a JAX PRNG key."""
    import jax
    import jax.numpy as jnp

    return int(jax.random.bits(key, dtype=jnp.uint32))


def new_version() -> str:
    """A fresh, unique params version name."""
    return f"v-{uuid.uuid4().hex[:16]}"


class Client(Backend):
    """Talks to a router: the cluster's `Backend`, supporting every method of the contract.
    Thread safe: a background thread owns the socket.

    `token` is the client secret (`LocalCluster.client()` passes it). `params_dir` is where
    `update_params` writes checkpoints (a directory every engine can read; `LocalCluster.client()`
    passes `workdir/params`); without one `update_params` streams the params over the transfer
    layer, offered from a transfer server of this process: `params_channel()` opens it (default:
    a `JaxTransferChannel` listening on `transfer_host`, which every engine must reach; the
    cluster's `cluster.transfer_host`). The client pings the router every `ping_s`; calls that have heard
    nothing from it for `dead_after_s` fail with kind `connection` (the router died or is
    unreachable), and a rejected secret fails every pending call with kind `auth`.

    A router restarted at the same address (`LocalCluster.restart("router")`) is reconnected
    to: the client learns of it from the first ping answered by the new one (`router_epoch`
    changes), fails the calls the old one took with kind `connection` (their rounds are lost,
    and so are its sessions: open them again; their stored KV is still hit) and goes on; a
    `stats()` in flight is asked of the new router instead.
    """

    def __init__(
        self,
        address: str,
        token: str = "",
        params_dir: str | pathlib.Path | None = None,
        *,
        ping_s: float = 1.0,
        dead_after_s: float = 5.0,
        transfer_host: str = "127.0.0.1",
        params_channel: Callable[[], Any] | None = None,
    ):
        from dualpath_jax.wire.rpc import RpcClient

        self.address = address
        self.params_dir = pathlib.Path(params_dir) if params_dir else None
        self.transfer_host = transfer_host
        self._params_channel = params_channel
        # What the last `update_params` moved: via, bytes, buckets, prepare_s, total_s.
        self.last_params_update: dict[str, Any] = {}
        self.ping_s, self.dead_after_s = ping_s, dead_after_s
        self._token = token
        self._rpc = RpcClient(address, token)
        self._out: queue.Queue[tuple[bytes, str, futures.Future | None, bool]] = queue.Queue()
        self._pending: dict[str, tuple[futures.Future, float]] = {}
        # Streamed rounds' token callbacks, by request id (set before the Submit is queued).
        self._streams: dict[str, Callable[[int, list[int]], None]] = {}
        self._stats: list[tuple[futures.Future, float]] = []
        self._closed = threading.Event()
        self.router_epoch = ""  # the router's incarnation, from its ping answers
        self.router_restarts = 0  # how many times it changed since this client started
        self._ids = itertools.count()
        self._thread = threading.Thread(target=self._loop, name="dualpath-client", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        heard = time.monotonic()
        last_ping = heard - self.ping_s  # a ping at once: the router's epoch is known early
        while not self._closed.is_set():
            now = time.monotonic()
            while True:
                try:
                    frame, ref, fut, is_stats = self._out.get_nowait()
                except queue.Empty:
                    break
                if fut is not None:
                    if is_stats:
                        self._stats.append((fut, now))
                    else:
                        self._pending[ref] = (fut, now)
                self._rpc.send_frame(frame)
            if now - last_ping >= self.ping_s:
                self._rpc.send_frame(frames.encode(messages.Ping(), self._token))
                last_ping = now
            try:
                reply = self._rpc.recv(5)
            except Exception as e:  # noqa: BLE001 - a frame that fails the checks fails nothing
                log.warning("dropped a frame from the router: %s", e)
                reply = None
                heard = time.monotonic()
            if reply is None:
                self._expire(time.monotonic(), heard)
                continue
            heard = time.monotonic()
            if isinstance(reply, messages.Partial):
                self._stream(reply)
                continue
            if isinstance(reply, messages.Stats):
                if self._stats:
                    self._stats.pop(0)[0].set_result(reply)
                continue
            if isinstance(reply, messages.Ack) and reply.epoch:
                self._heard_epoch(reply.epoch)
                continue
            if isinstance(reply, messages.Error) and not reply.ref and reply.kind == "auth":
                self._fail_all(
                    RolloutError(f"the router refused this client: {reply.message}", "auth")
                )
                continue
            ref = getattr(reply, "request", None) or getattr(reply, "ref", "")
            self._streams.pop(ref, None)
            item = self._pending.pop(ref, None)
            if item is not None:
                item[0].set_result(reply)
        self._fail_all(RolloutError("client is closed", "connection"))
        self._rpc.close()

    def _stream(self, msg: messages.Partial) -> None:
        """Hands each round's new tokens of a `Partial` (one decode step's) to its callback."""
        for new in msg.rounds:
            on_tokens = self._streams.get(new.request)
            if on_tokens is None:
                continue
            try:
                if new.logprobs is None:
                    on_tokens(new.start, new.tokens)
                else:
                    on_tokens(new.start, new.tokens, new.logprobs)
            except Exception:  # noqa: BLE001 - a caller's callback must not stop the loop
                log.exception("the token callback of %s failed", new.request)

    def _heard_epoch(self, epoch: str) -> None:
        """A ping's answer names the router's incarnation: another one than before means the
        router restarted, and every call the old one took is lost."""
        if self.router_epoch and epoch != self.router_epoch:
            log.warning("the router at %s restarted: failing the calls in flight", self.address)
            self.router_restarts += 1
            stats, self._stats = self._stats, []
            self._fail_all(
                RolloutError(
                    f"the router at {self.address} restarted: this call was lost (its "
                    "sessions too: open them again)",
                    "connection",
                )
            )
            # A stats query changes nothing: ask the new router again (replies are matched in
            # order and any of its snapshots answers any query, so one the new router already
            # took answers too)
            now = time.monotonic()
            for fut, _ in stats:
                self._stats.append((fut, now))
                self._rpc.send_frame(frames.encode(messages.GetStats(), self._token))
        self.router_epoch = epoch

    def _expire(self, now: float, heard: float) -> None:
        """Fails calls that have heard nothing from the router for `dead_after_s`."""
        if now - heard <= self.dead_after_s:
            return
        err = RolloutError(
            f"no answer from the router at {self.address} for {now - heard:.1f} s", "connection"
        )
        for ref, (fut, t) in list(self._pending.items()):
            if now - max(t, heard) > self.dead_after_s:
                del self._pending[ref]
                fut.set_exception(err)
        while self._stats and now - max(self._stats[0][1], heard) > self.dead_after_s:
            self._stats.pop(0)[0].set_exception(err)

    def _fail_all(self, err: RolloutError) -> None:
        self._streams.clear()
        pending, self._pending = self._pending, {}
        for fut, _ in pending.values():
            fut.set_exception(err)
        stats, self._stats = self._stats, []
        for fut, _ in stats:
            fut.set_exception(err)

    def _call(
        self, msg: messages.Msg, ref: str, fut: futures.Future | None = None
    ) -> futures.Future:
        if self._closed.is_set():
            raise RolloutError("client is closed", "connection")
        try:
            frame = frames.encode(msg, self._token)
        except frames.FrameError as e:
            raise RolloutError(str(e), "bad_request") from None
        fut = fut if fut is not None else futures.Future()
        self._out.put((frame, ref, fut, isinstance(msg, messages.GetStats)))
        return fut

    def finish(self, request: str) -> None:
        """Ends a round now with the tokens generated so far (e.g. a stop string matched): it
        completes (its future gets a `RoundResult` with `finish_reason="finished"`), so its tokens
        extend the session and its KV blocks are persisted. A finished round is not affected."""
        frame = frames.encode(messages.FinishRound(request=request), self._token)
        self._out.put((frame, "", None, False))

    submit_group = groups.submit_group  # one round per session, the prompt prefilled once

    def abort(
        self,
        requests: str | Sequence[str] = (),
        *,
        sessions: str | Sequence[str] = (),
        all: bool = False,  # noqa: A002 - the natural name
        timeout_s: float = 30.0,
    ) -> list[str]:
        """Ends rounds now with the tokens they have (partial rollouts): those of `requests`
        (a `RoundFuture.request`, or several), of `sessions`, or with `all=True` every round in
        flight or held, any client's. Their futures resolve to `RoundResult`s with
        `finish_reason="abort"`: a round already decoding returns the tokens it generated (and
        its KV is persisted), one not yet there returns none; either way the round's append and
        tokens join its session's context, which can step again. Returns the request ids that
        were ended (unknown or finished ones are ignored)."""
        ref = f"abort:{uuid.uuid4().hex}"
        msg = messages.AbortRounds(
            ref=ref,
            requests=[requests] if isinstance(requests, str) else [str(r) for r in requests],
            sessions=[sessions] if isinstance(sessions, str) else [str(s) for s in sessions],
            all=bool(all),
        )
        return list(self._check(self._call(msg, ref).result(timeout_s)).requests)

    def pause(self, mode: str = "wait", timeout_s: float = 600.0) -> None:
        """Pauses generation: rounds submitted from now on are held (not refused) until
        `resume`. `mode` "wait" returns once the rounds in flight finished; "abort" ends them at
        once (as `abort(all=True)`) and returns when their partial results are out; "keep"
        halts their decoding where it is (their slots and KV stay) and returns at once: an
        `update_params` then lands under them, and they decode on with the new params after
        `resume` (`RoundResult.params_versions` records which params drew which tokens)."""
        ref = f"pause:{uuid.uuid4().hex}"
        self._check(self._call(messages.Pause(ref=ref, mode=mode), ref).result(timeout_s))

    def resume(self, timeout_s: float = 30.0) -> None:
        """Resumes generation after `pause`: the held rounds start, in the order submitted."""
        ref = f"resume:{uuid.uuid4().hex}"
        self._check(self._call(messages.Resume(ref=ref), ref).result(timeout_s))

    def cancel(self, request: str) -> None:
        """Abandons a round: its future fails with kind `cancelled` and its session is free for
        the next round. A round that already finished is not affected."""
        frame = frames.encode(messages.CancelRound(request=request), self._token)
        self._out.put((frame, "", None, False))

    @staticmethod
    def _check(reply: messages.Msg) -> messages.Msg:
        if isinstance(reply, messages.Error):
            raise RolloutError(reply.message, reply.kind)
        return reply

    def open_session(
        self,
        session: str,
        resume: bool = False,
        timeout_s: float = 30.0,
        *,
        priority: int | None = None,
        ttl_s: float | None = None,
        fork_of: str = "",
    ) -> None:
        """Opens a session; an existing one is an error unless `resume=True` (continue it).

        `priority` and `ttl_s` set the retention of its stored blocks under capacity pressure
        (`store.eviction="retention"`): kept while a round runs and `ttl_s` seconds after each
        (-1: `store.retention_ttl_s`), lower priorities evicted first. None: a new session's
        defaults (0, -1); a resumed session keeps what it had. `fork_of`: the session
        starts with that (open, idle) session's context; its stored KV is shared through the
        store, nothing is computed or copied."""
        msg = messages.OpenSession(
            session=check_session(session),
            resume=bool(resume),
            priority=None if priority is None else check_int(priority, "priority", -(2**31), 2**31),
            ttl_s=None if ttl_s is None else check_ttl(ttl_s),
            fork_of=check_session(fork_of) if fork_of else "",
        )
        self._check(self._call(msg, session).result(timeout_s))

    def tool_call(self, session: str, expected_s: float, timeout_s: float = 30.0) -> None:
        """Tells the router that `session`'s last round ended with a tool call expected to take
        `expected_s` seconds: with `scheduler.prefetch` on, a decode engine may read the
        session's stored KV into memory meanwhile (router/prefetch.py). The `tool_call` hint
        sends it (and keeps the session's KV through the gap)."""
        msg = messages.ToolCall(
            session=check_session(session), expected_s=hints.check_seconds(expected_s)
        )
        self._check(self._call(msg, session).result(timeout_s))

    def close_session(self, session: str, release: bool = False, timeout_s: float = 30.0) -> None:
        """Ends a session; `release=True` also deletes its stored KV blocks that no other open
        session uses."""
        msg = messages.CloseSession(session=check_session(session), release=bool(release))
        self._check(self._call(msg, session).result(timeout_s))

    def submit(
        self,
        session: str,
        append: Sequence[int],
        gen: int,
        *,
        sampling: SamplingParams = GREEDY,
        keep: int = -1,
        stop_tokens: Sequence[int] = (),
        on_tokens: Callable[[int, list[int]], None] | None = None,
        priority: int | None = None,
        ttl_s: float | None = None,
        follows: str = "",
    ) -> futures.Future[messages.RoundResult]:
        """One round; the future resolves to a `RoundResult` or raises `RolloutError`. Token
        ids must be ints in [0, 2**31) (numpy integers too); bad input fails the future at once,
        before anything is sent.

        `sampling` is how its tokens are drawn (`model.SamplingParams`; greedy by default).
        `keep >= 0` builds on the first `keep` tokens of the session's context only (-1: all of
        it). The round ends after any of `stop_tokens`, which `sampling.min_tokens` masks until
        the round has that many tokens. `on_tokens(start, tokens)` streams the
        generated tokens from position `start` as they come (on the client's thread: keep it
        short); a retried round streams positions again, with the same tokens. A round whose
        `sampling.logprobs` asks for log-probabilities calls it with a third argument, those
        tokens' `Logprobs`; the result's `logprobs` holds every token's. `priority` and
        `ttl_s` change the session's retention (`open_session`) from this round on. `follows`:
        the request id of a round of the same prompt submitted just before (group sampling:
        `submit_group`); this one forks that round's prompt KV on its decode engine, or runs on
        its own where it cannot."""
        rid = f"{session}#{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        out: RoundFuture = RoundFuture()
        out.request = rid
        try:
            if not isinstance(sampling, SamplingParams):
                raise RolloutError(
                    f"sampling must be a SamplingParams, got {sampling!r}", "bad_request"
                )
            sub = messages.Submit(
                request=rid,
                session=check_session(session),
                append=check_tokens(append),
                gen=check_int(gen, "gen", 1, TOKEN_LIMIT),
                sampling=sampling,
                keep=check_int(keep, "keep", -1, TOKEN_LIMIT),
                stop_tokens=check_tokens(stop_tokens, "stop token"),
                stream=on_tokens is not None,
                priority=None
                if priority is None
                else check_int(priority, "priority", -(2**31), 2**31),
                ttl_s=None if ttl_s is None else check_ttl(ttl_s),
                follows=str(follows),
            )
            if on_tokens is not None:
                self._streams[rid] = on_tokens
            raw = self._call(sub, rid)
        except RolloutError as e:
            self._streams.pop(rid, None)
            out.set_exception(e)
            return out

        def done(f: futures.Future) -> None:
            try:
                out.set_result(self._check(f.result()))
            except BaseException as e:  # noqa: BLE001
                out.set_exception(e)

        raw.add_done_callback(done)
        return out

    def update_params(
        self,
        params: Any,
        version: str | None = None,
        *,
        directory: str | pathlib.Path | None = None,
        via: str | None = None,
        bucket_bytes: int | None = None,
        timeout_s: float = 600.0,
        pause: str = "wait",
    ) -> str:
        """Serves new parameters on every engine; returns the new params version. `pause`: what
        the rounds in flight do meanwhile ("wait": finish on the old params; "abort": end now
        with what they generated, `finish_reason="abort"`; "keep": halt, then decode on with the
        new params over their KV; see `update_params_from_checkpoint`).

        `params` is a `Transformer`, its `nnx.State` or a nested dict (`nnx.to_pure_dict`).
        `via` is how they travel (None: "checkpoint" when a directory is known, `directory` or
        the client's `params_dir`, else "transfer"):
        - "checkpoint": written as an orbax checkpoint to `directory` (default
          `params_dir/<version>`), which every engine must be able to read, then
          `update_params_from_checkpoint` runs; the directory stays as a record, and an engine
          restarted later is caught up from it;
        - "transfer": streamed from this process to every engine process over the transfer
          layer (transfer/params_sync.py): offered in buckets of at most `bucket_bytes`
          (default 256 MiB), each engine pulls, checks (tree, shapes, dtypes, each bucket's
          checksum) and stages them, and every engine commits at once or none does. No disk is
          involved; an engine restarted later cannot be caught up from the offer (it stays out
          of rotation until it restarts with `cluster.params_path` of these params).
        Raises RolloutError if any engine refuses them, fails or dies while pulling them; the
        cluster then keeps serving the old params everywhere.
        """

        from dualpath_jax.wire.params_protocol import check_version

        version = check_version(version or new_version())
        if via is None:
            via = "checkpoint" if directory is not None or self.params_dir else "transfer"
        t0 = time.monotonic()
        if via == "transfer":
            if directory is not None:
                raise RolloutError("via='transfer' writes no directory", "bad_request")
            from dualpath_jax.wire.params_push import stream_params

            return stream_params(self, params, version, bucket_bytes, timeout_s, pause)
        if via != "checkpoint":
            raise RolloutError(
                f"via must be 'checkpoint' or 'transfer', got {via!r}", "bad_request"
            )
        from dualpath_jax.model.checkpoint import save_params_tree
        from dualpath_jax.wire.params_push import tree_nbytes

        if directory is None:
            if self.params_dir is None:
                raise RolloutError(
                    "update_params via='checkpoint' needs a directory (or a Client with "
                    "params_dir)",
                    "bad_request",
                )
            directory = self.params_dir / version
        path = save_params_tree(params, directory)
        t_saved = time.monotonic()
        self.update_params_from_checkpoint(path, version, timeout_s=timeout_s, pause=pause)
        self.last_params_update = {
            "via": "checkpoint",
            "bytes": tree_nbytes(params),
            "prepare_s": t_saved - t0,
            "total_s": time.monotonic() - t0,
        }
        return version

    def update_params_from_checkpoint(
        self,
        path: str | pathlib.Path,
        version: str | None = None,
        *,
        timeout_s: float = 600.0,
        pause: str = "wait",
    ) -> str:
        """Serves the parameters of a checkpoint directory (orbax, as written by
        `model.checkpoint.save_params_tree`/`save_params`, or Hugging Face) as `version` (default:
        a fresh name). The router waits for the rounds already submitted to finish with the old
        params, holds new ones, and answers once every engine loaded and checked the new params;
        from then on block keys use the new version, so no KV of older params is reused. With
        `pause="abort"` the rounds in flight end at once instead, returning what they generated
        (`finish_reason="abort"`; `abort`)."""
        from dualpath_jax.wire.params_protocol import check_version

        version = check_version(version or new_version())
        msg = messages.UpdateParams(
            version=version, path=str(pathlib.Path(path).absolute()), pause=pause
        )
        self._check(self._call(msg, f"params:{version}").result(timeout_s))
        return version

    def stats(self, timeout_s: float = 30.0) -> dict:
        """The router's counters, queues and each live engine's load (`Router.stats`): the
        contract's keys (`Backend.stats`) and the cluster's own (`engines`, `loads`, ...)."""
        reply = self._check(self._call(messages.GetStats(), "__stats__").result(timeout_s))
        return json.loads(reply.json)

    def shutdown(self, timeout_s: float = 30.0) -> None:
        self._check(self._call(messages.Shutdown(), "shutdown").result(timeout_s))

    def close(self) -> None:
        """Stops the client's thread; calls in flight and later ones fail (kind
        `connection`). The cluster keeps serving (`shutdown` stops it)."""
        self._closed.set()
        if self._thread is not threading.current_thread():
            self._thread.join(2)
