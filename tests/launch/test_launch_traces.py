"""`--trace_format` on the run launchers: `launch/simulate.py` replays a Mooncake trace at its own
timestamps (`--aps=0`) and reports the hits its hash ids imply."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

from dualpath_jax.config import ExperimentConfig, from_json
from dualpath_jax.sched.cost import FittedCostModel
from dualpath_jax.workload.arrivals import plan_agents
from dualpath_jax.workload.sharing import replay_hits

ROOT = pathlib.Path(__file__).resolve().parents[2]
SAMPLE = "tests/workload/data/mooncake_sample.jsonl"


def test_simulate_replays_a_mooncake_trace_at_its_timestamps(tmp_path):
    cost = tmp_path / "cost.json"
    cost.write_text(
        FittedCostModel(prefill=(0.02, 2e-5, 5e-9), decode=(0.005, 1e-4, 1e-8)).to_json()
    )
    proc = subprocess.run(
        [sys.executable, str(ROOT / "launch" / "simulate.py"), "--config=configs/cpu_1p1d.py:tiny",
         f"--trace={SAMPLE}", "--trace_format=mooncake", "--aps=0", f"--cost_json={cost}",
         "--set", "workload.trace_block_tokens=96", "--set", "workload.length_scale=0.25",
         "--set", "workload.max_len=0", "--set", "workload.max_turns=0",
         f"--workdir={tmp_path / 'run'}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    cfg = from_json(ExperimentConfig, (tmp_path / "run" / "config.json").read_text())
    assert (cfg.workload.trace_format, cfg.workload.mode, cfg.workload.aps) == (
        "mooncake",
        "online",
        0.0,
    )
    trajs, arrivals = plan_agents(cfg)
    assert arrivals == [0.0, 1000.0, 3000.0]
    assert (summary["agents"], summary["requests"], summary["errors"]) == (3, 5, 0)
    assert summary["cached_tokens"] == sum(map(sum, replay_hits(trajs, 16))) == 336
    outputs = [json.loads(line) for line in (tmp_path / "run" / "outputs.jsonl").open()]
    assert {o["id"]: o["rounds"] for o in outputs} == {
        f"{t.id}/a{k}": [r.gen for r in t.rounds] for k, t in enumerate(trajs)
    }
