"""A prefill engine's cost model, fitted on the device it runs on.

At start a PE times a few single-request prefills with its own `ModelRunner`, through the entry
points its real batches take (`PrefillBatch.build`, then `runner.prefill_layerwise` with each
layer's cached KV as `LayerPages.from_rows`, as `PrefillEngine.run_batch` does), and fits
`sched.cost.FittedCostModel` to them: `p0 + p1 * new_tokens + p2 * attention_pairs` seconds per
forward. The PE packs its batches under the compute quota with that model and reports it when
it registers; the router derives beta from its PEs' models. `cluster.prefill_cost_json` pins a
model instead (no calibration), e.g. one `calibrate` fitted earlier:

    runner = ModelRunner(load_served_model(cfg))
    print(calibrate(runner, cfg).model.to_json())

Shapes (`calibration_shapes`): new tokens {`min_bucket`, `n_hi`} x cached tokens {0, `c_hi`},
four forwards of one request that separate the three terms. `n_hi` is the largest length
bucket within `max_new` tokens and half the context, `c_hi` the largest cache of `2**k - 1`
whole blocks (so its pages are not padded) that leaves room for `n_hi`; the context is bounded
by `max_context` and by what a PE can be given: `cluster.prefill_max_tokens`, the batch KV
bound (`cluster.prefill_max_kv_tokens`), the model's `max_seq_len` and `cluster.decode_max_len`
(the router admits no longer context). The caps keep calibration cheap where compute is slow
(one forward of 2,048 new tokens of the tiny models takes over a second on a CPU core); larger
batches are extrapolated by the fitted terms.

Each shape runs once untimed, which compiles it (single-request batches in the engine's own
length buckets and page counts; a persistent compilation cache serves later starts), then
`repeats` times; its sample is the median.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence

import jax
import numpy as np

from dualpath_jax.config import ExperimentConfig
from dualpath_jax.model.cached_kv import LayerPages
from dualpath_jax.model.runner import ModelRunner, PrefillBatch
from dualpath_jax.sched.cost import FittedCostModel
from dualpath_jax.sched.intra import batch_kv_bound
from dualpath_jax.sched.policy import make_policy
from dualpath_jax.wire import messages

log = logging.getLogger(__name__)

MAX_NEW_TOKENS = 256
MAX_CONTEXT = 1024


@dataclasses.dataclass(frozen=True)
class Calibration:
    """A fitted prefill model and what it was fitted to."""

    model: FittedCostModel
    samples: tuple[tuple[int, int, float], ...]  # (cached, new, median seconds) per shape
    seconds: float  # the whole calibration, compiles included

    def message(self) -> messages.PrefillCost:
        return messages.PrefillCost(
            prefill=self.model.prefill,
            calibrated=True,
            calibration_s=self.seconds,
            samples=list(self.samples),
        )


def calibration_shapes(
    cfg: ExperimentConfig,
    min_bucket: int = 16,
    *,
    max_new: int = MAX_NEW_TOKENS,
    max_context: int = MAX_CONTEXT,
) -> tuple[tuple[int, int], ...]:
    """The `(cached, new)` single-request shapes `calibrate` times (see the module docstring)."""
    m, cl, bt = cfg.model, cfg.cluster, cfg.store.block_tokens
    context = min(m.max_seq_len, cl.decode_max_len, max_context)
    kv = batch_kv_bound(
        cl.prefill_max_kv_tokens, m.num_layers, make_policy(cfg.scheduler).layerwise
    )
    if kv:
        context = min(context, kv)
    # At most half the context, so the cached shapes have room for as many cached tokens.
    new_cap = max(1, min(context // 2, max_new, cl.prefill_max_tokens or context))
    lo = min(min_bucket, new_cap)
    hi = lo
    while hi * 2 <= new_cap:
        hi *= 2
    pages = 1
    while bt * (2 * pages + 1) + hi <= context:
        pages = 2 * pages + 1
    cached = bt * pages if bt * pages + hi <= context else 0
    shapes = [(0, lo), (0, hi), (cached, lo), (cached, hi)]
    return tuple(dict.fromkeys(shapes))  # distinct, in order


def time_prefill(
    runner: ModelRunner,
    cached: int,
    new: int,
    block_tokens: int,
    *,
    repeats: int = 3,
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """Median seconds of a one-request layerwise prefill of `new` tokens after `cached` ones
    (after one untimed run that compiles the shape)."""
    cfg = runner.cfg
    tokens = [[t % cfg.vocab_size for t in range(new)]]
    rows = [np.zeros((cached, cfg.kv_width), cfg.kv_dtype)]

    def load_layer(i: int) -> LayerPages:
        return LayerPages.from_rows(
            rows, block_tokens, cfg.kv_width, cfg.kv_dtype, pad_to_table=runner.gathers_pages
        )

    def forward() -> float:
        t0 = clock()
        batch = PrefillBatch.build(cfg, tokens, [cached], runner.min_bucket)
        res = runner.prefill_layerwise(batch, load_layer if cached else None, None)
        jax.block_until_ready(res.last_logits)
        return clock() - t0

    forward()
    return float(np.median([forward() for _ in range(max(1, repeats))]))


def calibrate(
    runner: ModelRunner,
    cfg: ExperimentConfig,
    *,
    shapes: Sequence[tuple[int, int]] | None = None,
    repeats: int = 3,
    clock: Callable[[], float] = time.perf_counter,
) -> Calibration:
    """Times `shapes` (default `calibration_shapes(cfg, runner.min_bucket)`) on `runner`'s
    device and fits the prefill model to them."""
    t0 = clock()
    if shapes is None:
        shapes = calibration_shapes(cfg, runner.min_bucket)
    samples = tuple(
        (c, n, time_prefill(runner, c, n, cfg.store.block_tokens, repeats=repeats, clock=clock))
        for c, n in shapes
    )
    return Calibration(FittedCostModel.fit(samples), samples, clock() - t0)


def prefill_cost(cfg: ExperimentConfig, runner: ModelRunner) -> messages.PrefillCost:
    """The PE's prefill cost model: `cluster.prefill_cost_json` when set, else calibrated."""
    if cfg.cluster.prefill_cost_json:
        model = FittedCostModel.from_json(cfg.cluster.prefill_cost_json)
        log.info("prefill cost model from cluster.prefill_cost_json: %s", _terms(model))
        return messages.PrefillCost(prefill=model.prefill, calibrated=False)
    cal = calibrate(runner, cfg)
    log.info(
        "prefill cost model calibrated in %.2f s: %s; samples (cached, new, ms): %s",
        cal.seconds,
        _terms(cal.model),
        ", ".join(f"({c}, {n}, {s * 1e3:.2f})" for c, n, s in cal.samples),
    )
    return cal.message()


def _terms(model: FittedCostModel) -> str:
    p0, p1, p2 = model.prefill
    return f"{p0 * 1e3:.3g} ms per batch + {p1 * 1e6:.3g} us per new token + {p2 * 1e9:.3g} ns per pair"
