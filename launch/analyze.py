"""Bottleneck-free P/D range (section 4.2), cache-compute ratios (Table 1), trace statistics.

Examples:
  python launch/analyze.py                                   # P/D range (paper example) + Table 1
  python launch/analyze.py --g=8 --s=1 --mem_gbps=500 --bs_gbps=50
  python launch/analyze.py --table1 --contexts=16384,32721,65536
  python launch/analyze.py --trace_stats=64k                 # synthetic 64K set vs Table 2
  python launch/analyze.py --trace_stats=/path/trace.jsonl
  python launch/analyze.py --trace_stats=/path/sessions_dir --trace_format=weka

Only the sections asked for are printed; with no section flag, P/D range and Table 1.
`--workdir=DIR` also writes `DIR/summary.json` with the numbers.
"""

from __future__ import annotations

import json
import os
import sys

from absl import app, flags

from dualpath_jax.analysis import format_pd_range, format_table1, pd_range, table1
from dualpath_jax.config import WorkloadConfig
from dualpath_jax.workload import FORMATS, TraceError, read_trace, trace_stats
from dualpath_jax.workload.synthetic import PRESETS, generate

_G = flags.DEFINE_integer("g", 8, "GPUs (engines) per node.")
_S = flags.DEFINE_float("s", 1.0, "Storage NIC bandwidth in units of one compute NIC (B).")
_MEM = flags.DEFINE_float("mem_gbps", 500.0, "DRAM bandwidth per node, GB/s (M).")
_BS = flags.DEFINE_float("bs_gbps", 50.0, "Storage NIC bandwidth per node, GB/s (B*s).")
_TABLE1 = flags.DEFINE_bool("table1", False, "Print the cache-compute ratios of Table 1.")
_CONTEXTS = flags.DEFINE_list("contexts", ["16384", "65536"], "Context lengths for Table 1.")
_APPEND = flags.DEFINE_integer("append", 429, "Appended tokens per turn for Table 1.")
_TRACE = flags.DEFINE_string(
    "trace_stats",
    None,
    f"A synthetic preset ({', '.join(PRESETS)}) or a trace path in --trace_format (a directory"
    " of session files for weka).",
)
_FORMAT = flags.DEFINE_enum(
    "trace_format", "jsonl", list(FORMATS), "Format of the --trace_stats trace (docs/traces.md)."
)
_SCALE = flags.DEFINE_float(
    "length_scale", 1.0, "Scale the trace's lengths (as workload.length_scale)."
)
_BLOCK = flags.DEFINE_integer(
    "trace_block_tokens",
    512,
    "Tokens per hash id of a Mooncake trace (workload.trace_block_tokens).",
)
_TRAJ = flags.DEFINE_integer("trajectories", 500, "Synthetic trajectories (Table 2 uses 500).")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the synthetic trace.")
_WORKDIR = flags.DEFINE_string("workdir", None, "If set, write summary.json here.")

_PD_FLAGS = ("g", "s", "mem_gbps", "bs_gbps")


def _trace_section(spec: str) -> dict:
    if spec.lower() in PRESETS:
        preset = PRESETS[spec.lower()]
        stats = trace_stats(generate(preset, _TRAJ.value, _SEED.value))
        target = preset.target
        label = f"synthetic {preset.name} ({stats.trajectories} trajectories, seed {_SEED.value})"
    else:
        w = WorkloadConfig(
            trace=spec,
            trace_format=_FORMAT.value,
            length_scale=_SCALE.value,
            trace_block_tokens=_BLOCK.value,
        )
        trajs, starts = read_trace(w)
        stats = trace_stats(trajs)
        target = None
        label = f"{spec}, {_FORMAT.value} ({stats.trajectories} trajectories)"
        gaps = [r.gap_s for t in trajs for r in t.rounds[1:]]
        extra = {
            "rounds": sum(len(t.rounds) for t in trajs),
            "gap_s_mean": sum(gaps) / len(gaps) if gaps else 0.0,
            "last_start_s": max(starts) if starts else 0.0,
            "waiting_rounds": sum(1 for t in trajs for r in t.rounds if r.waits_for),
            # gaps that are a user's think time (the model ended its turn), not a tool call
            "think_gaps": sum(
                1 for t in trajs for r in t.rounds[1:] if r.gap_s and not r.tool_call
            ),
        }
    print(f"trace statistics: {label}")
    print(f"{'':<10}{'ours':>10}{'Table 2':>10}{'ratio':>8}")
    rows = stats.row()
    want = {}
    if target is not None:
        want = {
            "Turns": target.turns,
            "Append": target.append,
            "Gen": target.gen,
            "Total": target.total,
            "Context": target.context,
            "Hit%": 100 * target.context / (target.context + target.append),
        }
    for k, v in rows.items():
        if k in want:
            print(f"{k:<10}{v:>10.1f}{want[k]:>10.1f}{v / want[k]:>8.3f}")
        else:
            print(f"{k:<10}{v:>10.1f}")
    limit = f" (MaxLen {preset.max_len})" if target is not None else ""
    print(f"longest trajectory: {stats.max_total} tokens{limit}")
    out = {"stats": rows, "table2": want, "max_total": stats.max_total}
    if target is None:
        print(
            f"rounds: {extra['rounds']}, mean gap before a later round {extra['gap_s_mean']:.1f} s,"
            f" last trajectory starts at {extra['last_start_s']:.1f} s,"
            f" {extra['waiting_rounds']} waiting for other trajectories (subagents),"
            f" {extra['think_gaps']} gaps a user's think time rather than a tool call"
        )
        out.update(extra)
    return out


def _fail(msg: str) -> None:
    """A clear one-line error (no flag help dump) and exit status 2."""
    print(f"analyze.py: error: {msg}", file=sys.stderr)
    sys.exit(2)


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    present = {name for name in (*_PD_FLAGS, "table1", "trace_stats") if flags.FLAGS[name].present}
    want_pd = bool(present & set(_PD_FLAGS)) or not present
    want_t1 = _TABLE1.value or not present
    summary: dict = {}
    if want_pd:
        try:
            r = pd_range(_G.value, _S.value, _MEM.value, _BS.value)
        except ValueError as e:
            _fail(str(e))
        print(
            f"g={_G.value} s={_S.value:g} M={_MEM.value:g} GB/s B*s={_BS.value:g} GB/s "
            f"(B={_BS.value / _S.value:g} GB/s)"
        )
        print(format_pd_range(r))
        summary["pd_range"] = {
            "lower": r.lower,
            "upper": r.upper,
            "binding_lower": list(r.binding_lower),
            "binding_upper": list(r.binding_upper),
            "bounds": {b.name: b.value for b in r.bounds},
        }
    if want_t1:
        try:
            contexts = tuple(int(c) for c in _CONTEXTS.value)
        except ValueError:
            _fail(f"--contexts must be ints, got {_CONTEXTS.value}")
        if want_pd:
            print()
        print(format_table1(contexts, _APPEND.value))
        summary["table1"] = {
            row.model: dict(zip(map(str, contexts), vals))
            for row, vals in table1(contexts, _APPEND.value)
        }
    if _TRACE.value:
        if want_pd or want_t1:
            print()
        spec = _TRACE.value
        if spec.lower() not in PRESETS and not os.path.exists(spec):
            _fail(f"--trace_stats={spec!r} is neither a preset ({', '.join(PRESETS)}) nor a file")
        try:
            summary["trace_stats"] = _trace_section(spec)
        except TraceError as e:
            _fail(str(e))
    if _WORKDIR.value:
        os.makedirs(_WORKDIR.value, exist_ok=True)
        with open(os.path.join(_WORKDIR.value, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
    sys.stdout.flush()


if __name__ == "__main__":
    app.run(main)
