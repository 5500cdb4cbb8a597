"""What runs inside each actor of a `RayCluster` (runtimes/ray_cluster.py): `ProcessHost` owns one
cluster process, the router or an engine, started as `LocalCluster` starts it
(`runtimes.local.spawn_process`: `python -m dualpath_jax.runtimes SPEC CONFIG`, its own JAX
runtime, its log in `workdir/logs/NAME.log` on the actor's node).

A plain class (`RayCluster` wraps it with `ray.remote`), so importing it imports no Ray. The
secrets arrive as a constructor argument (a Ray object), and the host writes them to a 0600 file
of its node's workdir that only its process reads: never a command line.

Failures: the process watches its parent (the actor's worker) and stops when it is gone, so a
node or actor that dies takes its engine with it. An engine or router that dies on its own (exit
status not 0) ends its actor too, so Ray restarts it (`ray.max_restarts`). A restarted engine's
host waits until the router has declared the old engine dead before it starts the new one under
the same id, which then registers with a fresh transfer address. A restarted router's host
starts the router again at the old one's address (its port, from `workdir/router.address`),
serving the params it served (`ProcessSpec.resume`): the engines register with it again and
clients reconnect (docs/failures.md, "A router started again").

A process of an engine spanning several (`runtimes.ray_span`): the leader's host (rank 0) picks
the group's `jax.distributed` coordinator, a free port of its node (`coordinator()`); each
follower's host gets it as a Ray object of the leader's answer and starts its process with it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pathlib
import socket
import subprocess
import sys
import threading
import time
import warnings
from typing import Any

from dualpath_jax.config import ExperimentConfig, from_json
from dualpath_jax.runtimes.local import engine_stats, free_port, log_tail, spawn_process
from dualpath_jax.runtimes.process import ProcessSpec
from dualpath_jax.wire.client import Client
from dualpath_jax.wire.credentials import Credentials, write_credentials

log = logging.getLogger(__name__)


def wait_port_free(host: str, port: int, timeout_s: float = 15.0) -> None:
    """Returns once `port` of `host` can be bound (or after `timeout_s`: the bind's own error
    then says why)."""
    deadline = time.monotonic() + timeout_s
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    while time.monotonic() < deadline:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
                return
            except OSError:
                time.sleep(0.1)


class ProcessHost:
    """One router or engine process, owned by a Ray actor."""

    def __init__(
        self,
        name: str,
        spec: dict[str, Any],
        cfg_json: str,
        workdir: str,
        secrets: list,
        bind_node_ip: bool = False,
        coordinator: list | None = None,
    ):
        """`secrets`: `[ref]`, a Ray object holding `{"engine": ..., "client": ...}` (nested in
        a list, so this host fetches it, also when Ray restarts it). `coordinator`: for a
        follower of a spanning engine, `[ref]` of its leader's `coordinator()`."""
        import ray

        ctx = ray.get_runtime_context()
        self.name = name
        self.node_id = ctx.get_node_id()
        self.workdir = pathlib.Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.log_path = self.workdir / "logs" / f"{name}.log"
        self.stopping = threading.Event()
        cfg = from_json(ExperimentConfig, cfg_json)
        creds = Credentials(**ray.get(secrets[0]))
        secrets_dir = self.workdir / "secrets"
        secrets_dir.mkdir(mode=0o700, exist_ok=True)
        secrets_file = secrets_dir / f"{name}.json"
        write_credentials(secrets_file, creds)
        c = dataclasses.replace(cfg.cluster, secrets_file=str(secrets_file))
        role = spec["role"]
        with warnings.catch_warnings():  # deprecated, without a replacement yet
            warnings.simplefilter("ignore", DeprecationWarning)
            restarted = ctx.was_current_actor_reconstructed
        old_address = ""
        if role == "router" and restarted and (self.workdir / "router.address").exists():
            old_address = (self.workdir / "router.address").read_text().strip()
            c = dataclasses.replace(c, router_port=int(old_address.rsplit(":", 1)[1]))
        if bind_node_ip:  # an engine's `host` is where a spanning leader publishes its calls
            ip = ray.util.get_node_ip_address()
            c = dataclasses.replace(
                c, **({"host": ip} if role == "router" else {"host": ip, "transfer_host": ip})
            )
        self.cfg = dataclasses.replace(cfg, cluster=c)
        self.spec = ProcessSpec(**{**spec, "workdir": str(self.workdir), "parent_pid": os.getpid()})
        if role == "router":
            self.address_file = self.workdir / "router.address"
            self.address_file.unlink(missing_ok=True)
            self.spec = dataclasses.replace(
                self.spec, address_file=str(self.address_file), resume=bool(old_address)
            )
            if old_address:  # the old router may still hold its port for a moment
                wait_port_free(c.host, c.router_port)
        elif self.spec.span_rank == 0:  # a restarted engine: its old process may be registered
            self._wait_declared_dead(creds.engine)
        if self.spec.span_size > 1:
            if self.spec.span_rank == 0:  # the group's coordinator: a port of this node
                host = c.transfer_host if bind_node_ip else "127.0.0.1"  # as LocalCluster
                address = f"{host}:{free_port(host)}"
            else:
                address = ray.get(coordinator[0])
            self.spec = dataclasses.replace(self.spec, coordinator=address)
        self.proc = spawn_process(sys.executable, self.cfg, self.spec, self.log_path, None)
        threading.Thread(target=self._watch, name=f"{name}-watch", daemon=True).start()

    def _wait_declared_dead(self, token: str) -> None:
        """Until the router does not take this engine's id for alive (it refuses a second
        registration of a live id): at once on a first start. A router that does not answer
        yet (a loaded host) is asked again (`engine_stats`)."""
        c = self.cfg.cluster
        deadline = time.monotonic() + 3 * c.heartbeat_timeout_s + 30
        client = Client(self.spec.router_address, token)
        try:
            while time.monotonic() < deadline:
                engines = engine_stats(client, deadline, timeout_s=5.0)
                if not engines.get(str(self.spec.engine), {}).get("alive"):
                    return
                time.sleep(0.2)
        finally:
            client.close()

    def _watch(self) -> None:
        code = self.proc.wait()
        if self.stopping.is_set() or code == 0:
            return
        # An engine that failed ends its actor: Ray restarts it (within ray.max_restarts).
        print(f"{self.name} exited with {code}:\n{log_tail(self.log_path)}", file=sys.stderr)
        sys.stderr.flush()
        os._exit(1)

    # ------------------------------------------------------------------ calls from the driver

    def address(self, timeout_s: float) -> str:
        """The router's control address, once it listens."""
        deadline = time.monotonic() + timeout_s
        while not self.address_file.exists():
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited with {self.proc.returncode}:\n{log_tail(self.log_path)}"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{self.name} did not listen in time:\n{log_tail(self.log_path)}"
                )
            time.sleep(0.05)
        return self.address_file.read_text().strip()

    def coordinator(self) -> str:
        """The `jax.distributed` coordinator (host:port) of this leader's engine group."""
        return self.spec.coordinator

    def wait_exit(self) -> int:
        """Returns the process's exit status once it has ended (an engine group's supervisor
        waits on each of its processes)."""
        return self.proc.wait()

    def where(self) -> dict[str, Any]:
        """The node this host runs on and its process."""
        import ray

        return {
            "node_id": self.node_id,
            "ip": ray.util.get_node_ip_address(),
            "pid": self.proc.pid,
            "returncode": self.proc.poll(),
        }

    def log_tail(self, chars: int = 2000) -> str:
        return log_tail(self.log_path, chars)

    def kill_process(self, quiet: bool = False) -> None:
        """Kills the process (fault injection): its actor ends with it and Ray restarts it.
        `quiet`: the actor stays (its group is being stopped)."""
        if quiet:
            self.stopping.set()
        self.proc.kill()
        if quiet:
            self.proc.wait()

    def stop(self, timeout_s: float = 15.0) -> dict[str, Any]:
        """Waits for the process to end (the router stops its engines), ends it if it does not,
        and returns its exit status and what it wrote (relative path -> bytes: its log, the
        router's event log, an engine's link report) for a driver on another node."""
        self.stopping.set()
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        paths = [self.log_path]
        if self.spec.role == "router":
            paths += sorted(self.workdir.glob("events.jsonl*"))
        else:
            paths.append(self.workdir / "links" / f"{self.name}.json")
        files = {
            p.relative_to(self.workdir).as_posix(): p.read_bytes() for p in paths if p.is_file()
        }
        return {"returncode": self.proc.returncode, "files": files}
