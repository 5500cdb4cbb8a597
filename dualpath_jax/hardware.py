"""Hardware presets: the emulated CPU "node pair" and the paper's Hopper testbed.

Emulation on one CPU host scales the paper's link ratios down to rates the tiny models make
storage-bound: per node one storage NIC of `snic` bytes/s and, per engine, a compute NIC of
`cnic_ratio x snic` (the testbed's 8 x 400 Gbps compute NICs against 1 x 400 Gbps storage NIC
per node give 8x) and host<->device copies of `h2d_ratio x snic`. Every result of an emulated run
says so (`summary.json: emulated`).
"""

from __future__ import annotations

from dualpath_jax.config import HardwareConfig


def cpu_emulated(snic_bytes_per_s: float, *, cnic_ratio: float = 8.0, h2d_ratio: float = 16.0) -> HardwareConfig:
    return HardwareConfig(
        gpu="cpu",
        engines_per_node=1,
        snic_bytes_per_s=snic_bytes_per_s,
        cnic_bytes_per_s=cnic_ratio * snic_bytes_per_s,
        h2d_bytes_per_s=h2d_ratio * snic_bytes_per_s,
        d2h_bytes_per_s=h2d_ratio * snic_bytes_per_s,
        emulated=True,
    )


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


def emulated_cpu_experiment(
    prefill_nodes: int, decode_nodes: int, arg: str = "", *, snic_bytes_per_s: float = 5e5
):
    """The `configs/cpu_*` experiments: tiny model, emulated links, a CPU-sized 64k-shaped trace.

    `arg` is a comma list: `deepseek` picks the tiny DeepSeek model (default tiny Qwen2), `tiny`
    halves the workload to 8 agents (the demo). The trace is the 64k preset with every length
    scaled by 1/16, trajectories cut at 1,024 tokens and 16 rounds: many agents of similar
    length keep the storage links busy, so JCT measures throughput rather than the round-trip
    latency of one long trajectory.
    """
    from dualpath_jax.config import ClusterConfig, ExperimentConfig, StoreConfig, WorkloadConfig
    from dualpath_jax.model.presets import TINY_DEEPSEEK, TINY_QWEN2

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
            prefill_nodes=prefill_nodes, decode_nodes=decode_nodes, decode_max_len=2048, decode_slots=8
        ),
        store=StoreConfig(block_tokens=16),
        workload=WorkloadConfig(
            preset="64k", trajectories=agents, agents=agents, length_scale=1 / 16, max_len=1024,
            max_turns=16,
        ),
    )
