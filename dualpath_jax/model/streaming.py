"""Streaming safetensors: tensors memory-mapped, placed shard by shard, never whole on the host.

`Tensors(directory)` maps every `*.safetensors` file of a checkpoint once (`mmap`, read-only)
and hands out each tensor as a numpy *view* of the mapping: nothing is read until a slice of it
is. The Hugging Face mapping (`checkpoint._hf_layer`) transposes, slices and stacks these views
as it likes: transposes and slices stay views, stacks of per-expert tensors stay lazy
(`stack`), and block-wise FP8 weights stay FP8 (`Fp8`, the weight plus its small scale grid).

`place(value, sharding, dtype)` then builds the device array with
`jax.make_array_from_callback`: each device's shard is cut from the view and converted to the
parameter dtype on its own, so the host holds one shard's copy at a time. An `Fp8` weight is
placed as its FP8 bytes (one byte per element) and dequantized on the device by a compiled
program whose output has the parameter's sharding. After each parameter the mapping's pages
are released (`madvise(MADV_DONTNEED)`), so the touched file pages do not pile up in the
process's resident memory either: peak host memory follows the largest tensor, not the model
(`bench/load_memory.py` measures it).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import mmap
import pathlib
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dualpath_jax.model.layout import np_dtype

# safetensors dtype names -> numpy dtype names
_DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
}


class CheckpointError(ValueError):
    """A checkpoint directory is missing, incomplete or of an unsupported architecture, or one
    of its tensors is missing, malformed or of the wrong shape."""


@dataclasses.dataclass(frozen=True)
class _Entry:
    file: int  # index into Tensors._maps
    offset: int  # bytes from the start of the file
    dtype: np.dtype
    shape: tuple[int, ...]


class Tensors:
    """The tensors of every `*.safetensors` file of `directory`, as views of read-only maps.

    `get(name, shape)` returns a numpy view (or an `Fp8` when a `name + "_scale_inv"` grid of
    block-wise FP8 scales exists); `release(value)` drops the pages of what `value` views (every
    mapped page with no argument) from this process;
    `close()` unmaps the files (use as a context manager)."""

    def __init__(self, directory: str | pathlib.Path, fp8_block: Sequence[int] = (128, 128)):
        directory = pathlib.Path(directory)
        files = sorted(directory.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{directory}: no *.safetensors files")
        self._maps: list[mmap.mmap] = []
        self._entries: dict[str, _Entry] = {}
        self._spans: list[tuple[int, int]] = []  # each map's (address, size)
        self._fp8_block = tuple(int(b) for b in fp8_block)
        for i, path in enumerate(files):
            with open(path, "rb") as f:
                size = path.stat().st_size
                n = int.from_bytes(f.read(8), "little")
                if n <= 0 or 8 + n > size:
                    raise CheckpointError(f"{path.name}: not a safetensors file (header size {n})")
                header = json.loads(f.read(n))
                self._maps.append(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))
                base = np.frombuffer(self._maps[-1], np.uint8)
                self._spans.append((base.__array_interface__["data"][0], base.nbytes))
                del base
            for name, info in header.items():
                if name == "__metadata__":
                    continue
                if info["dtype"] not in _DTYPES:
                    raise CheckpointError(f"tensor {name!r}: unsupported dtype {info['dtype']}")
                start, end = info["data_offsets"]
                dtype = np_dtype(_DTYPES[info["dtype"]])
                shape = tuple(int(d) for d in info["shape"])
                if end - start != int(np.prod(shape)) * dtype.itemsize or 8 + n + end > size:
                    raise CheckpointError(f"tensor {name!r} in {path.name}: bad data offsets")
                self._entries[name] = _Entry(i, 8 + n + start, dtype, shape)

    def __enter__(self) -> Tensors:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def keys(self) -> list[str]:
        return sorted(self._entries)

    def has(self, name: str) -> bool:
        return name in self._entries

    def nbytes(self, name: str) -> int:
        e = self._entries[name]
        return int(np.prod(e.shape)) * e.dtype.itemsize

    def view(self, name: str) -> np.ndarray:
        """The tensor as a read-only numpy view of the mapped file (nothing read yet)."""
        e = self._entries.get(name)
        if e is None:
            raise CheckpointError(f"checkpoint lacks tensor {name!r}")
        count = int(np.prod(e.shape))
        return np.frombuffer(self._maps[e.file], e.dtype, count, e.offset).reshape(e.shape)

    def get(self, name: str, shape: Sequence[int] | None = None) -> np.ndarray | Fp8:
        """The tensor `name` (a view; an `Fp8` if it has block-wise scales), checked against
        `shape`."""
        w: np.ndarray | Fp8 = self.view(name)
        scale_name = name + "_scale_inv"
        if self.has(scale_name):
            s = np.asarray(self.view(scale_name), np.float32)
            bo, bi = self._fp8_block
            want = (-(-w.shape[0] // bo), -(-w.shape[1] // bi)) if w.ndim == 2 else None
            if s.shape != want:
                raise CheckpointError(
                    f"tensor {scale_name!r}: shape {s.shape}, expected {want} for a weight of shape"
                    f" {w.shape} in {bo}x{bi} blocks"
                )
            w = Fp8(w, s, (bo, bi))
        if shape is not None and tuple(w.shape) != tuple(shape):
            raise CheckpointError(f"tensor {name!r}: shape {w.shape}, model expects {tuple(shape)}")
        return w

    def release(self, value: Any = None) -> None:
        """Drops mapped pages from this process (they are clean file pages: a later read faults
        them in again), so resident memory does not grow with what was loaded: the pages of the
        tensors `value` views (a view, `Stacked` or `Fp8`, as `place` takes), one call per
        tensor's page-aligned byte range; every mapped page when `value` is None."""
        if value is None:
            for m in self._maps:
                m.madvise(mmap.MADV_DONTNEED)
            return
        for a in _viewed_arrays(value):
            while isinstance(a.base, np.ndarray):  # the tensor's whole view, not a slice of it
                a = a.base
            ptr = a.__array_interface__["data"][0]
            for m, (base, size) in zip(self._maps, self._spans):
                if base <= ptr < base + size:
                    start = ptr - base
                    start -= start % mmap.PAGESIZE
                    end = min(size, ptr - base + a.nbytes)
                    m.madvise(mmap.MADV_DONTNEED, start, end - start)
                    break

    def close(self) -> None:
        for m in self._maps:
            try:
                m.close()
            except BufferError:  # a view is still alive; the map goes with it
                pass
        self._maps = []


def _viewed_arrays(value: Any) -> list[np.ndarray]:
    """The numpy arrays inside `value` (a view, `Stacked` or `Fp8`, nested)."""
    if isinstance(value, np.ndarray):
        return [value]
    if isinstance(value, Stacked):
        return [a for p in value.parts for a in _viewed_arrays(p)]
    if isinstance(value, Fp8):
        return [*_viewed_arrays(value.data), *_viewed_arrays(value.scale)]
    return []


@dataclasses.dataclass(frozen=True)
class Fp8:
    """A block-wise FP8 weight kept FP8: `data` `[..., a, b]` (float8, a view or a lazy
    `Stacked`) and `scale` `[..., ceil(a / ba), ceil(b / bb)]` float32 with `block` `(ba, bb)`:
    element `[i, j]` is `data[i, j] * scale[i // ba, j // bb]`. Transposes keep it FP8; any
    other numpy use dequantizes it on the host (`__array__`)."""

    data: Any
    scale: np.ndarray
    block: tuple[int, int]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.data.shape)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(np.float32)

    @property
    def T(self) -> Fp8:  # noqa: N802 - numpy's name
        if self.ndim != 2:
            raise ValueError(".T of a stacked Fp8: use transpose")
        return Fp8(self.data.T, self.scale.T, self.block[::-1])

    def transpose(self, *axes: int) -> Fp8:
        axes = tuple(axes[0]) if len(axes) == 1 and isinstance(axes[0], tuple) else axes
        n = self.ndim
        if tuple(axes[:-2]) != tuple(range(n - 2)) or set(axes[-2:]) != {n - 2, n - 1}:
            raise ValueError(f"Fp8 transposes only its last two axes, not {axes}")
        swap = axes[-2] == n - 1
        block = self.block[::-1] if swap else self.block
        return Fp8(self.data.transpose(axes), self.scale.transpose(axes), block)

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        w = np.asarray(self.data).astype(np.float32)
        a, b = w.shape[-2:]
        s = np.repeat(np.repeat(self.scale, self.block[0], axis=-2), self.block[1], axis=-1)
        out = w * s[..., :a, :b]
        return out if dtype is None else out.astype(dtype)

    def astype(self, dtype) -> np.ndarray:
        return np.asarray(self, dtype)

    def __getitem__(self, index) -> np.ndarray:
        return np.asarray(self)[index]


@dataclasses.dataclass(frozen=True)
class Stacked:
    """Arrays of one shape stacked on a new leading axis, lazily: indexing stacks only the
    selected parts' selected slices (a shard of the experts reads only its experts)."""

    parts: tuple[Any, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        return (len(self.parts), *self.parts[0].shape)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def dtype(self) -> np.dtype:
        return self.parts[0].dtype

    def transpose(self, *axes: int) -> Stacked:
        axes = tuple(axes[0]) if len(axes) == 1 and isinstance(axes[0], tuple) else axes
        if axes[0] != 0:
            raise ValueError(f"a Stacked array keeps its stacking axis first, not {axes}")
        inner = tuple(a - 1 for a in axes[1:])
        return Stacked(tuple(p.transpose(inner) for p in self.parts))

    def __getitem__(self, index) -> np.ndarray:
        index = index if isinstance(index, tuple) else (index,)
        first, rest = index[0], index[1:]
        picked = self.parts[first] if isinstance(first, slice) else [self.parts[first]]
        out = np.stack([np.asarray(p[rest] if rest else p) for p in picked])
        return out if isinstance(first, slice) else out[0]

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        out = self[:]
        return out if dtype is None else out.astype(dtype)


def stack(parts: Sequence[Any]) -> Stacked | Fp8:
    """`np.stack` of checkpoint tensors, lazily (FP8 parts stay FP8: their scales stacked)."""
    parts = tuple(parts)
    if parts and all(isinstance(p, Fp8) for p in parts):
        blocks = {p.block for p in parts}
        if len(blocks) != 1:
            raise CheckpointError(f"stacked FP8 tensors with different blocks {blocks}")
        return Fp8(
            Stacked(tuple(p.data for p in parts)),
            np.stack([p.scale for p in parts]),
            parts[0].block,
        )
    return Stacked(tuple(np.asarray(p) if isinstance(p, Fp8) else p for p in parts))


# --------------------------------------------------------------------------- placement


def place(value: Any, sharding: jax.sharding.Sharding, dtype) -> jax.Array:
    """`value` (a view, `Stacked`, `Fp8` or array) as a device array of `dtype` with
    `sharding`, built shard by shard: each device's slice is cut and converted on its own."""
    dtype = np.dtype(np_dtype(str(np.dtype(dtype))))
    if isinstance(value, Fp8):
        return _place_fp8(value, sharding, dtype)
    shape = tuple(value.shape)

    def shard(index):
        return np.array(value[index] if shape else value, dtype=dtype)

    return jax.make_array_from_callback(shape, sharding, shard)


def _place_fp8(value: Fp8, sharding: jax.sharding.Sharding, dtype: np.dtype) -> jax.Array:
    data = value.data
    fp8 = jax.make_array_from_callback(
        value.shape, sharding, lambda index: np.array(data[index], dtype=data.dtype)
    )
    replicated = (
        jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
        if isinstance(sharding, jax.sharding.NamedSharding)
        else sharding
    )
    scale = jax.device_put(value.scale, replicated)
    return _dequantize(value.block, jnp.dtype(dtype).name, sharding)(fp8, scale)


@functools.cache
def _dequantize(block: tuple[int, int], dtype: str, sharding: jax.sharding.Sharding):
    """A compiled `(fp8 [..., a, b], scales) -> dtype` whose output has `sharding`."""

    def run(w, s):
        a, b = w.shape[-2:]
        full = jnp.repeat(jnp.repeat(s, block[0], axis=-2), block[1], axis=-1)[..., :a, :b]
        return (w.astype(jnp.float32) * full).astype(dtype)

    return jax.jit(run, out_shardings=sharding)
