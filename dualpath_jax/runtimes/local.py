"""LocalCluster: a router plus P prefill and D decode engine processes on this host.

    with LocalCluster(cfg, workdir) as cluster:
        client = cluster.client()
        ...

Each process is `python -m dualpath_jax.runtimes SPEC CONFIG` with its own log in `workdir/logs`.
The cluster waits until every engine has registered, restarts nothing silently (`restart(name)`
does on request), and on exit (also on Ctrl-C or a failing test) asks the router to shut down
and then ends every process it started, by PID. One engine per node: each engine process is a
node with its own storage NIC.

Devices: each engine process starts with the environment `runtimes.devices.engine_env` gives it
(`cluster.platform`: its own GPUs, TPU chips or CPU host devices, as many as its role's mesh
spans; `cluster.device_memory_fraction`), on top of `env` (default: this process's environment).

Secrets: without `cluster.secrets_file` the cluster writes fresh engine and client secrets to
`workdir/secrets.json` (mode 0600) for its processes to read; `client()` holds the client
secret only, so a client can neither register an engine nor stop the router.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence

from dualpath_jax.config import ClusterConfig, ExperimentConfig, to_json
from dualpath_jax.engines.core import EngineId
from dualpath_jax.runtimes import devices
from dualpath_jax.runtimes.process import ProcessSpec
from dualpath_jax.wire.client import Client, RolloutError
from dualpath_jax.wire.credentials import Credentials, read_credentials, write_credentials
from dualpath_jax.wire.params_protocol import check_params_config


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now (for a coordinator that must be named before it starts)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


START_TIMEOUT_S = 180.0
WARMUP_START_TIMEOUT_S = 1800.0


class ClusterError(RuntimeError):
    """The cluster could not start (a process died or did not register in time)."""


class ClusterLifecycle:
    """A cluster runtime as a context manager: entering starts it (a failed start stops what
    did start), leaving stops it. Runtimes define `start()` and `stop()`."""

    def start(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def prepare_workdir(
    cfg: ExperimentConfig, workdir: pathlib.Path
) -> tuple[ExperimentConfig, Credentials]:
    """Creates `workdir`, reads the configured secrets or writes fresh ones to
    `workdir/secrets.json` (naming them in the returned config), and writes `config.json`."""
    workdir.mkdir(parents=True, exist_ok=True)
    if cfg.cluster.secrets_file:
        credentials = read_credentials(cfg.cluster.secrets_file)
    else:
        path = workdir / "secrets.json"
        credentials = write_credentials(path)
        cfg = dataclasses.replace(
            cfg, cluster=dataclasses.replace(cfg.cluster, secrets_file=str(path))
        )
    (workdir / "config.json").write_text(to_json(cfg, indent=1))
    return cfg, credentials


def engine_plan(cluster: ClusterConfig) -> list[tuple[str, EngineId]]:
    """Every engine of a cluster, in id order: prefill engines, then decode engines, one per
    node (`pe0`, `pe1`, `de2`, ...); groups of `pe_group_size` / `de_group_size`."""
    out = []
    engine = 0
    for role, count in (("prefill", cluster.prefill_nodes), ("decode", cluster.decode_nodes)):
        size = cluster.pe_group_size if role == "prefill" else cluster.de_group_size
        for i in range(count):
            who = EngineId(role, engine, engine, i // size)
            out.append((who.name, who))
            engine += 1
    return out


def wait_registered(
    client: Client, engines: int, check_alive: Callable[[], None], deadline: float
) -> None:
    """Waits until `engines` engines are registered and alive at the router (`check_alive`
    raises when one of them died meanwhile)."""
    while True:
        check_alive()
        registered = engine_stats(client, deadline)
        if sum(1 for e in registered.values() if e["alive"]) == engines:
            return
        if time.monotonic() > deadline:
            raise ClusterError(f"only {len(registered)} of {engines} engines registered")
        time.sleep(0.1)


def engine_stats(client: Client, deadline: float, timeout_s: float = 30.0) -> dict[str, dict]:
    """The router's engines (`Client.stats(timeout_s)["engines"]`); a router that does not
    answer yet (it is starting, or restarting, on a loaded host) is asked again until
    `deadline`."""
    while True:
        try:
            return client.stats(timeout_s).get("engines", {})
        except RolloutError as e:
            if e.kind != "connection" or time.monotonic() > deadline:
                raise ClusterError(f"the router did not answer: {e}") from e
            time.sleep(0.5)


def wait_engine_alive(
    client: Client,
    engine: str,
    alive: bool,
    deadline: float,
    error: str,
    check: Callable[[], None] | None = None,
) -> None:
    """Until the router takes `engine` (its id) for alive, or (`alive=False`) no longer does;
    `check` runs between asks (it raises when the engine died meanwhile), `error` is the
    ClusterError's message past `deadline`."""
    while bool(engine_stats(client, deadline).get(engine, {}).get("alive")) != alive:
        if check is not None:
            check()
        if time.monotonic() > deadline:
            raise ClusterError(error)
        time.sleep(0.1)


def spawn_process(
    python: str,
    cfg: ExperimentConfig,
    spec: ProcessSpec,
    log_path: pathlib.Path,
    env: Mapping[str, str] | None,
) -> subprocess.Popen:
    """Starts one cluster process, `python -m dualpath_jax.runtimes SPEC CONFIG`, its output
    appended to `log_path`, in `env` (None: this process's environment)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log = open(log_path, "ab")  # noqa: SIM115 - owned by the child
    try:
        return subprocess.Popen(
            [python, "-m", "dualpath_jax.runtimes", json.dumps(spec.__dict__), to_json(cfg)],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=None if env is None else dict(env),
            start_new_session=True,  # Ctrl-C in the parent reaches only the parent; we stop them
        )
    finally:
        log.close()


def shutdown_router(address: str, credentials: Credentials, clients: list[Client]) -> None:
    """Asks the router at `address` ("": none running) to shut down, with the engine secret
    (Shutdown is the admin's), then closes and forgets the cluster's `clients`. A router that
    does not answer is the caller's to end."""
    if address:
        try:
            c = Client(address, credentials.engine)
            c.shutdown(timeout_s=5.0)
            c.close()
        except Exception:  # noqa: BLE001 - the caller ends it anyway
            pass
    for c in clients:
        c.close()
    clients.clear()


def log_tail(path: pathlib.Path, chars: int = 2000) -> str:
    """The last `chars` characters of a process log ("" before it exists)."""
    return path.read_text(errors="replace")[-chars:] if path.exists() else ""


class LocalCluster(ClusterLifecycle):
    def __init__(
        self,
        cfg: ExperimentConfig,
        workdir: str | os.PathLike,
        *,
        python: str = sys.executable,
        env: Mapping[str, str] | None = None,
        start_timeout_s: float | None = None,
        host_devices: Sequence[str] | None = None,
    ):
        """`env`: the processes' environment (None: this process's). `host_devices`: the ids of
        the host's GPUs or TPU chips the engines may use (`cluster.platform` gpu or tpu; None:
        those `env` makes visible). `start_timeout_s`: how long engines may take to register
        (default 180 s; 1,800 s with `cluster.warmup`, which compiles every shape first)."""
        if cfg.hardware.engines_per_node != 1:
            raise ValueError("LocalCluster runs one engine per node (hardware.engines_per_node=1)")
        check_params_config(cfg.cluster)
        self.cfg = cfg
        self.workdir = pathlib.Path(workdir).absolute()
        self.python = python
        self.env = env
        if start_timeout_s is None:
            start_timeout_s = WARMUP_START_TIMEOUT_S if cfg.cluster.warmup else START_TIMEOUT_S
        self.start_timeout_s = start_timeout_s
        # Each engine's environment, by engine id (checked now: too few devices fail here).
        base = dict(os.environ if env is None else env)  # the process boundary: engines inherit
        c = cfg.cluster
        host = (
            tuple(host_devices)
            if host_devices is not None
            else devices.host_devices(c.platform, base)
        )
        self.router_env = {**base, **devices.router_env(c)}
        # by engine id, then by process of the engine (one unless it spans several)
        self.engine_envs = [
            [
                {**base, **devices.engine_env(c, k, host, base, rank)}
                for rank in range(devices.processes(c, role))
            ]
            for k, role in enumerate(devices.engine_roles(c))
        ]
        self.procs: dict[str, subprocess.Popen] = {}
        self.specs: dict[str, ProcessSpec] = {}
        self.engine_ids: dict[str, int] = {}
        self.credentials = Credentials()
        self.address = ""
        self._clients: list[Client] = []

    # ------------------------------------------------------------------ lifecycle

    def _spawn(
        self, name: str, spec: ProcessSpec, cfg: ExperimentConfig | None = None
    ) -> subprocess.Popen:
        if spec.role == "router":
            env = self.router_env
        else:
            env = self.engine_envs[spec.engine][spec.span_rank]
        log_path = self.workdir / "logs" / f"{name}.log"
        p = spawn_process(self.python, cfg or self.cfg, spec, log_path, env)
        self.procs[name] = p
        self.specs[name] = spec
        return p

    def start(self, wait: bool = True) -> None:
        """Starts the router and the engines; `wait`: until every engine has registered (else
        call `wait_ready`, e.g. while a server reports that it is starting)."""
        self.cfg, self.credentials = prepare_workdir(self.cfg, self.workdir)
        deadline = time.monotonic() + self.start_timeout_s
        self.address = self._start_router(deadline)
        c = self.cfg.cluster
        for name, who in engine_plan(c):
            span = devices.processes(c, who.role)
            spec = ProcessSpec(
                who.role,
                str(self.workdir),
                self.address,
                who.engine,
                who.node,
                who.group,
                parent_pid=os.getpid(),
                span_size=span,
                coordinator=f"127.0.0.1:{free_port()}" if span > 1 else "",
            )
            self._spawn(name, spec)
            for rank in range(1, span):  # the processes that follow it (`engines.span`)
                self._spawn(f"{name}.{rank}", dataclasses.replace(spec, span_rank=rank))
            self.engine_ids[name] = who.engine
        self._deadline = deadline
        if wait:
            self.wait_ready()

    def _start_router(self, deadline: float, port: int = 0) -> str:
        """Starts the router process (on `port`, 0: the configured one); returns its address.
        With a port it is a restart over running engines (`ProcessSpec.resume`)."""
        addr_file = self.workdir / "router.address"
        addr_file.unlink(missing_ok=True)
        cfg = self.cfg
        if port:
            cfg = dataclasses.replace(
                cfg, cluster=dataclasses.replace(cfg.cluster, router_port=port)
            )
        spec = ProcessSpec(
            "router",
            str(self.workdir),
            address_file=str(addr_file),
            parent_pid=os.getpid(),
            resume=bool(port),
        )
        self._spawn("router", spec, cfg)
        while not addr_file.exists():
            self._check_alive(["router"])
            if time.monotonic() > deadline:
                raise ClusterError("the router did not start in time; see logs/router.log")
            time.sleep(0.05)
        return addr_file.read_text().strip()

    def wait_ready(self) -> None:
        """Returns once every engine has registered (warm, with `cluster.warmup`); raises
        ClusterError when one died or the start timed out."""
        wait_registered(self.client(), len(self.engine_ids), self._check_alive, self._deadline)

    def _check_alive(self, names: list[str] | None = None) -> None:
        for name, p in self.procs.items():
            if names is not None and name not in names:
                continue
            if p.poll() is not None:
                tail = log_tail(self.workdir / "logs" / f"{name}.log")
                raise ClusterError(f"{name} exited with {p.returncode} during start:\n{tail}")

    def client(self, **kw) -> Client:
        """A client holding the client secret (`Client` keyword arguments pass through; by
        default `params_dir` is `workdir/params`: `update_params` writes checkpoints there;
        `params_dir=None` streams them over the transfer layer instead)."""
        kw.setdefault("params_dir", self.workdir / "params")
        kw.setdefault("transfer_host", self.cfg.cluster.transfer_host)
        c = Client(self.address, self.credentials.client, **kw)
        self._clients.append(c)
        return c

    def kill(self, name: str) -> None:
        """Kills one engine process (fault injection), e.g. `kill("de1")`."""
        p = self.procs[name]
        p.kill()
        p.wait(10)

    def restart(self, name: str, timeout_s: float | None = None) -> None:
        """Starts engine `name` again (after `kill`, or after it died) under its old id, once
        the router has declared the old process dead; waits until it has registered.

        `restart("router")` starts the router again (after `kill("router")`, or after it died)
        at its old address, serving the params its predecessor served; the engines register
        with it again (within `cluster.router_timeout_s` of the old one's end, else they stop
        themselves), and clients reconnect by themselves: the rounds the old router had
        taken fail with kind `connection`, its sessions are gone (their stored KV stays)."""
        if name == "router":
            return self._restart_router(timeout_s)
        if name not in self.engine_ids:
            raise ValueError(
                f"restart takes 'router' or an engine name, one of {sorted(self.engine_ids)}"
            )
        if self.specs[name].span_size > 1:
            raise ClusterError(f"{name} spans several processes; restart the cluster instead")
        p = self.procs[name]
        if p.poll() is None:
            raise ClusterError(f"{name} is still running (pid {p.pid}); kill it first")
        engine = str(self.engine_ids[name])
        client = self.client()
        deadline = time.monotonic() + (timeout_s or self.start_timeout_s)
        wait_engine_alive(
            client, engine, False, deadline, f"the router still takes {name} for alive"
        )
        self._spawn(name, self.specs[name])
        wait_engine_alive(
            client, engine, True, deadline, f"{name} did not register again in time",
            check=lambda: self._check_alive([name]),
        )  # fmt: skip

    def _restart_router(self, timeout_s: float | None) -> None:
        p = self.procs["router"]
        if p.poll() is None:
            raise ClusterError(f"the router is still running (pid {p.pid}); kill it first")
        deadline = time.monotonic() + (timeout_s or self.start_timeout_s)
        port = int(self.address.rsplit(":", 1)[1])
        if self._start_router(deadline, port) != self.address:
            raise ClusterError(f"the restarted router does not listen on {self.address}")
        self._deadline = deadline
        self.wait_ready()

    def stop(self, timeout_s: float = 15.0) -> None:
        """Shuts the router down, then ends every process this cluster started."""
        running = "router" in self.procs and self.procs["router"].poll() is None
        shutdown_router(self.address if running else "", self.credentials, self._clients)
        deadline = time.monotonic() + timeout_s
        for p in self.procs.values():
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.terminate()
        for p in self.procs.values():
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
