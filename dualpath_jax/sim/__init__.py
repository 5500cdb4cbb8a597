"""The cluster simulator (docs/simulator.md): the real scheduler over simulated nodes, links and GPUs.

    from dualpath_jax.sim import simulate, advise
    run = simulate(cfg)            # or simulate(cfg, cost=FittedCostModel(...))
    run.summary["jct_s"]
    report = advise(cfg, AdviseSpace(pd=((1, 2), (2, 1))))   # the deployment advisor

The public names are `__all__`; the modules below are internal.

`core.EventLoop` is the virtual clock, `network.SimNetwork` the links (real `LinkArbiter`),
`cluster.SimCluster` the router, engines and data paths (their state in `state`), `decode` a DE's
continuous batched decode, `leaders` when group leaders fetch, `agents` the agents' rounds,
`run.simulate` the offline/online driver.
"""

from dualpath_jax.sim.advisor import AdviseSpace, advise, format_report
from dualpath_jax.sim.run import SimRun, simulate, write_run
from dualpath_jax.sim.state import SimOptions

__all__ = [
    "AdviseSpace",
    "SimOptions",
    "SimRun",
    "advise",
    "format_report",
    "simulate",
    "write_run",
]
