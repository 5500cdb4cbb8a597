"""A disaggregated cluster from Python: `LocalCluster` starts a router and its prefill and decode
engine processes on this host; `InProcessCluster` runs the same router and engines as threads of
this process (tests, sweeps, first experiments: one JAX runtime, identical tokens); `RayCluster`
runs them as Ray actors placed by resources on a Ray cluster of any size (the `ray` extra;
Ray is imported only when one starts); `Client` talks to any router (local or multi-host).

    from dualpath_jax import cluster, rollout

    with cluster.LocalCluster(cfg, "/tmp/dp_run") as c:
        session = rollout.Session(c.client(), "traj-0")
        tokens = session.step([1, 2, 3], 8)

What a run wrote: `read_events(workdir / "events.jsonl")` (the router's per-request events),
`read_link_reports(workdir)` (each engine's bytes per link, written when it stops) and
`link_totals(reports)` (bytes per link name over the whole cluster).

Failure kinds, secrets and liveness: docs/failures.md; several hosts: docs/multihost.md.
"""

from __future__ import annotations

from dualpath_jax.metrics.events import read_events
from dualpath_jax.metrics.summary import link_totals, read_link_reports
from dualpath_jax.runtimes.inprocess import InProcessCluster
from dualpath_jax.runtimes.local import ClusterError, LocalCluster
from dualpath_jax.runtimes.ray_cluster import RayCluster
from dualpath_jax.wire.client import Client, RolloutError
from dualpath_jax.wire.credentials import Credentials, read_credentials, write_credentials

__all__ = [
    "Client",
    "ClusterError",
    "Credentials",
    "InProcessCluster",
    "LocalCluster",
    "RayCluster",
    "RolloutError",
    "link_totals",
    "read_credentials",
    "read_events",
    "read_link_reports",
    "write_credentials",
]
