"""Child-process entry used by `LocalCluster`: `python -m dualpath_jax.runtimes SPEC_JSON CONFIG_JSON`.

Both arguments are JSON texts (a ProcessSpec and an ExperimentConfig); people start processes
with `launch/engine.py`, which has flags. `kill -USR1 PID` writes every thread's Python stack to
the process's log (faulthandler), to see where a process is stuck or what its threads are.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import signal
import sys

from dualpath_jax.config import ExperimentConfig, from_json
from dualpath_jax.logs import install_rate_limit
from dualpath_jax.runtimes.process import ProcessSpec, run_process


def main(argv: list[str]) -> None:
    if len(argv) != 3:
        raise SystemExit("usage: python -m dualpath_jax.runtimes SPEC_JSON CONFIG_JSON")
    spec = ProcessSpec(**json.loads(argv[1]))
    cfg = from_json(ExperimentConfig, argv[2])
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s {spec.role}{'' if spec.role == 'router' else spec.engine} %(levelname)s %(name)s: %(message)s",
    )
    install_rate_limit()  # a flood of garbage frames must not flood the log
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    run_process(cfg, spec)


if __name__ == "__main__":
    main(sys.argv)
