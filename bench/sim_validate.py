"""Simulator vs the real local cluster: same config, same trace, measured and simulated JCT.

Run (about 10 minutes on 2 cores):
  python bench/sim_validate.py --workdir=/tmp/dp_sim_validate
  python bench/sim_validate.py --workdir=/tmp/dp_sim_validate --reuse   # re-fit, re-simulate only

For each config (default `cpu_1p1d` and `cpu_1p2d`, `tiny`: 8 agents) it runs every policy on a
fresh local cluster (`experiment.compare`, the same runs as `bench/compare_policies.py`),
fits one CPU cost model to the pooled `events.jsonl` of those runs (`sim.fit.fit_events`: prefill
batch times, decode step time and the per-request DE overhead), simulates each policy with it on
the same trajectories, and prints measured JCT, simulated JCT and the error. The `cross` columns
simulate with the *other* config's fit: a check that the fit is not just absorbing one run. The
`own` columns fit each run to its own events alone (the host's load during that very run).
Writes WORKDIR/validation.json and WORKDIR/<config>/cpu_fit.json (for
`launch/simulate.py --cost_json`).

Wall times on a shared 2-core host are noisy (other processes, three engine processes sharing
two cores): repeated real runs of one policy differed by up to 18% (README).
"""

from __future__ import annotations

import json
import pathlib

from absl import app, flags

from dualpath_jax.config import apply_overrides
from dualpath_jax.configs_loader import load_config
from dualpath_jax.experiment import compare, with_policy
from dualpath_jax.model.layout import kv_bytes_per_token
from dualpath_jax.sim import SimOptions, simulate
from dualpath_jax.sim.fit import fit_events

_CONFIGS = flags.DEFINE_list(
    "configs",
    ["configs/cpu_1p1d.py:tiny", "configs/cpu_1p2d.py:tiny"],
    "Experiment files (with :ARG).",
)
_POLICIES = flags.DEFINE_list("policies", ["basic", "dualpath"], "Policies to run and simulate.")
_SET = flags.DEFINE_multi_string("set", [], "Override `section.key=value` (repeatable).")
_WORKDIR = flags.DEFINE_string("workdir", "/tmp/dp_sim_validate", "Output directory.")
_REUSE = flags.DEFINE_bool(
    "reuse", False, "Reuse real runs already in WORKDIR (fit and simulate only)."
)
_WARMUP = flags.DEFINE_bool(
    "warmup", True, "One unmeasured replay first to fill the compilation cache."
)


def validate(
    configs: list[str],
    policies: list[str],
    workdir: pathlib.Path,
    *,
    reuse: bool,
    warmup: bool,
    overrides: list[str],
) -> dict:
    cfgs, fits, measured = {}, {}, {}
    for i, spec in enumerate(configs):
        cfg = apply_overrides(load_config(spec), overrides)
        name = cfg.name
        wd = workdir / name
        cfgs[name] = cfg
        have = all((wd / p / "summary.json").exists() for p in policies)
        if reuse and have:
            measured[name] = {
                p: json.loads((wd / p / "summary.json").read_text()) for p in policies
            }
        else:
            measured[name] = compare(cfg, policies, wd, warmup=warmup and i == 0)["summaries"]
        fits[name] = fit_events(
            [wd / p for p in policies],
            block_tokens=cfg.store.block_tokens,
            kv_bytes_per_token=kv_bytes_per_token(cfg.model),
        )
        # usable as `launch/simulate.py --cost_json=...` (FittedCostModel keys + decode_overhead_s)
        (wd / "cpu_fit.json").write_text(json.dumps(fits[name].to_dict(), indent=1))
    rows = []
    names = list(cfgs)
    for name, cfg in cfgs.items():
        other = names[(names.index(name) + 1) % len(names)]
        for p in policies:
            real = measured[name][p]
            row = {
                "config": name,
                "policy": p,
                "measured_jct_s": real["jct_s"],
                "measured_requests": real["requests"],
            }
            own = fit_events(
                [workdir / name / p],
                block_tokens=cfg.store.block_tokens,
                kv_bytes_per_token=kv_bytes_per_token(cfg.model),
            )
            for key, fit in (("sim", fits[name]), ("cross", fits[other]), ("own", own)):
                run = simulate(
                    with_policy(cfg, p),
                    cost=fit.cost,
                    options=SimOptions(decode_overhead_s=fit.decode_overhead_s),
                )
                row[f"{key}_jct_s"] = run.jct_s
                row[f"{key}_error_pct"] = 100 * (run.jct_s / real["jct_s"] - 1)
                row[f"{key}_requests"] = run.summary["requests"]
            rows.append(row)
    result = {
        "rows": rows,
        "fits": {n: f.to_dict() for n, f in fits.items()},
        "policies": policies,
        "configs": configs,
    }
    (workdir / "validation.json").write_text(json.dumps(result, indent=1))
    return result


def table(result: dict) -> str:
    head = (
        f"{'config':<10}{'policy':<10}{'measured s':>11}{'simulated s':>12}{'error':>8}"
        f"{'cross s':>9}{'cross err':>10}{'own s':>8}{'own err':>9}"
    )
    lines = [head, "-" * len(head)]
    for r in result["rows"]:
        lines.append(
            f"{r['config']:<10}{r['policy']:<10}{r['measured_jct_s']:11.1f}{r['sim_jct_s']:12.1f}"
            f"{r['sim_error_pct']:+7.1f}%{r['cross_jct_s']:9.1f}{r['cross_error_pct']:+9.1f}%"
            f"{r['own_jct_s']:8.1f}{r['own_error_pct']:+8.1f}%"
        )
    lines.append(
        "fits (prefill p0 s, p1 s/token, p2 s/pair; decode step s; DE overhead s per request):"
    )
    for name, f in result["fits"].items():
        p = f["prefill"]
        lines.append(
            f"  {name}: prefill ({p[0]:.4f}, {p[1]:.2e}, {p[2]:.2e}) step {f['decode'][0]:.4f} "
            f"overhead {f['decode_overhead_s']:.3f}  [{f['prefill_batches']} batches, rms "
            f"{f['prefill_rms_s']:.3f} s; {f['decode_requests']} requests, rms {f['decode_rms_s']:.3f} s]"
        )
    return "\n".join(lines)


def main(argv):
    del argv
    wd = pathlib.Path(_WORKDIR.value)
    wd.mkdir(parents=True, exist_ok=True)
    result = validate(
        _CONFIGS.value,
        _POLICIES.value,
        wd,
        reuse=_REUSE.value,
        warmup=_WARMUP.value,
        overrides=_SET.value,
    )
    print(table(result))
    bad = [r for r in result["rows"] if r["sim_requests"] != r["measured_requests"]]
    if bad:
        print(
            f"WARNING: request counts differ (real vs simulated) for {[(r['config'], r['policy']) for r in bad]}"
        )


if __name__ == "__main__":
    app.run(main)
