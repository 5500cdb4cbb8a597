"""The paper's testbeds (section 7.2, appendix A): its three models on H800 nodes, as configs.

`paper_experiment(key, P, D, ...)` is the `ExperimentConfig` of one of the paper's runs with its
cost model; the config names that cost model itself (`hardware.calibration`, `fp8`,
`ep_decode_nodes`, `kv_format`), so `presets.config_cost_model(cfg)` and `sim.simulate(cfg)`
rebuild the same one. `paper_config(arg)` is the same config from a `configs/paper.py` ARG
(`ds660b_2p4d,preset=32k,agents=2048`), what the launchers and `bench/paper_runs.py` load.
"""

from __future__ import annotations

import dataclasses
import re

from dualpath_jax.config import (
    ClusterConfig,
    ConfigError,
    ExperimentConfig,
    HardwareConfig,
    Policy,
    SchedulerConfig,
    WorkloadConfig,
)
from dualpath_jax.presets.calibration import config_cost_model, make_cost_model
from dualpath_jax.presets.hardware import HOPPER_NODE
from dualpath_jax.presets.models import get_preset
from dualpath_jax.sched.cost import RooflineCostModel


@dataclasses.dataclass(frozen=True)
class PaperModel:
    """One of the paper's three models as its experiments ran it (section 7.2, appendix A).
    Models with routed experts (the DeepSeek ones) run them expert parallel across the decode
    GPUs with data-parallel attention; the dense Qwen model runs data parallel only."""

    key: str  # "ds660b" | "ds27b" | "qwen32b"
    preset: str  # `presets.PRESETS` name
    kv_format: str  # KV bytes per token (FP8 FlashMLA layout for the DeepSeek models; "": dtype)
    dram_buffer_bytes: float  # per node
    fp8: bool  # FP8 weights and GEMMs
    prefill_nodes: int
    decode_nodes: int
    gpu: str = "h800"


PAPER_MODELS: dict[str, PaperModel] = {
    m.key: m
    for m in (
        PaperModel("ds660b", "deepseek-v3.2-660b", "fp8_flashmla", 80e9, True, 2, 4),
        PaperModel("ds27b", "ds-27b", "fp8_flashmla", 80e9, True, 1, 1),
        # BF16 Qwen2.5-32B on every GPU (DP only) leaves an 80 GB H800 ~7 GB of KV (25k tokens at
        # 256 KiB/token), less than one 64K-trace prompt: its nodes get H200s (141 GB, Hopper).
        PaperModel("qwen32b", "qwen2.5-32b", "", 320e9, False, 1, 2, gpu="h200"),
    )
}


def paper_hardware(
    key: str, *, snic_bytes_per_s: float = 50e9, ep_decode_nodes: int = 0
) -> HardwareConfig:
    """The paper's node (`HOPPER_NODE`) for model `key`: its GPU, DRAM buffer per engine, storage
    NIC and cost model (FP8, KV format, expert-parallel group); HBM for KV is set by
    `paper_experiment` (it depends on the weights per GPU, so on the split)."""
    m = PAPER_MODELS[key]
    return dataclasses.replace(
        HOPPER_NODE,
        gpu=m.gpu,
        snic_bytes_per_s=snic_bytes_per_s,
        dram_buffer_bytes=m.dram_buffer_bytes / HOPPER_NODE.engines_per_node,
        calibration="hopper",
        fp8=m.fp8,
        ep_decode_nodes=ep_decode_nodes,
        kv_format=m.kv_format,
    )


def paper_cost_model(
    key: str, decode_nodes: int, *, engines_per_node: int = 8
) -> RooflineCostModel:
    """The calibrated Hopper roofline of a paper model (`presets.hopper_calibration`); routed
    experts spread over the decode nodes' GPUs (the memory-bound side that streams them). The
    calibrated decode overhead is expert-parallel communication, paid per MoE layer
    (`Calibration.overhead_for`): DS 27B's 29 MoE layers pay half of DS 660B's 58, and a
    data-parallel dense model (Qwen) pays none."""
    m = PAPER_MODELS[key]
    model = get_preset(m.preset)
    ep = decode_nodes * engines_per_node if model.n_routed_experts else 1
    cost = make_cost_model(paper_hardware(key), model, expert_parallel=ep)
    assert isinstance(cost, RooflineCostModel)
    return cost


def paper_experiment(
    key: str,
    prefill_nodes: int | None = None,
    decode_nodes: int | None = None,
    *,
    policy: Policy | str = Policy.DUALPATH,
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
) -> tuple[ExperimentConfig, RooflineCostModel]:
    """`(ExperimentConfig, cost model)` of one of the paper's runs: `P`P`D`D H800 nodes
    (8 GPUs, 8 x 400 Gbps compute NICs, one 400 Gbps storage NIC that 3FS saturates), the
    model's DRAM buffer, HBM left for KV after the weights, the Table 2 trace `preset`.
    Prefill batches are bounded by the compute quota and the PE's HBM; decode by HBM.
    `ep_decode_nodes` (0: all D): the decode nodes one expert-parallel group spans. The cost
    model is `config_cost_model(cfg)`: the config names it."""
    m = PAPER_MODELS[key]
    p = m.prefill_nodes if prefill_nodes is None else prefill_nodes
    d = m.decode_nodes if decode_nodes is None else decode_nodes
    g = HOPPER_NODE.engines_per_node
    # Routed experts spread over the decode GPUs of one expert-parallel group: all D nodes, or
    # `ep_decode_nodes` (a scaled-out cluster of replicated groups, e.g. 48P96D as 24 groups
    # of 2P4D's 4 decode nodes, keeps its unit's weights per GPU and decode step).
    hw = paper_hardware(key, snic_bytes_per_s=snic_bytes_per_s, ep_decode_nodes=ep_decode_nodes)
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
    cost = config_cost_model(cfg)
    assert isinstance(cost, RooflineCostModel)
    if cost.kv_hbm_bytes() <= 0:
        ep_nodes = ep_decode_nodes or d
        raise ValueError(
            f"{key} {p}P{d}D does not fit: {cost.weight_bytes_per_gpu / 1e9:.1f} GB of weights per GPU "
            f"(routed experts over {ep_nodes * g} decode GPUs) leave no HBM for KV"
        )
    cfg = dataclasses.replace(cfg, hardware=dataclasses.replace(hw, hbm_bytes=cost.kv_hbm_bytes()))
    return cfg, cost


# --------------------------------------------------------------------------- configs/paper.py ARG

# The paper's three testbeds by name; any `{model}_{P}p{D}d` split of a paper model is accepted.
PAPER_CONFIGS = ("ds660b_2p4d", "ds27b_1p1d", "qwen32b_1p2d")

# ARG options after the name: `paper_experiment` keyword -> type (`snic_gbps` is converted).
_ARG_OPTIONS: dict[str, type] = {
    "policy": str,
    "agents": int,
    "preset": str,
    "mode": str,
    "aps": float,
    "duration_s": float,
    "append_scale": float,
    "gen_scale": float,
    "max_turns": int,
    "snic_gbps": float,
    "seed": int,
    "ep_decode_nodes": int,
}
_NAME = re.compile(r"([a-z0-9]+?)(?:_(\d+)p(\d+)d)?")


def _parse_arg(arg: str) -> tuple[str, int | None, int | None, dict[str, object], list[str]]:
    """A `configs/paper.py` ARG -> (model key, P, D, `paper_experiment` keywords, the option
    texts as written); a bad name or option raises ConfigError."""
    name, *options = [part.strip() for part in arg.split(",")]
    m = _NAME.fullmatch(name)
    if not m or m.group(1) not in PAPER_MODELS:
        raise ConfigError(
            f"configs/paper.py: unknown testbed {name!r}; use one of {list(PAPER_CONFIGS)} or "
            f"MODEL_<P>p<D>d with MODEL in {sorted(PAPER_MODELS)}"
        )
    p = int(m.group(2)) if m.group(2) else None
    d = int(m.group(3)) if m.group(3) else None
    kw: dict[str, object] = {}
    for option in filter(None, options):
        k, eq, text = option.partition("=")
        k = k.strip()
        if not eq or k not in _ARG_OPTIONS:
            raise ConfigError(
                f"configs/paper.py: bad option {option!r}; write key=value with key in "
                f"{sorted(_ARG_OPTIONS)}"
            )
        tp = _ARG_OPTIONS[k]
        try:
            value = tp(text.strip().replace("_", "") if tp is not str else text.strip())
        except ValueError:
            raise ConfigError(
                f"configs/paper.py: option {k}: expected {tp.__name__}, got {text!r}"
            ) from None
        if k == "snic_gbps":
            kw["snic_bytes_per_s"] = value / 8 * 1e9  # as bench/paper_runs.py converts it
        else:
            kw[k] = value
    return m.group(1), p, d, kw, options


def paper_config(arg: str = "ds660b_2p4d") -> ExperimentConfig:
    """The config of `configs/paper.py:ARG`: `NAME[,key=value...]`, NAME one of
    `PAPER_CONFIGS` or any `{model}_{P}p{D}d` (model `ds660b`, `ds27b`, `qwen32b`; the bare model
    name is its paper split), then `paper_experiment` options: `policy`, `agents`, `preset`
    (`32k`/`48k`/`64k`), `mode`, `aps`, `duration_s`, `append_scale`, `gen_scale`,
    `max_turns`, `seed`, `ep_decode_nodes` and `snic_gbps` (the storage NIC per node in Gbps,
    default 400). `paper_config(...) == paper_experiment(...)[0]` for the same arguments."""
    key, p, d, kw, _ = _parse_arg(arg)
    return paper_experiment(key, p, d, **kw)[0]  # type: ignore[arg-type]


def paper_split_arg(arg: str, prefill_nodes: int, decode_nodes: int) -> str:
    """`arg` (a `configs/paper.py` ARG) for another P/D split of the same model and options:
    what the deployment advisor simulates for each candidate split (each split has its own HBM
    for KV, as the weights per GPU depend on the decode GPUs the experts spread over)."""
    key, _, _, _, options = _parse_arg(arg)
    return ",".join([f"{key}_{prefill_nodes}p{decode_nodes}d", *options])
