"""The config strings with a grammar of their own: mesh shapes (`cluster.prefill_mesh`,
`"data=2,tensor=4"`), ZeroMQ endpoints (`cluster.kv_events_address`, `tcp://HOST:PORT`) and Ray
resource requests (`ray.prefill_resources`, `"GPU=1,pool_a=1"`)."""

from __future__ import annotations

import math
import typing

MESH_AXES = ("data", "tensor", "expert")  # the mesh axes the partition rules know (model.sharding)
ROLES = ("prefill", "decode")  # engine roles; `cluster.<role>_mesh` is each one's mesh


def parse_mesh(spec: str | typing.Mapping[str, int]) -> dict[str, int]:
    """A mesh shape from `"data=2,tensor=4"` (a config string; "" = one device) or a mapping,
    checked: known axis names, sizes >= 1, each axis once. Axes keep `MESH_AXES` order."""
    if isinstance(spec, typing.Mapping):
        items = list(spec.items())
    else:
        items = []
        for part in filter(None, (p.strip() for p in spec.split(","))):
            name, sep, size = part.partition("=")
            if not sep or not size.strip().isdigit():
                raise ValueError(f"mesh {spec!r}: expected 'axis=size,...' (axes {MESH_AXES})")
            items.append((name.strip(), int(size)))
    names = [n for n, _ in items]
    for name, size in items:
        if name not in MESH_AXES:
            raise ValueError(f"mesh axis {name!r} is not one of {MESH_AXES}")
        if int(size) < 1:
            raise ValueError(f"mesh axis {name!r} has size {size}; sizes must be >= 1")
    if len(set(names)) != len(names):
        raise ValueError(f"mesh {spec!r} names an axis twice")
    shape = dict(items)
    return {a: int(shape[a]) for a in MESH_AXES if a in shape}


def mesh_size(spec: str | typing.Mapping[str, int]) -> int:
    """Devices a mesh spec spans (1 for "")."""
    return math.prod(parse_mesh(spec).values()) if spec else 1


def mesh_problem(spec: str) -> str:
    """Why `spec` is not a mesh spec ("" if it is one)."""
    try:
        parse_mesh(spec)
    except ValueError as e:
        return f"{e} (a mesh is written 'data=2,tensor=4'; empty: one device)"
    return ""


def parse_endpoint(address: str) -> tuple[str, int]:
    """`(host, port)` of a `tcp://HOST:PORT` ZeroMQ endpoint (an IPv6 host in brackets; port 0:
    any free port); raises ValueError for anything else."""
    scheme, sep, rest = address.partition("://")
    host, colon, port = rest.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        host = ""  # an IPv6 literal without brackets
    if scheme != "tcp" or not sep or not colon or not host or not port.isdigit():
        raise ValueError(f"{address!r} is not a tcp://HOST:PORT address (IPv6: tcp://[::1]:PORT)")
    if int(port) > 65535:
        raise ValueError(f"{address!r}: port {port} is not in [0, 65535]")
    return host, int(port)


def endpoint_problem(address: str) -> str:
    """Why `address` is neither "" nor a `tcp://HOST:PORT` endpoint ("" if it is one)."""
    try:
        if address:
            parse_endpoint(address)
    except ValueError as e:
        return str(e)
    return ""


def parse_resources(spec: str) -> dict[str, float]:
    """A Ray resource request from `"CPU=1,GPU=1,pool_a=0.5"` (names as Ray spells them,
    amounts > 0, each name once); "" is no request."""
    out: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, sep, amount = part.partition("=")
        name = name.strip()
        try:
            value = float(amount) if sep else math.nan
        except ValueError:
            value = math.nan
        if not name or not math.isfinite(value):
            raise ValueError(f"resources {spec!r}: expected 'NAME=AMOUNT,...', e.g. 'GPU=1,pool=1'")
        if value <= 0:
            raise ValueError(f"resources {spec!r}: {name} must be > 0, got {value:g}")
        if name in out:
            raise ValueError(f"resources {spec!r} names {name} twice")
        out[name] = value
    return out


def resources_problem(spec: str) -> str:
    """Why `spec` is not a resource request ("" if it is one)."""
    try:
        parse_resources(spec)
    except ValueError as e:
        return str(e)
    return ""
