"""Group sampling on the in-process backend: `step_group` (one prefill of the append, the G
samples decoding together, forks of the first one's prompt pages) against the same G rounds one
by one, side by side in one process.

    python bench/inprocess_group.py                 # G=8 samples of a 1,024-token append, 32 tokens
    python bench/inprocess_group.py --group=4 --append=2048 --json

Both modes run on forks of one session holding a 256-token context, with the same sampling
params (sample i keyed by `fold_in(key, i)`, temperature 1), each after a warm-up group of the
same shapes (compiles excluded); the tokens must be equal. Reported: wall seconds per group
(median of `--repeats`), the prompt tokens each mode computed, and the ratio.
"""

from __future__ import annotations

import json
import statistics
import time

from absl import app, flags


def run(group: int, append: int, gen: int, repeats: int, model: str = "tiny-qwen2") -> dict:
    import jax
    import numpy as np

    from dualpath_jax import model as dm
    from dualpath_jax.rollout import InProcessBackend, Session, round_sampling, step_group

    cfg = dm.get_preset(model)
    engine = InProcessBackend(dm.init_model(cfg, seed=0), max_len=256 + append + gen + 64)
    rs = np.random.RandomState(0)
    parent = Session(engine, "parent")
    parent.step(rs.randint(0, cfg.vocab_size, 256).tolist(), 1)
    key = jax.random.key(0)
    params = [round_sampling(1.0, 1.0, jax.random.fold_in(key, i)) for i in range(group)]

    def grouped(tokens):
        return step_group(parent.fork(group), tokens, gen, temperature=1.0, key=key)

    def separate(tokens):
        kids = parent.fork(group)
        return [
            list(engine.submit(k.id, tokens, gen, sampling=p).result().tokens)
            for k, p in zip(kids, params)
        ]

    out: dict = {"model": model, "samples": group, "append": append, "gen": gen, "repeats": repeats}
    warm = rs.randint(0, cfg.vocab_size, append).tolist()
    prompts = [rs.randint(0, cfg.vocab_size, append).tolist() for _ in range(repeats)]
    tokens: dict[str, list] = {}
    for name, fn in (("group", grouped), ("separate", separate)):
        fn(warm)
        times, got = [], []
        for p in prompts:
            t0 = time.perf_counter()
            got.append(fn(p))
            times.append(time.perf_counter() - t0)
        tokens[name] = got
        out[name] = {"wall_s": statistics.median(times), "wall_s_all": times}
    out["group"]["prompt_tokens_computed"] = append + (group - 1)  # the forks' last token
    out["separate"]["prompt_tokens_computed"] = group * append
    out["identical_tokens"] = tokens["group"] == tokens["separate"]
    out["separate_over_group"] = out["separate"]["wall_s"] / out["group"]["wall_s"]
    return out


def main(argv):
    del argv
    f = flags.FLAGS
    out = run(f.group, f.append, f.gen, f.repeats, f.model)
    if f.json:
        print(json.dumps(out))
        return
    print(
        f"{out['model']}: {out['samples']} samples of a {out['append']}-token append over a"
        f" 256-token context, {out['gen']} tokens each (median of {out['repeats']})"
    )
    for mode in ("group", "separate"):
        r = out[mode]
        print(
            f"{mode:>9}: {r['wall_s']:.3f} s per group, {r['prompt_tokens_computed']:,} prompt"
            " tokens computed"
        )
    print(
        f"separate / group: {out['separate_over_group']:.2f}x; tokens identical:"
        f" {'yes' if out['identical_tokens'] else 'NO'}"
    )


if __name__ == "__main__":
    flags.DEFINE_integer("group", 8, "samples of the prompt (G)")
    flags.DEFINE_integer("append", 1024, "tokens the group's round appends")
    flags.DEFINE_integer("gen", 32, "tokens generated per sample")
    flags.DEFINE_integer("repeats", 3, "measured groups per mode (medians reported)")
    flags.DEFINE_string("model", "tiny-qwen2", "model preset")
    flags.DEFINE_bool("json", False, "print one JSON object instead of a table")
    app.run(main)
