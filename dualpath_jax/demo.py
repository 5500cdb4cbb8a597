"""`make demo`: Basic vs DualPath vs Oracle on a local CPU cluster with emulated storage links.

Embedded defaults: the tiny Qwen2 model, a file block store in a temporary directory, the
emulated `cpu_1p2d` layout (one prefill node, two decode nodes; each node's storage NIC is the
bottleneck, compute NICs 8x faster), and a small synthetic 64k-shaped agent trace scaled down
to run in a few minutes on 2 cores. Prints the comparison table, checks that every policy
produced the same tokens, saves the figure and says where.

`python -m dualpath_jax.demo [WORKDIR]` keeps the run directory (default: a temporary one whose
figure and summaries are copied to ./demo_out).
"""

from __future__ import annotations

import pathlib
import shutil
import sys
import tempfile

from dualpath_jax.experiment import compare
from dualpath_jax.metrics.compare import table
from dualpath_jax.metrics.plots import plot_comparison
from dualpath_jax.presets import emulated_cpu_experiment

POLICIES = ("basic", "dualpath", "oracle")


def main(argv: list[str]) -> int:
    cfg = emulated_cpu_experiment(1, 2, "tiny")
    keep = pathlib.Path(argv[1]) if len(argv) > 1 else None
    tmp = None if keep else tempfile.mkdtemp(prefix="dualpath_demo_")
    workdir = keep or pathlib.Path(tmp)
    print(
        f"dualpath_jax demo: {cfg.name}, model {cfg.model.name}, {cfg.workload.agents} agents, "
        f"storage NIC {cfg.hardware.snic_bytes_per_s / 1e6:g} MB/s per node (emulated); run dir {workdir}"
    )
    try:
        result = compare(cfg, POLICIES, workdir, progress=True)
        print()
        print(table(result))
        out = keep or pathlib.Path("demo_out")
        out.mkdir(parents=True, exist_ok=True)
        fig = plot_comparison(result, workdir, out / "demo.png")
        if tmp:
            shutil.copy(workdir / "comparison.json", out / "comparison.json")
        print(f"\nfigure: {fig.resolve()}")
        print(f"summaries: {(out / 'comparison.json').resolve() if tmp else workdir}")
        return 0 if result["tokens_identical"] else 1
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
