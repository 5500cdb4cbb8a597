"""Meshes and partition rules: where every parameter, KV page and activation lives on a mesh.

An engine's devices form a `jax.sharding.Mesh` with named axes, any of `MESH_AXES`:

- `data`: requests of a batch (prefill) or decode slots are split over it; parameters are
  replicated over it.
- `tensor`: Megatron-style tensor parallelism. Query, KV and MLP projections are split by
  output heads / columns and the output projections by input rows, so each layer needs one
  all-reduce after attention and one after the MLP; the vocabulary is split in the embedding
  and the LM head; GQA KV pages are split by KV head (rows are head-major, `RowLayout.gqa`).
  MLA's latent KV is one head that every query head reads, so it is replicated.
- `expert`: the routed experts of MoE layers are split over it (expert parallelism); each
  expert's intermediate columns are also split over `tensor` when the mesh has one.

Parameters are named by their path in the model's pure dict (`layers/3/self_attn/q_proj/kernel`),
and `logical_axes` gives each dimension a logical name (`heads`, `kv_heads`, `mlp`, `vocab`,
`experts`, `batch`, or None) that `RULES` maps to a mesh axis. A dimension is split only when
its unit count divides by the axis size (heads by number of heads, so a head is never cut in
two); otherwise it is replicated over that axis. The tiny test models thus shard what they can
on any mesh, and a real model on its intended mesh shards everything.

Inside compiled code the model calls `constrain(x, *logical)`, which pins an activation's
sharding when a mesh is set (`jax.set_mesh`, as `ModelRunner` does for a sharded model) and is
the identity otherwise, so the single-device path compiles exactly as before.

    mesh = sharding.make_mesh({"data": 2, "tensor": 4})         # or jax.make_mesh(...)
    net = init_model(cfg, seed=0, mesh=mesh)                     # each shard made in place
    net = from_pretrained(hf_dir, mesh=mesh)                     # each shard read in place
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

# Mesh specs are config strings (`cluster.prefill_mesh`), parsed without JAX by the config.
from dualpath_jax.config import MESH_AXES, ModelConfig, mesh_size, parse_mesh  # noqa: F401

# logical axis -> mesh axis
RULES: dict[str, str] = {
    "batch": "data",
    "vocab": "tensor",
    "heads": "tensor",
    "kv_heads": "tensor",
    "mlp": "tensor",
    "experts": "expert",
}


def make_mesh(
    spec: str | Mapping[str, int], devices: Sequence[jax.Device] | None = None
) -> Mesh | None:
    """The mesh of `spec` (see `parse_mesh`) over `devices` (default: the first devices JAX
    finds), or None for a one-device spec ("" or every size 1)."""
    shape = parse_mesh(spec)
    n = math.prod(shape.values()) if shape else 1
    if n == 1 and not shape:
        return None
    devices = list(devices if devices is not None else jax.devices())
    if len(devices) < n:
        raise ValueError(f"mesh {shape} needs {n} devices; {len(devices)} available")
    grid = np.array(devices[:n], dtype=object).reshape(tuple(shape.values()))
    return Mesh(grid, tuple(shape), axis_types=(AxisType.Auto,) * len(shape))


def auto_mesh(mesh: Mesh) -> Mesh:
    """`mesh` with every axis `Auto` (GSPMD propagation). `jax.make_mesh` makes `Explicit` axes
    (shardings in the types), which the model's code does not annotate for; the same devices
    and names under `Auto` axes compile the model as it is."""
    if all(t == AxisType.Auto for t in mesh.axis_types):
        return mesh
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))


def check_mesh(mesh: Mesh) -> Mesh:
    unknown = [a for a in mesh.axis_names if a not in MESH_AXES]
    if unknown:
        raise ValueError(f"mesh axes {unknown} are not among {MESH_AXES}")
    return auto_mesh(mesh)


# --------------------------------------------------------------------------- parameters

# (regex on the parameter path, logical axes of its dimensions). First match wins; a path that
# matches none is replicated (norm weights, MLA's down projections, router weights).
_PARAM_RULES: tuple[tuple[str, tuple[str | None, ...]], ...] = (
    (r"embed/embedding$", ("vocab", None)),
    (r"head/lm_head/kernel$", (None, "vocab")),
    (r"self_attn/(q_proj|q_b_proj)/kernel$", (None, "heads")),
    (r"self_attn/q_proj/bias$", ("heads",)),
    (r"self_attn/(k_proj|v_proj)/kernel$", (None, "kv_heads")),
    (r"self_attn/(k_proj|v_proj)/bias$", ("kv_heads",)),
    (r"self_attn/o_proj/kernel$", ("heads", None)),
    (r"self_attn/(w_uk|w_uv)$", (None, "heads", None)),
    (r"mlp/(shared/)?(gate_proj|up_proj)/kernel$", (None, "mlp")),
    (r"mlp/(shared/)?down_proj/kernel$", ("mlp", None)),
    (r"mlp/(w_gate|w_up)$", ("experts", None, "mlp")),
    (r"mlp/w_down$", ("experts", "mlp", None)),
)


def param_logical_axes(path: str, ndim: int) -> tuple[str | None, ...]:
    """The logical axes of the parameter at `path` (`layers/0/mlp/w_gate`), one per dim."""
    for pattern, axes in _PARAM_RULES:
        if re.search(pattern, path):
            if len(axes) != ndim:
                raise ValueError(f"parameter {path}: {ndim} dims, rule has {len(axes)}")
            return axes
    return (None,) * ndim


def units(cfg: ModelConfig | None) -> dict[str, int]:
    """The indivisible units of a model's logical axes: a `heads` dimension holds `num_heads`
    heads, a `kv_heads` one `num_kv_heads` (GQA; MLA's latent is one head). Other axes split
    by element."""
    if cfg is None:
        return {}
    return {"heads": cfg.num_heads, "kv_heads": 1 if cfg.is_mla else cfg.num_kv_heads}


def spec_for(
    logical: Sequence[str | None],
    shape: Sequence[int],
    mesh: Mesh | jax.sharding.AbstractMesh,
    unit_counts: Mapping[str, int] | None = None,
    rules: Mapping[str, str] = RULES,
) -> P:
    """The PartitionSpec of an array of `shape` with `logical` axes on `mesh`: each logical
    axis goes to its mesh axis when the mesh has it, the axis is not used by an earlier
    dimension, and the dimension's units (`unit_counts`, see `units`; default: its elements) divide by
    the axis size; otherwise replicated."""
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    used: set[str] = set()
    out: list[str | None] = []
    for name, dim in zip(logical, shape):
        axis = rules.get(name) if name else None
        n = sizes.get(axis, 1) if axis else 1
        count = (unit_counts or {}).get(name, dim)
        if axis and n > 1 and axis not in used and count % n == 0 and dim % n == 0:
            out.append(axis)
            used.add(axis)
        else:
            out.append(None)
    while out and out[-1] is None:
        out.pop()
    return P(*out)


def _path(keys: tuple) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in keys)


def param_shardings(tree: Any, mesh: Mesh, cfg: ModelConfig | None = None) -> Any:
    """A NamedSharding for every leaf of a pure parameter dict (arrays or ShapeDtypeStructs,
    `nnx.to_pure_dict` layout), by `param_logical_axes` and `spec_for`."""
    mesh = check_mesh(mesh)

    def one(keys, leaf):
        logical = param_logical_axes(_path(keys), len(leaf.shape))
        return NamedSharding(mesh, spec_for(logical, leaf.shape, mesh, units(cfg)))

    return jax.tree_util.tree_map_with_path(one, tree)


def param_specs(tree: Any, mesh: Mesh, cfg: ModelConfig | None = None) -> dict[str, P]:
    """`path -> PartitionSpec` of every parameter (what the tests check and the docs list)."""
    shardings = param_shardings(tree, mesh, cfg)
    flat = jax.tree_util.tree_leaves_with_path(shardings)
    return {_path(k): s.spec for k, s in flat}


def model_mesh(tree: Any) -> Mesh | None:
    """The mesh a model's parameters live on (None: one device)."""
    for leaf in jax.tree.leaves(tree):
        s = getattr(leaf, "sharding", None)
        if isinstance(s, NamedSharding) and s.mesh.size > 1:
            return auto_mesh(s.mesh)
        return None
    return None


# --------------------------------------------------------------------------- KV and activations


def kv_logical_axes(cfg: ModelConfig) -> str | None:
    """The logical axis of a KV row's width: whole KV heads for GQA rows (with their fp8 scales,
    which sit inside each head's columns), replicated for MLA's latent (one head every query
    head reads)."""
    if cfg.is_mla:
        return None
    return "kv_heads"


def kv_pages_sharding(cfg: ModelConfig, mesh: Mesh, shape: Sequence[int]) -> NamedSharding:
    """The sharding of KV pages `[..., W]` (decode pool `[P, L, page_size, W]`, prefill pages
    `[P, 1, page_size, W]` or layer-major `[L, P, page_size, W]`): the row width by KV head."""
    logical = (None,) * (len(shape) - 1) + (kv_logical_axes(cfg),)
    return NamedSharding(mesh, spec_for(logical, shape, mesh, units(cfg)))


def kv_rows_sharding(cfg: ModelConfig, mesh: Mesh, shape: Sequence[int]) -> NamedSharding:
    """KV rows `[B, N, W]` (or `[L, B, N, W]`): the batch over `data`, the width by KV head."""
    lead = (None,) * (len(shape) - 3)
    logical = (*lead, "batch", None, kv_logical_axes(cfg))
    return NamedSharding(mesh, spec_for(logical, shape, mesh, units(cfg)))


def axis_size(name: str) -> int:
    """The size of mesh axis `name` in the mesh set for this trace (1 without a mesh or axis)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return 1
    return dict(zip(mesh.axis_names, mesh.axis_sizes)).get(name, 1)


def constrain(
    x: jax.Array, *logical: str | None, unit_counts: Mapping[str, int] | None = None
) -> jax.Array:
    """`x` pinned to the sharding of its logical axes on the mesh set for this trace
    (`jax.set_mesh`); the identity without one."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return x
    return jax.lax.with_sharding_constraint(x, spec_for(logical, x.shape, mesh, unit_counts))


def constrain_kv(x: jax.Array, layout: Any, *lead: str | None) -> jax.Array:
    """KV rows or pages `[..., W]` of `layout` (`kernels.kv_rows.RowLayout`) pinned by KV head
    (several heads) or replicated (one head: MLA); `lead` names the leading axes."""
    axis = "kv_heads" if layout.num_kv_heads > 1 else None
    logical = (*lead, *(None,) * (x.ndim - 1 - len(lead)), axis)
    return constrain(x, *logical, unit_counts={"kv_heads": layout.num_kv_heads})


def place(x, where: jax.sharding.Sharding):
    """`x` on `where`: `jax.device_put`, or for an abstract array (`jax.ShapeDtypeStruct`) the
    same shape and dtype carrying the sharding."""
    if isinstance(x, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=where)
    return jax.device_put(x, where)


def describe(mesh: Mesh | None) -> str:
    """`"data=2,tensor=4"` (the `parse_mesh` form), or "" for one device."""
    if mesh is None:
        return ""
    return ",".join(f"{a}={n}" for a, n in zip(mesh.axis_names, mesh.axis_sizes))


def join_column_pieces(pieces, piece_shape: Sequence[int], count: int, split) -> jax.Array:
    """One array split by its last axis over a mesh (`split`) from its `count` column pieces of
    `piece_shape`, each on a device of this process: `pieces[j]` (a list, or a mapping holding
    the pieces this process's devices need). A device that holds a piece it was not put on gets
    a device-to-device copy."""
    *lead, width = piece_shape
    shape = (*lead, width * count)
    arrays = []
    for dev, idx in split.addressable_devices_indices_map(shape).items():
        piece = pieces[(idx[-1].start or 0) // width]
        arrays.append(piece if piece.devices() == {dev} else jax.device_put(piece, dev))
    return jax.make_array_from_single_device_arrays(shape, split, arrays)


def whole(x, mesh: Mesh | None):
    """`x` replicated over `mesh` (None: `x` as it is). On a mesh over processes each process
    then holds all of it and `host_value` reads its own copy; every process must call this."""
    return x if mesh is None else _replicated(x, NamedSharding(mesh, P()))


@functools.partial(jax.jit, static_argnums=1)
def _replicated(x, sharding):
    return jax.lax.with_sharding_constraint(x, sharding)


def host_value(x) -> np.ndarray:
    """`x` on the host. An array of a mesh that spans processes must be replicated: each
    process reads its own copy (no collective)."""
    if getattr(x, "is_fully_addressable", True):
        return np.asarray(x)
    if not x.is_fully_replicated:
        raise ValueError(f"an array split over processes ({x.sharding}) has no host value here")
    return np.asarray(x.addressable_shards[0].data)
