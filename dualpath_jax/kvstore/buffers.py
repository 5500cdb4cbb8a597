"""Host buffers: the PE buffer and the DE buffer of the paper (bounded host DRAM for KV).

A `HostBufferPool` preallocates one slab `[capacity_blocks, n_layers, block_tokens, bytes]` uint8
and hands out Full Block slots from a free list; each slot is addressable as its Layer Blocks
`[1, block_tokens, bytes]`, the unit of layerwise streaming (store -> buffer fills whole Full
Blocks; buffer -> device and PE -> DE move Layer Blocks). Nothing is allocated per block after
construction.

Memory: by default the slab is the device's `pinned_host` memory (page-locked host memory that
the device copies from by DMA, allocated through JAX's memory kinds); the pool hands out
writable numpy views of it, so store reads land in pinned memory directly, and
`BufferReservation.layer_pages` copies one layer of reserved blocks to device memory inside a
compiled program (one host-to-device copy, no staging through pageable memory). `memory=
"pageable"` keeps a plain numpy slab (a device without a `pinned_host` memory needs it).

Lifecycle: `reserve` / `try_reserve` -> fill and use the views -> `release` (or leave the `with`
block). A request the pool cannot hold now fails cleanly with `BufferFull` (back-pressure) instead
of growing memory; `reserve(n, timeout_s=...)` waits for releases up to that long.
"""

from __future__ import annotations

import dataclasses
import threading
import time

import jax
import numpy as np

from dualpath_jax import copies
from dualpath_jax.model.layout import BlockLayout

MEMORIES = ("pinned_host", "pageable")


class BufferFull(RuntimeError):
    """A host buffer cannot hold the requested blocks (now, or ever when over capacity)."""

    def __init__(self, name: str, requested: int, free: int, capacity: int, setting: str = ""):
        over = requested > capacity
        super().__init__(
            f"{name}: {requested} block(s) requested, {free} free of {capacity}"
            + (" (more than the whole buffer" if over else "")
            + (f"; its size is set by {setting}" if over and setting else "")
            + (")" if over else "")
        )
        self.requested = requested
        self.free = free
        self.capacity = capacity


@dataclasses.dataclass(frozen=True)
class BufferStats:
    capacity_blocks: int
    used_blocks: int
    reservations: int
    refused: int
    peak_used_blocks: int


class BufferReservation:
    """Full Block slots held by one request; views stay valid until `release`."""

    def __init__(self, pool: HostBufferPool, slots: list[int], owner: str):
        self._pool = pool
        self.slots = tuple(slots)
        self.owner = owner
        self.released = False
        # One element of each device copy out of the pinned slab (`layer_pages`) not yet known
        # to have run: the copy is dispatched, not done, when `layer_pages` returns.
        self._copies: list[jax.Array] = []

    def __len__(self) -> int:
        return len(self.slots)

    @property
    def layout(self) -> BlockLayout:
        """The layout of the pool's Full Blocks."""
        return self._pool.layout

    @property
    def pinned(self) -> bool:
        """Whether the slots are `pinned_host` memory (else a pageable pool's)."""
        return self._pool.pinned is not None

    def block(self, i: int) -> np.ndarray:
        """Full Block `i` of the reservation: a writable view `[n_layers, block_tokens, bytes]`."""
        self._check()
        return self._pool.slab[self.slots[i]]

    def blocks(self) -> list[np.ndarray]:
        """Every Full Block view, in reservation order (a store read names the slots with
        `api.buffer_destination`)."""
        self._check()
        return [self._pool.slab[s] for s in self.slots]

    def layer_block(self, i: int, layer: int) -> np.ndarray:
        """Layer Block `layer` of block `i`: a writable view `[1, block_tokens, bytes]`."""
        self._check()
        return self._pool.slab[self.slots[i], layer : layer + 1]

    def layer(self, layer: int) -> np.ndarray:
        """One layer of every block, `[n_blocks, block_tokens, bytes]`: a view when the slots are
        consecutive, else a gathered copy."""
        self._check()
        s = self.slots
        if s and list(s) == list(range(s[0], s[0] + len(s))):
            return self._pool.slab[s[0] : s[-1] + 1, layer]
        return self._pool.slab[list(s), layer]

    def layer_pages(
        self, first: int, count: int, layer: int, pad_to: int = 0, purpose: str = "buffer_pages"
    ) -> jax.Array:
        """Layer `layer` of reserved blocks `[first, first + count)` in device memory, as bytes
        `[max(count, pad_to), block_tokens, bytes]` uint8 (padding blocks repeat block `first`).

        A pinned pool copies the blocks inside one compiled program (a page-sized slice of the
        pinned slab moved to device memory per block); a pageable pool gathers them on the host
        and copies once. Either way one host-to-device copy, counted under `purpose` (see
        `dualpath_jax.copies`)."""
        self._check()
        if not 0 <= first <= first + count <= len(self.slots) or count == 0:
            raise ValueError(
                f"{self._pool.name}: blocks [{first}, {first + count}) of a reservation of "
                f"{len(self.slots)}"
            )
        n = max(count, pad_to)
        ids = list(self.slots[first : first + count]) + [self.slots[first]] * (n - count)
        pool = self._pool
        if pool.pinned is None:
            return copies.to_device(pool.slab[ids, layer], purpose, pool.device)
        copies.count("h2d", purpose, n * pool.layout.layer_nbytes)
        pages, done = _slab_layer_to_device(pool.pinned, np.asarray(ids, np.int32), np.int32(layer))
        self._copies = [c for c in self._copies if not c.is_ready()] + [done]
        return pages

    def release(self) -> None:
        """Returns the slots to the pool (idempotent), once every device copy out of them has
        run: the program that copies pinned slots runs after `layer_pages` returns (async
        dispatch, behind whatever the device is running), and the next owner's writes into the
        slots are numpy writes JAX does not order against it."""
        if not self.released:
            self.released = True
            jax.block_until_ready(self._copies)
            self._copies = []
            self._pool._free(self.slots)

    def _check(self) -> None:
        if self.released:
            raise RuntimeError(f"{self._pool.name}: reservation of {self.owner!r} was released")

    def __enter__(self) -> BufferReservation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class HostBufferPool:
    """A bounded pool of host memory in Full Block slots (PE buffer or DE buffer).

    `slab`: `[capacity_blocks, n_layers, block_tokens, bytes_per_token_per_layer]` uint8, a
    writable numpy view of `pinned` (the same bytes as a `pinned_host` jax array on `device`) when
    `memory="pinned_host"`, else a plain numpy array; committed at construction so later use does
    not page-fault.
    """

    def __init__(
        self,
        layout: BlockLayout,
        capacity_blocks: int,
        name: str = "host buffer",
        setting: str = "",
        memory: str = "pinned_host",
        device: jax.Device | None = None,
    ):
        if memory not in MEMORIES:
            raise ValueError(f"{name}: memory must be one of {MEMORIES}, got {memory!r}")
        if capacity_blocks <= 0:
            raise ValueError(
                f"{name}: capacity_blocks must be positive, got {capacity_blocks}"
                + (f" (set by {setting})" if setting else "")
            )
        self.layout = layout
        self.name = name
        self.setting = setting  # the config setting that sizes the pool, named in errors
        self.capacity_blocks = capacity_blocks
        self.memory = memory
        self.device = device or jax.devices()[0]
        shape = (capacity_blocks, *layout.shape)
        self.pinned: jax.Array | None = None
        if memory == "pinned_host":
            self.pinned, self.slab = _pinned_slab(shape, self.device, name)
        else:
            self.slab = np.zeros(shape, np.uint8)
            self.slab.fill(0)  # commit the pages now rather than on the first read into them
        self._free_slots = list(range(capacity_blocks - 1, -1, -1))  # pop() gives low slots first
        self._cond = threading.Condition()
        self._reservations = 0
        self._refused = 0
        self._peak = 0

    @classmethod
    def for_bytes(
        cls,
        layout: BlockLayout,
        capacity_bytes: float,
        name: str = "host buffer",
        setting: str = "",
        **kw,
    ) -> HostBufferPool:
        """A pool of as many Full Blocks as fit in `capacity_bytes` (e.g. `dram_buffer_bytes`)."""
        return cls(layout, int(capacity_bytes // layout.nbytes), name, setting, **kw)

    @classmethod
    def for_config(
        cls, cfg, layout: BlockLayout, name: str, device: jax.Device | None = None
    ) -> HostBufferPool:
        """An engine's buffer: room for `cluster.host_buffer_tokens` tokens of the model, and
        at least `hardware.dram_buffer_bytes` (an `ExperimentConfig`), in the memory
        `cluster.host_buffer_memory` names."""
        return cls(
            layout,
            buffer_blocks(cfg, layout),
            name,
            "cluster.host_buffer_tokens / hardware.dram_buffer_bytes",
            memory=cfg.cluster.host_buffer_memory,
            device=device,
        )

    @classmethod
    def for_tokens(
        cls, layout: BlockLayout, tokens: int, name: str = "host buffer", setting: str = "", **kw
    ) -> HostBufferPool:
        """A pool of the Full Blocks that hold `tokens` tokens (every layer)."""
        return cls(layout, -(-tokens // layout.block_tokens), name, setting, **kw)

    @property
    def free_blocks(self) -> int:
        return len(self._free_slots)

    @property
    def used_blocks(self) -> int:
        return self.capacity_blocks - len(self._free_slots)

    def try_reserve(self, n_blocks: int, owner: str = "") -> BufferReservation | None:
        """Reserves `n_blocks` slots now, or returns None (nothing is held on failure)."""
        if n_blocks < 0:
            raise ValueError(f"cannot reserve {n_blocks} blocks")
        with self._cond:
            res = self._take(n_blocks, owner)
            if res is None:
                self._refused += 1
            return res

    def reserve(self, n_blocks: int, owner: str = "", timeout_s: float = 0.0) -> BufferReservation:
        """Reserves `n_blocks` slots, waiting up to `timeout_s` for releases; raises BufferFull.

        A request larger than the whole pool fails at once.
        """
        if n_blocks < 0:
            raise ValueError(f"cannot reserve {n_blocks} blocks")
        deadline = time.monotonic() + max(0.0, timeout_s)
        with self._cond:
            while True:
                if n_blocks > self.capacity_blocks:
                    break
                res = self._take(n_blocks, owner)
                if res is not None:
                    return res
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            self._refused += 1
            raise BufferFull(
                self.name, n_blocks, len(self._free_slots), self.capacity_blocks, self.setting
            )

    def _take(self, n: int, owner: str) -> BufferReservation | None:
        if n > len(self._free_slots):
            return None
        slots = [self._free_slots.pop() for _ in range(n)]
        self._reservations += 1
        self._peak = max(self._peak, self.used_blocks)
        return BufferReservation(self, slots, owner)

    def _free(self, slots: tuple[int, ...]) -> None:
        with self._cond:
            self._free_slots.extend(reversed(slots))
            self._cond.notify_all()

    def stats(self) -> BufferStats:
        with self._cond:
            return BufferStats(
                self.capacity_blocks,
                self.used_blocks,
                self._reservations,
                self._refused,
                self._peak,
            )


def _pinned_slab(shape: tuple[int, ...], device: jax.Device, name: str):
    """A zeroed uint8 array of `shape` in `device`'s `pinned_host` memory and a writable numpy
    view of its bytes (the pool writes store reads into the view; programs read the array)."""
    kinds = {m.kind for m in device.addressable_memories()}
    if "pinned_host" not in kinds:
        raise ValueError(
            f"{name}: {device} has no pinned_host memory (it has {sorted(kinds)}); "
            "set cluster.host_buffer_memory='pageable'"
        )
    sharding = jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
    # np.zeros maps the zero page lazily: the source of this copy costs no resident memory.
    arr = jax.device_put(np.zeros(shape, np.uint8), sharding)
    arr.block_until_ready()
    view = np.asarray(_Memory(arr, arr.unsafe_buffer_pointer(), tuple(shape)))
    return arr, view


class _Memory:
    """A numpy view's base over `arr`'s memory at `pointer` (the array interface), holding `arr`
    so a view outliving the pool keeps the memory alive. (A ctypes array would do as well, but
    makes a new ctypes type per size, which the cyclic collector frees at some later time.)"""

    def __init__(self, arr: jax.Array, pointer: int, shape: tuple[int, ...]):
        self.owner = arr
        self.__array_interface__ = {
            "data": (pointer, False),
            "shape": shape,
            "typestr": "|u1",
            "version": 3,
        }


@jax.jit
def _slab_layer_to_device(slab, ids, layer):
    """slab `[C, L, bt, B]` in pinned host memory -> (`[n, bt, B]` in device memory: block
    `ids[j]`'s layer `layer`, one page-sized host slice moved to the device per step (the
    dynamic-slice-then-move pattern XLA turns into DMA from pinned memory); one byte of it, an
    output of the same program, ready when the copy has run)."""
    _, _, bt, width = slab.shape

    def one(_, i):
        page = jax.lax.dynamic_slice(slab, (i, layer, 0, 0), (1, 1, bt, width))
        return None, jax.device_put(page[0, 0], jax.memory.Space.Device)

    _, pages = jax.lax.scan(one, None, ids)
    return pages, pages[0, 0, 0]


def buffer_blocks(cfg, layout: BlockLayout) -> int:
    """The Full Blocks of an engine's host buffer (`HostBufferPool.for_config`)."""
    return max(
        -(-cfg.cluster.host_buffer_tokens // layout.block_tokens),
        int(cfg.hardware.dram_buffer_bytes // layout.nbytes),
    )
