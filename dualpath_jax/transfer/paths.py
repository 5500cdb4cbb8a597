"""The links each copy crosses (docs/architecture.md, paper Fig. 4) and a request's copies in order.

Each path function returns the links one copy crosses, in order. Conventions: a host buffer (PE or
DE buffer) lives in its node's DRAM, so every read or write of it charges DRAM once; device ends
of a compute-network copy use GPUDirect RDMA (the CNIC reads / writes HBM: no H2D or D2H);
`cnic_assisted=True` routes a host<->device copy through the engine's own CNIC as an RDMA
loopback (paper section 5), which charges both CNIC directions besides the copy link.
`request_steps` lists one request's copies (the loader charges them on a `TrafficManager`, the
simulator on its links: `request_path(s)` and `step_bytes` are its two halves, the links of
each copy between two engines and the bytes of each copy of one request); `expected_link_bytes` sums
them per link.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from dualpath_jax.transfer.links import LinkId, LinkKind, TrafficClass

Owner = str | int


@functools.lru_cache(maxsize=65536)
def _lid(kind: LinkKind, owner: Owner) -> LinkId:
    # LinkIds are immutable: the simulator builds the same few thousand for every request.
    return LinkId(kind, str(owner))


def store_read_path(node: Owner) -> list[LinkId]:
    """store -> the node's host buffer (PE or DE buffer): `[SNIC_RX(node), DRAM(node)]`."""
    return [_lid(LinkKind.SNIC_RX, node), _lid(LinkKind.DRAM, node)]


def store_write_path(node: Owner) -> list[LinkId]:
    """the node's host memory -> store: `[DRAM(node), SNIC_TX(node)]`."""
    return [_lid(LinkKind.DRAM, node), _lid(LinkKind.SNIC_TX, node)]


def h2d_path(engine: Owner, node: Owner, *, cnic_assisted: bool = False) -> list[LinkId]:
    """the node's host buffer -> the engine's device: `[DRAM(node), H2D(engine)]`
    (with `cnic_assisted`: `[DRAM(node), CNIC_TX(engine), CNIC_RX(engine), H2D(engine)]`)."""
    loop = [_lid(LinkKind.CNIC_TX, engine), _lid(LinkKind.CNIC_RX, engine)] if cnic_assisted else []
    return [_lid(LinkKind.DRAM, node), *loop, _lid(LinkKind.H2D, engine)]


def d2h_path(engine: Owner, node: Owner, *, cnic_assisted: bool = False) -> list[LinkId]:
    """the engine's device -> the node's host memory: `[D2H(engine), DRAM(node)]`
    (with `cnic_assisted`: `[D2H(engine), CNIC_TX(engine), CNIC_RX(engine), DRAM(node)]`)."""
    loop = [_lid(LinkKind.CNIC_TX, engine), _lid(LinkKind.CNIC_RX, engine)] if cnic_assisted else []
    return [_lid(LinkKind.D2H, engine), *loop, _lid(LinkKind.DRAM, node)]


def engine_to_engine_path(
    src_engine: Owner,
    dst_engine: Owner,
    src_node: Owner,
    dst_node: Owner,
    device_src: bool,
    device_dst: bool,
) -> list[LinkId]:
    """A compute-network copy from one engine to another (RDMA over their CNICs).

    `[DRAM(src_node) unless device_src, CNIC_TX(src_engine), CNIC_RX(dst_engine),
    DRAM(dst_node) unless device_dst]`: a host-buffer end charges its node's DRAM; a device end
    is read or written by the CNIC directly (GPUDirect RDMA). PE device -> DE buffer is
    `(pe, de, pe_node, de_node, True, False)`; DE buffer -> PE device is
    `(de, pe, de_node, pe_node, False, True)`.
    """
    if str(src_engine) == str(dst_engine):
        raise ValueError(f"engine {src_engine}: a copy within one engine is h2d_path/d2h_path")
    out = [] if device_src else [_lid(LinkKind.DRAM, src_node)]
    out += [_lid(LinkKind.CNIC_TX, src_engine), _lid(LinkKind.CNIC_RX, dst_engine)]
    if not device_dst:
        out.append(_lid(LinkKind.DRAM, dst_node))
    return out


def persist_path(engine: Owner, node: Owner, *, cnic_assisted: bool = False) -> list[LinkId]:
    """the engine's device -> store, staged in host memory (the DE persisting a full block):
    `d2h_path + store_write_path` = `[D2H(engine), DRAM(node), DRAM(node), SNIC_TX(node)]`; DRAM
    appears twice because the staging write and the NIC's read both use it (half duplex)."""
    return [*d2h_path(engine, node, cnic_assisted=cnic_assisted), *store_write_path(node)]


@dataclasses.dataclass(frozen=True, init=False)
class TransferStep:
    """One copy of one request: `nbytes` over `path` in class `cls`; `name` says which copy.
    (A written `__init__`: the compiled core runs a generated one as interpreted code.)"""

    name: str
    path: tuple[LinkId, ...]
    nbytes: int
    cls: TrafficClass

    def __init__(self, name: str, path: tuple[LinkId, ...], nbytes: int, cls: TrafficClass):
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "path", path)
        object.__setattr__(self, "nbytes", nbytes)
        object.__setattr__(self, "cls", cls)


# A request's copies, in order (`request_steps`), with their traffic classes.
STEP_NAMES = (
    "pe_store_read",
    "de_store_read",
    "pe_buffer_to_pe_device",
    "de_buffer_to_pe_device",
    "pe_device_to_de_buffer",
    "de_buffer_to_de_device",
)
STEP_CLASSES = (
    TrafficClass.LOW,
    TrafficClass.LOW,
    TrafficClass.HIGH,
    TrafficClass.HIGH,
    TrafficClass.HIGH,
    TrafficClass.HIGH,
)


def request_path(
    step: int,
    *,
    pe: Owner,
    de: Owner,
    pe_node: Owner,
    de_node: Owner,
    cnic_assisted: bool = False,
) -> list[LinkId]:
    """The links of copy `step` (an index into `STEP_NAMES`) of a request between engines `pe`
    and `de`, whatever its bytes (`step_bytes`)."""
    cnic = cnic_assisted
    if step == 0:
        return store_read_path(pe_node)
    if step == 1:
        return store_read_path(de_node)
    if step == 2:
        return h2d_path(pe, pe_node, cnic_assisted=cnic)
    if step == 3:
        return engine_to_engine_path(de, pe, de_node, pe_node, False, True)
    if step == 4:
        return engine_to_engine_path(pe, de, pe_node, de_node, True, False)
    if step == 5:
        return h2d_path(de, de_node, cnic_assisted=cnic)
    raise ValueError(f"step must be in [0, {len(STEP_NAMES)}), got {step}")


def request_paths(
    *, pe: Owner, de: Owner, pe_node: Owner, de_node: Owner, cnic_assisted: bool = False
) -> tuple[list[LinkId], ...]:
    """`request_path` of every copy, in `STEP_NAMES` order: what `request_steps` moves the
    bytes over."""
    return tuple(
        request_path(i, pe=pe, de=de, pe_node=pe_node, de_node=de_node, cnic_assisted=cnic_assisted)
        for i in range(len(STEP_NAMES))
    )


def step_bytes(
    read_path: str, hit_bytes: int, miss_bytes: int, de_hit_bytes: int | None = None
) -> tuple[int, int, int, int, int, int]:
    """The bytes of each of a request's copies, in `STEP_NAMES` order (0: no such copy); the
    arguments are `request_steps`'s, validated the same way."""
    kind = str(read_path)
    for name, v in (("hit_bytes", hit_bytes), ("miss_bytes", miss_bytes)):
        if not (isinstance(v, int) and v >= 0):
            raise ValueError(f"{name} must be an int >= 0, got {v!r}")
    if kind == "pe" or (kind == "none" and hit_bytes == 0):
        de_hit = 0
    elif kind == "de":
        de_hit = hit_bytes
    elif kind == "split":
        if de_hit_bytes is None or not 0 <= de_hit_bytes <= hit_bytes:
            raise ValueError(
                f"split: de_hit_bytes must be in [0, {hit_bytes}], got {de_hit_bytes!r}"
            )
        de_hit = de_hit_bytes
    elif kind == "none":
        raise ValueError(f"read path 'none' reads nothing, but hit_bytes={hit_bytes}")
    else:
        raise ValueError(f"unknown read path {read_path!r}; expected pe, de, split or none")
    pe_hit = hit_bytes - de_hit
    return (
        pe_hit,
        de_hit,
        pe_hit,
        de_hit,
        pe_hit + miss_bytes,
        hit_bytes + miss_bytes,
    )


def request_steps(
    read_path: str,
    hit_bytes: int,
    miss_bytes: int,
    *,
    pe: Owner,
    de: Owner,
    pe_node: Owner,
    de_node: Owner,
    de_hit_bytes: int | None = None,
    cnic_assisted: bool = False,
    decode: bool = True,
) -> list[TransferStep]:
    """The copies that move one request's prompt KV (paper Fig. 4), in order; 0-byte steps omitted.

    `read_path`: "pe", "de", "split" (then `de_hit_bytes` of the hit are read by the DE node and
    the rest by the PE node) or "none" (no hit; `hit_bytes` must be 0); a `ReadPath` works too.
    `hit_bytes`: KV read from storage; `miss_bytes`: KV the PE computes. With `decode`, the last
    step moves the whole prompt KV from the DE buffer to the DE device. Steps (`STEP_NAMES`; their
    links `request_paths`, their bytes `step_bytes`):

    - `pe_store_read`   store -> PE buffer, PE-side hit, LOW (prefetch)
    - `de_store_read`   store -> DE buffer, DE-side hit, LOW (prefetch)
    - `pe_buffer_to_pe_device`  per layer, PE-side hit, HIGH
    - `de_buffer_to_pe_device`  per layer over the CNICs, DE-side hit, HIGH
    - `pe_device_to_de_buffer`  per layer over the CNICs, PE-side hit + miss, HIGH
    - `de_buffer_to_de_device`  decode H2D, hit + miss, HIGH
    """
    nbytes = step_bytes(read_path, hit_bytes, miss_bytes, de_hit_bytes)
    paths = request_paths(
        pe=pe, de=de, pe_node=pe_node, de_node=de_node, cnic_assisted=cnic_assisted
    )
    return [
        TransferStep(STEP_NAMES[i], tuple(paths[i]), nbytes[i], STEP_CLASSES[i])
        for i in range(6 if decode else 5)
        if nbytes[i] > 0
    ]


def expected_link_bytes(
    read_path: str, hit_bytes: int, miss_bytes: int, **where: Any
) -> dict[str, int]:
    """Bytes each link carries for one request, `{link name: bytes}`: `request_steps` with the
    same arguments (`pe=, de=, pe_node=, de_node=`, ...) summed per link. What a TrafficManager
    must count for that request."""
    out: dict[str, int] = {}
    for step in request_steps(read_path, hit_bytes, miss_bytes, **where):
        for lid in step.path:
            out[lid.name] = out.get(lid.name, 0) + step.nbytes
    return dict(sorted(out.items()))
