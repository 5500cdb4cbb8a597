"""When the rounds of one `run_trajectories` call may go: the rounds that wait for other
trajectories to end (`Round.waits_for`), the trajectories that start after another's round
(`Trajectory.after`), both checked before anything runs (no cycle, nothing that could never
start), and the appendix A.3 submission time of a round (`workload.trace.submit_time`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from dualpath_jax.workload.order import round_cycle, wait_cycle
from dualpath_jax.workload.trace import Trajectory, submit_time


@dataclasses.dataclass(frozen=True)
class Schedule:
    """The order constraints of a call's trajectories (indices into its list).

    `waits_of[k, i]`: the trajectories round i of trajectory k waits for (to have ended).
    `spawns[k, i]`: `(trajectory c, delay_s)` pairs: c starts `delay_s` after round i of
    trajectory k ended (or when k ends without it)."""

    waits_of: dict[tuple[int, int], list[int]]
    spawns: dict[tuple[int, int], list[tuple[int, float]]]

    @classmethod
    def plan(cls, trajs: Sequence[Trajectory], max_concurrent: int) -> Schedule:
        """The schedule of `trajs`, checked: ValueError for a cycle of waits, a round waiting
        for a trajectory that starts after it, and, with `max_concurrent`, a wait for a later
        trajectory or any start after another's round (a slot might never be freed)."""
        return cls(_waits(trajs, max_concurrent), _spawns(trajs, max_concurrent))

    @property
    def spawned(self) -> set[int]:
        """The trajectories that start after another's round, not at their arrival."""
        return {c for started in self.spawns.values() for c, _ in started}

    def delay(
        self,
        trajs: Sequence[Trajectory],
        k: int,
        i: int,
        ready: float,
        now: float,
        ended: Sequence[float | None],
    ) -> float:
        """Seconds from `now` until round i of trajectory k goes, ready (its previous round
        ended, or it arrived) at `ready` and every trajectory it waits for ended at `ended[w]`
        (`workload.trace.submit_time`; counted from `now` so that a plain gap stays exact)."""
        gap = trajs[k].rounds[i].gap_s
        ends = [ended[w] - now for w in self.waits_of.get((k, i), ())]
        return submit_time(ready - now, gap, ends, first=i == 0)


def _waits(trajs: Sequence[Trajectory], max_concurrent: int) -> dict:
    """`(trajectory k, round i) -> [indices of the trajectories it waits for]`, checked: no
    cycle, and with `max_concurrent` only earlier trajectories."""
    index: dict[str, list[int]] = {}
    for k, t in enumerate(trajs):
        index.setdefault(t.id, []).append(k)
    out: dict[tuple[int, int], list[int]] = {}
    edges: dict[str, set[str]] = {tid: set() for tid in index}
    for k, t in enumerate(trajs):
        for i, rd in enumerate(t.rounds):
            ws = sorted({w for name in rd.waits_for for w in index.get(name, ())})
            if not ws:
                continue
            if max_concurrent and ws[-1] >= k:
                raise ValueError(
                    f"round {i} of {t.id!r} waits for a later trajectory; with max_concurrent"
                    " the one it waits for might never get a slot"
                )
            out[k, i] = ws
            edges[t.id].update(trajs[w].id for w in ws)
    cycle = wait_cycle(edges)
    if cycle:
        raise ValueError(f"trajectories wait for each other in a cycle: {' -> '.join(cycle)}")
    return out


def _spawns(trajs: Sequence[Trajectory], max_concurrent: int) -> dict:
    """`(trajectory k, round i) -> [(trajectory c, delay_s), ...]`: the trajectories that start
    after round i of trajectory k, checked: no round waits for one that starts after it, none
    with `max_concurrent`. A parent not in the call leaves its child to its arrival."""
    index: dict[str, int] = {}
    for k, t in enumerate(trajs):
        index.setdefault(t.id, k)
    out: dict[tuple[int, int], list[tuple[int, float]]] = {}
    for c, t in enumerate(trajs):
        if not t.after:
            continue
        k = index.get(t.after[0])
        if k is None:
            continue
        if k == c:
            raise ValueError(f"trajectory {t.id!r} starts after a round of its own")
        at = min(t.after[1], len(trajs[k].rounds) - 1)
        out.setdefault((k, at), []).append((c, float(t.after[2])))
    if out and max_concurrent:
        raise ValueError(
            "trajectories that start after another's round need max_concurrent=0: a slot held"
            " by the one they start after might never be freed"
        )
    if out:
        cycle = round_cycle([(t.id, [r.waits_for for r in t.rounds], t.after) for t in trajs])
        if cycle:
            raise ValueError(f"rounds wait for each other in a cycle: {' -> '.join(cycle)}")
    return out
