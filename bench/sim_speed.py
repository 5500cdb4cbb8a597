"""Simulator speed: events per second and CPU time on the paper's hardware (one core).

`cpu_s` (process CPU time of the simulation) is the one-core figure on a shared machine, where
wall time also counts other processes. The run is `configs/paper.py:ds660b_<P>p<D>d` (the
paper's cluster and calibrated cost model, the same runs as `bench/paper_figures.py`) with the
flags' agents, policy, rounds and expert-parallel group.

    python bench/sim_speed.py --agents=2048                  # 2P4D, 2,048 agents, full 64K trace
    python bench/sim_speed.py --agents=49152 --prefill_nodes=48 --decode_nodes=96   # 48P96D, 48K

`--max_turns=N` replays the first N rounds only (a measured fraction); `--profile=N` prints the
N costliest functions (cProfile, cumulative); `--nopause_gc` keeps Python's cyclic collector
running during the simulation. `--native=auto` (the default) runs the compiled core when a fresh
build exists (`make native`), `--native=off` the pure modules, `--native=on` requires the build;
`native` in the output says which ran.
"""

from __future__ import annotations

import cProfile
import io
import json
import pstats
import resource
import time

from absl import app, flags

from dualpath_jax import load_config, native
from dualpath_jax.config import Policy

_NATIVE = flags.DEFINE_enum(
    "native", "auto", list(native.MODES), "Compiled core: auto (if a fresh build exists), on, off."
)
_AGENTS = flags.DEFINE_integer("agents", 64, "Agents (offline, all at t=0).")
_POLICY = flags.DEFINE_enum("policy", "dualpath", [p.value for p in Policy], "Policy.")
_P = flags.DEFINE_integer("prefill_nodes", 2, "P.")
_D = flags.DEFINE_integer("decode_nodes", 4, "D.")
_TURNS = flags.DEFINE_integer("max_turns", 0, "Rounds per trajectory (0: all).")
_PAUSE_GC = flags.DEFINE_bool(
    "pause_gc", True, "Python's cyclic collector off while the loop runs (`simulate(pause_gc=)`)."
)
_QUANTUM = flags.DEFINE_float("quantum_s", 0.05, "Link time per granted chunk.")
_PROFILE = flags.DEFINE_integer("profile", 0, "Print the N costliest functions (cProfile).")
_FAST_LINKS = flags.DEFINE_bool("fast_links", True, "One event per uncontended transfer.")
_EP = flags.DEFINE_integer(
    "ep_decode_nodes", 0, "Decode nodes per expert-parallel group (0: all D)."
)
_LEADERS = flags.DEFINE_bool(
    "leader_phases", True, "Leaders fetch as the engine loops do (False: one pass per interval)."
)


def main(argv):
    del argv
    native.use(_NATIVE.value)  # before the simulator's modules are imported
    from dualpath_jax.sim import SimOptions, simulate

    cfg = load_config(
        f"paper:ds660b_{_P.value}p{_D.value}d,policy={_POLICY.value},agents={_AGENTS.value},"
        f"max_turns={_TURNS.value},ep_decode_nodes={_EP.value}"
    )
    opts = SimOptions(
        quantum_s=_QUANTUM.value, fast_links=_FAST_LINKS.value, leader_phases=_LEADERS.value
    )
    prof = cProfile.Profile() if _PROFILE.value else None
    if prof:
        prof.enable()
    t0, c0 = time.perf_counter(), time.process_time()
    run = simulate(cfg, options=opts, pause_gc=_PAUSE_GC.value)
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
