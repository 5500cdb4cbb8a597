"""Compiling an engine's shapes before it registers (`cluster.warmup`).

Every distinct shape an engine runs compiles once, on first use: without a warm-up the first
requests of a server wait for the compiles of their shapes (tens of seconds on a CPU), and so
does any later request whose batch size or length falls in a bucket not seen yet. With
`cluster.warmup` an engine runs each shape bucket its config can produce through the entry
points its real work takes, before it registers, so the router sends it nothing until it is
warm and the serving path compiles nothing (tests/integration/test_warmup.py counts the programs of
a mixed trace after start-up).

The buckets (what `PrefillEngine.run_batch` and the decoder pad to):

- prefill: batch sizes padded to powers of two up to `cluster.prefill_max_batch`
  (`batch_bucket`), new tokens padded by `runner.bucket_len` up to `cluster.prefill_max_tokens`,
  cached context in page tables of a power of two of pages up to the context
  (`cluster.decode_max_len` and the model's `max_seq_len`), each combination a context can hold.
  Each runs through `prefill_forward.forward` (layerwise or not, as the policy prefills) over
  host rows, with the new rows turned into what the PE sends its DE, and its first tokens
  sampled greedily and with a temperature; hit blocks pulled from a DE (the DE read path) are
  placed as `DevicePages` of every power of two of blocks a table holds. The layers are
  compiled ahead of time, not run (`ModelRunner.compile_only`: zeros stand for their outputs),
  so a restart from the compilation cache costs the tracing and loading, not the forwards.
- decode: `Decoder.warmup` (each table width a step passes, each page count a write takes).

`jax.monitoring` counts the backend compiles (`CompileCounter`), so an engine logs how many
programs its warm-up compiled and how many came from the persistent compilation cache
(`enable_compilation_cache`: `cluster.compilation_cache_dir`, by default the workdir's
`jax_cache/`), which makes a restart several times faster to ready than a cold start
(bench/cold_start.py). After a warm-up the engine turns on `jax_log_compiles`: a program
compiled while serving (a shape the warm-up missed, a stall for its compile time) is logged as
a warning with its name and shapes.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pathlib
import threading
import time

import numpy as np

from dualpath_jax.config import ExperimentConfig

log = logging.getLogger(__name__)

BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
CACHE_HIT = "/jax/compilation_cache/cache_hits"


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


class CompileCounter:
    """Counts the programs this process compiled or loaded from the persistent compilation
    cache since the counter was made, through `jax.monitoring` (every jitted function, not
    only the model's; JAX reports a backend compile event for a cache load too)."""

    _lock = threading.Lock()
    _programs = 0
    _hits = 0
    _installed = False

    def __init__(self) -> None:
        CompileCounter._install()
        self._p0, self._h0 = CompileCounter._programs, CompileCounter._hits

    @classmethod
    def _install(cls) -> None:
        with cls._lock:
            if cls._installed:
                return
            import jax.monitoring

            def on_duration(event: str, duration: float, **kw) -> None:  # noqa: ARG001
                if event == BACKEND_COMPILE:
                    with cls._lock:
                        cls._programs += 1

            def on_event(event: str, **kw) -> None:  # noqa: ARG001
                if event == CACHE_HIT:
                    with cls._lock:
                        cls._hits += 1

            jax.monitoring.register_event_duration_secs_listener(on_duration)
            jax.monitoring.register_event_listener(on_event)
            cls._installed = True

    @property
    def programs(self) -> int:
        """Programs compiled or loaded from the persistent cache (neither: none was new)."""
        return CompileCounter._programs - self._p0

    @property
    def cache_hits(self) -> int:
        """Of `programs`, those loaded from the persistent compilation cache."""
        return CompileCounter._hits - self._h0


def enable_compilation_cache(cfg: ExperimentConfig, workdir: str | os.PathLike) -> str:
    """Turns on JAX's persistent compilation cache for this process, every compile cached
    (JAX's default keeps only those over a second): `cluster.compilation_cache_dir`, else the
    directory `JAX_COMPILATION_CACHE_DIR` names, else `workdir/jax_cache`. Returns it."""
    import jax

    # JAX reads JAX_COMPILATION_CACHE_DIR into its config at import
    where = cfg.cluster.compilation_cache_dir or jax.config.jax_compilation_cache_dir or ""
    where = where or str(pathlib.Path(workdir) / "jax_cache")
    pathlib.Path(where).mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", where)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return where


@dataclasses.dataclass(frozen=True)
class Warmup:
    """What a warm-up ran: shapes, new programs (compiled or loaded from the persistent
    compilation cache), of which cache loads, seconds."""

    shapes: int
    programs: int
    cache_hits: int
    seconds: float

    def describe(self) -> str:
        return (
            f"{self.shapes} shapes in {self.seconds:.1f} s: {self.programs - self.cache_hits}"
            f" programs compiled, {self.cache_hits} loaded from the compilation cache"
        )


def context_limit(cfg: ExperimentConfig) -> int:
    """Tokens (cached + new) of the longest request the router admits."""
    return min(cfg.model.max_seq_len, cfg.cluster.decode_max_len)


def prefill_shapes(
    cfg: ExperimentConfig, min_bucket: int = 16, pack: bool = True
) -> list[tuple[int, int, int, int]]:
    """The `(batch, new_tokens, cached_tokens, fill)` forwards that reach every prefill shape
    bucket of `cfg`: per batch bucket, per new-token bucket, per page-table width (0: nothing
    cached), the shortest request of that bucket, when a context holds it; the batch's other
    requests have `fill` new tokens each and nothing cached (the longest request sets the
    padded shapes), one `fill` per packed length such a batch can have (`pack`: the runner
    packs, model/packing.py) and one for the padded layout where it can stay padded."""
    from dualpath_jax.model.runner import batch_buckets, bucket_len
    from dualpath_jax.sched.intra import batch_kv_bound
    from dualpath_jax.sched.policy import make_policy

    c, bt = cfg.cluster, cfg.store.block_tokens
    context = context_limit(cfg)
    max_new = min(c.prefill_max_tokens, context)
    news: dict[int, int] = {}  # bucket -> its shortest length
    for n in range(1, max_new + 1):
        news.setdefault(bucket_len(n, min_bucket), n)
    caches = {0: 0}  # table width (pages) -> the shortest cached length reaching it
    for pages in range(1, -(-(context - 1) // bt) + 1):
        caches.setdefault(_pow2(pages), (pages - 1) * bt + 1)
    # what one forward may hold at once (`PrefillEngine.max_kv_tokens`; 0: unbounded)
    layerwise = make_policy(cfg.scheduler).layerwise
    kv_bound = batch_kv_bound(c.prefill_max_kv_tokens, cfg.model.num_layers, layerwise)
    out = []
    for b in batch_buckets(c.prefill_max_batch):
        for n in news.values():
            fills = _fills(b, n, c.prefill_max_tokens, min_bucket) if pack else [1]
            for cached in caches.values():
                if cached + n > context or (kv_bound and cached + n > kv_bound):
                    continue
                out += [(b, n, cached, fill) for fill in fills]
    return out


def _fills(b: int, n: int, max_tokens: int, min_bucket: int) -> list[int]:
    """The new tokens of each other request of a batch of `b` with a request of `n` that give
    each packed length (`model.batch.packed_length`) and the padded layout such a batch can
    have: the others hold up to `n`'s bucket, and all of them up to the packer's bound plus
    the one-token requests a warmed-up engine pads its batch with."""
    from dualpath_jax.model.batch import bucket_len, packed_length

    n_pad, got = bucket_len(n, min_bucket), {}
    for fill in range(1, n_pad + 1):
        total = n + (b - 1) * fill
        if got and total > max_tokens + b - 1:
            break
        got.setdefault(packed_length(total, b, n_pad, min_bucket), fill)
    return sorted(got.values())


def warm_prefill(cfg: ExperimentConfig, runner, buffer=None) -> Warmup:
    """Runs every `prefill_shapes` forward as `PrefillEngine.run_batch` would, then the page
    placements of hits that arrive on the device and of earlier chunks' rows, and the PE
    buffer's copies to the device (`buffer`, its `HostBufferPool`); changes nothing the engine
    serves with. See the module docstring."""
    import jax

    from dualpath_jax.engines.prefill_forward import forward
    from dualpath_jax.model.cached_kv import LayerPages
    from dualpath_jax.model.runner import PrefillBatch
    from dualpath_jax.model.sampler import sample_at
    from dualpath_jax.model.sampling_params import GREEDY, SamplingParams
    from dualpath_jax.sched.policy import make_policy
    from dualpath_jax.transfer.prefill_load import _row_bytes

    m, bt = cfg.model, cfg.store.block_tokens
    layerwise = make_policy(cfg.scheduler).layerwise
    counter, t0 = CompileCounter(), time.perf_counter()
    shapes = prefill_shapes(cfg, runner.min_bucket, runner.pack)
    rng = np.random.default_rng(0)
    no_rows = np.zeros((0, m.kv_width), m.kv_dtype)
    sampled = SamplingParams(temperature=1.0, seed=1)
    widths = {0}
    for b, n, cached, fill in shapes:
        prompts = [rng.integers(0, m.vocab_size, n).tolist()] + [[1] * fill] * (b - 1)
        batch = PrefillBatch.build(m, prompts, [cached] + [0] * (b - 1), runner.min_bucket)
        rows = np.zeros((cached, m.kv_width), m.kv_dtype)

        def load_layer(i: int, rows=rows, b=b) -> LayerPages:  # noqa: ARG001
            return LayerPages.assemble(
                [[rows]] + [[no_rows]] * (b - 1),
                bt,
                m.kv_width,
                m.kv_dtype,
                placement=runner.kv_placement,
                pad_to_table=runner.gathers_pages,
            )

        def emit_layer(i: int, out) -> None:  # noqa: ARG001
            if runner.mesh is None:  # what `PrefillLoad` offers the DE (one array per layer)
                _row_bytes(out, 0)

        with runner.compile_only():  # the layers compiled, not run: zeros come out
            res = forward(runner, m.num_layers, batch, layerwise, load_layer, emit_layer)
        logits = np.asarray(jax.device_get(res.last_logits))
        sample_at(logits, [GREEDY] * b, [n] * b)
        sample_at(logits, [sampled] * b, [n] * b)
        widths.add(_pow2(-(-cached // bt)) if cached else 0)
    if runner.mesh is None:
        _warm_placements(cfg, runner, max(widths))
    if buffer is not None:
        warm_buffer(cfg, buffer)
    jax.effects_barrier()
    return Warmup(len(shapes), counter.programs, counter.cache_hits, time.perf_counter() - t0)


def _warm_placements(cfg: ExperimentConfig, runner, max_width: int) -> None:
    """`LayerPages.assemble`'s device programs at every page count a batch may have (a power
    of two up to the largest table of the largest batch): hit blocks pulled from a DE
    (`DevicePages`, padded to a power of two of blocks, bitcast from the bytes that arrived)
    and an earlier chunk's rows kept on the device (`DeviceRowRun`, one per forward shape)."""
    import jax

    from dualpath_jax.model.cached_kv import _row_of, _scatter_rows, bytes_to_pages, scatter_pages
    from dualpath_jax.model.layout import BlockLayout
    from dualpath_jax.model.runner import batch_buckets, bucket_len

    m, c, bt = cfg.model, cfg.cluster, cfg.store.block_tokens
    row_bytes = BlockLayout.for_model(m, bt).bytes_per_token_per_layer
    home = runner.kv_placement((1, 1, bt, m.kv_width))
    largest = _pow2(c.prefill_max_batch * max_width + 2)
    news = sorted({bucket_len(n, runner.min_bucket) for n in range(1, c.prefill_max_tokens + 1)})
    blocks = [1 << k for k in range(max_width.bit_length())]  # 1 .. max_width
    for n in blocks:
        data = jax.device_put(np.zeros((n, bt, row_bytes), np.uint8), home)
        bytes_to_pages(data, bt, m.kv_width, m.kv_dtype)
    for b in batch_buckets(c.prefill_max_batch):  # a request's rows out of a batch's
        for n_pad in news:
            _row_of(jax.device_put(np.zeros((b, n_pad, m.kv_width), m.kv_dtype), home), 0)
    total = 4
    while total <= largest:
        for n in blocks:
            if n + 2 > total:
                break
            pages = jax.device_put(np.zeros((total, 1, bt, m.kv_width), m.kv_dtype), home)
            dev = jax.device_put(np.zeros((n, bt, m.kv_width), m.kv_dtype), home)
            scatter_pages(pages, jax.device_put(np.zeros((n,), np.int32)), dev)
        for n_pad in news:
            pages = jax.device_put(np.zeros((total, 1, bt, m.kv_width), m.kv_dtype), home)
            rows = jax.device_put(np.zeros((n_pad, m.kv_width), m.kv_dtype), home)
            ids = jax.device_put(np.zeros((n_pad,), np.int32))
            _scatter_rows(pages, ids, ids, rows)
        jax.numpy.zeros((total, 1, bt, m.kv_width), m.kv_dtype, device=home)
        total *= 2


def warm_buffer(cfg: ExperimentConfig, buffer) -> None:
    """A pinned host buffer's copies of a layer of `n` blocks to the device
    (`BufferReservation.layer_pages`), `n` every power of two up to a context's blocks."""
    if buffer.pinned is None:
        return
    from dualpath_jax.kvstore.buffers import _slab_layer_to_device

    most = -(-context_limit(cfg) // cfg.store.block_tokens)
    n = 1
    while n <= _pow2(most):
        _slab_layer_to_device(buffer.pinned, np.zeros((n,), np.int32), np.int32(0))
        n *= 2


def warm_decoder(cfg: ExperimentConfig, decoder, buffer=None) -> Warmup:
    """`Decoder.warmup` (every step width and page write) and the DE buffer's copies to the
    device (the DE read path offers a hit's layers from there), counted."""
    counter, t0 = CompileCounter(), time.perf_counter()
    shapes = decoder.warmup(cfg.cluster.decode_steps)
    if buffer is not None:
        warm_buffer(cfg, buffer)
    return Warmup(shapes, counter.programs, counter.cache_hits, time.perf_counter() - t0)
