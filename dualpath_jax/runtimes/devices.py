"""Which devices each engine process owns, given as the environment it starts with.

Every engine is its own JAX runtime (docs/architecture.md), so its devices are settled before
JAX starts, by variables of its process's environment. `LocalCluster` starts P + D engines on
one host and gives each its own devices (`engine_env`); `launch/engine.py` starts one engine with
the same settings (`device_env`). `cluster.platform` says how (nothing here probes the host):

- `cpu`: `XLA_FLAGS=--xla_force_host_platform_device_count=N` (the launching process's other XLA
  flags kept) and `JAX_PLATFORMS=cpu`: N host devices in that process, N the size of its role's
  mesh (`cluster.prefill_mesh` / `decode_mesh`).
- `gpu`: `CUDA_VISIBLE_DEVICES`: a disjoint run of the host's GPUs per engine, PEs first, then
  DEs, in engine order (the host's GPUs: `LocalCluster(host_devices=...)`, else the launching
  environment's `CUDA_VISIBLE_DEVICES`).
- `tpu`: the same with chips, for processes on one TPU VM that do not talk to each other:
  `TPU_VISIBLE_CHIPS` (and `TPU_VISIBLE_DEVICES`, its older name), `TPU_CHIPS_PER_PROCESS_BOUNDS`
  of that many chips, `TPU_PROCESS_BOUNDS=1,1,1` and a mesh controller port of its own. A mesh
  device is a chip here (one JAX device per chip, as on v4, v5e, v5p and v6e).
- `""`: nothing: each engine sees every device of the host and meshes over its first ones (one
  engine per host, or one-device engines that may share a device).

With `cluster.device_memory_fraction` > 0, `XLA_PYTHON_CLIENT_MEM_FRACTION` too (what a GPU
process preallocates; other platforms ignore it). The router, which computes on no device, gets
`JAX_PLATFORMS=cpu` wherever the platform is set (`router_env`).

    >>> from dualpath_jax.config import ClusterConfig
    >>> c = ClusterConfig(platform="gpu", prefill_mesh="tensor=2", decode_mesh="")
    >>> assign_devices(c, ["0", "1", "2", "3"])
    [('0', '1'), ('2',)]
    >>> engine_env(c, 1, ["0", "1", "2", "3"], {})
    {'CUDA_VISIBLE_DEVICES': '2'}
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from dualpath_jax.config import ClusterConfig, ConfigError, mesh_size

PLATFORMS = ("", "cpu", "gpu", "tpu")
# The variable that lists the devices a process may use, per platform.
VISIBLE = {"gpu": "CUDA_VISIBLE_DEVICES", "tpu": "TPU_VISIBLE_CHIPS"}
# TPU_CHIPS_PER_PROCESS_BOUNDS of a process holding n chips of one host.
TPU_CHIP_BOUNDS = {1: "1,1,1", 2: "1,2,1", 4: "2,2,1", 8: "2,4,1"}
TPU_PORT_BASE = 8476  # the first engine's TPU mesh controller port; engine k uses base + k
_HOST_COUNT_FLAG = "--xla_force_host_platform_device_count"


def role_mesh(cluster: ClusterConfig, role: str) -> str:
    """The mesh spec of engines of `role` ("prefill" or "decode")."""
    if role not in ("prefill", "decode"):
        raise ValueError(f"unknown engine role {role!r}; expected prefill or decode")
    return cluster.prefill_mesh if role == "prefill" else cluster.decode_mesh


def engine_roles(cluster: ClusterConfig) -> list[str]:
    """The role of each engine of a `LocalCluster`, by engine id: PEs first, then DEs."""
    return ["prefill"] * cluster.prefill_nodes + ["decode"] * cluster.decode_nodes


def host_devices(platform: str, env: Mapping[str, str]) -> tuple[str, ...]:
    """The host's devices a cluster may hand out on `platform` (gpu, tpu): the ids `env`'s
    visibility variable lists. Other platforms hand out no ids (empty)."""
    var = VISIBLE.get(platform)
    if var is None:
        return ()
    ids = tuple(x.strip() for x in env.get(var, "").split(",") if x.strip())
    if not ids:
        raise ConfigError(
            f"cluster.platform={platform!r}: name the devices the cluster may use in {var} "
            f"(e.g. {var}=0,1,2,3) or pass LocalCluster(host_devices=[...])"
        )
    return ids


def assign_devices(cluster: ClusterConfig, host: Sequence[str]) -> list[tuple[str, ...]]:
    """Each engine's devices (by engine id, PEs first): on gpu and tpu disjoint consecutive runs
    of `host`, as many as its role's mesh spans; on cpu and "" no ids (a cpu engine gets its
    own host devices by count). Raises ConfigError when `host` has too few, or when engines that
    share the host's devices ("") would mesh over more than one."""
    roles = engine_roles(cluster)
    sizes = [mesh_size(role_mesh(cluster, r)) for r in roles]
    if cluster.platform not in VISIBLE:
        if cluster.platform == "" and max(sizes, default=1) > 1:
            role = roles[sizes.index(max(sizes))]
            raise ConfigError(
                f"cluster.{role}_mesh={role_mesh(cluster, role)!r} spans {max(sizes)} devices:"
                " set cluster.platform (cpu, gpu or tpu) so that each engine gets devices of its"
                " own"
            )
        return [()] * len(roles)
    if sum(sizes) > len(host):
        raise ConfigError(
            f"{cluster.prefill_nodes} prefill engine(s) of {mesh_size(cluster.prefill_mesh)}"
            f" device(s) (cluster.prefill_mesh) and {cluster.decode_nodes} decode engine(s) of"
            f" {mesh_size(cluster.decode_mesh)} (cluster.decode_mesh) need {sum(sizes)}"
            f" {cluster.platform} devices; the host has {len(host)}: {','.join(host) or 'none'}"
        )
    out, start = [], 0
    for n in sizes:
        out.append(tuple(host[start : start + n]))
        start += n
    return out


def device_env(
    cluster: ClusterConfig,
    role: str,
    devices: Sequence[str] | None,
    env: Mapping[str, str],
    port: int = TPU_PORT_BASE,
) -> dict[str, str]:
    """The variables to set in the environment of an engine of `role` whose launching
    environment is `env`: the platform's device visibility (`devices`: its gpu or tpu ids; None
    leaves visibility as it is) and the memory fraction. `port`: its TPU mesh controller port
    (unique per process on a host)."""
    n = mesh_size(role_mesh(cluster, role)) // processes(cluster, role)
    out: dict[str, str] = {}
    platform = cluster.platform
    if platform == "cpu":
        kept = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith(_HOST_COUNT_FLAG)]
        out["XLA_FLAGS"] = " ".join([*kept, f"{_HOST_COUNT_FLAG}={n}"])
        out["JAX_PLATFORMS"] = "cpu"
    elif platform in VISIBLE and devices is not None:
        if len(devices) != n:
            raise ConfigError(
                f"cluster.{role}_mesh={role_mesh(cluster, role)!r} spans {n} device(s);"
                f" given {len(devices)} ({','.join(devices)})"
            )
        ids = ",".join(devices)
        out[VISIBLE[platform]] = ids
        if platform == "tpu":
            if n not in TPU_CHIP_BOUNDS:
                raise ConfigError(
                    f"cluster.{role}_mesh: an engine on one TPU host holds"
                    f" {sorted(TPU_CHIP_BOUNDS)} chips, not {n}"
                )
            out["TPU_VISIBLE_DEVICES"] = ids
            out["TPU_CHIPS_PER_PROCESS_BOUNDS"] = TPU_CHIP_BOUNDS[n]
            out["TPU_PROCESS_BOUNDS"] = "1,1,1"
            out["TPU_MESH_CONTROLLER_ADDRESS"] = f"localhost:{port}"
            out["TPU_MESH_CONTROLLER_PORT"] = str(port)
    if cluster.device_memory_fraction > 0:
        out["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{cluster.device_memory_fraction:g}"
    return out


def router_env(cluster: ClusterConfig) -> dict[str, str]:
    """The variables to set for the router process: it computes on no device, so where engines
    own the devices (`cluster.platform` set) it keeps JAX, should anything start it, on the
    CPU and off the engines' GPUs and chips."""
    return {"JAX_PLATFORMS": "cpu"} if cluster.platform else {}


def processes(cluster: ClusterConfig, role: str) -> int:
    """Processes one engine of `role` spans (`cluster.prefill_processes` / `decode_processes`)."""
    return cluster.decode_processes if role == "decode" else cluster.prefill_processes


def engine_env(
    cluster: ClusterConfig,
    engine: int,
    host: Sequence[str],
    env: Mapping[str, str],
    rank: int = 0,
) -> dict[str, str]:
    """The variables to set for process `rank` of engine `engine` of a `LocalCluster` (ids: PEs
    0..P-1, then DEs) on a host whose devices are `host` (`host_devices`), launched from
    environment `env`. An engine spanning several processes gives each its share of its
    devices, in rank order."""
    roles = engine_roles(cluster)
    if not 0 <= engine < len(roles):
        raise ValueError(f"engine {engine} of a cluster of {len(roles)} engines")
    role = roles[engine]
    span = processes(cluster, role)
    if span > 1 and cluster.platform not in ("cpu", "gpu"):
        raise ConfigError(
            f"cluster.{role}_processes={span}: LocalCluster runs an engine over several"
            f" processes with cluster.platform cpu or gpu, not {cluster.platform!r}"
        )
    devices = assign_devices(cluster, host)[engine]
    share = len(devices) // span
    mine = devices[rank * share : (rank + 1) * share] if share else devices
    return device_env(
        cluster,
        role,
        mine if cluster.platform in VISIBLE else None,
        env,
        port=TPU_PORT_BASE + engine,
    )
