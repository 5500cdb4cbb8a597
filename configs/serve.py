"""Serving: one prefill and one decode engine on this host, every link at the host's speed.

Run: python launch/api_server.py --config=configs/serve.py:tiny --workdir=/tmp/dp_api --port=8000
ARG: comma list of the model family, `qwen2` (default), `qwen3`, `qwen3_moe`, `deepseek` (V3) or
`deepseek_v2` (`--checkpoint` replaces it); `tiny` (4 decode slots, prefill batches of up to 4:
fewer shapes to compile, a faster start; 8 agents in the trace); `<P>p<D>d` for P prefill and D
decode engines (default `1p1d`), e.g. `configs/serve.py:2p1d`.

No link is emulated (every `hardware` rate 0: `transfer.links.emulated_links` is empty), unlike
the `cpu_*` and `balanced` experiments, whose storage NICs carry the demo's 0.5 MB/s. A later
turn reads its earlier turns' KV at the store's own speed, or recomputes it when the PE is
faster than the reads the router measures (`scheduler.recompute="auto"`). Blocks, trace and
SLOs are the `cpu_*` experiments', so `launch/rollout.py` and `launch/serve.py` also run it:
the same workload without emulation.
"""

from __future__ import annotations

import re

from dualpath_jax.config import (
    ClusterConfig,
    ExperimentConfig,
    HardwareConfig,
    SchedulerConfig,
    StoreConfig,
    WorkloadConfig,
)
from dualpath_jax.presets import (
    CPU_TPOT_SLO_S,
    TINY_DEEPSEEK,
    TINY_DEEPSEEK_V2,
    TINY_QWEN2,
    TINY_QWEN3,
    TINY_QWEN3_MOE,
)

MODELS = {
    "qwen2": TINY_QWEN2,
    "qwen3": TINY_QWEN3,
    "qwen3_moe": TINY_QWEN3_MOE,
    "deepseek": TINY_DEEPSEEK,
    "deepseek_v2": TINY_DEEPSEEK_V2,
}


def get_config(arg: str = "") -> ExperimentConfig:
    model, tiny, split = "qwen2", False, (1, 1)
    for part in filter(None, arg.split(",")):
        if part in MODELS:
            model = part
        elif part == "tiny":
            tiny = True
        elif m := re.fullmatch(r"(\d+)p(\d+)d", part):
            split = (int(m[1]), int(m[2]))
        else:
            raise ValueError(
                f"configs/serve.py: unknown ARG part {part!r}; use one of {sorted(MODELS)},"
                " tiny, <P>p<D>d"
            )
    prefill, decode = split
    return ExperimentConfig(
        name=f"serve_{prefill}p{decode}d",
        model=MODELS[model],
        hardware=HardwareConfig(gpu="cpu"),  # every rate 0: nothing paced
        cluster=ClusterConfig(
            prefill_nodes=prefill,
            decode_nodes=decode,
            decode_max_len=2048,
            decode_slots=4 if tiny else 8,
            prefill_max_batch=4 if tiny else 8,
        ),
        store=StoreConfig(block_tokens=16),
        scheduler=SchedulerConfig(recompute="auto"),
        workload=WorkloadConfig(
            preset="64k",
            trajectories=8 if tiny else 16,
            agents=8 if tiny else 16,
            length_scale=1 / 16,
            max_len=1024,
            max_turns=16,
            ttft_slo_s=4.0,
            tpot_slo_s=CPU_TPOT_SLO_S,
        ),
    )
