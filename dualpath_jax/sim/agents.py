"""Agents replaying their trajectories on a simulated cluster (appendix A.3).

Round i+1 of an agent is submitted when its round i is done and its tool call (`Round.gap_s`)
is over, with prompt `A_1 G_1 ... A_{i+1}`; a round that waits for other agents' trajectories
(`Round.waits_for`: subagents) also not before they finished, its gap counting from the last
of their ends (`workload.trace.submit_time`). An agent whose trajectory starts after another
agent's round (`Trajectory.after`: a subagent) starts that long after the round ends, not at
its arrival. The hit of a round is what the DE persisted for the
previous round (`round_hit`); a first round given as content pieces (`Round.pieces`: Mooncake
and conversation traces) hits the longest prefix it shares with the first rounds finished so
far, as the content-addressed store finds it (`workload.sharing`). With a store capacity, the
part of that hit still stored (`sim.kvcache`). Part of the compiled core (`dualpath_jax.native`): one submission per round
of every agent.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from dualpath_jax.sched.types import Request
from dualpath_jax.sim.cluster import SimCluster
from dualpath_jax.sim.kvcache import SimBlockStore
from dualpath_jax.sim.state import RoundState
from dualpath_jax.workload.sharing import PrefixIndex, prefix_hit
from dualpath_jax.workload.trace import Trajectory, TurnSpec, check_waits, submit_time


def round_hit(prev: TurnSpec | None, spec: TurnSpec, block_tokens: int) -> int:
    """Cached tokens of round `spec` given the previous round of the same trajectory: every Full
    Block of its prompt + generated tokens but the last (whose KV is never computed), less one
    block when that would cover the whole prompt (at least one new token makes logits)."""
    if prev is None:
        return 0
    return _hit(prev.prompt, prev.gen, spec.prompt, block_tokens)


def _hit(prev_prompt: int, prev_gen: int, prompt: int, block_tokens: int) -> int:
    blocks = (prev_prompt + prev_gen - 1) // block_tokens
    if blocks * block_tokens >= prompt:
        blocks -= 1
    return max(0, blocks) * block_tokens


def reference_request(trajs: Sequence[Trajectory]) -> tuple[int, int]:
    """`(cached, new)` of a mean round of the workload (`turn_specs`' context and append over
    every round of every trajectory): the reference request of beta."""
    ctx, app, n = 0, 0, 0
    for t in trajs:
        context = 0
        for r in t.rounds:
            append = r.append_len
            ctx, app, n = ctx + context, app + append, n + 1
            context += append + r.gen
    return (ctx // max(n, 1), max(1, app // max(n, 1)))


def schedule_agents(
    cluster: SimCluster, trajectories: Sequence[Trajectory], arrivals: Sequence[float]
) -> list[float]:
    """Schedules each agent's first round at its arrival on `cluster`'s loop; each later round is
    submitted when the one before finishes. Returns the agents' finish times, NaN until each
    finishes (filled in while the loop runs)."""
    agents = AgentReplay(cluster, trajectories)
    for agent, t0 in enumerate(arrivals):
        if agents.prompts[agent] and agent not in agents.spawned:
            cluster.loop.at(t0, agents.start, agent)
    return agents.done_at


class AgentReplay:
    """`schedule_agents`' submissions. Keeps each agent's round lengths as ints (`turn_specs`'
    prompt and gen, without a `TurnSpec` per round). Its callbacks are bound methods, not
    closures that call each other (those would make a reference cycle per round)."""

    def __init__(self, cluster: SimCluster, trajectories: Sequence[Trajectory]) -> None:
        self.cluster = cluster
        self.bt = cluster.bt
        self.ids: list[str] = []
        self.prompts: list[list[int]] = []
        self.gens: list[list[int]] = []
        self.gaps: list[list[float]] = []
        self.thinks: list[set[int]] = []  # per agent: its rounds after a user's think time
        # Each agent's first-round pieces (empty: private tokens) and those finished so far.
        self.pieces: list[tuple[tuple[int, int], ...]] = []
        self.shared = PrefixIndex()
        named: list[tuple[int, int, tuple[str, ...]]] = []  # rounds with `waits_for`
        for t in trajectories:
            self.pieces.append(t.rounds[0].pieces if t.rounds else ())
            prompts: list[int] = []
            gens: list[int] = []
            gaps: list[float] = []
            thinks: set[int] = set()  # rounds whose gap is a user's think time, not a tool call
            context = 0
            for r in t.rounds:
                if r.waits_for:
                    named.append((len(self.ids), len(gens), r.waits_for))
                append = r.append_len
                prompts.append(context + append)
                gens.append(r.gen)
                if not r.tool_call:
                    thinks.add(len(gaps))
                gaps.append(float(r.gap_s))
                context += append + r.gen
            self.ids.append(t.id)
            self.prompts.append(prompts)
            self.gens.append(gens)
            self.gaps.append(gaps)
            self.thinks.append(thinks)
        self.done_at: list[float] = [math.nan] * len(self.ids)
        # Rounds that wait for other agents (`Round.waits_for`): (agent, turn) -> those agents
        # (empty for most workloads: their rounds take the paths below without a lookup); the
        # rounds waiting for each agent still running, and how many agents each still awaits
        # since it was ready.
        self.waits: dict[tuple[int, int], list[int]] = {}
        if named:
            self.waits = _wait_table(trajectories, named)
        self.waiting: dict[int, list[tuple[int, int]]] = {}
        self.pending: dict[tuple[int, int], tuple[int, float]] = {}
        # Agents that start after another agent's round (`Trajectory.after`, of an agent in the
        # run): (agent, turn) -> [(agent, delay_s)]; they do not start at their arrival.
        self.spawns: dict[tuple[int, int], list[tuple[int, float]]] = _spawn_table(trajectories)
        self.spawned: set[int] = {a for started in self.spawns.values() for a, _ in started}
        self.store: SimBlockStore | None = None
        st = cluster.cfg.store
        if st.capacity_bytes > 0:
            loop = cluster.loop
            self.store = SimBlockStore(
                st.capacity_bytes,
                cluster.kvb * self.bt,
                self.bt,
                st.eviction,
                st.retention_ttl_s,
                lambda: loop.now,
                cluster.counters,
            )

    def start(self, agent: int) -> None:
        """The agent arrives (or the round it starts after ended, plus its delay)."""
        if (agent, 0) in self.waits:
            self.ready(agent, 0)
        else:
            self.submit(agent, 0)

    def submit(self, agent: int, turn: int) -> None:
        prompts, gens = self.prompts[agent], self.gens[agent]
        prompt = prompts[turn]
        if turn:
            hit = _hit(prompts[turn - 1], gens[turn - 1], prompt, self.bt)
        elif self.pieces[agent]:
            hit = prefix_hit(self.shared.longest(self.pieces[agent]), prompt, self.bt)
        else:
            hit = 0
        traj = f"{self.ids[agent]}/a{agent}"
        if self.cluster.prefetch is not None:
            self.cluster.prefetch.turn_submitted(traj)
        if self.store is not None:
            hit = self.store.begin(agent, traj, self.pieces[agent], hit)
        req = Request(f"{traj}/r{turn}", traj, turn, prompt, hit, gens[turn])
        self.cluster.submit_round(req, agent, self._done)

    def _done(self, st: RoundState) -> None:
        agent, turn = st.agent, st.request.turn + 1
        if self.spawns and (agent, turn - 1) in self.spawns:
            for child, delay in self.spawns.pop((agent, turn - 1)):
                self.cluster.loop.after(delay, self.start, child)
        if turn == 1 and self.pieces[agent]:
            self.shared.add(self.pieces[agent])
        last = turn == len(self.prompts[agent])
        if self.store is not None:
            r = st.request
            n_full = (r.prompt_tokens + r.gen_tokens - 1) // self.bt
            self.store.end(agent, r.trajectory, self.pieces[agent], n_full, last)
        if last:
            self.done_at[agent] = self.cluster.loop.now
            if self.waiting:
                self._ended(agent)
        elif self.waits and (agent, turn) in self.waits:
            self.ready(agent, turn)
        elif self.gaps[agent][turn] > 0:  # the agent's tool call runs first
            gap = self.gaps[agent][turn]
            if self.cluster.prefetch is not None and turn not in self.thinks[agent]:
                # the trace says a tool call: prefetch its hit
                prompts, gens = self.prompts[agent], self.gens[agent]
                hit = _hit(prompts[turn - 1], gens[turn - 1], prompts[turn], self.bt)
                self.cluster.prefetch.tool_call(st.request.trajectory, hit, gap)
            self.cluster.loop.after(gap, self.submit, agent, turn)
        else:
            self.submit(agent, turn)

    def ready(self, agent: int, turn: int) -> None:
        """Round `turn` of `agent`, which waits for other agents, is ready (the previous round
        ended, or the agent arrived): it goes once they have all finished."""
        running = [w for w in self.waits[(agent, turn)] if math.isnan(self.done_at[w])]
        now = self.cluster.loop.now
        if not running:
            self._go(agent, turn, now)
            return
        self.pending[(agent, turn)] = (len(running), now)
        for w in running:
            self.waiting.setdefault(w, []).append((agent, turn))

    def _ended(self, agent: int) -> None:
        for key in self.waiting.pop(agent, []):
            left, ready = self.pending[key]
            if left > 1:
                self.pending[key] = (left - 1, ready)
            else:
                del self.pending[key]
                self._go(key[0], key[1], ready)

    def _go(self, agent: int, turn: int, ready: float) -> None:
        ends = [self.done_at[w] for w in self.waits[(agent, turn)]]
        gap = self.gaps[agent][turn]
        loop = self.cluster.loop
        at = submit_time(ready, gap, ends, first=turn == 0)
        if at <= loop.now:
            self.submit(agent, turn)
            return
        if turn and self.cluster.prefetch is not None and turn not in self.thinks[agent]:
            # the rest of the wait is a tool call
            prompts, gens = self.prompts[agent], self.gens[agent]
            hit = _hit(prompts[turn - 1], gens[turn - 1], prompts[turn], self.bt)
            self.cluster.prefetch.tool_call(f"{self.ids[agent]}/a{agent}", hit, at - loop.now)
        loop.at(at, self.submit, agent, turn)


def _spawn_table(
    trajectories: Sequence[Trajectory],
) -> dict[tuple[int, int], list[tuple[int, float]]]:
    """`(agent, turn) -> [(agent, delay_s)]`: the agents whose trajectory starts after that
    round of that agent's (`Trajectory.after` naming a trajectory of the run)."""
    index: dict[str, int] = {}
    for agent, t in enumerate(trajectories):
        if t.rounds and t.id not in index:
            index[t.id] = agent
    out: dict[tuple[int, int], list[tuple[int, float]]] = {}
    for agent, t in enumerate(trajectories):
        if t.after is None or not t.rounds:
            continue
        name, turn, delay = t.after
        parent = index.get(name, agent)
        if parent != agent:
            turn = min(turn, len(trajectories[parent].rounds) - 1)
            out.setdefault((parent, turn), []).append((agent, float(delay)))
    if out:
        check_waits(trajectories)  # (no round waits for an agent that starts after it)
    return out


def _wait_table(
    trajectories: Sequence[Trajectory], named: list[tuple[int, int, tuple[str, ...]]]
) -> dict[tuple[int, int], list[int]]:
    """`(agent, turn) -> [agents it waits for]` of the rounds `named` (agent, turn, their
    `waits_for`): the agents with rounds of those ids (other ids are not in the run). Raises
    `TraceError` on a cycle."""
    check_waits(trajectories)
    index: dict[str, list[int]] = {}
    for agent, t in enumerate(trajectories):
        if t.rounds:
            index.setdefault(t.id, []).append(agent)
    out: dict[tuple[int, int], list[int]] = {}
    for agent, turn, ids in named:
        ws = sorted({w for name in ids for w in index.get(name, [])})
        if ws:
            out[(agent, turn)] = ws
    return out
