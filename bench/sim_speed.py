"""Simulator speed: events per second and CPU time on the paper's hardware (one core).

`cpu_s` (process CPU time of the simulation) is the one-core figure on a shared machine, where
wall time also counts other processes. The default `--preset=paper` is the paper's cluster as
`presets.paper_experiment("ds660b", P, D)` builds it, the config of
`configs/paper.py:ds660b_<P>p<D>d` (the same runs as `bench/paper_figures.py`).

    python bench/sim_speed.py --agents=2048                  # 2P4D, 2,048 agents, full 64K trace
    python bench/sim_speed.py --agents=49152 --prefill_nodes=48 --decode_nodes=96   # 48P96D, 48K

`--max_turns=N` replays the first N rounds only (a measured fraction); `--profile=N` prints the
N costliest functions (cProfile, cumulative); `--model` applies to `--preset=engine_groups`;
`--nopause_gc` keeps Python's cyclic collector running during the simulation. `--native=auto`
(the default) runs the compiled core when a fresh build exists (`make native`), `--native=off`
the pure modules, `--native=on` requires the build; `native` in the output says which ran.
"""

from __future__ import annotations

import cProfile
import io
import json
import pstats
import resource
import time

from absl import app, flags

from dualpath_jax import native
from dualpath_jax.config import (
    ClusterConfig,
    ExperimentConfig,
    Policy,
    SchedulerConfig,
    WorkloadConfig,
)
from dualpath_jax.presets import HOPPER_NODE, get_preset

_NATIVE = flags.DEFINE_enum(
    "native", "auto", list(native.MODES), "Compiled core: auto (if a fresh build exists), on, off."
)
_AGENTS = flags.DEFINE_integer("agents", 64, "Agents (offline, all at t=0).")
_POLICY = flags.DEFINE_enum("policy", "dualpath", [p.value for p in Policy], "Policy.")
_P = flags.DEFINE_integer("prefill_nodes", 2, "P.")
_D = flags.DEFINE_integer("decode_nodes", 4, "D.")
_MODEL = flags.DEFINE_string("model", "deepseek-v3.2-660b", "Model preset.")
_TURNS = flags.DEFINE_integer("max_turns", 0, "Rounds per trajectory (0: all).")
_PAUSE_GC = flags.DEFINE_bool(
    "pause_gc", True, "Python's cyclic collector off while the loop runs (`simulate(pause_gc=)`)."
)
_QUANTUM = flags.DEFINE_float("quantum_s", 0.05, "Link time per granted chunk.")
_PROFILE = flags.DEFINE_integer("profile", 0, "Print the N costliest functions (cProfile).")
_FAST_LINKS = flags.DEFINE_bool("fast_links", True, "One event per uncontended transfer.")
_BLIND = flags.DEFINE_list(
    "class_blind_links",
    [],
    "Link kinds served FIFO whatever the class (SimOptions.class_blind_links), e.g. dram.",
)
_EP = flags.DEFINE_integer(
    "ep_decode_nodes", 0, "--preset=paper: decode nodes per expert-parallel group (0: all D)."
)
_LEADERS = flags.DEFINE_bool(
    "leader_phases", True, "Leaders fetch as the engine loops do (False: one pass per interval)."
)
_PRESET = flags.DEFINE_enum(
    "preset",
    "paper",
    ["paper", "engine_groups"],
    "paper: presets.paper_experiment('ds660b', P, D) (per-node PE/DE groups of 8, "
    "HBM for KV after the weights, calibrated roofline); engine_groups: HOPPER_NODE "
    "with one-engine groups and 80 GB of KV per DE (the configuration of the first "
    "speed measurements).",
)


def paper_config(
    agents: int, policy: str, p: int, d: int, model: str, max_turns: int = 0
) -> ExperimentConfig:
    """The paper's testbed (HOPPER_NODE) with the 64K trace; prefill batch limits lifted."""
    return ExperimentConfig(
        name=f"paper_{p}p{d}d",
        model=get_preset(model),
        hardware=HOPPER_NODE,
        cluster=ClusterConfig(
            prefill_nodes=p,
            decode_nodes=d,
            decode_slots=256,
            decode_max_len=65536,
            prefill_max_batch=0,
            prefill_max_tokens=0,
            fetch_interval_s=0.005,
        ),
        scheduler=SchedulerConfig(policy=Policy(policy)),
        workload=WorkloadConfig(
            preset="64k", trajectories=min(agents, 500), agents=agents, max_turns=max_turns
        ),
    )


def main(argv):
    del argv
    native.use(_NATIVE.value)  # before the simulator's modules are imported
    from dualpath_jax.sim import SimOptions, simulate

    cost = None
    if _PRESET.value == "paper":
        from dualpath_jax.presets import paper_experiment

        cfg, cost = paper_experiment(
            "ds660b",
            _P.value,
            _D.value,
            policy=_POLICY.value,
            agents=_AGENTS.value,
            max_turns=_TURNS.value,
            ep_decode_nodes=_EP.value,
        )
    else:
        cfg = paper_config(
            _AGENTS.value, _POLICY.value, _P.value, _D.value, _MODEL.value, _TURNS.value
        )
    opts = SimOptions(
        kv_format="fp8_flashmla",
        quantum_s=_QUANTUM.value,
        fast_links=_FAST_LINKS.value,
        class_blind_links=tuple(_BLIND.value),
        leader_phases=_LEADERS.value,
    )
    prof = cProfile.Profile() if _PROFILE.value else None
    if prof:
        prof.enable()
    t0, c0 = time.perf_counter(), time.process_time()
    run = simulate(cfg, cost=cost, options=opts, pause_gc=_PAUSE_GC.value)
    total, cpu = time.perf_counter() - t0, time.process_time() - c0
    if prof:
        prof.disable()
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(_PROFILE.value)
        print(out.getvalue())
    s = run.summary
    print(
        json.dumps(
            {
                "config": cfg.name,
                "agents": cfg.workload.agents,
                "policy": cfg.scheduler.policy.value,
                "requests": s["requests"],
                "jct_s": s["jct_s"],
                "errors": s["errors"],
                "cpu_s": cpu,
                "total_wall_s": total,
                "loop_wall_s": run.wall_s,
                "events": run.events,
                "events_per_cpu_s": run.events / cpu,
                "events_per_s": run.events / run.wall_s,
                # The compiled core ran (`dualpath_jax.native`; --native=off: pure).
                "native": native.active(),
                # Peak resident memory of this process (Linux reports KiB).
                "max_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
                "snic_max_over_avg": s["snic_max_over_avg"],
                "ttft_mean_s": s["ttft_s"]["mean"],
                "tpot_mean_s": s["tpot_s"]["mean"],
                "sim": s["sim"],
            },
            indent=1,
            default=str,
        )
    )


if __name__ == "__main__":
    app.run(main)
