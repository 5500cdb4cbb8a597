"""The demo's workload at two commits, side by side in one run: is a change a regression?

Checks each revision out into a git worktree of its own and runs `python -m dualpath_jax.demo
WORKDIR` there, the revisions taking turns (`--repeats` times each), each run with an empty
compilation cache of its own. Reports per revision and policy the JCT, the prefill time per
request (the TTFT breakdown's prefill mean), the KV read time per request, TPOT (the decode
step as a request sees it), the compiled programs (entries its run left in its cache) and
whether the tokens equal the first revision's, then the ratios B / A.

    python bench/compare_commits.py 7fe896a HEAD
    python bench/compare_commits.py 7fe896a HEAD --repeats=2 --json

`--interpreter=shared` (the default) runs every revision with this interpreter and its
installed dependencies, the worktree first on `PYTHONPATH`: right for commits whose
dependencies agree. `--interpreter=fresh` gives each worktree its own virtualenv
(`pip install -e .`: minutes and network).
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from absl import app, flags

from dualpath_jax.experiment import read_outputs

_REPEATS = flags.DEFINE_integer("repeats", 1, "demo runs per revision (taking turns)")
_INTERPRETER = flags.DEFINE_enum("interpreter", "shared", ["shared", "fresh"], "see the docstring")
_KEEP = flags.DEFINE_string("keep", "", "keep the worktrees and run directories here")
_JSON = flags.DEFINE_bool("json", False, "print one JSON object instead of a table")

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _git(*args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout.strip()


def _interpreter(tree: pathlib.Path) -> str:
    if _INTERPRETER.value == "shared":
        return sys.executable
    venv = tree / ".venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = str(venv / "bin" / "python")
    subprocess.run([py, "-m", "pip", "install", "-q", "-e", str(tree)], check=True)
    return py


def run_demo(tree: pathlib.Path, py: str, workdir: pathlib.Path) -> dict:
    """One `make demo` run at `tree`: its comparison.json, compiled programs and tokens."""
    cache = workdir / "jax_cache"
    env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=str(cache))
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    env["PYTHONPATH"] = os.pathsep.join([str(tree), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    t0 = time.monotonic()
    proc = subprocess.run(
        [py, "-m", "dualpath_jax.demo", str(workdir / "run")],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
    )
    wall = time.monotonic() - t0
    if not (workdir / "run" / "comparison.json").exists():
        raise RuntimeError(
            f"the demo at {tree} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
    result = json.loads((workdir / "run" / "comparison.json").read_text())
    policies = list(result["summaries"])
    return {
        "wall_s": wall,
        "compiled_programs": sum(1 for p in cache.rglob("*") if p.is_file()),
        "tokens_identical_across_policies": result["tokens_identical"],
        "policies": {
            p: {
                "jct_s": s["jct_s"],
                "prefill_s": s["ttft_breakdown_s"]["prefill"]["mean"],
                "kv_read_s": s["ttft_breakdown_s"]["kv_read"]["mean"],
                "tpot_s": s["tpot_s"]["mean"],
            }
            for p, s in result["summaries"].items()
        },
        "outputs": {p: read_outputs(workdir / "run" / p / "outputs.jsonl") for p in policies},
    }


def _median(runs: list[dict], policy: str, key: str) -> float:
    return statistics.median(r["policies"][policy][key] for r in runs)


def summarize(revs: list[str], runs: dict[str, list[dict]]) -> dict:
    first = runs[revs[0]][0]["outputs"]
    out: dict = {"revisions": {}}
    for rev in revs:
        rs = runs[rev]
        pols = list(rs[0]["policies"])
        jct = {p: _median(rs, p, "jct_s") for p in pols}
        out["revisions"][rev] = {
            "commit": _git("rev-parse", "--short", rev),
            "runs": len(rs),
            "policies": {
                p: {k: _median(rs, p, k) for k in ("jct_s", "prefill_s", "kv_read_s", "tpot_s")}
                for p in pols
            },
            "basic_over_dualpath": jct["basic"] / jct["dualpath"]
            if {"basic", "dualpath"} <= jct.keys()
            else None,
            "compiled_programs": statistics.median(r["compiled_programs"] for r in rs),
            "tokens_equal_first_revision": all(r["outputs"] == first for r in rs),
            "tokens_identical_across_policies": all(
                r["tokens_identical_across_policies"] for r in rs
            ),
            "wall_s": [round(r["wall_s"], 1) for r in rs],
        }
    a, b = (out["revisions"][r] for r in revs)
    out["b_over_a"] = {
        p: {k: b["policies"][p][k] / a["policies"][p][k] for k in a["policies"][p]}
        for p in a["policies"]
        if p in b["policies"]
    }
    return out


def table(summary: dict) -> str:
    lines = []
    head = f"{'revision':<12}{'policy':<10}{'JCT s':>8}{'prefill s':>11}{'read s':>9}{'TPOT ms':>9}"
    for rev, r in summary["revisions"].items():
        lines += [f"{rev} ({r['commit']}), {r['runs']} run(s), wall {r['wall_s']} s", head]
        for p, x in r["policies"].items():
            lines.append(
                f"{'':<12}{p:<10}{x['jct_s']:8.1f}{x['prefill_s']:11.3f}{x['kv_read_s']:9.3f}"
                f"{1e3 * x['tpot_s']:9.1f}"
            )
        ratio = r["basic_over_dualpath"]
        lines.append(
            f"{'':<12}Basic/DualPath {ratio:.2f}x; compiled programs {r['compiled_programs']:g}; "
            f"tokens identical across policies: {r['tokens_identical_across_policies']}, "
            f"equal to the first revision's: {r['tokens_equal_first_revision']}"
        )
        lines.append("")
    lines.append("B / A: " + "; ".join(
        f"{p} JCT {x['jct_s']:.2f}, prefill {x['prefill_s']:.2f}, TPOT {x['tpot_s']:.2f}"
        for p, x in summary["b_over_a"].items()
    ))  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    revs = argv[1:]
    if len(revs) != 2:
        raise app.UsageError("usage: compare_commits.py REV_A REV_B [flags]")
    base = pathlib.Path(_KEEP.value or tempfile.mkdtemp(prefix="dualpath_commits_")).absolute()
    base.mkdir(parents=True, exist_ok=True)
    trees: dict[str, pathlib.Path] = {}
    try:
        for i, rev in enumerate(revs):
            tree = base / f"tree{i}"
            _git("worktree", "add", "--detach", str(tree), _git("rev-parse", rev))
            trees[rev] = tree
        pys = {rev: _interpreter(tree) for rev, tree in trees.items()}
        runs: dict[str, list[dict]] = {rev: [] for rev in revs}
        for k in range(_REPEATS.value):
            for i, rev in enumerate(revs):
                print(f"run {k + 1}/{_REPEATS.value} of {rev} ...", file=sys.stderr, flush=True)
                runs[rev].append(run_demo(trees[rev], pys[rev], base / f"run{i}_{k}"))
        summary = summarize(revs, runs)
        print(json.dumps(summary, indent=1) if _JSON.value else table(summary))
    finally:
        if not _KEEP.value:
            for tree in trees.values():
                _git("worktree", "remove", "--force", str(tree))
            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    app.run(main)
