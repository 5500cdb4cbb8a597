"""Online run on a local cluster: Poisson agent arrivals at --aps for --duration_s (or --agents).

Example:
  python launch/serve.py --config=configs/cpu_1p2d.py --policy=dualpath --aps=0.5 --agents=8 --workdir=/tmp/dp_online
Reports TTFT, TTST, TPOT, JCT and SLO attainment (workload.ttft_slo_s / workload.tpot_slo_s).
"""

from __future__ import annotations

import _flags  # this directory's shared flags
from absl import app, flags

from dualpath_jax import launcher
from dualpath_jax.experiment import run_local
from dualpath_jax.workload.formats import TIMED_FORMATS

_APS = flags.DEFINE_float("aps", None, "Agent arrivals per second.")
_DURATION = flags.DEFINE_float(
    "duration_s", None, "Arrivals stop after this many seconds (0: use --agents)."
)


def main(argv):
    del argv
    cfg = _flags.build_config("online", aps=_APS.value, duration_s=_DURATION.value)
    w = cfg.workload
    if w.aps <= 0 and not (w.trace and w.trace_format in TIMED_FORMATS):
        raise app.UsageError(
            "online runs need --aps > 0 (or workload.aps, or a timed trace: mooncake, weka,"
            " tracelab)"
        )
    wd = _flags.prepare_workdir(cfg)
    launcher.print_summary(run_local(cfg, wd))


if __name__ == "__main__":
    app.run(main)
