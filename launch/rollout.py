"""Offline run on a local cluster: N agents start together; JCT = time until all finish.

Example:
  python launch/rollout.py --config=configs/cpu_1p2d.py --policy=dualpath --agents=8 --workdir=/tmp/dp_run
Writes config.json, events.jsonl, outputs.jsonl, summary.json (and logs/, links/) to --workdir.
"""

from __future__ import annotations

import sys

from absl import app

sys.path.insert(0, __import__("os").path.dirname(__file__))
import _common  # noqa: E402

from dualpath_jax.experiment import run_local  # noqa: E402


def main(argv):
    del argv
    cfg = _common.build_config("offline")
    wd = _common.prepare_workdir(cfg)
    _common.print_summary(run_local(cfg, wd))


if __name__ == "__main__":
    app.run(main)
