"""Per-layer entry points and layerwise prefill.

`ModelRunner` splits a `Transformer` into static graph definitions and parameter pytrees and runs
it through a few jitted functions: embed, one layer (compiled once per layer kind and length
bucket, shared by every layer of that kind), the head, and a monolithic all-layers forward.

Layerwise prefill (paper section 5.1): for a batch of requests, each with `cached` tokens whose
per-layer KV rows come from the host and `new` tokens to compute, layer i's cached KV is taken
only when layer i runs and layer i's new KV is handed out right after it runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import weakref
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from dualpath_jax import copies
from dualpath_jax.config import ModelConfig
from dualpath_jax.model import sharding
from dualpath_jax.model.cached_kv import CachedPages, LayerPages, grow_pages, pow2, scatter_pages
from dualpath_jax.model.layers import PagedKV, resolve_attention_impl
from dualpath_jax.model.transformer import Transformer, shard_model

Array = jax.Array


def bucket_len(n: int, minimum: int = 16, step: int = 1024) -> int:
    """Padded length for `n` tokens: powers of two from `minimum` up to `step`, then multiples of
    `step`. Every distinct shape compiles once, so lengths are padded to these buckets."""
    if n <= 0:
        return 0
    b = minimum
    while b < n and b < step:
        b *= 2
    if b >= n:
        return b
    return -(-n // step) * step


def batch_bucket(n: int, max_batch: int) -> int:
    """Requests a prefill batch of `n` is padded to: a power of two, at most `max_batch`."""
    return min(pow2(n), max(max_batch, n))


def batch_buckets(max_batch: int) -> list[int]:
    return sorted({batch_bucket(n, max_batch) for n in range(1, max_batch + 1)})


def validate_tokens(cfg: ModelConfig, tokens: np.ndarray, what: str = "tokens") -> None:
    tokens = np.asarray(tokens)
    if tokens.size and (tokens.min() < 0 or tokens.max() >= cfg.vocab_size):
        bad = tokens[(tokens < 0) | (tokens >= cfg.vocab_size)][0]
        raise ValueError(f"{what}: token id {int(bad)} is out of range [0, {cfg.vocab_size})")


def validate_context(cfg: ModelConfig, total: int) -> None:
    if total > cfg.max_seq_len:
        raise ValueError(
            f"context of {total} tokens exceeds the model's max_seq_len {cfg.max_seq_len}"
        )


@dataclasses.dataclass(frozen=True)
class PrefillBatch:
    """A padded prefill batch.

    tokens `[B, N_pad]` int32 (the new tokens of each request, zero padded), new_lens `[B]`,
    cached_lens `[B]`; `c_pad` is the padded cached length of the KV rows each layer receives.
    """

    tokens: np.ndarray
    new_lens: np.ndarray
    cached_lens: np.ndarray
    c_pad: int

    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    @property
    def n_pad(self) -> int:
        return self.tokens.shape[1]

    @classmethod
    def build(
        cls,
        cfg: ModelConfig,
        new_tokens: Sequence[Sequence[int]],
        cached_lens: Sequence[int],
        min_bucket: int = 16,
    ) -> PrefillBatch:
        """Pads requests (new token ids, cached length) into one batch, validating them."""
        if len(new_tokens) != len(cached_lens) or not new_tokens:
            raise ValueError("a prefill batch needs one cached length per request and >= 1 request")
        new_lens = np.array([len(t) for t in new_tokens], np.int32)
        cached = np.array(cached_lens, np.int32)
        if (new_lens < 1).any():
            raise ValueError("every request in a prefill batch needs at least one new token")
        if (cached < 0).any():
            raise ValueError("cached lengths must be >= 0")
        for t, c in zip(new_tokens, cached):
            validate_tokens(cfg, np.asarray(t))
            validate_context(cfg, int(c) + len(t))
        n_pad = bucket_len(int(new_lens.max()), min_bucket)
        tokens = np.zeros((len(new_tokens), n_pad), np.int32)
        for b, t in enumerate(new_tokens):
            tokens[b, : len(t)] = t
        c_max = int(cached.max())
        c_pad = bucket_len(c_max, min_bucket) if c_max else 0
        return cls(tokens, new_lens, cached, c_pad)

    def positions(self) -> np.ndarray:
        return self.cached_lens[:, None] + np.arange(self.n_pad, dtype=np.int32)[None, :]


@dataclasses.dataclass
class PrefillResult:
    """last_logits `[B, V]` (each request's last new token); logits `[B, N_pad, V]` if asked."""

    last_logits: Array
    logits: Array | None = None


# ----------------------------------------------------------------------------- jitted pieces


def _zero_outputs(compiled):
    """Zeros where `compiled`'s outputs would be, placed as they would be (no program runs:
    host zeros put on the devices)."""
    return jax.tree.map(
        lambda s: jax.device_put(np.zeros(s.shape, s.dtype), s.sharding), compiled.out_info
    )


@functools.partial(jax.jit, static_argnums=0)
def _embed(gd, state, tokens):
    return nnx.merge(gd, state)(tokens)


@functools.partial(jax.jit, static_argnums=0)
def _layer(gd, state, h, positions, cached_rows, cached_lens, new_lens):
    return nnx.merge(gd, state)(h, positions, cached_rows, cached_lens, new_lens)


@functools.partial(jax.jit, static_argnums=0)
def _layer_paged(gd, state, h, positions, pages, table, cached_lens, new_lens):
    """One layer over cached KV in pages `[P, 1, page_size, W]` (see `PagedKV`)."""
    return nnx.merge(gd, state)(h, positions, PagedKV(pages, table, cached_lens, new_lens=new_lens))


@functools.partial(jax.jit, static_argnums=(0, 5))
def _head(gd, state, embedding, h, new_lens, all_logits):
    head = nnx.merge(gd, state)
    last = h[jnp.arange(h.shape[0]), new_lens - 1]
    return head(last, embedding), (head(h, embedding) if all_logits else None)


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 9))
def _forward_all(
    embed_gd,
    layer_gds,
    head_gd,
    params,
    tokens,
    positions,
    cached_kv,
    cached_lens,
    new_lens,
    all_logits,
):
    """Monolithic prefill: every layer in one compiled function. cached_kv `[L, B, C, W]`."""
    embed_state, layer_states, head_state = params
    embed = nnx.merge(embed_gd, embed_state)
    h = embed(tokens)
    new = []
    for i, gd in enumerate(layer_gds):
        h, rows = nnx.merge(gd, layer_states[i])(h, positions, cached_kv[i], cached_lens, new_lens)
        new.append(rows)
    head = nnx.merge(head_gd, head_state)
    emb = embed.embedding[...]
    last = h[jnp.arange(h.shape[0]), new_lens - 1]
    return head(last, emb), (head(h, emb) if all_logits else None), jnp.stack(new)


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4))
def _prefill_program(
    embed_gd,
    runs,
    head_gd,
    treedef,
    all_logits,
    leaves,
    tokens,
    positions,
    pages,
    table,
    cached_lens,
    new_lens,
):
    """Prefill as one program: embed, each run of layers under a scan, head. `pages` holds the
    cached KV of every layer, layer-major, `[L, P, page_size, W]` (page 0 the null page), with
    one `table` `[B, M]` for all layers. Each iteration takes its layer's pages and moves them to
    device memory (`jax.device_put` to `jax.memory.Space.Device`: a no-op for pages already on
    the device; for pages in `pinned_host` memory, a host-to-device copy inside the program, which
    XLA may overlap with the previous layer's compute and which keeps about one layer of cached
    KV in device memory). Returns (last logits, logits or None, new rows `[L, B, N, W]`)."""
    embed_state, stacked, head_state = jax.tree.unflatten(treedef, leaves)
    embed = nnx.merge(embed_gd, embed_state)
    h = embed(tokens)
    new = []
    for (gd, start, count), states in zip(runs, stacked):

        def body(h, xs, gd=gd):
            state, layer_pages = xs
            kv = jax.device_put(layer_pages, jax.memory.Space.Device)[:, None]
            kv = PagedKV(kv, table, cached_lens, new_lens=new_lens)
            return nnx.merge(gd, state)(h, positions, kv)

        h, rows = jax.lax.scan(body, h, (states, pages[start : start + count]))
        new.append(rows)
    head = nnx.merge(head_gd, head_state)
    emb = embed.embedding[...]
    last = h[jnp.arange(h.shape[0]), new_lens - 1]
    rows = new[0] if len(new) == 1 else jnp.concatenate(new)
    return head(last, emb), (head(h, emb) if all_logits else None), rows


def runs_on_mesh(method):
    """Runs a `ModelRunner` method under the runner's mesh (`ModelRunner.on_mesh`)."""

    @functools.wraps(method)
    def run(self, *args, **kwargs):
        if self.mesh is None:
            return method(self, *args, **kwargs)
        with jax.set_mesh(self.mesh):
            return method(self, *args, **kwargs)

    return run


def _stacked_sharding(x, layer_leaf):
    """A stacked run's leaf placed with its layers' spec under the leading layer axis."""
    s = getattr(layer_leaf, "sharding", None)
    if not isinstance(s, jax.sharding.NamedSharding):
        return x
    return sharding.place(x, jax.sharding.NamedSharding(s.mesh, P(None, *s.spec)))


def _stack(*xs):
    """Stacks arrays on a new leading axis (abstract ones too: `nnx.eval_shape` models)."""
    if isinstance(xs[0], jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct((len(xs), *xs[0].shape), xs[0].dtype)
    return jnp.stack(xs)


class ModelRunner:
    """A model split into static graphdefs + parameter pytrees, run through jitted entry points.

    `update_params(model)` swaps in new parameters (RL updates) without recompiling.
    """

    def __init__(self, model: Transformer, min_bucket: int = 16, *, mesh: Mesh | None = None):
        self.cfg: ModelConfig = model.cfg
        self.min_bucket = min_bucket
        self._compile_only = False  # `compile_only`
        # The mesh the parameters live on (given, or found on them; None: one device). Every
        # entry point traces under it (`jax.set_mesh`), so the model's `sharding.constrain`
        # calls pin activations and the KV to their shardings.
        self.mesh = sharding.check_mesh(mesh) if mesh is not None else None
        if self.mesh is None:
            self.mesh = sharding.model_mesh(nnx.state(model))
        self.embed_gd, _ = nnx.split(model.embed)
        self.head_gd, _ = nnx.split(model.head)
        self.layer_gds = tuple(nnx.split(layer)[0] for layer in model.layers)
        self._device_sharding: jax.sharding.Sharding | None = None  # `commit`'s, found lazily
        self.update_params(model)

    def update_params(self, model: Transformer) -> None:
        if model.cfg != self.cfg:
            raise ValueError("update_params: the new model has a different config")
        if self.mesh is not None:
            model = shard_model(model, self.mesh)
        self.embed_state = nnx.state(model.embed)
        self.head_state = nnx.state(model.head)
        self.layer_states = [nnx.state(layer) for layer in model.layers]
        self._stacked = None  # stacked_params, rebuilt for the new parameters
        self._device_sharding = None  # `commit`'s device, found again
        self._stacked_leaves = None

    @property
    def layer_runs(self) -> tuple[tuple[nnx.GraphDef, int, int], ...]:
        """Consecutive layers of one kind: `(graphdef, first layer, count)` per run (Qwen2: one
        run; DeepSeek: the dense layers, then the MoE layers)."""
        runs: list[list] = []
        for i, gd in enumerate(self.layer_gds):
            if runs and runs[-1][0] == gd:
                runs[-1][2] += 1
            else:
                runs.append([gd, i, 1])
        return tuple((gd, start, n) for gd, start, n in runs)

    @property
    def stacked_params(self):
        """`(embed, (stacked layer states per run), head)`: each run's layer parameters stacked
        on a leading axis, for a scan over layers (built once per parameter version; a second
        copy of the layer weights)."""
        if self._stacked is None:
            stacked = tuple(
                jax.tree.map(_stack, *self.layer_states[start : start + n])
                for _, start, n in self.layer_runs
            )
            if self.mesh is not None:  # each layer's split, under the new leading axis
                stacked = tuple(
                    jax.tree.map(_stacked_sharding, run, self.layer_states[start])
                    for run, (_, start, _) in zip(stacked, self.layer_runs)
                )
            self._stacked = (self.embed_state, stacked, self.head_state)
        return self._stacked

    @property
    def stacked_leaves(self) -> tuple[jax.tree_util.PyTreeDef, list[Array]]:
        """`stacked_params` flattened once: (treedef, leaves). A jitted function that takes the
        leaves dispatches without the parameter containers' Python flatten."""
        if self._stacked_leaves is None:
            leaves, treedef = jax.tree.flatten(self.stacked_params)
            self._stacked_leaves = (treedef, leaves)
        return self._stacked_leaves

    def on_mesh(self) -> contextlib.AbstractContextManager:
        """The context every entry point runs under: the runner's mesh set (`jax.set_mesh`),
        or nothing on one device."""
        return jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext()

    def pages_sharding(self, shape: Sequence[int]) -> jax.sharding.NamedSharding | None:
        """Where KV pages `[..., W]` of a sharded runner live (`sharding.kv_pages_sharding`);
        None on one device."""
        if self.mesh is None:
            return None
        return sharding.kv_pages_sharding(self.cfg, self.mesh, shape)

    def kv_placement(self, shape: Sequence[int]) -> jax.sharding.Sharding:
        """Where a prefill batch's KV pages `[..., W]` are built (`LayerPages.assemble`): split
        by KV head over a sharded runner's mesh (`pages_sharding`), else committed to the
        runner's one device, as `commit` places the layers' inputs (one compiled program per
        shape, not one per placement)."""
        at = self.pages_sharding(shape)
        if at is not None:
            return at
        self.commit(np.zeros((), np.int32))  # finds the device
        return self._device_sharding

    def commit(self, x):
        """`x` committed to the runner's one device (zero-copy for an array already there);
        unchanged on a mesh, where placements are explicit. A layer's compiled program is
        cached per argument placement: a batch whose pages come from a device program (a pinned
        buffer, the compute network) gives committed layer outputs, and layer 0's hidden state
        from uncommitted inputs would trace, lower and compile every layer shape twice."""
        if self.mesh is not None:
            return x
        if self._device_sharding is None:  # where the parameters are (host ones: the default)
            emb = self.embedding
            (device,) = emb.devices() if isinstance(emb, jax.Array) else jax.devices()[:1]
            self._device_sharding = jax.sharding.SingleDeviceSharding(device)
        return jax.device_put(x, self._device_sharding)

    @property
    def one_program_prefill(self) -> bool:
        """Whether a prefill with all its KV up front (Basic) runs as one program
        (`prefill_program`): on an accelerator, where the program copies each layer's pinned
        host pages to the device while earlier layers compute. Not on CPU, where host and device
        memory are one and the whole model's program costs several times a layer's to trace,
        lower and compile (each new batch shape in each engine process)."""
        return jax.default_backend() != "cpu"

    @property
    def gathers_pages(self) -> bool:
        """Whether attention gathers a batch's cached pages into dense rows (every backend but
        the paged kernel): callers building `LayerPages` for it pass `pad_to_table=True`."""
        return resolve_attention_impl(self.cfg.attention_impl) != "pallas"

    @property
    def num_layers(self) -> int:
        return self.cfg.num_layers

    @property
    def params(self):
        return (self.embed_state, tuple(self.layer_states), self.head_state)

    @property
    def embedding(self) -> Array:
        return self.embed_state["embedding"][...]

    # Per-layer entry points ------------------------------------------------------------------

    @runs_on_mesh
    def embed(self, tokens: Array) -> Array:
        """tokens `[B, N]` -> hidden `[B, N, hidden]`."""
        return _embed(self.embed_gd, self.embed_state, tokens)

    @runs_on_mesh
    def layer(
        self,
        i: int,
        h: Array,
        positions: Array,
        cached_rows: Array,
        cached_lens: Array,
        new_lens: Array | None = None,
    ):
        """Runs layer i: h `[B, N, hidden]`, cached KV rows `[B, C, W]` (or `LayerPages`), the
        real new tokens per request (default all N) -> (h, new rows `[B, N, W]`)."""
        gd, state = self.layer_gds[i], self.layer_states[i]
        if new_lens is None:
            new_lens = self.commit(np.full((h.shape[0],), h.shape[1], np.int32))
        if isinstance(cached_rows, LayerPages):
            fn = _layer_paged
            pages, table = cached_rows.pages, cached_rows.table
            args = (gd, state, h, positions, pages, table, cached_lens, new_lens)
        else:
            fn, args = _layer, (gd, state, h, positions, cached_rows, cached_lens, new_lens)
        if self._compile_only:
            return _zero_outputs(fn.lower(*args).compile())
        return fn(*args)

    @contextlib.contextmanager
    def compile_only(self):
        """Within it `layer` and `prefill_program` compile their program for their arguments
        ahead of time (JAX reuses that executable when a call of the same shapes comes) and
        return zeros shaped as their outputs instead of running it: a warm-up reaches every
        forward shape without the forwards' compute (engine/warmup.py). Everything else runs
        as usual."""
        self._compile_only = True
        try:
            yield self
        finally:
            self._compile_only = False

    @runs_on_mesh
    def head(self, h: Array, new_lens: Array, all_logits: bool = False):
        return _head(self.head_gd, self.head_state, self.embedding, h, new_lens, all_logits)

    # Prefill ---------------------------------------------------------------------------------

    def check_layer_kv(self, i: int, rows, batch: PrefillBatch) -> None:
        want = (batch.batch_size, batch.c_pad, self.cfg.kv_width)
        if tuple(rows.shape) != want:
            raise ValueError(
                f"layer {i}: cached KV rows have shape {tuple(rows.shape)}, expected {want}"
            )

    @runs_on_mesh
    def prefill_layerwise(
        self,
        batch: PrefillBatch,
        load_layer: Callable[[int], np.ndarray | Array] | None,
        emit_layer: Callable[[int, Array], None] | None = None,
        all_logits: bool = False,
    ) -> PrefillResult:
        """Layerwise prefill.

        `load_layer(i)` returns layer i's cached KV: rows `[B, c_pad, W]` (host or device array)
        or `LayerPages` (each request's cached tokens in its own pages, not padded to the
        longest); it is called only when layer i-1 has been dispatched, so it may block until
        that layer's KV has arrived. `emit_layer(i, rows)` receives layer i's new KV rows
        `[B, N_pad, W]` as soon as layer i is dispatched.
        """
        cfg = self.cfg
        kv_dtype = jnp.dtype(cfg.kv_dtype)
        empty = self.commit(jnp.zeros((batch.batch_size, 0, cfg.kv_width), kv_dtype))

        def fetch(i: int):
            if batch.c_pad == 0 or load_layer is None:
                return empty
            rows = load_layer(i)
            if isinstance(rows, LayerPages):
                if rows.table.shape[0] != batch.batch_size:
                    raise ValueError(
                        f"layer {i}: a page table of {rows.table.shape[0]} rows for a batch of"
                        f" {batch.batch_size}"
                    )
                pages = rows.to_device()
                return LayerPages(self.commit(pages.pages), self.commit(pages.table))
            self.check_layer_kv(i, rows, batch)
            return self.commit(copies.to_device(rows, "prefill_rows"))

        # every input committed alike (`commit`): one compiled program per layer shape
        positions = self.commit(batch.positions())
        cached_lens = self.commit(batch.cached_lens)
        new_lens = self.commit(batch.new_lens)
        h = self.embed(self.commit(batch.tokens))
        kv = fetch(0)
        for i in range(cfg.num_layers):
            h, rows = self.layer(i, h, positions, kv, cached_lens, new_lens)
            if i + 1 < cfg.num_layers:
                kv = fetch(i + 1)  # overlaps with layer i's compute (async dispatch)
            if emit_layer is not None:
                emit_layer(i, rows)
        last, logits = self.head(h, new_lens, all_logits)
        return PrefillResult(last, logits)

    @runs_on_mesh
    def prefill_program(
        self, batch: PrefillBatch, kv: CachedPages | None = None, all_logits: bool = False
    ) -> tuple[PrefillResult, Array]:
        """Prefill in one compiled program (`_prefill_program`) over the cached KV of every
        layer in pages (`CachedPages`; None: nothing cached). With the pages in `pinned_host`
        memory (`CachedPages.to_host`) each layer's pages are copied to the device inside the
        program, while earlier layers compute; with the pages on the device it is the
        monolithic forward over resident KV. Returns the result and the new KV rows
        `[L, B, N_pad, W]` (on the device)."""
        cfg = self.cfg
        if kv is None or batch.c_pad == 0:
            kv = CachedPages.empty(cfg, batch.batch_size)
        want = (cfg.num_layers, cfg.kv_width)
        got = (kv.pages.shape[0], kv.pages.shape[-1])
        if got != want or kv.table.shape[0] != batch.batch_size:
            raise ValueError(
                f"cached pages {tuple(kv.pages.shape)} with a table of {kv.table.shape[0]} rows"
                f" for {cfg.num_layers} layers of width {cfg.kv_width} and a batch of"
                f" {batch.batch_size}"
            )
        treedef, leaves = self.stacked_leaves
        args = (
            self.embed_gd,
            self.layer_runs,
            self.head_gd,
            treedef,
            all_logits,
            leaves,
            jnp.asarray(batch.tokens),
            jnp.asarray(batch.positions()),
            kv.pages,
            jnp.asarray(kv.table),
            jnp.asarray(batch.cached_lens),
            jnp.asarray(batch.new_lens),
        )
        if self._compile_only:
            last, logits, new = _zero_outputs(_prefill_program.lower(*args).compile())
        else:
            last, logits, new = _prefill_program(*args)
        return PrefillResult(last, logits), new

    @runs_on_mesh
    def prefill_monolithic(
        self,
        batch: PrefillBatch,
        cached_kv: np.ndarray | Array | None = None,
        all_logits: bool = False,
    ) -> tuple[PrefillResult, Array]:
        """All layers in one compiled call with all cached KV `[L, B, c_pad, W]` given up front.
        Returns the result and the new KV rows `[L, B, N_pad, W]`."""
        cfg = self.cfg
        if cached_kv is None or batch.c_pad == 0:
            cached_kv = jnp.zeros((cfg.num_layers, batch.batch_size, 0, cfg.kv_width), cfg.kv_dtype)
        want = (cfg.num_layers, batch.batch_size, batch.c_pad, cfg.kv_width)
        if tuple(cached_kv.shape) != want:
            raise ValueError(f"cached KV has shape {tuple(cached_kv.shape)}, expected {want}")
        last, logits, new = _forward_all(
            self.embed_gd,
            self.layer_gds,
            self.head_gd,
            self.params,
            jnp.asarray(batch.tokens),
            jnp.asarray(batch.positions()),
            jnp.asarray(cached_kv),
            jnp.asarray(batch.cached_lens),
            jnp.asarray(batch.new_lens),
            all_logits,
        )
        return PrefillResult(last, logits), new


# Jitted functions made per runner (decode steps, see decode.py), counted by `compile_count`.
JITTED: weakref.WeakSet = weakref.WeakSet()


def compile_count() -> int:
    """Number of distinct compiled variants of the model's jitted entry points so far (the
    per-layer prefill entries, the monolithic forward and the decode functions)."""
    fixed = (
        _embed, _layer, _layer_paged, _head, _forward_all, _prefill_program, grow_pages,
        scatter_pages,
    )  # fmt: skip
    return sum(f._cache_size() for f in (*fixed, *JITTED))
