"""The cluster simulator (docs/simulator.md): the real scheduler over simulated nodes, links and GPUs.

    from dualpath_jax.sim import simulate
    run = simulate(cfg)            # or simulate(cfg, cost=FittedCostModel(...))
    run.summary["jct_s"]

`core.EventLoop` is the virtual clock, `network.SimNetwork` the links (real `LinkArbiter`),
`cluster.SimCluster` the router, engines and data paths (their state in `state`), `decode` a DE's
continuous batched decode, `leaders` when group leaders fetch, `agents` the agents' rounds,
`run.simulate` the offline/online driver.
"""

from dualpath_jax.sim.agents import round_hit, schedule_agents
from dualpath_jax.sim.cluster import SimCluster
from dualpath_jax.sim.core import Event, EventLoop
from dualpath_jax.sim.network import SimLink, SimNetwork
from dualpath_jax.sim.run import (
    SimRun,
    build_agents,
    simulate,
    write_run,
)
from dualpath_jax.sim.state import RoundResult, SimOptions

__all__ = [
    "Event",
    "EventLoop",
    "RoundResult",
    "SimCluster",
    "SimLink",
    "SimNetwork",
    "SimOptions",
    "SimRun",
    "build_agents",
    "round_hit",
    "schedule_agents",
    "simulate",
    "write_run",
]
