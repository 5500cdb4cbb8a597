"""`RoundResult`: the outcome of one round, one record wherever the round ran.

The router answers a client's `Submit` with it (it is one of the control-plane messages,
`wire.messages`), `rollout.InProcessBackend` returns it, the simulator keeps one per simulated
round (`sim.cluster.SimCluster.results`), and `metrics.summary.summarize` reads any of them. Times
are seconds on the clock of whoever ran the round: the router's (or the in-process backend's)
monotonic clock, or the simulator's virtual clock, which starts at 0.

>>> r = RoundResult.timed("traj-0/r0", [5, 6, 7], t_submit=1.0, t_assign=1.5, t_first=2.0,
...                       t_second=2.25, t_done=3.0, cached_tokens=16, prompt_tokens=40,
...                       read_path="de")
>>> r.ttft_s, r.ttst_s, r.tpot_s, r.jct_s, r.queue_s
(1.0, 0.25, 0.5, 2.0, 0.5)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import msgspec


class Logprobs(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Log-probabilities of a round's generated tokens (`SamplingParams.logprobs`), one entry per
    token, in f32 from the logits that drew it: `sampled` under the distribution it was drawn
    from (temperature and top-p applied; a greedy round's is the model's), `model` under the
    model (its plain log-softmax), and with top-k asked the k most likely tokens under the model
    (`top_ids`, `top`: ids and log-probabilities, most likely first).

    >>> lp = Logprobs()
    >>> lp.append(-0.5, -0.75, [3, 1], [-0.25, -0.75])
    >>> lp.append(-1.0, -1.5)
    >>> lp.head(1)
    Logprobs(sampled=[-0.5], model=[-0.75], top_ids=[[3, 1]], top=[[-0.25, -0.75]])
    """

    sampled: list[float] = []
    model: list[float] = []
    top_ids: list[list[int]] = []
    top: list[list[float]] = []

    def __len__(self) -> int:
        return len(self.sampled)

    def append(
        self,
        sampled: float,
        model: float,
        top_ids: Sequence[int] = (),
        top: Sequence[float] = (),
    ) -> None:
        """One more token's entry (`top_ids`/`top` only when the round asked for top-k)."""
        self.sampled.append(float(sampled))
        self.model.append(float(model))
        if len(top_ids):
            self.top_ids.append([int(t) for t in top_ids])
            self.top.append([float(v) for v in top])

    def extend(self, other: Logprobs) -> None:
        self.sampled += other.sampled
        self.model += other.model
        self.top_ids += other.top_ids
        self.top += other.top

    def head(self, n: int) -> Logprobs:
        """The first `n` tokens' entries (a round cut at a stop string keeps its tokens')."""
        return Logprobs(
            sampled=self.sampled[:n],
            model=self.model[:n],
            top_ids=self.top_ids[:n],
            top=self.top[:n],
        )

    def tail(self, start: int) -> Logprobs:
        """The entries from token `start` on (a stream's newest)."""
        return Logprobs(
            sampled=self.sampled[start:],
            model=self.model[start:],
            top_ids=self.top_ids[start:],
            top=self.top[start:],
        )


class RoundResult(msgspec.Struct, tag=True, kw_only=True, omit_defaults=True):
    """One finished round: its generated tokens and where its time went (seconds).

    `ttft_s`: submit -> first token; `ttst_s`: first -> second token; `tpot_s`: the mean time per
    output token after the first; `jct_s`: submit -> done; `queue_s`: submit -> assigned to
    engines. `cached_tokens` of its `prompt_tokens` came from stored KV (`read_path`: which
    engine's node read them, "pe", "de" or "none"; "fork": a group sample started on its DE
    from the group's first round's prompt pages, all but the prompt's last token cached;
    `recomputed_blocks` of the hit were recomputed instead). `finish_reason`: "length" (all the tokens asked for), "stop" (a stop
    token, its last token), "finished" (`Client.finish`) or "abort" (`Client.abort`, a pause or
    params update with `pause="abort"`: the tokens generated until then, maybe none).
    `persist_error` is non-empty when the DE could not store the round's new blocks (e.g. the
    store is full): the tokens are right; the next round recomputes what was not stored.

    `logprobs`: the tokens' log-probabilities when the round asked for them
    (`SamplingParams.logprobs`), else None. `params_versions`: which params drew which tokens,
    as (index of the first token, params version) spans: one span, unless a params update with
    `pause="keep"` landed while the round decoded (empty where not known: the simulator).

    Optional timings (NaN where not known; fields left at their defaults are not sent):
    `submit_s` is when the round was submitted; `read_s` (assignment -> hit KV read) and
    `prefill_s` (its prefill's forward batches) break the TTFT down, kept here by the simulator
    (the router reports them in its `first_token` events instead).
    """

    request: str
    # The generated tokens. The simulator has no token ids and keeps `range(n)` (never sent).
    tokens: Sequence[int]
    ttft_s: float
    ttst_s: float
    tpot_s: float
    jct_s: float
    queue_s: float
    cached_tokens: int
    prompt_tokens: int
    read_path: str
    recomputed_blocks: int = 0
    finish_reason: str = "length"
    persist_error: str = ""
    logprobs: Logprobs | None = None
    params_versions: list[tuple[int, str]] = []
    submit_s: float = math.nan
    read_s: float = math.nan
    prefill_s: float = math.nan

    @classmethod
    def timed(
        cls,
        request: str,
        tokens: Sequence[int],
        *,
        t_submit: float,
        t_assign: float,
        t_first: float,
        t_second: float,
        t_done: float,
        **fields: Any,
    ) -> RoundResult:
        """The record of a round from the times it reached each point (one clock): submitted,
        assigned, first and second token (NaN: not reached), done. `fields`: the others."""
        g = len(tokens)
        return cls(
            request=request,
            tokens=tokens,
            ttft_s=t_first - t_submit,
            ttst_s=t_second - t_first if g > 1 and not math.isnan(t_second) else 0.0,
            tpot_s=(t_done - t_first) / (g - 1) if g > 1 else 0.0,
            jct_s=t_done - t_submit,
            queue_s=t_assign - t_submit,
            submit_s=t_submit,
            **fields,
        )
