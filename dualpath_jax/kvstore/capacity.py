"""How many bytes a block store may hold (`StoreConfig.capacity_bytes`, `capacity_fraction`).

A block store left without a bound grows for as long as the server runs (every round persists
its new Full Blocks), until the disk is full and every persist fails. So a store on a local
disk gets a bound by default: when `capacity_bytes` is 0, `capacity_fraction` of the space it
may use, which is the filesystem's free bytes plus the bytes of the blocks the store already
holds (found when it opened: a restarted server gets the same bound as before, not a smaller
one because its own blocks took the space). An explicit `capacity_bytes > 0` wins; -1 asks for
no bound. Each process derives it when it opens its store, and enforces it on its own view
(`TensorStoreBlockStore`).

Where the disk is unknown (a memory store, or a `spec` store on a bucket: gcs, s3, http) the
store stays unbounded unless `capacity_bytes` says otherwise; a remote one logs a warning
(its bucket's lifecycle rules, or `capacity_bytes`, bound it).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
from collections.abc import Callable
from typing import Any

from dualpath_jax.config import StoreConfig

log = logging.getLogger(__name__)

UNLIMITED = -1  # StoreConfig.capacity_bytes: no bound, whatever the disk

DiskUsage = Callable[[str], Any]  # shutil.disk_usage: `.free` (and `.total`) in bytes


@dataclasses.dataclass(frozen=True)
class Capacity:
    """A store's bound in bytes (0: none) and what set it (or why there is none), for the
    log."""

    nbytes: int
    why: str


def local_root(kind: str, spec: dict[str, Any] | str) -> str | None:
    """The local directory a kvstore spec keeps its files in (None: not on a local disk).
    A `file` driver, a `file://` URL, or a driver layered over one (`base`, e.g. ocdbt)."""
    if kind == "memory":
        return None
    if isinstance(spec, str):
        return spec[len("file://") :] if spec.startswith("file://") else None
    if not isinstance(spec, dict):
        return None
    if spec.get("driver") == "file" and isinstance(spec.get("path"), str):
        return spec["path"]
    base = spec.get("base")
    return local_root("spec", base) if isinstance(base, dict | str) else None


def _existing(path: str) -> str:
    """`path` or its nearest existing parent (disk usage needs a path that exists)."""
    path = os.path.abspath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


def store_capacity(
    cfg: StoreConfig,
    spec: dict[str, Any] | str,
    stored_bytes: int,
    disk_usage: DiskUsage = shutil.disk_usage,
) -> Capacity:
    """The bound of a store of `cfg` over `spec` that holds `stored_bytes` already (module
    docstring). `disk_usage(path)` is `shutil.disk_usage` (tests pass a fake one)."""
    if cfg.capacity_bytes > 0:
        return Capacity(cfg.capacity_bytes, "store.capacity_bytes")
    if cfg.capacity_bytes == UNLIMITED:
        return Capacity(0, "store.capacity_bytes=-1")
    root = local_root(cfg.kind, spec)
    if root is None:
        if cfg.kind == "memory":
            return Capacity(0, "a memory store; set store.capacity_bytes to bound it")
        log.warning(
            "the block store's disk is not local, so its size is unknown: the store is"
            " unlimited; set store.capacity_bytes (or the bucket's lifecycle rules) to bound it"
        )
        return Capacity(0, "a remote store; set store.capacity_bytes to bound it")
    try:
        free = int(disk_usage(_existing(root)).free)
    except OSError as e:
        log.warning("cannot read the free space under %s (%s): the store is unlimited", root, e)
        return Capacity(0, f"the free space under {root} is unknown")
    room = free + stored_bytes
    nbytes = max(1, int(room * cfg.capacity_fraction))
    why = (
        f"store.capacity_fraction={cfg.capacity_fraction:g} of {_gib(room)} (free under"
        f" {root} plus the {_gib(stored_bytes)} the store holds)"
    )
    return Capacity(nbytes, why)


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"
