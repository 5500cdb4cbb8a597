"""The cluster simulator: the real scheduler over simulated nodes, links and GPUs (virtual time).

Example:
  python launch/simulate.py --config=configs/paper.py:ds660b_2p4d --policy=dualpath --agents=2048 --workdir=/tmp/dp_paper
  python launch/simulate.py --config=configs/cpu_1p1d.py --policy=dualpath --agents=16 --workdir=/tmp/dp_sim
  python launch/simulate.py --config=configs/cpu_1p2d.py --policy=basic --aps=0.5 --workdir=/tmp/dp_sim_on
  python launch/simulate.py --config=configs/cpu_1p2d.py --trace=/tmp/mooncake.jsonl --trace_format=mooncake --aps=0 --workdir=/tmp/dp_sim_mc
Same flags as launch/rollout.py (offline) and launch/serve.py (--aps: online; a Mooncake trace
with --aps=0 arrives at its own timestamps, docs/traces.md). Writes config.json,
summary.json (the launchers' keys plus `simulated` and `sim`), links/node<N>.json (per-link byte
series) and outputs.jsonl holding generated lengths only (`{"id", "rounds": [gen, ...],
"lengths_only": true}`): the simulator has no token ids.

Cost model: for GPU presets, the one the config's `hardware` names (the roofline of
`hardware.gpu`, calibrated unless `hardware.calibration=none`, with `fp8`, `ep_decode_nodes` and
`kv_format`; `configs/paper.py` sets them as the paper ran); for `gpu="cpu"` a FittedCostModel
from --cost_json (`FittedCostModel.to_json`, or a fit written by bench/sim_validate.py, whose
`decode_overhead_s` is used too), else the prefill model a PE would batch with (the config's
`cluster.prefill_cost_json`, or calibrated on this host as a PE calibrates at start) with no
decode cost.

Advisor (`--advise`, `sim.advise`): sweeps P/D splits (every split of --advise_nodes nodes, default
the config's P+D, or the --advise_pd list), --advise_alpha_s and --advise_beta_s (default: the
config's values x 0.5, 1, 2), simulates each candidate with the config's policy, prints a table
and the best by JCT (offline) or by APS capacity under the SLO (with --advise_aps: the rates to
try), beside the bottleneck-free P/D range, and writes advise.json. A config file that defines
`config_for_split(arg, P, D)` (configs/paper.py: each split's HBM for KV) gives each candidate
its own base config:
  python launch/simulate.py --config=configs/cpu_1p2d.py:tiny --advise --workdir=/tmp/dp_advise
  python launch/simulate.py --config=configs/cpu_1p2d.py:tiny --advise --advise_aps=0.5,1,2 --workdir=/tmp/dp_advise_on
"""

from __future__ import annotations

import json
import pathlib

import _flags  # this directory's shared flags
from absl import app, flags, logging

from dualpath_jax import launcher, native
from dualpath_jax.configs_loader import split_configurer

_NATIVE = flags.DEFINE_enum(
    "native",
    "auto",
    list(native.MODES),
    "The simulator's compiled core (make native): auto (used when a fresh build exists), on "
    "(required), off (the pure Python modules; same results).",
)

_APS = flags.DEFINE_float("aps", None, "Agent arrivals per second (online mode).")
_DURATION = flags.DEFINE_float("duration_s", None, "Online arrivals stop after this many seconds.")
_COST = flags.DEFINE_string("cost_json", None, "FittedCostModel JSON (gpu='cpu' configs).")
_QUANTUM = flags.DEFINE_float("quantum_s", 0.05, "Link time per granted chunk (simulator detail).")
_LEADERS = flags.DEFINE_bool(
    "leader_phases",
    True,
    "Group leaders fetch as the engine loops do (between batches/steps, on their own timers); "
    "false: one synchronous fetch pass of every group per interval (the earlier model).",
)
_ADVISE = flags.DEFINE_bool(
    "advise", False, "Sweep P/D, alpha and beta; report the best (advise.json)."
)
_ADV_NODES = flags.DEFINE_integer(
    "advise_nodes", 0, "Total nodes split into P and D (0: the config's P+D)."
)
_ADV_PD = flags.DEFINE_string(
    "advise_pd", "", "Explicit P/D splits, e.g. 1p2d,2p4d (overrides --advise_nodes)."
)
_ADV_ALPHA = flags.DEFINE_list(
    "advise_alpha_s", [], "alpha seconds to try (default: config x 0.5,1,2)."
)
_ADV_BETA = flags.DEFINE_list(
    "advise_beta_s", [], "beta seconds to try (default: config x 0.5,1,2)."
)
_ADV_APS = flags.DEFINE_list(
    "advise_aps", [], "Online: arrival rates to try; the objective becomes APS capacity."
)
_ADV_ATTAIN = flags.DEFINE_float(
    "advise_attainment", 0.9, "Online: SLO attainment a rate must reach."
)


def main(argv):
    del argv
    native.use(_NATIVE.value)  # before the simulator's modules are imported
    from dualpath_jax.sched.cost import FittedCostModel
    from dualpath_jax.sim import SimOptions, simulate, write_run

    online = _APS.value is not None
    mode, workload = (
        "online" if online else "offline",
        dict(aps=_APS.value, duration_s=_DURATION.value),
    )
    cfg = _flags.build_config(mode, **workload)
    wd = _flags.prepare_workdir(cfg)
    cost, overhead = None, 0.0
    if _COST.value:
        text = pathlib.Path(_COST.value).read_text()
        cost = FittedCostModel.from_json(text)
        overhead = float(json.loads(text).get("decode_overhead_s", 0.0))
    elif cfg.hardware.gpu == "cpu" and cfg.cluster.prefill_cost_json:
        cost = FittedCostModel.from_json(cfg.cluster.prefill_cost_json)
    elif cfg.hardware.gpu == "cpu":
        from dualpath_jax.engines.calibrate import calibrate
        from dualpath_jax.engines.params import load_served_model
        from dualpath_jax.model.runner import ModelRunner

        cal = calibrate(ModelRunner(load_served_model(cfg)), cfg)
        logging.warning(
            "gpu='cpu' without --cost_json: prefill %s, calibrated on this host; decode steps"
            " cost 0",
            cal.model.prefill,
        )
        cost = cal.model
    options = SimOptions(
        quantum_s=_QUANTUM.value, decode_overhead_s=overhead, leader_phases=_LEADERS.value
    )
    if _ADVISE.value:
        # Each candidate split from the config file's `config_for_split` when it has one (its
        # hardware depends on the split), with the same --set and flags applied.
        split = split_configurer(_flags.CONFIG.value)
        configure = None
        if split is not None:
            configure = lambda p, d: _flags.apply_flags(split(p, d), mode, **workload)  # noqa: E731
        return advise_main(cfg, wd, cost, options, configure)
    run = simulate(cfg, cost=cost, options=options)
    write_run(run, wd)
    logging.info(
        "simulated %.1f s in %.2f s wall (%d events, %.0f events/s)",
        run.jct_s,
        run.wall_s,
        run.events,
        run.summary["sim"]["events_per_s"],
    )
    launcher.print_summary(run.summary)


def advise_main(cfg, wd, cost, options, configure) -> None:
    from dualpath_jax.sim import advisor as adv

    sc, cl = cfg.scheduler, cfg.cluster
    pd = (
        adv.parse_pd(_ADV_PD.value)
        if _ADV_PD.value
        else adv.pd_splits(_ADV_NODES.value or cl.prefill_nodes + cl.decode_nodes)
    )
    space = adv.AdviseSpace(
        pd=pd,
        alpha_s=tuple(map(float, _ADV_ALPHA.value)) or tuple(sc.alpha_s * k for k in (0.5, 1, 2)),
        beta_s=tuple(map(float, _ADV_BETA.value)) or tuple(sc.beta_s * k for k in (0.5, 1, 2)),
    )
    rates = tuple(map(float, _ADV_APS.value))
    logging.info(
        "advising over %d candidates (%s)",
        len(space.candidates()),
        "APS capacity" if rates else "JCT",
    )
    report = adv.advise(
        cfg,
        space,
        cost=cost,
        configure=configure,
        options=options,
        objective="capacity" if rates else "jct",
        aps=rates,
        attainment=_ADV_ATTAIN.value,
    )
    (wd / "advise.json").write_text(json.dumps(report, indent=1, default=str))
    print(adv.format_report(report))
    print(
        f"{len(report['candidates'])} candidates simulated in {report['wall_s']:.1f} s; wrote {wd / 'advise.json'}"
    )


if __name__ == "__main__":
    app.run(main)
