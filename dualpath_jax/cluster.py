"""A disaggregated cluster from Python: `LocalCluster` starts a router and its prefill and decode
engine processes on this host; `Client` talks to any router (local or multi-host).

    from dualpath_jax import cluster, rollout

    with cluster.LocalCluster(cfg, "/tmp/dp_run") as c:
        session = rollout.Session(c.client(), "traj-0")
        tokens = session.step([1, 2, 3], 8)

Failure kinds, secrets and liveness: docs/failures.md; several hosts: docs/multihost.md.
"""

from __future__ import annotations

from dualpath_jax.engine.client import Client, RolloutError
from dualpath_jax.engine.cluster import ClusterError, LocalCluster
from dualpath_jax.engine.credentials import Credentials, read_credentials, write_credentials

__all__ = [
    "Client",
    "ClusterError",
    "Credentials",
    "LocalCluster",
    "RolloutError",
    "read_credentials",
    "write_credentials",
]
