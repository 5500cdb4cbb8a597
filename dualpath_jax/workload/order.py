"""The order a replay's rounds may run in: cycles of rounds that wait for each other.

A round waits for the round before it, for every trajectory its `waits_for` names (their last
rounds) and, a first round, for the round its trajectory starts after (`Trajectory.after`). A
cycle means none of them could ever run; `workload.trace.check_waits` and
`rollout.run_trajectories` refuse one.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def round_cycle(
    trajectories: Sequence[tuple[str, Sequence[Sequence[str]], tuple]],
) -> list[str]:
    """A cycle of rounds that wait for each other, `["a#2", "b#0", ..., "a#2"]`, or `[]`:
    `(id, each round's waits_for, after)` per trajectory. Round i waits for round i - 1 of its
    trajectory and for the last round of each trajectory it names; a trajectory's first round
    for the round its `after` names (ids not among them are ignored)."""
    last = {tid: len(rounds) - 1 for tid, rounds, _ in trajectories if rounds}
    deps: dict[tuple[str, int], list[tuple[str, int]]] = {}
    for tid, rounds, after in trajectories:
        for i, waits in enumerate(rounds):
            d = [(tid, i - 1)] if i else []
            d += [(w, last[w]) for w in sorted(set(waits)) if w in last]
            if not i and after and after[0] in last:
                d.append((after[0], min(after[1], last[after[0]])))
            deps[tid, i] = d
    done: set[tuple[str, int]] = set()
    for root in deps:
        if root in done:
            continue
        path, on_path = [root], {root}
        stack = [iter(deps[root])]
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                stack.pop()
                node = path.pop()
                on_path.discard(node)
                done.add(node)
            elif nxt in on_path:
                cyc = [*path[path.index(nxt) :], nxt]
                return [f"{t}#{i}" for t, i in cyc]
            elif nxt not in done:
                path.append(nxt)
                on_path.add(nxt)
                stack.append(iter(deps[nxt]))
    return []


def wait_cycle(waits: dict[str, Iterable[str]]) -> list[str]:
    """A cycle of `waits` (trajectory id -> the ids it waits for; ids that are not keys are
    ignored) as `[a, b, ..., a]`, or `[]` when there is none."""
    edges = {k: sorted(w for w in v if w in waits) for k, v in waits.items()}
    done: set[str] = set()
    for root in sorted(edges):
        if root in done:
            continue
        path = [root]
        stack = [iter(edges[root])]
        while stack:
            child = next(stack[-1], None)
            if child is None:
                stack.pop()
                done.add(path.pop())
            elif child in path:
                return [*path[path.index(child) :], child]
            elif child not in done:
                path.append(child)
                stack.append(iter(edges[child]))
    return []
