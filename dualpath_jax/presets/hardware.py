"""Node presets: the paper's Hopper node and the emulated CPU "node pair" (the GPUs that
`HardwareConfig.gpu` names are `presets.gpus`).

Emulation on one CPU host scales the paper's link ratios down to rates the tiny models make
storage-bound: per node one storage NIC of `snic` bytes/s and, per engine, a compute NIC of
`cnic_ratio x snic` (the testbed's 8 x 400 Gbps compute NICs against 1 x 400 Gbps storage NIC
per node give 8x) and host<->device copies of `h2d_ratio x snic`. Every result of an emulated run
says so (`summary.json: emulated`).
"""

from __future__ import annotations

from dualpath_jax.config import (
    ClusterConfig,
    ExperimentConfig,
    HardwareConfig,
    StoreConfig,
    WorkloadConfig,
)
from dualpath_jax.presets.models import TINY_DEEPSEEK, TINY_QWEN2

# This module imports no module of the compiled core (`dualpath_jax._compiled.MODULES`), so a
# program may take a node preset before it opts in to the core (`dualpath_jax.native.use`).

# --------------------------------------------------------------------------- nodes

# The paper's testbed (section 7.2): 8 Hopper GPUs per node, 8 x 400 Gbps compute NICs (one per
# GPU), one 400 Gbps storage NIC per node, PCIe Gen5 host links, ~500 GB/s DRAM per node.
HOPPER_NODE = HardwareConfig(
    gpu="h800",
    engines_per_node=8,
    snic_bytes_per_s=50e9,
    cnic_bytes_per_s=50e9,
    h2d_bytes_per_s=55e9,
    d2h_bytes_per_s=55e9,
    dram_bytes_per_s=500e9,
    hbm_bytes=80e9,
    dram_buffer_bytes=80e9,
    emulated=False,
)


def cpu_emulated(
    snic_bytes_per_s: float, *, cnic_ratio: float = 8.0, h2d_ratio: float = 16.0
) -> HardwareConfig:
    return HardwareConfig(
        gpu="cpu",
        engines_per_node=1,
        snic_bytes_per_s=snic_bytes_per_s,
        cnic_bytes_per_s=cnic_ratio * snic_bytes_per_s,
        h2d_bytes_per_s=h2d_ratio * snic_bytes_per_s,
        d2h_bytes_per_s=h2d_ratio * snic_bytes_per_s,
        emulated=True,
    )


# --------------------------------------------------------------------------- CPU experiments

# The online SLO of the CPU configs: the paper's TTFT limit (4 s), but a TPOT limit of 1 s instead
# of 50 ms. On a 2-core host the three engine processes share the cores, so a decode step's time
# is set by CPU sharing with the prefill engine (measured: TPOT p50 75 ms, p90 0.32 s at 0.05
# agents/s under Basic), not by the loading policy that the capacity benchmark compares.
CPU_TPOT_SLO_S = 1.0


def emulated_cpu_experiment(
    prefill_nodes: int, decode_nodes: int, arg: str = "", *, snic_bytes_per_s: float = 5e5
) -> ExperimentConfig:
    """The `configs/cpu_*` experiments: tiny model, emulated links, a CPU-sized 64k-shaped trace.

    `arg` is a comma list: `deepseek` picks the tiny DeepSeek model (default tiny Qwen2), `tiny`
    halves the workload to 8 agents (the demo). The trace is the 64k preset with every length
    scaled by 1/16, trajectories cut at 1,024 tokens and 16 rounds: many agents of similar
    length keep the storage links busy, so JCT measures throughput rather than the round-trip
    latency of one long trajectory.
    """
    parts = set(arg.split(",")) if arg else set()
    unknown = parts - {"qwen2", "deepseek", "tiny"}
    if unknown:
        raise ValueError(f"unknown config ARG part(s) {sorted(unknown)}; use qwen2, deepseek, tiny")
    agents = 8 if "tiny" in parts else 16
    return ExperimentConfig(
        name=f"cpu_{prefill_nodes}p{decode_nodes}d",
        model=TINY_DEEPSEEK if "deepseek" in parts else TINY_QWEN2,
        hardware=cpu_emulated(snic_bytes_per_s),
        cluster=ClusterConfig(
            prefill_nodes=prefill_nodes,
            decode_nodes=decode_nodes,
            decode_max_len=2048,
            decode_slots=8,
        ),
        store=StoreConfig(block_tokens=16),
        workload=WorkloadConfig(
            preset="64k",
            trajectories=agents,
            agents=agents,
            length_scale=1 / 16,
            max_len=1024,
            max_turns=16,
            ttft_slo_s=4.0,
            tpot_slo_s=CPU_TPOT_SLO_S,
        ),
    )
