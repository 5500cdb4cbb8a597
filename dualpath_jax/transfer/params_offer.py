"""The manifest of parameters offered over the transfer layer (`params_sync`): the value that
travels in the control plane's `UpdateParams` and `LoadParams` (wire/messages.py) instead of a
checkpoint path. Imports no JAX."""

from __future__ import annotations

import msgspec


class ParamsLeaf(msgspec.Struct, frozen=True, kw_only=True):
    """One parameter of a `ParamsOffer`: its tree path (`layers/0/mlp/up_proj/kernel`), shape and
    dtype name."""

    path: str
    shape: list[int]
    dtype: str


class ParamsBucket(msgspec.Struct, frozen=True, kw_only=True):
    """A group of parameters pulled as one transfer: their leaves (in the offer's array order),
    total bytes and the checksum of their bytes (`transfer.params_sync.bucket_checksum`)."""

    leaves: list[ParamsLeaf]
    nbytes: int
    checksum: str


class ParamsOffer(msgspec.Struct, frozen=True, kw_only=True):
    """New parameters offered over the transfer layer (`transfer.params_sync`) instead of a
    checkpoint directory: the trainer's transfer server `address` offers every bucket `copies`
    times, copy `c` of bucket `b` under uuid `uuid + c * len(buckets) + b` (an offer is pulled
    once; each pulling process takes its own copy)."""

    address: str
    uuid: int
    copies: int
    buckets: list[ParamsBucket]

    def uuid_of(self, copy: int, bucket: int) -> int:
        return self.uuid + copy * len(self.buckets) + bucket

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)
