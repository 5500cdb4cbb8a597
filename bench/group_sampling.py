"""Group sampling (GRPO's G samples of one prompt) against G separate sessions, side by side.

    python bench/group_sampling.py                       # G=8 samples of one 4,096-token prompt
    python bench/group_sampling.py --json
    python bench/group_sampling.py --config=configs/cpu_1p1d.py --set cluster.decode_max_len=8192

Both modes draw the same G samples (sample i with `fold_in(key, i)`, temperature 1) of one
random prompt on a 1P1D cluster (the tiny Qwen2 model by default, engines as threads of this
process; `--runtime=process` for a LocalCluster), each mode in a cluster of its own:

- `fork`: `Client.submit_group` (what `rollout.step_group` runs) on G forks of one session: the
  first sample's round prefills the prompt, the others start from its pages on its decode engine
  (each computes the prompt's last token in its first decode step);
- `store`: `Client.submit_group(..., share="store")`: a prefix round prefills the prompt once and
  stores its KV once, then the G rounds read its whole blocks from the store and compute only
  the tail;
- `separate`: G fresh sessions, each submitting the whole prompt at once (concurrently).

For each mode: the prompt tokens computed (the sum of `prompt_tokens - cached_tokens` over every
round, the prefix round included), the KV stored (bytes and block files in the store directory
once the rounds are done) and the wall time from the first submit to the last result. A warm-up
of the same mode on another prompt runs first in each cluster, so that neither pays compiles in
the measured runs; then `--repeats` groups, each on a prompt of its own (medians reported). The
store keys blocks by content, so G sessions writing the same prompt store it once: "KV written"
(the bytes the decode engine sent to the store over its storage NIC) shows what they cost, "KV
read" what the engines read from it. The tokens of every mode must be equal.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import shutil
import time

from absl import app, flags

MODES = ("fork", "store", "separate")


def default_config(prompt_tokens: int, gen: int, group: int):
    """The tiny Qwen2 model on a 1P1D cluster whose decode engine holds G sequences of the
    prompt and the generated tokens; 64-token blocks."""
    from dualpath_jax.config import ClusterConfig, ExperimentConfig, StoreConfig
    from dualpath_jax.presets import TINY_QWEN2

    return ExperimentConfig(
        name="group-sampling",
        model=TINY_QWEN2,
        cluster=ClusterConfig(
            prefill_nodes=1,
            decode_nodes=1,
            decode_slots=group,
            decode_max_len=prompt_tokens + gen + 64,
        ),
        store=StoreConfig(block_tokens=64),
    )


def store_usage(root: pathlib.Path) -> tuple[int, int]:
    """(bytes, files) under a file store's directory."""
    files = [p for p in root.rglob("*") if p.is_file()]
    return sum(p.stat().st_size for p in files), len(files)


def storage_nic_bytes(stats: dict) -> dict[str, int]:
    """Bytes the engines moved over their nodes' storage NICs: "snic_tx" (KV written to the
    store, even when the block was there already) and "snic_rx" (KV read from it)."""
    out = {"snic_tx": 0, "snic_rx": 0}
    for engine in stats.get("engines", {}).values():
        for link in engine.get("links", {}).get("links", {}).values():
            if link["kind"] in out:
                out[link["kind"]] += int(link["bytes"])
    return out


def run_once(client, mode: str, tag: str, prompt: list[int], gen: int, group: int, key):
    """One group of samples of `prompt`; returns (wall seconds, the rounds' results with the
    prefix round first in store mode, the samples' tokens, the sessions to close)."""
    import jax

    from dualpath_jax.rollout import round_sampling

    samplings = [round_sampling(1.0, 1.0, jax.random.fold_in(key, i)) for i in range(group)]
    if mode != "separate":
        parent = f"{tag}-parent"
        client.open_session(parent)
        sessions = [f"{tag}-{i}" for i in range(group)]
        for s in sessions:
            client.open_session(s, fork_of=parent)
        t0 = time.monotonic()
        futs = client.submit_group(sessions, prompt, gen, samplings=samplings, share=mode)
        results = [f.result() for f in futs]
        wall = time.monotonic() - t0
        return (
            wall,
            [futs.prefix.result(), *results] if futs.prefix is not None else results,
            [r.tokens for r in results],
            [parent, *sessions],
        )
    sessions = [f"{tag}-{i}" for i in range(group)]
    for s in sessions:
        client.open_session(s)
    t0 = time.monotonic()
    futs = [client.submit(s, prompt, gen, sampling=p) for s, p in zip(sessions, samplings)]
    results = [f.result() for f in futs]
    wall = time.monotonic() - t0
    return wall, results, [r.tokens for r in results], sessions


def measure(
    cfg,
    mode: str,
    workdir: pathlib.Path,
    runtime: str,
    prompt_tokens: int,
    gen: int,
    group: int,
    repeats: int,
) -> list[dict]:
    """Starts a cluster, warms `mode` up on one prompt, then measures it `repeats` times, each
    on a prompt of its own (prompt r is the same in both modes); one record per repeat."""
    import jax
    import numpy as np

    from dualpath_jax.cluster import InProcessCluster, LocalCluster

    shutil.rmtree(workdir, ignore_errors=True)
    rs = np.random.RandomState(0)
    prompts = [
        rs.randint(0, cfg.model.vocab_size, prompt_tokens).tolist() for _ in range(repeats + 1)
    ]
    cls = InProcessCluster if runtime == "thread" else LocalCluster
    root = pathlib.Path(cfg.store.root or workdir / "store")
    records = []
    with cls(cfg, workdir) as cluster:
        client = cluster.client()
        try:
            *_, opened = run_once(client, mode, "warm", prompts[0], gen, group, jax.random.key(1))
            for s in opened:
                client.close_session(s, release=True)
            for r, prompt in enumerate(prompts[1:]):
                before, nic_before = store_usage(root), storage_nic_bytes(client.stats())
                wall, results, tokens, opened = run_once(
                    client, mode, f"run{r}", prompt, gen, group, jax.random.key(r)
                )
                after, nic_after = store_usage(root), storage_nic_bytes(client.stats())
                for s in opened:
                    client.close_session(s, release=True)
                computed = [x.prompt_tokens - x.cached_tokens for x in results]
                records.append(
                    {
                        "wall_s": wall,
                        "rounds": len(results),
                        "prefill_tokens_computed": sum(computed),
                        "prompt_tokens": sum(x.prompt_tokens for x in results),
                        "cached_tokens": sum(x.cached_tokens for x in results),
                        "computed_per_round": computed,
                        "kv_bytes_stored": after[0] - before[0],
                        "kv_block_files": after[1] - before[1],
                        "kv_bytes_written": nic_after["snic_tx"] - nic_before["snic_tx"],
                        "kv_bytes_read": nic_after["snic_rx"] - nic_before["snic_rx"],
                        "tokens": [list(t) for t in tokens],
                    }
                )
        finally:
            client.close()
    return records


def summarize(records: list[dict]) -> dict:
    """The median of every numeric figure over the repeats; the last repeat's per-round list."""
    import statistics

    out = {k: statistics.median(r[k] for r in records) for k, v in records[0].items()
           if isinstance(v, int | float)}  # fmt: skip
    out["wall_s_all"] = [r["wall_s"] for r in records]
    out["computed_per_round"] = records[-1]["computed_per_round"]
    return out


def run(
    cfg, workdir: pathlib.Path, runtime: str, prompt_tokens: int, gen: int, group: int, repeats: int
) -> dict:
    """Every mode, each in a cluster of its own; the report (JSON-ready): each mode's figures
    and, for `fork` and `store`, `vs_separate`: separate sessions' figure over theirs."""
    out = {
        "model": cfg.model.name,
        "runtime": runtime,
        "prompt_tokens": prompt_tokens,
        "gen": gen,
        "group": group,
        "repeats": repeats,
        "block_tokens": cfg.store.block_tokens,
    }
    records = {}
    for mode in MODES:
        records[mode] = measure(
            cfg, mode, workdir / mode, runtime, prompt_tokens, gen, group, repeats
        )
        out[mode] = summarize(records[mode])
    s = out["separate"]
    out["identical_tokens"] = all(
        a["tokens"] == b["tokens"] == c["tokens"]
        for a, b, c in zip(records["fork"], records["store"], records["separate"])
    )
    out["vs_separate"] = {
        mode: {
            "prefill": s["prefill_tokens_computed"] / max(1, out[mode]["prefill_tokens_computed"]),
            "kv_stored": s["kv_bytes_stored"] / max(1, out[mode]["kv_bytes_stored"]),
            "kv_written": s["kv_bytes_written"] / max(1, out[mode]["kv_bytes_written"]),
            "wall": s["wall_s"] / out[mode]["wall_s"],
        }
        for mode in ("fork", "store")
    }
    return out


def main(argv):
    del argv
    from dualpath_jax import apply_overrides, load_config

    f = flags.FLAGS
    prompt_tokens, gen, group = f.prompt_tokens, f.gen, f.group
    cfg = load_config(f.config) if f.config else default_config(prompt_tokens, gen, group)
    cfg = apply_overrides(cfg, list(f.set))
    if cfg.cluster.decode_max_len < prompt_tokens + gen + 1:
        raise app.UsageError(
            f"cluster.decode_max_len={cfg.cluster.decode_max_len} cannot hold a {prompt_tokens}"
            f"-token prompt and {gen} generated tokens: --set cluster.decode_max_len=..."
        )
    if cfg.store.kind != "file":
        raise app.UsageError("the KV bytes are measured in a file store: store.kind=file")
    workdir = pathlib.Path(f.workdir).absolute()
    cfg = dataclasses.replace(cfg, store=dataclasses.replace(cfg.store, root=""))
    out = run(cfg, workdir, f.runtime, prompt_tokens, gen, group, f.repeats)
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "group_sampling.json").write_text(json.dumps(out, indent=1))
    if f.json:
        print(json.dumps(out))
        return
    print(
        f"{out['model']}, {group} samples of a {prompt_tokens}-token prompt, {gen} tokens each,"
        f" {out['block_tokens']}-token blocks, engines as {out['runtime']}s"
    )
    head = (
        f"{'mode':>9} {'rounds':>6} {'prefill computed':>16} {'cached':>8} {'KV stored':>12}"
        f" {'blocks':>7} {'KV written':>12} {'KV read':>12} {'wall s':>7}"
    )
    print(head)
    print("-" * len(head))
    for mode in MODES:
        r = out[mode]
        print(
            f"{mode:>9} {r['rounds']:>6} {r['prefill_tokens_computed']:>16,} {r['cached_tokens']:>8,}"
            f" {r['kv_bytes_stored'] / 1e6:>10.2f}MB {r['kv_block_files']:>7}"
            f" {r['kv_bytes_written'] / 1e6:>10.2f}MB {r['kv_bytes_read'] / 1e6:>10.2f}MB"
            f" {r['wall_s']:>7.2f}"
        )
    for mode in ("fork", "store"):
        v = out["vs_separate"][mode]
        print(
            f"separate / {mode}: prefill {v['prefill']:.2f}x, KV stored {v['kv_stored']:.2f}x,"
            f" KV written {v['kv_written']:.2f}x, wall {v['wall']:.2f}x"
        )
    print(f"tokens identical: {'yes' if out['identical_tokens'] else 'NO'}")


if __name__ == "__main__":
    # Flags exist only when run as a script: tests import several bench modules at once.
    flags.DEFINE_string("config", "", "config file[:arg] (default: tiny Qwen2 on 1P1D)")
    flags.DEFINE_multi_string("set", [], "Override `section.key=value` (repeatable).")
    flags.DEFINE_enum("runtime", "thread", ["thread", "process"], "engines as threads or processes")
    flags.DEFINE_integer("prompt_tokens", 4096, "tokens of the prompt")
    flags.DEFINE_integer("group", 8, "samples of the prompt (G)")
    flags.DEFINE_integer("gen", 16, "tokens generated per sample")
    flags.DEFINE_integer("repeats", 3, "measured groups per mode (medians reported)")
    flags.DEFINE_string("workdir", "bench_out/group_sampling", "Output directory.")
    flags.DEFINE_bool("json", False, "print one JSON object instead of a table")
    app.run(main)
