"""Hardware presets: the emulated CPU "node pair" and the paper's Hopper testbed.

Emulation on one CPU host scales the paper's link ratios down to rates the tiny models make
storage-bound: per node one storage NIC of `snic` bytes/s and, per engine, a compute NIC of
`cnic_ratio x snic` (the testbed's 8 x 400 Gbps compute NICs against 1 x 400 Gbps storage NIC
per node give 8x) and host<->device copies of `h2d_ratio x snic`. Every result of an emulated run
says so (`summary.json: emulated`).
"""

from __future__ import annotations

import dataclasses

from dualpath_jax.config import HardwareConfig


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


# The online SLO of the CPU configs: the paper's TTFT limit (4 s), but a TPOT limit of 1 s instead
# of 50 ms. On a 2-core host the three engine processes share the cores, so a decode step's time
# is set by CPU sharing with the prefill engine (measured: TPOT p50 75 ms, p90 0.32 s at 0.05
# agents/s under Basic), not by the loading policy that the capacity benchmark compares.
CPU_TPOT_SLO_S = 1.0


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


# --------------------------------------------------------------------------- the paper's clusters


@dataclasses.dataclass(frozen=True)
class PaperModel:
    """One of the paper's three models as its experiments ran it (section 7.2, appendix A)."""

    key: str  # "ds660b" | "ds27b" | "qwen32b"
    preset: str  # `model.presets` name
    kv_format: str | None  # KV bytes per token (FP8 FlashMLA layout for the DeepSeek models)
    dram_buffer_bytes: float  # per node
    fp8: bool  # FP8 weights and GEMMs
    expert_parallel: bool  # DeepSeek models: EP across the role's GPUs + DP attention
    prefill_nodes: int
    decode_nodes: int
    gpu: str = "h800"


PAPER_MODELS: dict[str, PaperModel] = {
    m.key: m
    for m in (
        PaperModel("ds660b", "deepseek-v3.2-660b", "fp8_flashmla", 80e9, True, True, 2, 4),
        PaperModel("ds27b", "ds-27b", "fp8_flashmla", 80e9, True, True, 1, 1),
        # BF16 Qwen2.5-32B on every GPU (DP only) leaves an 80 GB H800 ~7 GB of KV (25k tokens at
        # 256 KiB/token), less than one 64K-trace prompt: its nodes get H200s (141 GB, Hopper).
        PaperModel("qwen32b", "qwen2.5-32b", None, 320e9, False, False, 1, 2, gpu="h200"),
    )
}


def paper_cost_model(key: str, decode_nodes: int, *, engines_per_node: int = 8):
    """The calibrated Hopper roofline of a paper model (`sched.cost.hopper_calibration`); routed
    experts spread over the decode nodes' GPUs (the memory-bound side that streams them). The
    calibrated decode overhead is expert-parallel communication, paid per MoE layer
    (`Calibration.overhead_for`): DS 27B's 29 MoE layers pay half of DS 660B's 58, and a
    data-parallel dense model (Qwen) pays none."""
    from dualpath_jax.model.presets import get_preset
    from dualpath_jax.sched.cost import make_cost_model

    m = PAPER_MODELS[key]
    ep = decode_nodes * engines_per_node if m.expert_parallel else 1
    return make_cost_model(
        dataclasses.replace(HOPPER_NODE, gpu=m.gpu),
        get_preset(m.preset),
        fp8=m.fp8,
        expert_parallel=ep,
        kv_format=m.kv_format,
    )


def paper_experiment(
    key: str,
    prefill_nodes: int | None = None,
    decode_nodes: int | None = None,
    *,
    policy: str = "dualpath",
    agents: int = 1024,
    preset: str = "64k",
    mode: str = "offline",
    aps: float = 0.0,
    duration_s: float = 0.0,
    append_scale: float = 1.0,
    gen_scale: float = 1.0,
    max_turns: int = 0,
    snic_bytes_per_s: float = 50e9,
    seed: int = 0,
    ep_decode_nodes: int = 0,
):
    """`(ExperimentConfig, cost model)` of one of the paper's runs: `P`P`D`D H800 nodes
    (8 GPUs, 8 x 400 Gbps compute NICs, one 400 Gbps storage NIC that 3FS saturates), the
    model's DRAM buffer, HBM left for KV after the weights, the Table 2 trace `preset`.
    Prefill batches are bounded by the compute quota and the PE's HBM; decode by HBM.
    `ep_decode_nodes` (0: all D): the decode nodes one expert-parallel group spans."""
    from dualpath_jax.config import (
        ClusterConfig,
        ExperimentConfig,
        Policy,
        SchedulerConfig,
        WorkloadConfig,
    )
    from dualpath_jax.model.presets import get_preset

    m = PAPER_MODELS[key]
    p = m.prefill_nodes if prefill_nodes is None else prefill_nodes
    d = m.decode_nodes if decode_nodes is None else decode_nodes
    g = HOPPER_NODE.engines_per_node
    # Routed experts spread over the decode GPUs of one expert-parallel group: all D nodes, or
    # `ep_decode_nodes` (a scaled-out cluster of replicated groups, e.g. 48P96D as 24 groups
    # of 2P4D's 4 decode nodes, keeps its unit's weights per GPU and decode step).
    ep_nodes = ep_decode_nodes or d
    cost = paper_cost_model(key, ep_nodes, engines_per_node=g)
    if cost.kv_hbm_bytes() <= 0:
        raise ValueError(
            f"{key} {p}P{d}D does not fit: {cost.weight_bytes_per_gpu / 1e9:.1f} GB of weights per GPU "
            f"(routed experts over {ep_nodes * g} decode GPUs) leave no HBM for KV"
        )
    hw = dataclasses.replace(
        HOPPER_NODE,
        gpu=m.gpu,
        snic_bytes_per_s=snic_bytes_per_s,
        hbm_bytes=cost.kv_hbm_bytes(),
        dram_buffer_bytes=m.dram_buffer_bytes / g,
    )
    cfg = ExperimentConfig(
        name=f"paper_{key}_{p}p{d}d",
        model=get_preset(m.preset),
        hardware=hw,
        cluster=ClusterConfig(
            prefill_nodes=p,
            decode_nodes=d,
            pe_group_size=g,
            de_group_size=g,
            decode_slots=1024,
            decode_max_len=131072,
            prefill_max_batch=0,
            prefill_max_tokens=0,
        ),
        scheduler=SchedulerConfig(policy=Policy(policy)),
        workload=WorkloadConfig(
            preset=preset,
            trajectories=500,
            agents=agents,
            mode=mode,
            aps=aps,
            duration_s=duration_s,
            append_scale=append_scale,
            gen_scale=gen_scale,
            max_turns=max_turns,
            seed=seed,
        ),
    )
    return cfg, cost
