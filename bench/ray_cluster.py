"""RayCluster beside LocalCluster: start-up time and one policy comparison through each runtime.

For each runtime (LocalCluster: processes started here; RayCluster: the same processes as Ray
actors of a local Ray, started by this script) and each policy, in one run: start the cluster,
replay the config's workload offline, stop it. Reports start seconds, each policy's JCT, the
JCT ratio of the first policy over the second per runtime (Ray adds nothing on the data path,
so the ratios should agree within noise) and whether every runtime gave the same tokens. A
first, unmeasured replay per runtime fills the compilation cache (`--warmup`).

    python bench/ray_cluster.py --config=configs/cpu_1p2d.py:tiny --json

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
_JSON = flags.DEFINE_bool("json", False, "print one JSON object instead of a table")


def one_run(make_cluster, cfg, rounds) -> dict:
    from dualpath_jax.rollout import run_trajectories

    with tempfile.TemporaryDirectory() as workdir:
        t0 = time.monotonic()
        cluster = make_cluster(cfg, workdir)
        cluster.start()
        try:
            start_s = time.monotonic() - t0
            client = cluster.client()
            t = time.monotonic()
            outs = run_trajectories(client, rounds, progress=False)
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
    from dualpath_jax.workload.arrivals import as_rounds, build_workload, check_context

    cfg = apply_overrides(load_config(_CONFIG.value), _SET.value)
    plan = build_workload(cfg)
    check_context(cfg, plan.trajectories)
    rounds = as_rounds(plan.trajectories)
    ray.init(num_cpus=_NUM_CPUS.value, include_dashboard=False, object_store_memory=200 << 20)
    try:
        runtimes = {"local": LocalCluster, "ray": RayCluster}
        out: dict = {}
        tokens: dict = {}
        for name, cls in runtimes.items():
            if _WARMUP.value:
                one_run(cls, cfg, rounds)
            for policy in _POLICIES.value:
                c = dataclasses.replace(
                    cfg, scheduler=dataclasses.replace(cfg.scheduler, policy=Policy(policy))
                )
                r = one_run(cls, c, rounds)
                tokens[(name, policy)] = r.pop("tokens")
                out.setdefault(name, {})[policy] = r
            first, second = _POLICIES.value[:2]
            out[name]["jct_ratio"] = out[name][first]["jct_s"] / out[name][second]["jct_s"]
    finally:
        ray.shutdown()
    out["identical_tokens"] = len({json.dumps(t, sort_keys=True) for t in tokens.values()}) == 1
    out["config"] = cfg.name
    out["trajectories"] = len(rounds)
    if _JSON.value:
        print(json.dumps(out))
        return
    first, second = _POLICIES.value[:2]
    print(f"{'runtime':8} {'policy':9} {'start s':>8} {'JCT s':>8} {'errors':>7}")
    for name in runtimes:
        for policy in _POLICIES.value:
            r = out[name][policy]
            print(f"{name:8} {policy:9} {r['start_s']:8.2f} {r['jct_s']:8.2f} {r['errors']:7d}")
    for name in runtimes:
        print(f"{name}: JCT {first} / {second} = {out[name]['jct_ratio']:.2f}")
    print(f"tokens identical across runtimes and policies: {out['identical_tokens']}")


if __name__ == "__main__":
    app.run(main)
