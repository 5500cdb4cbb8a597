"""The cluster simulator: the real scheduler over simulated nodes, links and GPUs (virtual time).

Example:
  python launch/simulate.py --config=configs/cpu_1p1d.py --policy=dualpath --agents=16 --workdir=/tmp/dp_sim
  python launch/simulate.py --config=configs/cpu_1p2d.py --policy=basic --aps=0.5 --workdir=/tmp/dp_sim_on
Same flags as launch/rollout.py (offline) and launch/serve.py (--aps: online). Writes config.json,
summary.json (the launchers' keys plus `simulated` and `sim`), links/node<N>.json (per-link byte
series) and outputs.jsonl holding generated lengths only (`{"id", "rounds": [gen, ...],
"lengths_only": true}`): the simulator has no token ids.

Cost model: the roofline of `hardware.gpu` for GPU presets; for `gpu="cpu"` a FittedCostModel
from --cost_json (`FittedCostModel.to_json`), else the CPU engines' prefill constants with no
decode cost.
"""

from __future__ import annotations

import pathlib
import sys

from absl import app, flags, logging

sys.path.insert(0, __import__("os").path.dirname(__file__))
import _common  # noqa: E402

from dualpath_jax.sched.cost import FittedCostModel  # noqa: E402
from dualpath_jax.sim import SimOptions, simulate, write_run  # noqa: E402

_APS = flags.DEFINE_float("aps", None, "Agent arrivals per second (online mode).")
_DURATION = flags.DEFINE_float("duration_s", None, "Online arrivals stop after this many seconds.")
_COST = flags.DEFINE_string("cost_json", None, "FittedCostModel JSON (gpu='cpu' configs).")
_QUANTUM = flags.DEFINE_float("quantum_s", 0.01, "Link time per granted chunk (simulator detail).")


def main(argv):
    del argv
    online = _APS.value is not None
    cfg = _common.build_config("online" if online else "offline", aps=_APS.value, duration_s=_DURATION.value)
    wd = _common.prepare_workdir(cfg)
    cost = None
    if _COST.value:
        cost = FittedCostModel.from_json(pathlib.Path(_COST.value).read_text())
    elif cfg.hardware.gpu == "cpu":
        from dualpath_jax.engine.process import CPU_PREFILL_COST

        logging.warning("gpu='cpu' without --cost_json: CPU prefill constants, decode steps cost 0")
        cost = FittedCostModel(prefill=CPU_PREFILL_COST)
    run = simulate(cfg, cost=cost, options=SimOptions(quantum_s=_QUANTUM.value))
    write_run(run, wd)
    logging.info("simulated %.1f s in %.2f s wall (%d events, %.0f events/s)", run.jct_s, run.wall_s,
                 run.events, run.summary["sim"]["events_per_s"])
    _common.print_summary(run.summary)


if __name__ == "__main__":
    app.run(main)
