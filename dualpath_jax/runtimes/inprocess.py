"""InProcessCluster: the router and every engine as threads of this process.

    with InProcessCluster(cfg, workdir) as cluster:
        client = cluster.client()
        ...

The same router, engines, scheduler and loader code as `LocalCluster`, assembled by the same
`runtimes.build.build_router` / `build_engine`, with two things swapped: the control plane binds a
ZeroMQ `inproc://` endpoint (every frame is still encoded, signed and checked), and KV moves over
an `InProcessChannel` on one shared `InProcessFabric` instead of `jax.experimental.transfer`.
Tokens are identical to a `LocalCluster`'s (tests/integration/test_inprocess_cluster.py); start-up
costs one JAX runtime instead of one per engine, and compiled programs are shared by engines of
the same shapes. It is the runtime for tests, policy sweeps and first experiments; what needs
processes stays with `LocalCluster`: engines spanning processes, KV over sockets, separate
device sets per process, measuring real engine isolation.

Devices: engines whose mesh spans several devices (`cluster.prefill_mesh`/`decode_mesh`) get
disjoint slices of this process's devices in engine order (e.g. with
`XLA_FLAGS=--xla_force_host_platform_device_count=8`); one-device engines share the default
device. `kill(name)` ends an engine's thread without a goodbye (its channel dies at once, the
router notices the silence after `cluster.heartbeat_timeout_s`); `restart(name)` starts it again.
Log lines of every thread go to `workdir/logs/inprocess.log`, each with its thread's name.
"""

from __future__ import annotations

import logging
import os
import pathlib
import threading
import time
import uuid
from collections.abc import Sequence

from dualpath_jax.config import ExperimentConfig, mesh_size
from dualpath_jax.engines.core import EngineId
from dualpath_jax.logs import RateLimit
from dualpath_jax.runtimes import devices as engine_devices
from dualpath_jax.runtimes.build import BuiltEngine, Transport, build_engine, build_router
from dualpath_jax.runtimes.local import (
    ClusterError,
    ClusterLifecycle,
    engine_plan,
    prepare_workdir,
    wait_engine_alive,
    wait_registered,
)
from dualpath_jax.transfer.inprocess_channel import InProcessChannel, InProcessFabric
from dualpath_jax.wire.client import Client
from dualpath_jax.wire.credentials import Credentials
from dualpath_jax.wire.params_protocol import check_params_config

log = logging.getLogger(__name__)


class _EngineThread:
    """One engine's thread and what it built (`built` once assembled)."""

    def __init__(self, cluster: InProcessCluster, who: EngineId, devices: Sequence | None):
        self.who, self.devices = who, devices
        self.halt = threading.Event()
        self.gate = threading.Event()  # clear: frozen before its next turn (`freeze`)
        self.gate.set()
        self.built: BuiltEngine | None = None
        self.channel: InProcessChannel | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(
            target=self._run, args=(cluster,), name=who.name, daemon=True
        )

    def _channel(self, cluster: InProcessCluster, bind: str) -> InProcessChannel:  # noqa: ARG002
        device = self.devices[0] if self.devices else None
        self.channel = InProcessChannel(cluster.fabric, self.who.name, device=device)
        return self.channel

    def _run(self, cluster: InProcessCluster) -> None:
        transport = Transport(
            router_address=cluster.address,
            token=cluster.credentials.engine,
            channel=lambda bind: self._channel(cluster, bind),
            devices=self.devices,
            on_router_lost=self.halt.set,
        )
        try:
            self.built = build_engine(cluster.cfg, self.who, str(cluster.workdir), transport)
            self.built.halt, self.built.gate = self.halt, self.gate
            with self.built:
                self.built.run()
        except BaseException as e:  # noqa: BLE001 - reported by the cluster
            if not self.halt.is_set():
                log.exception("%s failed", self.who.name)
                self.error = e

    def kill(self) -> None:
        self.halt.set()
        self.gate.set()  # (a frozen one ends without another turn)
        if self.channel is not None:
            self.channel.close()  # pulls from it fail now, as a dead process's do


class InProcessCluster(ClusterLifecycle):
    """A router plus P prefill and D decode engines, as threads of this process.

    The surface of `LocalCluster`: a context manager (`start`, `stop`), `client()`, `address`,
    `credentials`, `workdir`, `engine_ids`, `kill(name)`, `restart(name)`; the same
    `events.jsonl`, link reports and `config.json` in `workdir`. `errors` maps an engine or
    `router` to the exception that ended its thread."""

    def __init__(
        self,
        cfg: ExperimentConfig,
        workdir: str | os.PathLike,
        *,
        start_timeout_s: float = 180.0,
        devices: Sequence | None = None,
    ):
        """`devices`: the devices engines may use (None: this process's local devices)."""
        if cfg.hardware.engines_per_node != 1:
            raise ValueError("InProcessCluster runs one engine per node (engines_per_node=1)")
        c = cfg.cluster
        if c.prefill_processes > 1 or c.decode_processes > 1:
            raise ValueError(
                "engines spanning several processes (cluster.prefill_processes / "
                "decode_processes > 1) need LocalCluster"
            )
        check_params_config(c)
        self.cfg = cfg
        self.workdir = pathlib.Path(workdir).absolute()
        self.start_timeout_s = start_timeout_s
        self.fabric = InProcessFabric()
        self.credentials = Credentials()
        self.address = ""
        self.engine_ids: dict[str, int] = {}
        self.errors: dict[str, BaseException] = {}
        self._devices = devices
        self._engines: dict[str, _EngineThread] = {}
        self._router_thread: threading.Thread | None = None
        self._router = None
        self._clients: list[Client] = []
        self._log_handler: logging.Handler | None = None

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        self.cfg, self.credentials = prepare_workdir(self.cfg, self.workdir)
        self._start_logging()
        endpoint = f"inproc://dualpath-router-{uuid.uuid4().hex[:12]}"
        self._router = build_router(self.cfg, str(self.workdir), endpoint=endpoint)
        self.address = self._router.address
        self._router_thread = threading.Thread(target=self._serve, name="router", daemon=True)
        self._router_thread.start()
        slices = self._device_slices()
        for name, who in engine_plan(self.cfg.cluster):
            self.engine_ids[name] = who.engine
            self._engines[name] = _EngineThread(self, who, slices[who.engine])
        for t in self._engines.values():
            t.thread.start()
        wait_registered(
            self.client(),
            len(self.engine_ids),
            self._check_alive,
            time.monotonic() + self.start_timeout_s,
        )

    def _serve(self) -> None:
        try:
            self._router.serve()
        except BaseException as e:  # noqa: BLE001 - reported by stop()
            log.exception("the router failed")
            self.errors["router"] = e

    def _device_slices(self) -> dict[int, list | None]:
        """Each engine's devices: a disjoint slice for multi-device meshes, None (the default
        device) for one-device engines."""
        import jax

        available = list(self._devices if self._devices is not None else jax.local_devices())
        out: dict[int, list | None] = {}
        at = 0
        for k, role in enumerate(engine_devices.engine_roles(self.cfg.cluster)):
            n = mesh_size(engine_devices.role_mesh(self.cfg.cluster, role))
            if n == 1:
                out[k] = None if self._devices is None else available[:1]
                continue
            if at + n > len(available):
                raise ClusterError(
                    f"engine {k} ({role}) needs {n} devices; only {len(available) - at} of "
                    f"{len(available)} are left (set XLA_FLAGS=--xla_force_host_platform_"
                    "device_count on CPU)"
                )
            out[k] = available[at : at + n]
            at += n
        return out

    def _check_alive(self, names: Sequence[str] | None = None) -> None:
        for name, t in self._engines.items():
            if names is not None and name not in names:
                continue
            if t.error is not None:
                raise ClusterError(f"{name} failed during start: {t.error!r}") from t.error
            if not t.thread.is_alive() and not t.halt.is_set():
                raise ClusterError(f"{name} ended during start")
        if "router" in self.errors:
            raise ClusterError(f"the router failed: {self.errors['router']!r}")

    def _start_logging(self) -> None:
        logs = self.workdir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        handler = logging.FileHandler(logs / "inprocess.log")
        handler.setFormatter(
            logging.Formatter("%(asctime)s %(threadName)s %(levelname)s %(name)s: %(message)s")
        )
        handler.setLevel(logging.INFO)
        handler.addFilter(RateLimit(names=("dualpath_jax",)))  # as engine processes' logs
        package = logging.getLogger("dualpath_jax")
        if package.level == logging.NOTSET or package.level > logging.INFO:
            package.setLevel(logging.INFO)
        package.addHandler(handler)
        self._log_handler = handler

    def client(self, **kw) -> Client:
        """A client holding the client secret (`Client` keyword arguments pass through; by
        default `params_dir` is `workdir/params`: `update_params` writes checkpoints there;
        `params_dir=None` streams them over the transfer layer instead)."""
        kw.setdefault("params_dir", self.workdir / "params")
        kw.setdefault(
            "params_channel", lambda: InProcessChannel(self.fabric, "client", offer_ttl_s=None)
        )
        c = Client(self.address, self.credentials.client, **kw)
        self._clients.append(c)
        return c

    def kill(self, name: str) -> None:
        """Ends engine `name` without telling the router (fault injection), e.g. `kill("de1")`."""
        t = self._engine(name)
        t.kill()
        t.thread.join(30)

    def freeze(self, name: str, frozen: bool = True) -> None:
        """Stops engine `name` before its next turn (it sends nothing more, its heartbeat goes
        on), or lets it go on (`frozen=False`): what SIGSTOP / SIGCONT do to an engine process
        (fault injection: a test kills it once it knows what it holds)."""
        gate = self._engine(name).gate
        if frozen:
            gate.clear()
        else:
            gate.set()

    def restart(self, name: str, timeout_s: float | None = None) -> None:
        """Starts engine `name` again under its old id, once the router has declared the old
        one dead; waits until it has registered."""
        old = self._engine(name)
        if old.thread.is_alive():
            raise ClusterError(f"{name} is still running; kill it first")
        client = self.client()
        engine = str(old.who.engine)
        deadline = time.monotonic() + (timeout_s or self.start_timeout_s)
        wait_engine_alive(
            client, engine, False, deadline, f"the router still takes {name} for alive"
        )
        t = self._engines[name] = _EngineThread(self, old.who, old.devices)
        t.thread.start()
        wait_engine_alive(
            client, engine, True, deadline, f"{name} did not register again in time",
            check=lambda: self._check_alive([name]),
        )  # fmt: skip

    def _engine(self, name: str) -> _EngineThread:
        if name not in self._engines:
            raise ValueError(f"no engine {name!r}; engines: {sorted(self._engines)}")
        return self._engines[name]

    def stop(self, timeout_s: float = 30.0) -> None:
        """Shuts the router down (it stops every engine), then waits for every thread; an
        engine that does not stop in time is halted."""
        if self._router_thread is not None and self._router_thread.is_alive():
            try:
                c = Client(self.address, self.credentials.engine)  # Shutdown is the admin's
                c.shutdown(timeout_s=5.0)
                c.close()
            except Exception:  # noqa: BLE001 - the router is stopped below anyway
                self._router.router.stopping = True
            self._router_thread.join(timeout_s)
        for c in self._clients:
            c.close()
        self._clients.clear()
        deadline = time.monotonic() + timeout_s
        for t in self._engines.values():
            if t.thread.ident is not None:
                t.thread.join(max(0.1, deadline - time.monotonic()))
            if t.thread.is_alive():
                log.warning("%s did not stop in time: halting it", t.who.name)
                t.kill()
                t.thread.join(10)
        for name, t in self._engines.items():
            if t.error is not None:
                self.errors[name] = t.error
        if self._router is not None:
            self._router.close()
            self._router = None
        if self._log_handler is not None:
            logging.getLogger("dualpath_jax").removeHandler(self._log_handler)
            self._log_handler.close()
            self._log_handler = None

    def alive(self) -> dict[str, bool]:
        """Whether each thread (router and engines) is still running."""
        out = {name: t.thread.is_alive() for name, t in self._engines.items()}
        out["router"] = self._router_thread is not None and self._router_thread.is_alive()
        return out
