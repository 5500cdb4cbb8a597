"""Many trajectories on the in-process backend: one slot (a round at a time) against S slots
(the rounds submitted meanwhile prefilled together and decoded S at a time).

Run: python bench/inprocess_batch.py [--trajectories=32 --rounds=4 --slots=8,32 --hidden=256]
     [--json]

`run_trajectories` replays the same multi-turn trajectories (appends of 16-128 tokens, 8-48
generated tokens a round, greedy) on `InProcessBackend(slots=1)` and on `slots=S` for each S,
side by side in one process. Each engine runs the workload once to compile its shapes, then
again under fresh session ids (timed). Reported: wall seconds, generated tokens per second, the
speedup over one slot, and whether every trajectory's tokens equal one slot's.
"""

from __future__ import annotations

import dataclasses
import json
import time

import numpy as np
from absl import app, flags

from dualpath_jax.model.transformer import init_model
from dualpath_jax.presets import TINY_QWEN2
from dualpath_jax.rollout import InProcessBackend, Round, Trajectory, run_trajectories


def workload(n: int, rounds: int, vocab: int, seed: int = 0) -> list[tuple[Round, ...]]:
    rs = np.random.RandomState(seed)
    return [
        tuple(Round(tuple(rs.randint(1, vocab, rs.randint(16, 129)).tolist()),
                    int(rs.randint(8, 49)))
              for _ in range(rounds))
        for _ in range(n)
    ]  # fmt: skip


def measure(
    trajectories: int = 32, rounds: int = 4, slots=(8, 32), hidden: int = 256, layers: int = 4
) -> dict:
    cfg = dataclasses.replace(
        TINY_QWEN2,
        hidden_size=hidden,
        num_layers=layers,
        num_heads=max(2, hidden // 64),
        num_kv_heads=max(1, hidden // 128),
        head_dim=64 if hidden >= 128 else hidden // 2,
        intermediate_size=hidden * 3,
    )
    net = init_model(cfg, seed=0)
    work = workload(trajectories, rounds, cfg.vocab_size)
    tokens = sum(r.gen for t in work for r in t)
    max_len = max(sum(r.append_len + r.gen for r in t) for t in work) + 1
    rows, base = {}, None
    for s in (1, *slots):
        engine = InProcessBackend(net, max_len=max_len, slots=s)
        try:
            for run in ("warm", "timed"):
                named = [Trajectory(f"{run}{s}-{k}", t) for k, t in enumerate(work)]
                t0 = time.perf_counter()
                out = run_trajectories(engine, named, progress=False, max_concurrent=trajectories)
                wall = time.perf_counter() - t0
        finally:
            engine.close()
        errors = [o.error for o in out if o.error]
        if errors:
            raise RuntimeError(f"slots={s}: {errors[0]}")
        got = [o.rounds for o in out]
        base = base or (wall, got)
        rows[s] = {
            "seconds": wall,
            "tokens_per_s": tokens / wall,
            "speedup": base[0] / wall,
            "same_tokens": got == base[1],
        }
    return {
        "model": {"hidden": hidden, "layers": layers},
        "trajectories": trajectories,
        "rounds": rounds,
        "generated_tokens": tokens,
        "slots": rows,
    }


def main(argv):
    del argv
    slots = tuple(int(s) for s in _SLOTS.value.split(","))
    r = measure(_TRAJ.value, _ROUNDS.value, slots, _HIDDEN.value, _LAYERS.value)
    if _JSON.value:
        print(json.dumps(r))
        return
    m = r["model"]
    print(
        f"{r['trajectories']} trajectories x {r['rounds']} rounds, {r['generated_tokens']}"
        f" generated tokens; model: {m['layers']} layers of hidden {m['hidden']}"
    )
    for s, row in r["slots"].items():
        print(
            f"slots={s:3d}: {row['seconds']:7.2f} s  {row['tokens_per_s']:8.1f} tok/s"
            f"  {row['speedup']:5.2f}x  tokens as one slot's: {row['same_tokens']}"
        )


if __name__ == "__main__":
    # Flags exist only when run as a script: tests import several bench modules at once.
    _TRAJ = flags.DEFINE_integer("trajectories", 32, "trajectories")
    _ROUNDS = flags.DEFINE_integer("rounds", 4, "rounds per trajectory")
    _SLOTS = flags.DEFINE_string("slots", "8,32", "decode slots to compare with one")
    _HIDDEN = flags.DEFINE_integer("hidden", 256, "hidden size")
    _LAYERS = flags.DEFINE_integer("layers", 4, "decoder layers")
    _JSON = flags.DEFINE_bool("json", False, "print one JSON object")
    app.run(main)
