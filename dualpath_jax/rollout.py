"""The RL-facing API: sessions of multi-turn trajectories, sync or async, and batch rollout.

    with LocalCluster(cfg, workdir) as cluster:
        session = Session(cluster.client(), "traj-0")
        tokens = session.step(append_tokens, gen_tokens)   # exactly gen_tokens new tokens

`run_trajectories(client, trajectories)` replays many trajectories concurrently (each one's
rounds in order, appendix A.3) with a progress bar. The same API runs over `InProcessEngine`
(one model in this process, no disaggregation) for quick experiments.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import queue
import threading
import uuid
from collections.abc import Iterable, Sequence
from concurrent import futures
from typing import Protocol

from dualpath_jax.engine import messages as M


class RolloutError(RuntimeError):
    """A round was refused or failed; `kind` is bad_request, store, engine, overloaded, ..."""

    def __init__(self, message: str, kind: str = "error"):
        super().__init__(message)
        self.kind = kind


class Backend(Protocol):
    def open_session(self, session: str) -> None: ...
    def submit(self, session: str, append: Sequence[int], gen: int) -> futures.Future[M.Result]: ...
    def close_session(self, session: str) -> None: ...


class Client:
    """Talks to a router. Thread safe: a background thread owns the socket."""

    def __init__(self, address: str, token: str = ""):
        from dualpath_jax.engine.rpc import RpcClient

        self._rpc = RpcClient(address, token)
        self._out: queue.Queue[tuple[M.Msg, str, futures.Future]] = queue.Queue()
        self._pending: dict[str, futures.Future] = {}
        self._stats: list[futures.Future] = []
        self._closed = threading.Event()
        self._ids = itertools.count()
        self._thread = threading.Thread(target=self._loop, name="dualpath-client", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._closed.is_set():
            while True:
                try:
                    msg, ref, fut = self._out.get_nowait()
                except queue.Empty:
                    break
                if isinstance(msg, M.GetStats):
                    self._stats.append(fut)
                else:
                    self._pending[ref] = fut
                self._rpc.send(msg)
            try:
                reply = self._rpc.recv(5)
            except Exception as e:  # noqa: BLE001 - a bad frame fails nothing in flight
                reply = M.Error(ref="", message=str(e))
            if reply is None:
                continue
            if isinstance(reply, M.Stats):
                if self._stats:
                    self._stats.pop(0).set_result(reply)
                continue
            ref = getattr(reply, "request", None) or getattr(reply, "ref", "")
            fut = self._pending.pop(ref, None)
            if fut is not None:
                fut.set_result(reply)
        self._rpc.close()

    def _call(self, msg: M.Msg, ref: str) -> futures.Future:
        if self._closed.is_set():
            raise RolloutError("client is closed")
        fut: futures.Future = futures.Future()
        self._out.put((msg, ref, fut))
        return fut

    @staticmethod
    def _check(reply: M.Msg) -> M.Msg:
        if isinstance(reply, M.Error):
            raise RolloutError(reply.message, reply.kind)
        return reply

    def open_session(self, session: str, timeout_s: float = 30.0) -> None:
        self._check(self._call(M.OpenSession(session=session), session).result(timeout_s))

    def close_session(self, session: str, timeout_s: float = 30.0) -> None:
        self._check(self._call(M.CloseSession(session=session), session).result(timeout_s))

    def submit(self, session: str, append: Sequence[int], gen: int) -> futures.Future[M.Result]:
        """One round; the future resolves to a `Result` or raises `RolloutError`."""
        rid = f"{session}#{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        raw = self._call(M.Submit(request=rid, session=session, append=[int(t) for t in append], gen=int(gen)), rid)
        out: futures.Future[M.Result] = futures.Future()

        def done(f: futures.Future) -> None:
            try:
                out.set_result(self._check(f.result()))
            except BaseException as e:  # noqa: BLE001
                out.set_exception(e)

        raw.add_done_callback(done)
        return out

    def stats(self, timeout_s: float = 30.0) -> dict:
        reply = self._check(self._call(M.GetStats(), "__stats__").result(timeout_s))
        return json.loads(reply.json)

    def shutdown(self, timeout_s: float = 30.0) -> None:
        self._check(self._call(M.Shutdown(), "shutdown").result(timeout_s))

    def close(self) -> None:
        self._closed.set()
        if self._thread is not threading.current_thread():
            self._thread.join(2)


class Session:
    """One trajectory: each `step` appends tokens and generates exactly `gen` tokens."""

    def __init__(self, backend: Backend, session_id: str | None = None):
        self.backend = backend
        self.id = session_id or uuid.uuid4().hex
        backend.open_session(self.id)
        self.results: list[M.Result] = []

    def step_async(self, append: Sequence[int], gen: int) -> futures.Future[M.Result]:
        fut = self.backend.submit(self.id, append, gen)
        fut.add_done_callback(lambda f: f.exception() is None and self.results.append(f.result()))
        return fut

    def step(self, append: Sequence[int], gen: int, timeout_s: float | None = None) -> list[int]:
        return list(self.step_async(append, gen).result(timeout_s).tokens)

    def close(self) -> None:
        self.backend.close_session(self.id)


@dataclasses.dataclass
class TrajectoryOutput:
    id: str
    rounds: list[list[int]]
    results: list[M.Result]
    error: str = ""


def run_trajectories(
    backend: Backend,
    trajectories: Iterable[tuple[str, Sequence[tuple[Sequence[int], int]]]],
    *,
    max_concurrent: int = 0,
    arrivals: Sequence[float] | None = None,
    progress: bool = True,
    timeout_s: float | None = None,
) -> list[TrajectoryOutput]:
    """Replays trajectories `(id, [(append tokens, gen), ...])` concurrently, rounds in order.

    `max_concurrent` bounds how many trajectories run at once (0: all); `arrivals` gives each
    trajectory's start time in seconds after the call (online replay; default: all at once).
    Returns one output per trajectory, in input order; a failed round ends its trajectory with
    `error` set.
    """
    from tqdm.auto import tqdm

    trajs = list(trajectories)
    outputs = [TrajectoryOutput(tid, [], []) for tid, _ in trajs]
    if arrivals is not None and len(arrivals) != len(trajs):
        raise ValueError(f"{len(arrivals)} arrival times for {len(trajs)} trajectories")
    total = sum(len(r) for _, r in trajs)
    bar = tqdm(total=total, desc="rounds", disable=not progress, unit="round")
    lock = threading.Lock()
    limit = threading.Semaphore(max_concurrent or max(1, len(trajs)))
    done_all = threading.Event()
    remaining = [len(trajs)]

    def finish_one() -> None:
        limit.release()
        with lock:
            remaining[0] -= 1
            if remaining[0] == 0:
                done_all.set()

    def advance(k: int, session: Session, i: int) -> None:
        rounds = trajs[k][1]
        if i == len(rounds):
            finish_one()
            return
        append, gen = rounds[i]

        def on_done(f: futures.Future) -> None:
            try:
                res = f.result()
            except Exception as e:  # noqa: BLE001
                outputs[k].error = str(e)
                finish_one()
                return
            outputs[k].rounds.append(list(res.tokens))
            outputs[k].results.append(res)
            with lock:
                bar.update(1)
            advance(k, session, i + 1)

        session.step_async(append, gen).add_done_callback(on_done)

    if not trajs:
        return outputs
    import time

    t0 = time.monotonic()
    for k, (tid, _) in enumerate(trajs):
        if arrivals is not None:
            wait = t0 + arrivals[k] - time.monotonic()
            if wait > 0:
                time.sleep(wait)
        limit.acquire()
        try:
            advance(k, Session(backend, tid), 0)
        except Exception as e:  # noqa: BLE001
            outputs[k].error = str(e)
            finish_one()
    finished = done_all.wait(timeout_s)
    bar.close()
    if not finished:
        for o, (_, rounds) in zip(outputs, trajs):
            if not o.error and len(o.rounds) < len(rounds):
                o.error = f"timed out after {timeout_s} s with {len(o.rounds)} of {len(rounds)} rounds done"
    return outputs


class InProcessEngine:
    """The rollout backend without disaggregation: one model in this process, each session's KV
    kept in host memory between rounds and fed back layer by layer (layerwise prefill).

    For quick experiments and RL loops on one device; `Session` and `run_trajectories` work on it
    unchanged. Rounds run synchronously inside `submit` (the returned future is already done).
    """

    def __init__(self, model, *, max_len: int = 0):
        import numpy as np

        from dualpath_jax.model.runner import ModelRunner

        self.runner = model if isinstance(model, ModelRunner) else ModelRunner(model)
        self.cfg = self.runner.cfg
        self.max_len = max_len or self.cfg.max_seq_len
        self._np = np
        self._sessions: dict[str, tuple[list[int], object]] = {}
        self._lock = threading.Lock()

    def update_params(self, model) -> None:
        """Swaps in new parameters (e.g. after an RL update); cached session KV is dropped
        because it was computed with the old parameters."""
        self.runner.update_params(model)
        with self._lock:
            for sid in self._sessions:
                self._sessions[sid] = ([], None)

    def open_session(self, session: str) -> None:
        with self._lock:
            self._sessions.setdefault(session, ([], None))

    def close_session(self, session: str) -> None:
        with self._lock:
            if self._sessions.pop(session, None) is None:
                raise RolloutError(f"unknown session {session!r}", "bad_request")

    def submit(self, session: str, append: Sequence[int], gen: int) -> futures.Future[M.Result]:
        fut: futures.Future[M.Result] = futures.Future()
        try:
            fut.set_result(self._round(session, [int(t) for t in append], int(gen)))
        except RolloutError as e:
            fut.set_exception(e)
        except ValueError as e:
            fut.set_exception(RolloutError(str(e), "bad_request"))
        return fut

    def _round(self, session: str, append: list[int], gen: int) -> M.Result:
        import time

        from dualpath_jax.model.decode import Decoder, sample
        from dualpath_jax.model.runner import PrefillBatch

        np, cfg = self._np, self.cfg
        with self._lock:
            if session not in self._sessions:
                raise RolloutError(f"unknown session {session!r}", "bad_request")
            context, kv = self._sessions[session]
        if gen <= 0:
            raise RolloutError(f"gen must be > 0, got {gen}", "bad_request")
        if not append:
            raise RolloutError("a round must append at least one token", "bad_request")
        prompt = context + append
        if len(prompt) + gen > self.max_len:
            raise RolloutError(f"context of {len(prompt)} + {gen} tokens exceeds the limit of {self.max_len}", "bad_request")
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
        tok = int(np.asarray(sample(res.last_logits))[0])
        t_first = time.monotonic()
        dec = Decoder(self.runner, slots=1, max_len=len(prompt) + gen + 1)
        dec.insert(0, prompt_kv, len(prompt), tok)
        out, t_second = [tok], t_first
        for k in range(gen - 1):
            tok = int(np.asarray(sample(dec.step()))[0])
            out.append(tok)
            dec.set_next(np.array([tok]))
            if k == 0:
                t_second = time.monotonic()
        kv_after = np.asarray(dec.kv[:, 0, : len(prompt) + gen - 1])
        with self._lock:
            if session in self._sessions:
                self._sessions[session] = (prompt + out, kv_after)
        now = time.monotonic()
        return M.Result(
            request=f"{session}#{len(context)}", tokens=out, ttft_s=t_first - t0,
            ttst_s=t_second - t_first if gen > 1 else 0.0,
            tpot_s=(now - t_first) / (gen - 1) if gen > 1 else 0.0, jct_s=now - t0, queue_s=0.0,
            cached_tokens=cached, prompt_tokens=len(prompt), read_path="none", recomputed_blocks=0,
        )
