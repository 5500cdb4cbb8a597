"""Offline run on a local cluster: N agents start together; JCT = time until all finish.

Example:
  python launch/rollout.py --config=configs/cpu_1p2d.py --policy=dualpath --agents=8 --workdir=/tmp/dp_run
Writes config.json, events.jsonl, outputs.jsonl, summary.json (and logs/, links/) to --workdir.
"""

from __future__ import annotations

import _flags  # this directory's shared flags
from absl import app

from dualpath_jax import launcher
from dualpath_jax.experiment import run_local


def main(argv):
    del argv
    cfg = _flags.build_config("offline")
    wd = _flags.prepare_workdir(cfg)
    launcher.print_summary(run_local(cfg, wd))


if __name__ == "__main__":
    app.run(main)
