"""Parameters streamed from a trainer's process to the engines over the transfer layer.

`Client.update_params(params)` without a checkpoint directory (engines/params.py) moves the new
parameters over `jax.experimental.transfer` (a `KVChannel`) instead of a shared disk:

- the client (`offer_params`) splits the parameter tree into buckets of at most `bucket_bytes`
  (whole leaves, in tree order), computes each bucket's checksum, and offers each bucket
  `copies` times from its own transfer server (an offer is pulled once: every pulling process
  takes its own copy; offering a copy costs no memory, the arrays are shared). The
  `ParamsOffer` manifest (transfer/params_offer.py: address, uuids, leaves, checksums) travels
  in `UpdateParams` and the router's `LoadParams`;
- each engine process (`pull_params`) first checks the manifest's paths, shapes and dtypes
  against its model (nothing is pulled for a wrong tree), then pulls one bucket at a time onto
  its first device, verifies the bucket's checksum, and places each array as the served one is
  placed (its sharding; on a mesh spanning processes each process keeps its own shards). The
  pulled bucket is dropped before the next, so an engine holds at most its served params, the
  staged ones and one bucket. The staged params replace the served ones at `CommitParams`.

The checksum (`bucket_checksum`) is a CRC-32 over the bucket's paths and its arrays' bytes
(read on the host one array at a time: on CPU devices that is no copy; on an accelerator one
array's copy at a time). CRC-32 catches every burst of flipped bits up to 32 long and any other
corruption but one in 2**32.
"""

from __future__ import annotations

import logging
import secrets
import time
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from dualpath_jax.transfer.channel import UUID_BITS, KVChannel
from dualpath_jax.transfer.params_offer import ParamsBucket, ParamsLeaf, ParamsOffer

log = logging.getLogger(__name__)

DEFAULT_BUCKET_BYTES = 256 * 2**20


class ParamsTransferError(RuntimeError):
    """A streamed parameter update could not be pulled or failed its checks."""


def flat_params(tree: Any) -> list[tuple[str, Any]]:
    """`(path, array)` of every leaf of a pure parameter dict, in tree order."""
    import jax

    from dualpath_jax.model.sharding import _path

    return [(_path(k), x) for k, x in jax.tree_util.tree_leaves_with_path(tree)]


def plan_buckets(nbytes: Sequence[int], bucket_bytes: int) -> list[list[int]]:
    """Consecutive leaves grouped into buckets of at most `bucket_bytes` (a larger leaf is a
    bucket of its own): the indices of each bucket's leaves."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    out: list[list[int]] = []
    size = 0
    for i, n in enumerate(nbytes):
        if not out or size + n > bucket_bytes:
            out.append([])
            size = 0
        out[-1].append(i)
        size += n
    return out


def bucket_checksum(paths: Sequence[str], arrays: Sequence[Any]) -> str:
    """The checksum of a bucket: CRC-32 over its paths and its arrays' bytes, in order (each
    array read on the host, one at a time; on a CPU device that is no copy)."""
    crc = 0
    for path, a in zip(paths, arrays):
        crc = zlib.crc32(path.encode(), crc)
        crc = zlib.crc32(np.ascontiguousarray(np.asarray(a)).reshape(-1).view(np.uint8), crc)
    return f"{crc:08x}"


def manifest_spec(offer: ParamsOffer) -> dict[str, tuple[tuple[int, ...], str]]:
    """`path -> (shape, dtype)` of every leaf an offer holds (`checkpoint.check_params_tree`)."""
    return {leaf.path: (tuple(leaf.shape), leaf.dtype) for b in offer.buckets for leaf in b.leaves}


# ----------------------------------------------------------------------------- the client side


class ParamsOfferHandle:
    """The offers of one update, served from `channel` until `close()` (which drops them)."""

    def __init__(self, offer: ParamsOffer, channel: KVChannel, seconds: float):
        self.offer, self.channel, self.offer_s = offer, channel, seconds

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> ParamsOfferHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def offer_params(
    params: Any,
    channel: KVChannel,
    copies: int,
    *,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    clock: Callable[[], float] = time.monotonic,
) -> ParamsOfferHandle:
    """Offers `params` (a `Transformer`, its `nnx.State` or a pure dict) from `channel`, every
    bucket `copies` times; returns the handle whose `offer` is the manifest to send. The channel
    is closed on failure and by the handle's `close()`."""
    import jax

    from dualpath_jax.model.checkpoint import params_state

    if copies < 1:
        raise ValueError(f"copies must be >= 1, got {copies}")
    t0 = clock()
    try:
        flat = [(p, _single_device(x)) for p, x in flat_params(params_state(params))]
        plan = plan_buckets([int(x.nbytes) for _, x in flat], bucket_bytes)
        buckets = []
        for idx in plan:
            paths = [flat[i][0] for i in idx]
            arrays = [flat[i][1] for i in idx]
            leaves = [
                ParamsLeaf(path=p, shape=list(a.shape), dtype=str(np.dtype(a.dtype)))
                for p, a in zip(paths, arrays)
            ]
            buckets.append(
                ParamsBucket(
                    leaves=leaves,
                    nbytes=sum(int(a.nbytes) for a in arrays),
                    checksum=bucket_checksum(paths, arrays),
                )
            )
        base = 1 + secrets.randbelow((1 << UUID_BITS) - 1 - copies * len(plan))
        offer = ParamsOffer(address=channel.address, uuid=base, copies=copies, buckets=buckets)
        for c in range(copies):
            for b, idx in enumerate(plan):
                channel.offer(offer.uuid_of(c, b), [flat[i][1] for i in idx])
        jax.block_until_ready([x for _, x in flat])
    except BaseException:
        channel.close()
        raise
    return ParamsOfferHandle(offer, channel, clock() - t0)


def _single_device(x: Any) -> Any:
    """`x` as a jax array on one device (an array split over devices is gathered to the first)."""
    import jax

    if isinstance(x, jax.Array) and len(x.sharding.device_set) == 1:
        return x
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        raise ParamsTransferError(
            "a parameter split over processes cannot be offered from one process; gather it "
            "(or write a checkpoint: update_params_from_checkpoint)"
        )
    if isinstance(x, jax.Array):
        return jax.device_put(x, jax.sharding.SingleDeviceSharding(min(x.devices(), key=str)))
    return jax.device_put(np.asarray(x), jax.local_devices()[0])


# ----------------------------------------------------------------------------- the engine side


def pull_params(
    offer: ParamsOffer,
    copy: int,
    channel: KVChannel,
    served: dict[str, Any],
    timeout_s: float,
    *,
    corrupt: Callable[[list[Any]], list[Any]] = lambda arrays: arrays,
    clock: Callable[[], float] = time.monotonic,
) -> dict[str, Any]:
    """Pulls copy `copy` of every bucket of `offer` over `channel`, bucket by bucket, checks each
    (checksum) and places every array as `served[path]` is placed; returns `path -> array`.

    The manifest's tree must match `served` exactly (paths, shapes, dtypes: CheckpointError
    names what differs). Raises ParamsTransferError when a pull fails or times out (all of them
    together within `timeout_s`) or a bucket's bytes differ from the offered ones. `corrupt` is
    a test hook applied to each pulled bucket before it is checked."""
    from dualpath_jax.model.checkpoint import check_params_tree

    check_params_tree(
        {p: (tuple(x.shape), str(np.dtype(x.dtype))) for p, x in served.items()},
        manifest_spec(offer),
        "the offered ",
    )
    deadline = clock() + timeout_s
    out: dict[str, Any] = {}
    for b, bucket in enumerate(offer.buckets):
        paths = [leaf.path for leaf in bucket.leaves]
        specs = [(tuple(leaf.shape), np.dtype(leaf.dtype)) for leaf in bucket.leaves]
        uuid = offer.uuid_of(copy, b)
        try:
            arrays = channel.pull(offer.address, uuid, specs, max(deadline - clock(), 1e-3))
        except Exception as e:  # noqa: BLE001 - TransferError, TransferTimeout, anything
            raise ParamsTransferError(
                f"pulling bucket {b + 1}/{len(offer.buckets)} ({_name(paths)}) from "
                f"{offer.address}: {type(e).__name__}: {e}"
            ) from e
        arrays = corrupt(list(arrays))
        got = bucket_checksum(paths, arrays)
        if got != bucket.checksum:
            raise ParamsTransferError(
                f"bucket {b + 1}/{len(offer.buckets)} ({_name(paths)}, {bucket.nbytes} bytes) "
                f"arrived corrupted: checksum {got}, offered {bucket.checksum}"
            )
        for path, a in zip(paths, arrays):
            out[path] = place_like(a, served[path])
        del arrays
    return out


def _name(paths: Sequence[str]) -> str:
    return paths[0] if len(paths) == 1 else f"{paths[0]} .. {paths[-1]}, {len(paths)} arrays"


def place_like(a: Any, like: Any) -> Any:
    """`a` (on one device of this process) placed with `like`'s sharding; on a sharding that
    spans processes each process builds its own shards from its copy."""
    import jax

    target = getattr(like, "sharding", None)
    if target is None:  # served from host arrays (an orbax restore without a mesh): as pulled
        return a
    if target.is_fully_addressable:
        return a if a.sharding == target else jax.device_put(a, target)
    return jax.make_array_from_callback(a.shape, target, lambda idx: a[idx])
