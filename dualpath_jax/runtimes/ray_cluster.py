"""RayCluster: the router and every engine as Ray actors, placed by resources, on a running Ray
cluster (`address`: "auto", "ray://HOST:10001", ...) or a local one.

    with RayCluster(cfg, workdir, address="auto") as cluster:
        client = cluster.client()
        ...

The same surface as `LocalCluster` (`client()`, `kill`, `restart`, a context manager), and the
same processes: each actor (`runtimes.ray_host.ProcessHost`) runs one `python -m
dualpath_jax.runtimes` process, its own JAX runtime. KV moves over the transfer layer as
everywhere else, never through Ray's object store; Ray places, restarts and stops.

Placement (`cfg.ray`): one placement group per cluster, a bundle per actor (the router first,
then the engines in id order) of its role's resources (`ray.router_resources`,
`prefill_resources`, `decode_resources`: CPU, GPU, TPU or a node pool's custom resource), with
the group's `ray.strategy`. An actor asking for GPUs or TPU chips gets the ones Ray assigns it.
An engine spanning several processes (`cluster.*_processes` > 1) is a gang of actors, one per
process, in a placement group of its own (`runtimes.ray_span`: `ray.span_strategy`; its bundles
are each process's share of the engine's devices).

Failures: a node that dies takes its actors and their processes with it; the router requeues
what its engines held (as for any engine death) and Ray restarts the engine actors (up to
`ray.max_restarts` times each), which register again under their ids; a spanning engine is
restarted whole, by its gang's supervisor. A router whose process or actor died is restarted by
Ray too, in its bundle, at its old address, serving the params it served; engines register with
it again and clients reconnect (the rounds it had taken fail with kind `connection`). That holds
while its bundle stays on its node: a router whose node is gone comes back elsewhere, at an
address clients do not know.

What the processes write (`logs/`, `events.jsonl`, `links/`) lands in `workdir` on each actor's
node; `stop()` copies what is missing here from the others (a driver on another node).

Nothing here imports Ray until a `RayCluster` starts (the `ray` extra: pip install
'dualpath_jax[ray]').
"""

from __future__ import annotations

import ipaddress
import math
import os
import pathlib
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from dualpath_jax.config import (
    ConfigError,
    ExperimentConfig,
    mesh_size,
    parse_resources,
    to_json,
)
from dualpath_jax.runtimes import devices
from dualpath_jax.runtimes.local import (
    START_TIMEOUT_S,
    WARMUP_START_TIMEOUT_S,
    ClusterError,
    ClusterLifecycle,
    engine_plan,
    shutdown_router,
    wait_engine_alive,
    wait_registered,
)
from dualpath_jax.runtimes.process import ProcessSpec
from dualpath_jax.runtimes.ray_span import SpanGroup
from dualpath_jax.wire.client import Client
from dualpath_jax.wire.credentials import Credentials, new_credentials, read_credentials
from dualpath_jax.wire.params_protocol import check_params_config


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def check_ray_nodes(cfg: ExperimentConfig, nodes: Sequence[Mapping[str, Any]]) -> None:
    """Refuses a config that cannot work on these Ray nodes (`ray.nodes()`, the alive ones): a
    block store on local files, or one in memory, when there are several nodes (unless
    `ray.shared_filesystem` says every node mounts the root), and loopback addresses when the
    nodes are on several hosts (unless `ray.bind_node_ip`)."""
    alive = [n for n in nodes if n.get("Alive", True)]
    if len(alive) > 1:
        if cfg.store.kind == "memory":
            raise ConfigError(
                f"store.kind='memory' on a Ray cluster of {len(alive)} nodes: each engine would "
                "hold its own store; use a file root every node mounts or a gcs/s3 spec"
            )
        if cfg.store.kind == "file" and not cfg.ray.shared_filesystem:
            root = cfg.store.root or "<workdir>/store"
            raise ConfigError(
                f"store.root={root!r} is a local file root on a Ray cluster of {len(alive)} "
                "nodes, which do not share it: use a gcs/s3 store (store.kind='spec'), or a "
                "root every node mounts at the same path with ray.shared_filesystem=true"
            )
    hosts = {n.get("NodeManagerAddress") for n in alive}
    c = cfg.cluster
    if len(hosts) > 1 and not cfg.ray.bind_node_ip:
        for key, host in (("cluster.host", c.host), ("cluster.transfer_host", c.transfer_host)):
            if _loopback(host):
                raise ConfigError(
                    f"{key}={host!r} is loopback on a Ray cluster of {len(hosts)} hosts: set "
                    "ray.bind_node_ip=true (each actor binds its node's address)"
                )


def through_restarts(call: Callable[[], Any], deadline: float) -> Any:
    """`ray.get` of `call()` (an actor method's remote call), asked again while the actor is
    being restarted (`ActorUnavailableError`) until `deadline`, when that error is raised; an
    actor dead for good raises `RayActorError`."""
    import ray

    while True:
        try:
            return ray.get(call(), timeout=max(1.0, deadline - time.monotonic()))
        except ray.exceptions.ActorUnavailableError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def actor_options(resources: Mapping[str, float]) -> dict[str, Any]:
    """The actor options asking for a whole bundle of `resources`."""
    r = dict(resources)
    out: dict[str, Any] = {"num_cpus": r.pop("CPU", 0), "num_gpus": r.pop("GPU", 0)}
    if "memory" in r:
        out["memory"] = r.pop("memory")
    out["resources"] = r
    return out


# A local Ray's object store: the cluster puts only its secrets there (KV and params move over
# the transfer layer or the file system), and Ray's default takes 30% of the host's memory.
LOCAL_OBJECT_STORE_BYTES = 128 << 20


def local_ray_kwargs(bundles: Sequence[Mapping[str, float]]) -> dict[str, Any]:
    """`ray.init` arguments for a local Ray of one node that holds `bundles`: as many logical
    CPUs and custom resources as they ask for in all (GPUs and TPU chips are the host's, as Ray
    detects them), and a small object store."""
    total: dict[str, float] = {}
    for b in bundles:
        for k, v in b.items():
            total[k] = total.get(k, 0.0) + v
    custom = {k: v for k, v in total.items() if k not in ("CPU", "GPU", "TPU", "memory")}
    return {
        "num_cpus": max(1, math.ceil(total.get("CPU", 0))),
        "resources": custom,
        "object_store_memory": LOCAL_OBJECT_STORE_BYTES,
    }


class RayCluster(ClusterLifecycle):
    def __init__(
        self,
        cfg: ExperimentConfig,
        workdir: str | os.PathLike,
        *,
        address: str | None = None,
        init_kwargs: Mapping[str, Any] | None = None,
        env: Mapping[str, str] | None = None,
        start_timeout_s: float | None = None,
    ):
        """`address`: the Ray cluster to join ("auto", "ray://HOST:10001", a GCS address;
        None: the one this process is connected to, else as `ray.init()` finds one; "local": the
        one this process is connected to, else a new one of this host sized for the cluster's
        bundles, `local_ray_kwargs`). A Ray it starts is started with `init_kwargs` (over those
        defaults) and shut down with the cluster. `env`: variables added to every actor's
        environment (through Ray's runtime env; the engines' device variables are set on top).
        `start_timeout_s` as for `LocalCluster`."""
        if cfg.hardware.engines_per_node != 1:
            raise ValueError("RayCluster runs one engine per actor (hardware.engines_per_node=1)")
        c = cfg.cluster
        for role in ("prefill", "decode"):
            span = devices.processes(c, role)
            if span > 1 and c.platform not in ("cpu", "gpu"):
                raise ConfigError(
                    f"cluster.{role}_processes={span}: RayCluster runs an engine over several "
                    f"processes with cluster.platform cpu or gpu, not {c.platform!r}"
                )
            share = mesh_size(devices.role_mesh(c, role)) // span
            gpus = parse_resources(getattr(cfg.ray, f"{role}_resources")).get("GPU", 0)
            if c.platform == "gpu" and gpus != share:
                raise ConfigError(
                    f"ray.{role}_resources asks for GPU={gpus:g}; each process of a {role} "
                    f"engine holds {share} GPU(s) of cluster.{role}_mesh: ask for GPU={share}"
                )
        check_params_config(c)
        self.cfg = cfg
        self.workdir = pathlib.Path(workdir).absolute()
        self.ray_address = address
        self.init_kwargs = dict(init_kwargs or {})
        self.env = dict(env or {})
        if start_timeout_s is None:
            start_timeout_s = WARMUP_START_TIMEOUT_S if c.warmup else START_TIMEOUT_S
        self.start_timeout_s = start_timeout_s
        self.credentials = Credentials()
        self.address = ""
        self.actors: dict[str, Any] = {}  # name -> actor handle ("router", "pe0", "de1", ...)
        self.engine_ids: dict[str, int] = {}
        # name -> (placement group, bundle index): the cluster's group holds the router and the
        # one-process engines; an engine spanning processes has a group of its own (`groups`)
        self.bundles: dict[str, tuple[Any, int]] = {}
        self.placement_group = None
        self.groups: dict[str, SpanGroup] = {}  # engine name -> its processes' gang
        self._killed: dict[str, int] = {}  # a group's generation when `kill` ended it
        self.multinode = False
        self._owns_ray = False
        self._secrets_ref = None
        self._clients: list[Client] = []
        self._deadline = 0.0

    # ------------------------------------------------------------------ lifecycle

    def _resources(self, role: str) -> dict[str, float]:
        return parse_resources(getattr(self.cfg.ray, f"{role}_resources"))

    def _env(self, role: str, engine: int) -> dict[str, str]:
        c = self.cfg.cluster
        if role == "router":
            extra = devices.router_env(c)
        else:
            port = devices.TPU_PORT_BASE + engine
            extra = devices.device_env(c, role, None, self.env, port=port)
        return {**self.env, **extra}

    def _start_actor(
        self,
        name: str,
        spec: ProcessSpec,
        role: str,
        engine: int = 0,
        *,
        bundle: tuple[Any, int] | None = None,
        max_restarts: int | None = None,
        coordinator: list | None = None,
    ):
        """Starts the actor `name` owning the process `spec`, in `bundle` (placement group,
        index; default: its bundle of the cluster's group). Ray restarts it `max_restarts`
        times (default: `ray.max_restarts`)."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from dualpath_jax.runtimes.ray_host import ProcessHost

        env = self._env(role, engine)
        group, index = bundle or self.bundles[name]
        if max_restarts is None:
            max_restarts = self.cfg.ray.max_restarts
        options: dict[str, Any] = {
            **actor_options(self._resources(role)),
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                group, placement_group_bundle_index=index
            ),
            "max_restarts": max_restarts,
            "max_concurrency": 6,  # `where`, `stop`, `wait_exit` while `address` waits
        }
        if env:
            options["runtime_env"] = {"env_vars": env}
        fields = {k: v for k, v in spec.__dict__.items() if k not in ("workdir", "parent_pid")}
        actor = (
            ray.remote(ProcessHost)
            .options(**options)
            .remote(
                name,
                fields,
                to_json(self.cfg),
                str(self.workdir),
                [self._secrets_ref],
                self.cfg.ray.bind_node_ip,
                coordinator,
            )
        )
        self.actors[name] = actor
        return actor

    def start(self, wait: bool = True) -> None:
        """Joins (or starts) Ray, places the cluster's placement group, starts the router's
        actor, then the engines'; `wait`: until every engine has registered."""
        import ray
        from ray.util.placement_group import placement_group

        c = self.cfg.cluster
        plan = engine_plan(c)
        self.groups = {
            n: SpanGroup(self, n, who, devices.processes(c, who.role))
            for n, who in plan
            if devices.processes(c, who.role) > 1
        }
        # the cluster's placement group: the router's bundle, then each one-process engine's
        names = ["router", *(n for n, _ in plan if n not in self.groups)]
        roles = {"router": "router", **{n: who.role for n, who in plan}}
        bundles = [self._resources(roles[n]) for n in names]
        if not ray.is_initialized():
            kw: dict[str, Any] = {"include_dashboard": False}
            if self.ray_address == "local":
                gangs = [b for g in self.groups.values() for b in g.bundles()]
                kw.update(local_ray_kwargs(bundles + gangs))
            ray.init(address=self.ray_address, **{**kw, **self.init_kwargs})
            self._owns_ray = True
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        check_ray_nodes(self.cfg, nodes)
        self.multinode = len(nodes) > 1
        self.credentials = read_credentials(c.secrets_file) if c.secrets_file else new_credentials()
        self.workdir.mkdir(parents=True, exist_ok=True)
        (self.workdir / "config.json").write_text(to_json(self.cfg, indent=1))
        self._deadline = time.monotonic() + self.start_timeout_s
        self.placement_group = placement_group(bundles, strategy=self.cfg.ray.strategy)
        self.bundles = {n: (self.placement_group, i) for i, n in enumerate(names)}
        wanted = [(self.placement_group, bundles, self.cfg.ray.strategy, "the cluster's")]
        for name, g in self.groups.items():  # placed meanwhile: each is all or nothing
            wanted.append((g.place(), g.bundles(), self.cfg.ray.span_strategy, f"{name}'s"))
        for group, asked, strategy, whose in wanted:
            if not group.wait(timeout_seconds=max(1.0, self._deadline - time.monotonic())):
                raise ClusterError(
                    f"Ray could not place {whose} bundles {asked} ({strategy}) in "
                    f"{self.start_timeout_s:.0f} s; the cluster has {ray.cluster_resources()}"
                )
        # Held here for the cluster's life: a restarted actor fetches it again (Ray warns that
        # an actor's arguments in the object store must outlive it; this one does).
        self._secrets_ref = ray.put(
            {"engine": self.credentials.engine, "client": self.credentials.client}
        )
        router = self._start_actor("router", ProcessSpec("router", str(self.workdir)), "router")
        try:
            self.address = ray.get(router.address.remote(self.start_timeout_s))
        except Exception as e:  # noqa: BLE001 - the actor's error, as a start failure
            raise ClusterError(f"the router did not start: {e}") from e
        for name, who in plan:
            if name in self.groups:
                self.groups[name].start()
            else:
                spec = ProcessSpec(who.role, "", self.address, who.engine, who.node, who.group)
                self._start_actor(name, spec, who.role, who.engine)
            self.engine_ids[name] = who.engine
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        """Returns once every engine has registered; raises ClusterError when an actor died
        for good or the start timed out."""
        wait_registered(self.client(), len(self.engine_ids), self._check_alive, self._deadline)

    def _check_alive(self, names: Sequence[str] | None = None) -> None:
        import ray

        spanned = {n: g for g in self.groups.values() for n in g.names}
        for name in names or list(self.actors):
            group = spanned.get(name)
            if group is not None and not group.given_up:
                continue  # its group's supervisor restarts the whole engine (ray_span.py)
            try:
                ray.get(self.actors[name].where.remote(), timeout=60)
            except (ray.exceptions.ActorUnavailableError, ray.exceptions.GetTimeoutError):
                continue  # being (re)started, or the driver's connection to it is: not dead
            except ray.exceptions.RayActorError as e:
                raise ClusterError(f"{name}'s actor died during start: {e}") from e

    def where(self) -> dict[str, dict[str, Any]]:
        """Each actor's node (`node_id`, `ip`) and process (`pid`, `returncode`), by name."""
        import ray

        actors = dict(self.actors)
        found = ray.get([a.where.remote() for a in actors.values()], timeout=60)
        return dict(zip(actors, found))

    def client(self, **kw) -> Client:
        """A client holding the client secret (`Client` keyword arguments pass through). By
        default `update_params` writes checkpoints to `workdir/params` on one node or a shared
        file system, and streams them over the transfer layer (`params_dir=None`) otherwise."""
        shared = not self.multinode or self.cfg.ray.shared_filesystem
        kw.setdefault("params_dir", self.workdir / "params" if shared else None)
        kw.setdefault("transfer_host", self._driver_host())
        c = Client(self.address, self.credentials.client, **kw)
        self._clients.append(c)
        return c

    def _driver_host(self) -> str:
        if not self.cfg.ray.bind_node_ip:
            return self.cfg.cluster.transfer_host
        import ray

        return ray.util.get_node_ip_address()

    def kill(self, name: str) -> None:
        """Kills engine `name`'s actor, or the router's (`"router"`), and its process (fault
        injection); Ray restarts it (within `ray.max_restarts`). For a process of an engine
        spanning several (`de1`, `de1.1`, ...), the cluster restarts the engine's every process
        together."""
        import ray

        if name == "router":
            ray.kill(self.actors[name], no_restart=False)
            return
        group = next((g for g in self.groups.values() if name in g.names), None)
        if name not in self.engine_ids and group is None:
            names = sorted({*self.engine_ids, *(n for g in self.groups.values() for n in g.names)})
            raise ValueError(f"kill takes 'router' or an engine's process name, one of {names}")
        if group is not None:
            self._killed[group.name] = group.generation
        ray.kill(self.actors[name], no_restart=group is not None)

    def restart(self, name: str, timeout_s: float | None = None) -> None:
        """Waits until engine `name` serves again: Ray restarts an actor that died (the gang's
        supervisor a spanning engine's processes); one out of restarts is started afresh (in its
        bundle). Returns once it has registered."""
        import ray

        if name == "router":
            return self._restart_router(timeout_s)
        if name not in self.engine_ids:
            raise ValueError(
                f"restart takes 'router' or an engine name, one of {sorted(self.engine_ids)}"
            )
        deadline = time.monotonic() + (timeout_s or self.start_timeout_s)
        group = self.groups.get(name)
        if group is not None:  # its supervisor restarts it; one out of restarts is revived
            # after `kill`, or when out of restarts: a start after this one; else the current one
            running = group.generation - (0 if group.given_up else 1)
            if not group.wait_started(self._killed.pop(name, running), deadline):
                raise ClusterError(f"{name}'s processes were not started again in time")
        try:
            through_restarts(lambda: self.actors[name].where.remote(), deadline)
        except ray.exceptions.RayActorError:  # dead for good: a fresh actor, a fresh budget
            if group is not None:
                raise ClusterError(f"{name} died again while it started") from None
            who = dict(engine_plan(self.cfg.cluster))[name]
            spec = ProcessSpec(who.role, "", self.address, who.engine, who.node, who.group)
            self._start_actor(name, spec, who.role, who.engine)
        engine = str(self.engine_ids[name])
        client = self.client()
        wait_engine_alive(client, engine, True, deadline, f"{name} did not register again in time")

    def _restart_router(self, timeout_s: float | None) -> None:
        """Waits until Ray has restarted the router's actor, which starts the router again at
        its address (runtimes/ray_host.py), and every engine has registered with it."""
        import ray

        deadline = time.monotonic() + (timeout_s or self.start_timeout_s)
        router = self.actors["router"]
        try:
            address = through_restarts(
                lambda: router.address.remote(self.start_timeout_s), deadline
            )
        except ray.exceptions.ActorUnavailableError:
            raise ClusterError("the router's actor did not come back in time") from None
        except ray.exceptions.RayActorError as e:
            raise ClusterError(
                f"the router's actor is gone for good (ray.max_restarts): {e}"
            ) from None
        if address != self.address:
            raise ClusterError(f"the restarted router listens on {address}, not {self.address}")
        self._deadline = deadline
        self.wait_ready()

    def stop(self, timeout_s: float = 15.0) -> None:
        """Shuts the router down, waits for every process to end (copying what it wrote here
        when it ran on another node), then ends the actors, the placement group and a Ray this
        cluster started."""
        try:
            import ray
        except ImportError:
            return
        for group in self.groups.values():  # before the engines stop: no restarts now
            group.halt()
        shutdown_router(
            self.address if "router" in self.actors else "", self.credentials, self._clients
        )
        names = [n for n in self.actors if n != "router"] + (
            ["router"] if "router" in self.actors else []
        )
        refs = [self.actors[n].stop.remote(timeout_s) for n in names]
        for ref in refs:
            try:
                out = ray.get(ref, timeout=timeout_s + 15)
            except Exception:  # noqa: BLE001 - a dead actor has nothing to hand over
                continue
            for rel, data in out["files"].items():
                path = self.workdir / rel
                if not path.exists():  # another node's: a driver elsewhere gets a copy
                    path.parent.mkdir(parents=True, exist_ok=True)
                    path.write_bytes(data)
        for actor in self.actors.values():
            ray.kill(actor, no_restart=True)
        self.actors.clear()
        from ray.util.placement_group import remove_placement_group

        for group in [self.placement_group, *(g.placement_group for g in self.groups.values())]:
            if group is not None:
                remove_placement_group(group)
        self.placement_group = None
        for g in self.groups.values():
            g.placement_group = None
        if self._owns_ray:
            ray.shutdown()
            self._owns_ray = False
