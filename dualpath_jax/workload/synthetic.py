"""Seeded synthetic agent traces matching Table 2 (the 32K / 48K / 64K sets).

Shape of a trajectory (production agentic RL traces: a long first prompt, then many short tool
outputs and short generations, often cut at MaxLen):

- turns `T ~ LogNormal(turns_mu, turns_sigma)` (the spread makes short trajectories have longer
  rounds, which is why Table 2's Total is well below Turns x (Append + Gen));
- total length `total = MaxLen * (1 - total_depth * u**total_shape)`, `u ~ U(0, 1)`: most
  trajectories end near MaxLen;
- `gen_share` of the total is generated, spread over the rounds with log-normal jitter;
- the first append holds `first_frac` of the total (system prompt, task, repository context); the
  rest of the appends are spread over the other rounds with log-normal jitter.

`T` and `total` are drawn by stratified sampling (one draw per quantile stratum, shuffled), so
500 trajectories reproduce the target means within a few percent for any seed. The parameters
below were calibrated against Table 2 (`tests/workload` checks the match within 5%).
"""

from __future__ import annotations

import dataclasses
import statistics

import numpy as np

from dualpath_jax.config import WorkloadConfig
from dualpath_jax.workload.formats import read_trace
from dualpath_jax.workload.trace import Round, Trajectory, truncate


@dataclasses.dataclass(frozen=True)
class Table2Row:
    """A row of Table 2: Turns and Total per trajectory; Append, Gen, Context per turn."""

    turns: float
    append: float
    gen: float
    total: float
    context: float


@dataclasses.dataclass(frozen=True)
class SyntheticPreset:
    name: str
    max_len: int
    turns_mu: float
    turns_sigma: float
    total_depth: float
    total_shape: float
    gen_share: float
    first_frac: float
    target: Table2Row
    round_sigma: float = 0.8


PRESETS: dict[str, SyntheticPreset] = {
    "32k": SyntheticPreset(
        "32k",
        32 * 1024,
        turns_mu=3.864,
        turns_sigma=0.679,
        total_depth=0.9,
        total_shape=6.14,
        gen_share=0.1958,
        first_frac=0.252,
        target=Table2Row(60, 608, 148, 28639, 17183),
    ),
    "48k": SyntheticPreset(
        "48k",
        48 * 1024,
        turns_mu=4.426,
        turns_sigma=0.690,
        total_depth=0.9,
        total_shape=5.76,
        gen_share=0.2663,
        first_frac=0.214,
        target=Table2Row(106, 474, 172, 42607, 25120),
    ),
    "64k": SyntheticPreset(
        "64k",
        64 * 1024,
        turns_mu=4.791,
        turns_sigma=0.729,
        total_depth=0.9,
        total_shape=5.16,
        gen_share=0.2909,
        first_frac=0.191,
        target=Table2Row(157, 429, 176, 55958, 32721),
    ),
}


def get_preset(name: str) -> SyntheticPreset:
    try:
        return PRESETS[name.lower()]
    except KeyError:
        raise KeyError(f"unknown trace preset {name!r}; known: {sorted(PRESETS)}") from None


def _stratified(n: int, rng: np.random.Generator) -> np.ndarray:
    """`n` uniforms, one in each of the strata `[k/n, (k+1)/n)`, in random order."""
    return (rng.permutation(n) + rng.random(n)) / n


def _allocate(budget: int, weights: np.ndarray) -> np.ndarray:
    """Integers >= 1 summing to `budget`, roughly proportional to `weights`."""
    n = len(weights)
    extra = budget - n
    if extra < 0:
        raise ValueError(f"cannot give {n} parts at least 1 token from {budget}")
    cum = np.rint(np.cumsum(weights) / weights.sum() * extra).astype(np.int64)
    return 1 + np.diff(cum, prepend=0)


def _trajectory(
    p: SyntheticPreset, tid: str, u_turns: float, u_total: float, rng: np.random.Generator
) -> Trajectory:
    z = statistics.NormalDist().inv_cdf(min(max(u_turns, 1e-9), 1 - 1e-9))
    total = int(p.max_len * (1.0 - p.total_depth * u_total**p.total_shape))
    turns = int(min(max(1, round(np.exp(p.turns_mu + p.turns_sigma * z))), total // 2))
    gen = int(min(max(turns, round(p.gen_share * total)), total - turns))
    app = total - gen
    if turns == 1:
        appends = np.array([app])
    else:
        first = int(min(max(1, round(p.first_frac * total)), app - (turns - 1)))
        rest = _allocate(app - first, rng.lognormal(0.0, p.round_sigma, turns - 1))
        appends = np.concatenate([[first], rest])
    gens = _allocate(gen, rng.lognormal(0.0, p.round_sigma, turns))
    return Trajectory(tid, tuple(Round(int(a), int(g)) for a, g in zip(appends, gens)))


def scale_trajectory(
    t: Trajectory, *, append_scale: float = 1.0, gen_scale: float = 1.0, length_scale: float = 1.0
) -> Trajectory:
    """Scales every append by `append_scale * length_scale` and every generation by
    `gen_scale * length_scale` (rounded, at least 1 token each). Int appends only."""
    a_s, g_s = append_scale * length_scale, gen_scale * length_scale
    if a_s <= 0 or g_s <= 0:
        raise ValueError("scales must be positive")
    if a_s == 1.0 and g_s == 1.0:
        return t
    rounds = []
    for r in t.rounds:
        if not isinstance(r.append, int):
            raise ValueError(f"trajectory {t.id!r}: cannot scale explicit token ids")
        rounds.append(
            Round(max(1, round(r.append * a_s)), max(1, round(r.gen * g_s)), gap_s=r.gap_s)
        )
    return Trajectory(t.id, tuple(rounds))


def generate(
    preset: str | SyntheticPreset,
    n: int = 500,
    seed: int = 0,
    *,
    append_scale: float = 1.0,
    gen_scale: float = 1.0,
    length_scale: float = 1.0,
    max_len: int = 0,
) -> list[Trajectory]:
    """`n` synthetic trajectories of a preset, a pure function of the arguments.

    Scales apply after generation (see `scale_trajectory`); trajectories are then truncated at
    `max_len` (0: the preset's MaxLen times `length_scale`). Ids are `"{preset}-{seed}-{k}"`.
    """
    p = get_preset(preset) if isinstance(preset, str) else preset
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    limit = max_len or max(2, round(p.max_len * length_scale))
    rng = np.random.default_rng([seed, 0x7A11])
    u_turns, u_total = _stratified(n, rng), _stratified(n, rng)
    out = []
    for k in range(n):
        t = _trajectory(p, f"{p.name}-{seed}-{k}", float(u_turns[k]), float(u_total[k]), rng)
        t = scale_trajectory(
            t, append_scale=append_scale, gen_scale=gen_scale, length_scale=length_scale
        )
        out.append(truncate(t, limit) if t.total_len > limit else t)
    return out


def from_config(cfg: WorkloadConfig, *, vocab_size: int | None = None) -> list[Trajectory]:
    """The trajectories a `WorkloadConfig` asks for (`load_workload` without the start times)."""
    return load_workload(cfg, vocab_size=vocab_size)[0]


def load_workload(
    cfg: WorkloadConfig, *, vocab_size: int | None = None
) -> tuple[list[Trajectory], list[float] | None]:
    """The trajectories a `WorkloadConfig` asks for, and their start times in seconds when the
    trace has them (Mooncake, Weka, TraceLab; else None): the file `trace` in `trace_format` if
    set (validated, JSONL token ids checked against `vocab_size`, truncated at `max_len` if set),
    else `trajectories` synthetic ones of `preset` with the three scales and `max_len`; then at
    most `max_turns` rounds each (if set)."""
    trajs, times, _ = read_workload(cfg, vocab_size=vocab_size)
    return trajs, times


def read_workload(
    cfg: WorkloadConfig, *, vocab_size: int | None = None
) -> tuple[list[Trajectory], list[float] | None, int]:
    """`load_workload`, and how many trace trajectories `max_len` cut."""
    times = None
    truncated = 0
    if cfg.trace:
        trajs, times = read_trace(cfg, vocab_size=vocab_size)
        if cfg.max_len:
            truncated = sum(1 for t in trajs if t.total_len > cfg.max_len)
            trajs = [truncate(t, cfg.max_len) if t.total_len > cfg.max_len else t for t in trajs]
    else:
        trajs = generate(
            cfg.preset,
            cfg.trajectories,
            cfg.seed,
            append_scale=cfg.append_scale,
            gen_scale=cfg.gen_scale,
            length_scale=cfg.length_scale,
            max_len=cfg.max_len,
        )
    if cfg.max_turns:
        trajs = [Trajectory(t.id, t.rounds[: cfg.max_turns]) for t in trajs]
    return trajs, times, truncated
