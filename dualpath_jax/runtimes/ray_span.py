"""Engines spanning several processes under `RayCluster` (runtimes/ray_cluster.py): placed, started
and restarted as one gang.

An engine whose mesh spans N processes (`cluster.prefill_processes` / `decode_processes`; how
they split the work: engines/span.py) is N actors, named as `LocalCluster` names its processes:
`de1` (process 0, the leader: the engine the router knows) and `de1.1` ... `de1.{N-1}` (its
followers), one `jax.distributed` world of their own.

Placement: a placement group per such engine, N bundles of its role's resources (each
process's share of the engine's devices: `ray.decode_resources="GPU=4"` for a `tensor=8` mesh
over two processes), with `ray.span_strategy` (`STRICT_PACK` by default: the processes share a
node; `STRICT_SPREAD`: one per node, which needs `ray.bind_node_ip`). Ray reserves the N bundles
together or not at all, and the N actors are created together: the leader's host picks the
world's coordinator, a free port of its node, and each follower's host reads it from the
leader's answer (a Ray object) before starting its process.

Failures: a `jax.distributed` world cannot take back a process it lost, so Ray does not restart
these actors one by one (`max_restarts=0`). A supervisor thread of the driver waits on every
process of the group; when one ends while the cluster runs (its process failed or stopped, its
actor or its node died) it kills the others' processes and actors and starts the whole group
again in its bundles (Ray places them again once a node replaces a dead one), up to
`ray.max_restarts` times. The new leader registers under the engine's id once the router has
declared the old one dead; the router requeues what the old one held. A group out of restarts
stays down until `RayCluster.restart(name)` revives it.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Any

from dualpath_jax.engines.core import EngineId
from dualpath_jax.runtimes.process import ProcessSpec

log = logging.getLogger(__name__)

_POLL_S = 0.5


class SpanGroup:
    """The actors of one engine spanning `size` processes, and their supervisor. `cluster` is
    the `RayCluster` (its `_start_actor`, `_resources`, `cfg`, `address`)."""

    def __init__(self, cluster, name: str, who: EngineId, size: int):
        self.cluster, self.name, self.who, self.size = cluster, name, who, size
        self.names = [name, *(f"{name}.{rank}" for rank in range(1, size))]
        self.placement_group = None
        self.actors: list[Any] = []  # by rank
        self.generation = 0  # how many times the group has been started
        self.restarts = 0
        self.given_up = False
        self.stopping = threading.Event()
        self._revive = threading.Event()
        self._thread: threading.Thread | None = None

    def bundles(self) -> list[dict[str, float]]:
        """A bundle of the role's resources per process."""
        return [self.cluster._resources(self.who.role) for _ in range(self.size)]

    def place(self):
        """Asks Ray for the group's bundles (all or none); returns the placement group."""
        from ray.util.placement_group import placement_group

        strategy = self.cluster.cfg.ray.span_strategy
        self.placement_group = placement_group(self.bundles(), strategy=strategy)
        return self.placement_group

    def start(self) -> None:
        """Starts the group's actors and its supervisor."""
        self._start_actors()
        self._thread = threading.Thread(target=self._supervise, name=f"{self.name}-gang")
        self._thread.daemon = True
        self._thread.start()

    def _start_actors(self) -> None:
        who = self.who
        spec = ProcessSpec(
            who.role, "", self.cluster.address, who.engine, who.node, who.group, span_size=self.size
        )
        start = self.cluster._start_actor
        leader = start(
            self.name, spec, who.role, who.engine, bundle=(self.placement_group, 0), max_restarts=0
        )
        coordinator = [leader.coordinator.remote()]  # nested: each follower's host fetches it
        followers = [
            start(
                self.names[rank],
                dataclasses.replace(spec, span_rank=rank),
                who.role,
                who.engine,
                bundle=(self.placement_group, rank),
                max_restarts=0,
                coordinator=coordinator,
            )
            for rank in range(1, self.size)
        ]
        self.actors = [leader, *followers]
        self.generation += 1

    def _supervise(self) -> None:
        import ray

        while not self.stopping.is_set():
            refs = [a.wait_exit.remote() for a in self.actors]
            ready: list = []
            while not ready:
                if self.stopping.is_set():
                    return
                ready, _ = ray.wait(refs, num_returns=1, timeout=_POLL_S)
            if self.stopping.is_set():
                return
            ended = self.names[refs.index(ready[0])]
            try:
                why = f"exited with {ray.get(ready[0])}"
            except Exception as e:  # noqa: BLE001 - the actor died: say how
                why = f"died ({type(e).__name__})"
            self._kill()
            if self.restarts >= self.cluster.cfg.ray.max_restarts:
                log.error("%s %s; the group is out of restarts: down until restart()", ended, why)
                self.given_up = True
                while not self._revive.wait(_POLL_S):
                    if self.stopping.is_set():
                        return
                self._revive.clear()
                self.given_up, self.restarts = False, 0
            else:
                self.restarts += 1
                log.warning("%s %s: restarting %s (%d)", ended, why, self.names, self.restarts)
            if self.stopping.is_set():
                return
            self._start_actors()

    def _kill(self) -> None:
        """Ends every process of the group and its actor (one that is gone already is skipped)."""
        import ray

        for actor in self.actors:
            try:
                ray.get(actor.kill_process.remote(quiet=True), timeout=15)
            except Exception:  # noqa: BLE001 - dead already: its process stops with its worker
                pass
            ray.kill(actor, no_restart=True)

    def revive(self) -> None:
        """Starts a group that is out of restarts again, with a fresh budget."""
        self._revive.set()

    def wait_started(self, generation: int, deadline: float) -> bool:
        """Waits until the group has been started more than `generation` times, reviving it
        meanwhile if it is out of restarts."""
        while self.generation <= generation:
            if time.monotonic() > deadline or self.stopping.is_set():
                return False
            if self.given_up:
                self.revive()
            time.sleep(0.1)
        return True

    def halt(self, timeout_s: float = 60.0) -> None:
        """Stops supervising (before the cluster stops the actors)."""
        self.stopping.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
