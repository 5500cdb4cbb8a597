"""RayCluster beside LocalCluster: start-up time and one policy comparison through each runtime.

For each runtime (LocalCluster: processes started here; RayCluster: the same processes as Ray
actors of a local Ray, started by this script) and each policy, in one run: start the cluster,
replay the config's workload offline, stop it. Reports start seconds, each policy's JCT, the
JCT ratio of the first policy over the second per runtime (Ray adds nothing on the data path,
so the ratios should agree within noise) and whether every runtime gave the same tokens. A
first, unmeasured replay per runtime fills the compilation cache (`--warmup`). `--repeats=N`
measures N rounds, each running both runtimes back to back (so drift of a shared machine
reaches both alike), and reports each round's ratios and their range.

    python bench/ray_cluster.py --config=configs/cpu_1p2d.py:tiny --repeats=3 --json

Needs the `ray` extra.
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
import time

from absl import app, flags

_CONFIG = flags.DEFINE_string("config", "configs/cpu_1p2d.py:tiny", "config file[:arg]")
_SET = flags.DEFINE_multi_string("set", [], "Override `section.key=value` (repeatable).")
_POLICIES = flags.DEFINE_list("policies", ["basic", "dualpath"], "two policies, compared")
_NUM_CPUS = flags.DEFINE_integer("num_cpus", 4, "CPUs of the local Ray (one per actor)")
_WARMUP = flags.DEFINE_bool("warmup", True, "one unmeasured replay per runtime first")
_REPEATS = flags.DEFINE_integer("repeats", 1, "measured rounds, both runtimes in each")
_JSON = flags.DEFINE_bool("json", False, "print one JSON object instead of a table")


def one_run(make_cluster, cfg, trajs) -> dict:
    from dualpath_jax.rollout import run_trajectories

    with tempfile.TemporaryDirectory() as workdir:
        t0 = time.monotonic()
        cluster = make_cluster(cfg, workdir)
        cluster.start()
        try:
            start_s = time.monotonic() - t0
            client = cluster.client()
            t = time.monotonic()
            outs = run_trajectories(client, trajs, progress=False)
            jct_s = time.monotonic() - t
        finally:
            cluster.stop()
    errors = [o.error for o in outs if o.error]
    return {
        "start_s": start_s,
        "jct_s": jct_s,
        "errors": len(errors),
        "tokens": {o.id: o.rounds for o in outs},
    }


def main(argv):
    del argv
    import ray

    from dualpath_jax import apply_overrides, load_config
    from dualpath_jax.cluster import LocalCluster, RayCluster
    from dualpath_jax.config import Policy
    from dualpath_jax.workload.arrivals import build_workload, check_context

    cfg = apply_overrides(load_config(_CONFIG.value), _SET.value)
    plan = build_workload(cfg)
    check_context(cfg, plan.trajectories)
    trajs = plan.trajectories
    ray.init(num_cpus=_NUM_CPUS.value, include_dashboard=False, object_store_memory=200 << 20)
    runtimes = {"local": LocalCluster, "ray": RayCluster}
    first, second = _POLICIES.value[:2]
    runs: list[dict] = []  # one per measured round: runtime -> policy -> figures
    tokens: dict = {}
    try:
        if _WARMUP.value:
            for cls in runtimes.values():
                one_run(cls, cfg, trajs)
        for _ in range(_REPEATS.value):
            run: dict = {}
            for name, cls in runtimes.items():
                for policy in _POLICIES.value:
                    c = dataclasses.replace(
                        cfg, scheduler=dataclasses.replace(cfg.scheduler, policy=Policy(policy))
                    )
                    r = one_run(cls, c, trajs)
                    tokens[(name, policy, len(runs))] = r.pop("tokens")
                    run.setdefault(name, {})[policy] = r
                run[name]["jct_ratio"] = run[name][first]["jct_s"] / run[name][second]["jct_s"]
            runs.append(run)
    finally:
        ray.shutdown()
    out: dict = dict(runs[0])  # the first round's figures, as before
    out["runs"] = runs
    for name in runtimes:
        ratios = [r[name]["jct_ratio"] for r in runs]
        out[f"{name}_ratio_range"] = [min(ratios), max(ratios)]
    out["identical_tokens"] = len({json.dumps(t, sort_keys=True) for t in tokens.values()}) == 1
    out["config"] = cfg.name
    out["trajectories"] = len(trajs)
    if _JSON.value:
        print(json.dumps(out))
        return
    print(f"{'round':5} {'runtime':8} {'policy':9} {'start s':>8} {'JCT s':>8} {'errors':>7}")
    for i, run in enumerate(runs):
        for name in runtimes:
            for policy in _POLICIES.value:
                r = run[name][policy]
                print(
                    f"{i:5d} {name:8} {policy:9} {r['start_s']:8.2f} {r['jct_s']:8.2f} "
                    f"{r['errors']:7d}"
                )
    for name in runtimes:
        ratios = ", ".join(f"{r[name]['jct_ratio']:.2f}" for r in runs)
        print(f"{name}: JCT {first} / {second} per round = {ratios}")
    print(f"tokens identical across runtimes and policies: {out['identical_tokens']}")


if __name__ == "__main__":
    app.run(main)
