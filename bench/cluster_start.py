"""Time to a usable cluster: LocalCluster (processes) vs InProcessCluster (threads), side by side.

For each runtime, `--repeats` times in alternation: start the cluster, run the same two-round
session, stop it; reports start, first round, second round and stop seconds (medians) and
checks that both runtimes give the same tokens. The compilation cache is the caller's
(`JAX_COMPILATION_CACHE_DIR`); the first repeat of each runtime also pays the compiles it cannot
take from it.

    python bench/cluster_start.py --config=configs/cpu_1p1d.py:tiny --repeats=3 --json
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time

from absl import app, flags

_CONFIG = flags.DEFINE_string("config", "configs/cpu_1p1d.py:tiny", "config file[:arg]")
_REPEATS = flags.DEFINE_integer("repeats", 3, "starts per runtime (alternating)")
_JSON = flags.DEFINE_bool("json", False, "print one JSON object instead of a table")

ROUNDS = [([1, 2, 3, 4] * 20, 8), ([5, 6, 7] * 6, 4)]


def one_run(runtime_cls, cfg) -> tuple[dict[str, float], list[list[int]]]:
    from dualpath_jax.rollout import Session

    times: dict[str, float] = {}
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory() as workdir:
        cluster = runtime_cls(cfg, workdir)
        cluster.start()
        try:
            times["start_s"] = time.monotonic() - t0
            session = Session(cluster.client(), "bench")
            tokens = []
            for i, (append, gen) in enumerate(ROUNDS):
                t = time.monotonic()
                tokens.append(session.step(append, gen))
                times[f"round{i + 1}_s"] = time.monotonic() - t
            session.close()
        finally:
            t = time.monotonic()
            cluster.stop()
            times["stop_s"] = time.monotonic() - t
    return times, tokens


def main(argv):
    del argv
    from dualpath_jax import apply_overrides, load_config
    from dualpath_jax.cluster import InProcessCluster, LocalCluster
    from dualpath_jax.presets import TINY_CPU_PREFILL_COST

    cfg = load_config(_CONFIG.value)
    if cfg.model.name.startswith("tiny"):  # both runtimes skip calibration alike
        cfg = apply_overrides(cfg, [f"cluster.prefill_cost_json={TINY_CPU_PREFILL_COST.to_json()}"])
    runtimes = {"process": LocalCluster, "thread": InProcessCluster}
    samples: dict[str, list[dict[str, float]]] = {k: [] for k in runtimes}
    tokens: dict[str, list] = {}
    for _ in range(_REPEATS.value):
        for name, cls in runtimes.items():
            times, toks = one_run(cls, cfg)
            samples[name].append(times)
            tokens.setdefault(name, toks)
    out = {
        name: {k: statistics.median(s[k] for s in runs) for k in runs[0]}
        for name, runs in samples.items()
    }
    out["identical_tokens"] = tokens["process"] == tokens["thread"]
    out["start_ratio"] = out["process"]["start_s"] / out["thread"]["start_s"]
    if _JSON.value:
        print(json.dumps(out))
        return
    print(f"{'runtime':8} {'start s':>8} {'round1 s':>9} {'round2 s':>9} {'stop s':>7}")
    for name in runtimes:
        r = out[name]
        print(
            f"{name:8} {r['start_s']:8.2f} {r['round1_s']:9.2f} {r['round2_s']:9.2f}"
            f" {r['stop_s']:7.2f}"
        )
    print(
        f"start: process / thread = {out['start_ratio']:.1f}x; tokens identical: "
        f"{'yes' if out['identical_tokens'] else 'NO'}"
    )


if __name__ == "__main__":
    app.run(main)
