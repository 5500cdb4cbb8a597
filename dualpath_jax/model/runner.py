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
from dualpath_jax.model.batch import (  # noqa: F401 (bucket_len, batch_bucket(s): theirs too)
    PrefillBatch,
    PrefillResult,
    batch_bucket,
    batch_buckets,
    bucket_len,
)
from dualpath_jax.model.cached_kv import CachedPages, LayerPages, grow_pages, scatter_pages
from dualpath_jax.model.layers import PagedKV, resolve_attention_impl
from dualpath_jax.model.packing import Packing
from dualpath_jax.model.transformer import Transformer, shard_model

Array = jax.Array


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
def _layer(gd, state, h, positions, cached_rows, cached_lens, new_lens, packing=None):
    return nnx.merge(gd, state)(h, positions, cached_rows, cached_lens, new_lens, packing)


@functools.partial(jax.jit, static_argnums=0)
def _layer_paged(gd, state, h, positions, pages, table, cached_lens, new_lens, packing=None):
    """One layer over cached KV in pages `[P, 1, page_size, W]` (see `PagedKV`)."""
    kv = PagedKV(pages, table, cached_lens, new_lens=new_lens)
    return nnx.merge(gd, state)(h, positions, kv, packing=packing)


def _logits(head, embedding, h, new_lens, all_logits, packing):
    """(Each request's last new token's logits, every token's `[B, N_pad, V]` or None) from the
    last hidden states (padded, or packed with `packing`)."""
    if packing is None:
        last = h[jnp.arange(h.shape[0]), new_lens - 1]
    else:
        last, h = h[0, packing.last], (packing.pad(h) if all_logits else h)
    return head(last, embedding), (head(h, embedding) if all_logits else None)


@functools.partial(jax.jit, static_argnums=(0, 5))
def _head(gd, state, embedding, h, new_lens, all_logits, packing=None):
    return _logits(nnx.merge(gd, state), embedding, h, new_lens, all_logits, packing)


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
    packing=None,
):
    """Monolithic prefill: every layer in one compiled function. cached_kv `[L, B, C, W]`."""
    embed_state, layer_states, head_state = params
    embed = nnx.merge(embed_gd, embed_state)
    h = embed(tokens)
    new = []
    for i, gd in enumerate(layer_gds):
        layer = nnx.merge(gd, layer_states[i])
        h, rows = layer(h, positions, cached_kv[i], cached_lens, new_lens, packing)
        new.append(rows)
    head = nnx.merge(head_gd, head_state)
    last, logits = _logits(head, embed.embedding[...], h, new_lens, all_logits, packing)
    return last, logits, jnp.stack(new)


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
    packing=None,
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
            return nnx.merge(gd, state)(h, positions, kv, packing=packing)

        h, rows = jax.lax.scan(body, h, (states, pages[start : start + count]))
        new.append(rows)
    head = nnx.merge(head_gd, head_state)
    last, logits = _logits(head, embed.embedding[...], h, new_lens, all_logits, packing)
    return last, logits, (new[0] if len(new) == 1 else jnp.concatenate(new))


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

    def __init__(
        self,
        model: Transformer,
        min_bucket: int = 16,
        *,
        mesh: Mesh | None = None,
        pack: bool = True,
    ):
        self.cfg: ModelConfig = model.cfg
        self.min_bucket = min_bucket
        self._compile_only = False  # `compile_only`
        # The mesh the parameters live on (given, or found on them; None: one device). Every
        # entry point traces under it (`jax.set_mesh`), so the model's `sharding.constrain`
        # calls pin activations and the KV to their shardings.
        self.mesh = sharding.check_mesh(mesh) if mesh is not None else None
        if self.mesh is None:
            self.mesh = sharding.model_mesh(nnx.state(model))
        # Packed prefill (model/packing.py), where it pays; not over a `data` axis, which
        # splits the padded batch's requests.
        data = dict(zip(self.mesh.axis_names, self.mesh.axis_sizes)) if self.mesh else {}
        self.pack = pack and data.get("data", 1) == 1
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
        packing: Packing | None = None,
    ):
        """Runs layer i: h `[B, N, hidden]`, cached KV rows `[B, C, W]` (or `LayerPages`), the
        real new tokens per request (default all N) -> (h, new rows `[B, N, W]`); with
        `packing`, h and positions are packed (`DecoderLayer`)."""
        gd, state = self.layer_gds[i], self.layer_states[i]
        if new_lens is None:
            new_lens = self.commit(np.full((h.shape[0],), h.shape[1], np.int32))
        if isinstance(cached_rows, LayerPages):
            fn = _layer_paged
            pages, table = cached_rows.pages, cached_rows.table
            args = (gd, state, h, positions, pages, table, cached_lens, new_lens, packing)
        else:
            fn = _layer
            args = (gd, state, h, positions, cached_rows, cached_lens, new_lens, packing)
        if self._compile_only:
            return _zero_outputs(fn.lower(*args).compile())
        return fn(*args)

    @contextlib.contextmanager
    def compile_only(self):
        """Within it `layer` and `prefill_program` compile their program for their arguments
        ahead of time (JAX reuses that executable when a call of the same shapes comes) and
        return zeros shaped as their outputs instead of running it: a warm-up reaches every
        forward shape without the forwards' compute (engines/warmup.py). Everything else runs
        as usual."""
        self._compile_only = True
        try:
            yield self
        finally:
            self._compile_only = False

    @runs_on_mesh
    def head(
        self, h: Array, new_lens: Array, all_logits: bool = False, packing: Packing | None = None
    ):
        return _head(
            self.head_gd, self.head_state, self.embedding, h, new_lens, all_logits, packing
        )

    def inputs(self, batch: PrefillBatch, put=jnp.asarray):
        """(tokens, positions, `Packing` or None): the batch as its layers take it, packed where
        that pays (`pack`, `PrefillBatch.packed`), each array through `put`."""
        p = batch.packed(self.min_bucket) if self.pack else None
        if p is None:
            return put(batch.tokens), put(batch.positions()), None
        return put(p.tokens), put(p.positions), Packing(put(p.index), put(p.flat), put(p.last))

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
        tokens, positions, packing = self.inputs(batch, self.commit)
        cached_lens = self.commit(batch.cached_lens)
        new_lens = self.commit(batch.new_lens)
        h = self.embed(tokens)
        kv = fetch(0)
        for i in range(cfg.num_layers):
            h, rows = self.layer(i, h, positions, kv, cached_lens, new_lens, packing)
            if i + 1 < cfg.num_layers:
                kv = fetch(i + 1)  # overlaps with layer i's compute (async dispatch)
            if emit_layer is not None:
                emit_layer(i, rows)
        last, logits = self.head(h, new_lens, all_logits, packing)
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
        tokens, positions, packing = self.inputs(batch)
        args = (
            self.embed_gd,
            self.layer_runs,
            self.head_gd,
            treedef,
            all_logits,
            leaves,
            tokens,
            positions,
            kv.pages,
            jnp.asarray(kv.table),
            jnp.asarray(batch.cached_lens),
            jnp.asarray(batch.new_lens),
            packing,
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
        tokens, positions, packing = self.inputs(batch)
        last, logits, new = _forward_all(
            self.embed_gd,
            self.layer_gds,
            self.head_gd,
            self.params,
            tokens,
            positions,
            jnp.asarray(cached_kv),
            jnp.asarray(batch.cached_lens),
            jnp.asarray(batch.new_lens),
            all_logits,
            packing,
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
