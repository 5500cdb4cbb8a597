"""Policies side by side on one config and trace: table, token check and figures.

Run:
  python bench/compare_policies.py --config=configs/cpu_1p2d.py --workdir=/tmp/dp_compare
  python bench/compare_policies.py --config=configs/cpu_1p1d.py --policies=basic,dualpath,oracle
Writes WORKDIR/<policy>/{summary.json,outputs.jsonl,...}, WORKDIR/comparison.json and
WORKDIR/compare.png, and prints the table.
"""

from __future__ import annotations

import pathlib

from absl import app, flags

from dualpath_jax.config import apply_overrides
from dualpath_jax.configs_loader import load_config
from dualpath_jax.experiment import compare
from dualpath_jax.metrics.compare import table
from dualpath_jax.metrics.plots import plot_comparison

_CONFIG = flags.DEFINE_string("config", "configs/cpu_1p2d.py", "Experiment file.")
_SET = flags.DEFINE_multi_string("set", [], "Override `section.key=value` (repeatable).")
_POLICIES = flags.DEFINE_list(
    "policies",
    ["basic", "layerwise", "dualpath_rr", "dualpath", "split", "oracle"],
    "Policies, in order.",
)
_WORKDIR = flags.DEFINE_string("workdir", "/tmp/dp_compare", "Output directory.")
_WARMUP = flags.DEFINE_bool("warmup", True, "Replay once unmeasured to fill the compilation cache.")


def main(argv):
    del argv
    cfg = apply_overrides(load_config(_CONFIG.value), _SET.value)
    wd = pathlib.Path(_WORKDIR.value)
    result = compare(cfg, _POLICIES.value, wd, warmup=_WARMUP.value)
    print(table(result))
    print(f"figure: {plot_comparison(result, wd, wd / 'compare.png')}")
    if not result["tokens_identical"]:
        raise SystemExit(f"tokens differ between policies: {result['mismatches'][:5]}")


if __name__ == "__main__":
    app.run(main)
