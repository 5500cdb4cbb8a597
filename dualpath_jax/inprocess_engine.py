"""`InProcessEngine`: the rollout backend without disaggregation (re-exported by
`dualpath_jax.rollout`, whose `Session` and `run_trajectories` run on it unchanged)."""

from __future__ import annotations

import logging
import pathlib
import threading
from collections.abc import Callable, Sequence
from concurrent import futures
from typing import Any

from dualpath_jax.engine.client import (
    TOKEN_LIMIT,
    RolloutError,
    _check_int,
    check_tokens,
    new_version,
)
from dualpath_jax.model.sampling import GREEDY, SamplingParams, min_tokens_problem
from dualpath_jax.rounds import Logprobs, RoundResult

log = logging.getLogger(__name__)


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
        self.params_version = ""

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
        from dualpath_jax.engine.params import check_version
        from dualpath_jax.model.checkpoint import CheckpointError

        version = check_version(version or new_version())
        try:
            model = load()
        except CheckpointError as e:
            raise RolloutError(f"params {version!r} refused: {e}", "bad_request") from None
        self._swap(model, version)
        return version

    def _swap(self, model, version: str) -> None:
        with self._lock:
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
        """Opens a session (`priority` and `ttl_s` are accepted for the `Backend` interface; the
        in-process engine keeps every session's KV until it is closed); `fork_of`: it starts
        with that session's context and KV."""
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
    ) -> futures.Future[RoundResult]:
        fut: futures.Future[RoundResult] = futures.Future()
        try:
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
            res = self._round(
                session,
                tokens,
                _check_int(gen, "gen", 1, TOKEN_LIMIT),
                sampling,
            )
            fut.set_result(res)
        except RolloutError as e:
            fut.set_exception(e)
        except ValueError as e:
            fut.set_exception(RolloutError(str(e), "bad_request"))
        return fut

    def _round(
        self,
        session: str,
        append: list[int],
        gen: int,
        sampling: SamplingParams,
    ) -> RoundResult:
        import time

        from dualpath_jax.model.decode import Decoder
        from dualpath_jax.model.runner import PrefillBatch
        from dualpath_jax.model.sampler import sample_at

        np, cfg = self._np, self.cfg
        with self._lock:
            if session not in self._sessions:
                raise RolloutError(f"unknown session {session!r}", "bad_request")
            context, kv = self._sessions[session]
        if gen <= 0:
            raise RolloutError(f"gen must be > 0, got {gen}", "bad_request")
        if not append:
            raise RolloutError("a round must append at least one token", "bad_request")
        if sampling.min_tokens > gen:  # no stop tokens here: min_tokens masks nothing
            raise RolloutError(min_tokens_problem(sampling, gen, ()), "bad_request")
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
        lps = Logprobs() if sampling.logprobs is not None else None

        def draw(logits, pos: int) -> int:
            tokens, entries = sample_at(logits, [sampling], [pos], logprobs=True)
            if lps is not None:
                lps.extend(entries[0])
            return int(tokens[0])

        tok = draw(res.last_logits, len(prompt))
        t_first = time.monotonic()
        dec = Decoder(self.runner, slots=1, max_len=len(prompt) + gen + 1)
        dec.insert(0, prompt_kv, len(prompt), tok)
        out, t_second = [tok], t_first
        for k in range(gen - 1):
            pos = len(prompt) + len(out)
            tok = draw(dec.step()[:1], pos)
            out.append(tok)
            dec.set_next(np.array([tok]))
            if k == 0:
                t_second = time.monotonic()
        kv_after = dec.rows(0, 0, len(prompt) + gen - 1)
        with self._lock:
            if session in self._sessions:
                self._sessions[session] = (prompt + out, kv_after)
        return RoundResult.timed(
            f"{session}#{len(context)}",
            out,
            t_submit=t0,
            t_assign=t0,
            t_first=t_first,
            t_second=t_second,
            t_done=time.monotonic(),
            cached_tokens=cached,
            prompt_tokens=len(prompt),
            read_path="none",
            logprobs=lps,
        )
