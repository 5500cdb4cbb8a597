"""Agent traces: the JSONL format, validation, the appendix A.3 replay rule, expansion, stats.

Trace JSONL (docs/traces.md), one trajectory per line:
`{"id": str, "rounds": [{"append": int | [int, ...], "gen": int, "gap_s": float,
"waits_for": [str, ...], "tool_call": bool}, ...], "after": {"id": str, "round": int,
"delay_s": float}}` (`gap_s` optional: the tool call's seconds before the round; `waits_for`
optional: ids of trajectories, such as subagents, that must finish first; `tool_call` optional,
true by default: false when the gap is a user's think time, not a tool call; `after` optional:
the trajectory starts `delay_s` after that round of that trajectory ended, as a subagent starts
when its parent's round that called it ends). An int
append means that many seeded random token ids (`materialize`); a list gives the ids
themselves. Other trace formats (Mooncake, conversations) are read by `workload.formats`; their
appends are content pieces (`Round.pieces`), so equal content gives equal tokens in every
trajectory.

Replay (appendix A.3): round i+1 of a trajectory sends the prompt `A_1 G_1 ... A_i G_i A_{i+1}`
and generates exactly `g_{i+1}` tokens `G_{i+1}`. Everything before `A_{i+1}` was computed in
earlier rounds, so it is the round's possible cache hit (hits stay within a trajectory).
More agents than trajectories: `expand` prepends a synthetic round of random tokens with
`g_1 = 1` to a sampled trajectory.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
from collections.abc import Iterable, Sequence

import numpy as np

from dualpath_jax.workload.order import round_cycle, wait_cycle


class TraceError(ValueError):
    """A malformed trace; the message names the line (1-based) and what is wrong."""


@dataclasses.dataclass(frozen=True)
class Round:
    """`append`: the appended token count or the ids themselves; `gen`: tokens to generate.

    `pieces`: what the append holds, as `(content id, tokens)` pairs summing to its length (empty:
    private random tokens). A piece stands for the first `tokens` ids of its content's seeded
    token stream (`content_tokens`), so equal content ids give equal tokens in every trajectory
    and a shorter piece of a content is a prefix of a longer one (`workload.sharing`).

    `gap_s`: seconds the agent spends between the end of the previous round and the submission of
    this one (a tool call; a first round's counts only after the trajectories it waits for).

    `waits_for`: ids of other trajectories (subagents the agent waits for) that must have
    finished, every round of them, before this round is submitted; the gap then counts from the
    later of the previous round's end and their last end (`submit_time`). Ids of trajectories
    that are not in a run are ignored by it.

    `tool_call`: whether the gap is a tool call, which the agent's client knows of as it begins
    (the model stopped to call a tool): a prefetch candidate, and in a replay a `tool_call`
    hint. False: the model ended its turn and the gap is the user's think time, which no
    client can foresee (the Weka format's `stop: "end_turn"`)."""

    append: int | tuple[int, ...]
    gen: int
    pieces: tuple[tuple[int, int], ...] = ()
    gap_s: float = 0.0
    waits_for: tuple[str, ...] = ()
    tool_call: bool = True

    def __repr__(self) -> str:  # pieces, gap, waits and a think time only when there are some
        pieces = f", pieces={self.pieces!r}" if self.pieces else ""
        gap = f", gap_s={self.gap_s!r}" if self.gap_s else ""
        waits = f", waits_for={self.waits_for!r}" if self.waits_for else ""
        think = "" if self.tool_call else ", tool_call=False"
        return f"Round(append={self.append!r}, gen={self.gen!r}{pieces}{gap}{waits}{think})"

    def __post_init__(self) -> None:
        if not (self.gap_s >= 0 and math.isfinite(self.gap_s)):
            raise ValueError(f"gap_s must be a finite number >= 0, got {self.gap_s}")
        if self.waits_for and (  # (checked only when set: most rounds have none)
            not isinstance(self.waits_for, tuple)
            or not all(isinstance(w, str) and w for w in self.waits_for)
        ):
            raise ValueError(f"waits_for must be a tuple of ids, got {self.waits_for!r}")
        if self.pieces and sum(n for _, n in self.pieces) != self.append_len:
            raise ValueError(
                f"pieces hold {sum(n for _, n in self.pieces)} tokens, the append {self.append_len}"
            )

    @property
    def append_len(self) -> int:
        return self.append if isinstance(self.append, int) else len(self.append)


@dataclasses.dataclass(frozen=True)
class Trajectory:
    """`after`: `(trajectory id, round index, delay_s)`: in a replay this trajectory starts
    `delay_s` seconds after that round of that trajectory ended (a subagent its parent's round
    called; if that trajectory ends before the round, at its end), not at its arrival time;
    None: at its arrival. A run without that trajectory starts it at its arrival."""

    id: str
    rounds: tuple[Round, ...]
    after: tuple[str, int, float] | None = None

    def __repr__(self) -> str:  # `after` only when set
        after = f", after={self.after!r}" if self.after else ""
        return f"Trajectory(id={self.id!r}, rounds={self.rounds!r}{after})"

    def __post_init__(self) -> None:
        if self.after:
            problem = after_problem(self.after)
            if problem:
                raise ValueError(f"trajectory {self.id!r}: {problem}")

    @property
    def total_len(self) -> int:
        """Tokens of the whole trajectory: sum of every append and every generation."""
        return sum(r.append_len + r.gen for r in self.rounds)


@dataclasses.dataclass(frozen=True)
class TurnSpec:
    """Lengths of one replayed round: the prompt is `context + append` tokens, of which the
    first `context` (`A_1 G_1 ... A_{i-1} G_{i-1}`) may hit the cache; generate `gen`."""

    turn: int  # 0-based
    context: int
    append: int
    gen: int

    @property
    def prompt(self) -> int:
        return self.context + self.append


# --------------------------------------------------------------------------- parsing


_ROUND_KEYS = frozenset({"append", "gen", "gap_s", "waits_for", "tool_call"})


def _check_int(value: object, what: str, lineno: int, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TraceError(f"line {lineno}: {what} must be an int, got {value!r}")
    if value < minimum:
        raise TraceError(f"line {lineno}: {what} must be >= {minimum}, got {value}")
    return value


def json_object(line: str, lineno: int) -> dict:
    """One JSONL line as a JSON object, or `TraceError` naming the line."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise TraceError(f"line {lineno}: not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(obj, dict):
        raise TraceError(f"line {lineno}: expected an object, got {type(obj).__name__}")
    return obj


def parse_trajectory(line: str, lineno: int = 1, *, vocab_size: int | None = None) -> Trajectory:
    """One JSONL line -> `Trajectory`, or `TraceError` naming the line and the problem.

    `vocab_size`: when given, explicit token ids must lie in `[0, vocab_size)`.
    """
    obj = json_object(line, lineno)
    unknown = sorted(set(obj) - {"id", "rounds", "after"})
    if unknown:
        raise TraceError(
            f"line {lineno}: unknown key(s) {unknown}; expected 'id', 'rounds' and 'after'"
        )
    tid = obj.get("id")
    if not isinstance(tid, str) or not tid:
        raise TraceError(f"line {lineno}: 'id' must be a non-empty string, got {tid!r}")
    rounds = obj.get("rounds")
    if not isinstance(rounds, list) or not rounds:
        raise TraceError(f"line {lineno}: 'rounds' must be a non-empty list (trajectory {tid!r})")
    out = []
    for i, rd in enumerate(rounds):
        where = f"round {i} of {tid!r}"
        if not isinstance(rd, dict) or not {"append", "gen"} <= set(rd) <= _ROUND_KEYS:
            raise TraceError(
                f"line {lineno}: {where} must be an object with 'append' and 'gen'"
                " (and optionally 'gap_s', 'waits_for', 'tool_call')"
            )
        gen = _check_int(rd["gen"], f"{where}: 'gen'", lineno, 1)
        gap = rd.get("gap_s", 0.0)
        if (
            isinstance(gap, bool)
            or not isinstance(gap, (int, float))
            or not (gap >= 0 and math.isfinite(gap))
        ):
            raise TraceError(f"line {lineno}: {where}: 'gap_s' must be a number >= 0, got {gap!r}")
        waits = rd.get("waits_for", [])
        if not isinstance(waits, list) or not all(isinstance(w, str) and w for w in waits):
            raise TraceError(
                f"line {lineno}: {where}: 'waits_for' must be a list of trajectory ids, got {waits!r}"
            )
        tool_call = rd.get("tool_call", True)
        if not isinstance(tool_call, bool):
            raise TraceError(
                f"line {lineno}: {where}: 'tool_call' must be true or false, got {tool_call!r}"
            )
        app = rd["append"]
        if isinstance(app, list):
            if not app:
                raise TraceError(f"line {lineno}: {where}: 'append' list is empty")
            for t in app:
                _check_int(t, f"{where}: token id", lineno, 0)
                if vocab_size is not None and t >= vocab_size:
                    raise TraceError(
                        f"line {lineno}: {where}: token id {t} >= vocab size {vocab_size}"
                    )
            app = tuple(app)
        else:
            app = _check_int(app, f"{where}: 'append'", lineno, 1)
        out.append(Round(app, gen, gap_s=float(gap), waits_for=tuple(waits), tool_call=tool_call))
    after = obj.get("after", {})
    if not isinstance(after, dict) or (after and set(after) != {"id", "round", "delay_s"}):
        raise TraceError(
            f"line {lineno}: 'after' of {tid!r} must be an object with 'id', 'round' and"
            f" 'delay_s', got {after!r}"
        )
    spec = (after["id"], after["round"], after["delay_s"]) if after else ()
    problem = after_problem(spec) if spec else ""
    if problem:
        raise TraceError(f"line {lineno}: 'after' of {tid!r}: {problem}")
    return Trajectory(tid, tuple(out), (spec[0], spec[1], float(spec[2])) if spec else None)


def after_problem(after: object) -> str:
    """What is wrong with a trajectory's `after` (`Trajectory.after`), or ""."""
    ok = isinstance(after, tuple | list) and len(after) == 3
    if ok:
        tid, i, delay = after
        ok = (
            isinstance(tid, str)
            and bool(tid)
            and isinstance(i, int)
            and not isinstance(i, bool)
            and i >= 0
            and isinstance(delay, int | float)
            and not isinstance(delay, bool)
            and math.isfinite(delay)
            and delay >= 0
        )
    if not ok:
        return f"after must be (trajectory id, round index >= 0, delay_s >= 0), got {after!r}"
    return ""


def parse_trace(lines: Iterable[str], *, vocab_size: int | None = None) -> list[Trajectory]:
    """Parses JSONL lines (blank lines skipped); ids must be unique."""
    out: list[Trajectory] = []
    seen: dict[str, int] = {}
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        t = parse_trajectory(line, lineno, vocab_size=vocab_size)
        if t.id in seen:
            raise TraceError(f"line {lineno}: duplicate id {t.id!r} (first on line {seen[t.id]})")
        seen[t.id] = lineno
        out.append(t)
    if not out:
        raise TraceError("the trace has no trajectories")
    rounds_of = {t.id: len(t.rounds) for t in out}
    for t in out:
        for i, r in enumerate(t.rounds):
            for w in r.waits_for:
                if w not in seen:
                    raise TraceError(
                        f"line {seen[t.id]}: round {i} of {t.id!r} waits for {w!r}, which is not"
                        " in the trace"
                    )
        if t.after and t.after[1] >= rounds_of.get(t.after[0], 0):
            raise TraceError(
                f"line {seen[t.id]}: {t.id!r} starts after round {t.after[1]} of"
                f" {t.after[0]!r}, which is not in the trace"
            )
    check_waits(out)
    return out


def load_trace(path: str | os.PathLike[str], *, vocab_size: int | None = None) -> list[Trajectory]:
    try:
        with open(path, encoding="utf-8") as f:
            return parse_trace(f, vocab_size=vocab_size)
    except TraceError as e:
        raise TraceError(f"{os.fspath(path)}: {e}") from None


def trajectory_to_json(t: Trajectory) -> str:
    rounds = [
        {
            "append": r.append if isinstance(r.append, int) else list(r.append),
            "gen": r.gen,
            **({"gap_s": r.gap_s} if r.gap_s else {}),
            **({"waits_for": list(r.waits_for)} if r.waits_for else {}),
            **({} if r.tool_call else {"tool_call": False}),
        }
        for r in t.rounds
    ]
    after = {"after": dict(zip(("id", "round", "delay_s"), t.after))} if t.after else {}
    return json.dumps({"id": t.id, "rounds": rounds, **after}, separators=(",", ":"))


def dump_trace(trajectories: Iterable[Trajectory], path: str | os.PathLike[str]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for t in trajectories:
            f.write(trajectory_to_json(t) + "\n")


# --------------------------------------------------------------------------- replay


def _seed_of(seed: int, *parts: object) -> int:
    h = hashlib.blake2b(repr((seed, *parts)).encode(), digest_size=8)
    return int.from_bytes(h.digest(), "little")


def random_tokens(n: int, vocab_size: int, seed: int, *key: object) -> tuple[int, ...]:
    """`n` token ids in `[0, vocab_size)`, a pure function of `(seed, *key)`."""
    rng = np.random.default_rng(_seed_of(seed, *key))
    return tuple(int(x) for x in rng.integers(0, vocab_size, size=n))


def content_tokens(content: int, n: int, vocab_size: int, seed: int) -> tuple[int, ...]:
    """The first `n` ids of content `content`'s token stream (a pure function of `seed` and
    `content`; `content_tokens(c, n)` is a prefix of `content_tokens(c, m)` for `n <= m`)."""
    return random_tokens(n, vocab_size, seed, "content", content)


def _append_tokens(t: Trajectory, i: int, r: Round, vocab_size: int, seed: int) -> tuple[int, ...]:
    if not r.pieces:
        return random_tokens(r.append_len, vocab_size, seed, t.id, i)
    out: list[int] = []
    for content, n in r.pieces:
        out.extend(content_tokens(content, n, vocab_size, seed))
    return tuple(out)


def materialize(t: Trajectory, vocab_size: int, seed: int = 0) -> Trajectory:
    """Replaces every int append by token ids: its pieces' content tokens if it has pieces, else
    that many random ids (seeded by seed, id and round)."""
    rounds = tuple(
        r
        if not isinstance(r.append, int)
        else dataclasses.replace(r, append=_append_tokens(t, i, r, vocab_size, seed))
        for i, r in enumerate(t.rounds)
    )
    return Trajectory(t.id, rounds)


def turn_specs(t: Trajectory) -> list[TurnSpec]:
    """The replay lengths of every round of `t` (appendix A.3)."""
    out = []
    context = 0
    for i, r in enumerate(t.rounds):
        out.append(TurnSpec(i, context, r.append_len, r.gen))
        context += r.append_len + r.gen
    return out


def prompt_tokens(t: Trajectory, generated: Sequence[Sequence[int]], turn: int) -> list[int]:
    """The prompt of round `turn` (0-based): `A_1 G_1 ... A_turn G_turn A_{turn+1}` in 1-based
    paper terms. `t` must be materialized; `generated[i]` are the `g_i` tokens of round i."""
    if not 0 <= turn < len(t.rounds):
        raise IndexError(f"trajectory {t.id!r} has {len(t.rounds)} rounds, no round {turn}")
    if len(generated) < turn:
        raise ValueError(
            f"round {turn} needs the outputs of {turn} earlier rounds, got {len(generated)}"
        )
    out: list[int] = []
    for i in range(turn + 1):
        app = t.rounds[i].append
        if isinstance(app, int):
            raise ValueError(f"trajectory {t.id!r} is not materialized (round {i})")
        out.extend(app)
        if i < turn:
            if len(generated[i]) != t.rounds[i].gen:
                raise ValueError(
                    f"round {i} of {t.id!r} must have generated {t.rounds[i].gen} tokens, got {len(generated[i])}"
                )
            out.extend(generated[i])
    return out


def truncate(t: Trajectory, max_len: int) -> Trajectory:
    """Drops the rounds after the first whose end would exceed `max_len` tokens; a first round
    longer than `max_len` is cut to fit (appends first, keeping at least one generated token)."""
    if max_len < 2:
        raise ValueError(f"max_len must be >= 2, got {max_len}")
    kept: list[Round] = []
    total = 0
    for r in t.rounds:
        if total + r.append_len + r.gen > max_len:
            break
        kept.append(r)
        total += r.append_len + r.gen
    if not kept:
        first = t.rounds[0]
        gen = min(first.gen, max_len // 2)
        n = max_len - gen
        app = n if isinstance(first.append, int) else first.append[:n]
        kept.append(
            dataclasses.replace(first, append=app, gen=gen, pieces=cut_pieces(first.pieces, n))
        )
    return Trajectory(t.id, tuple(kept))


def cut_pieces(pieces: Sequence[tuple[int, int]], n: int) -> tuple[tuple[int, int], ...]:
    """The pieces of the first `n` tokens of `pieces` (the last one shortened if needed)."""
    out = []
    for content, k in pieces:
        if n <= 0:
            break
        out.append((content, min(k, n)))
        n -= k
    return tuple(out)


def expand(
    trajectories: Sequence[Trajectory],
    n: int,
    rng: np.random.Generator,
    *,
    max_first_append: int = 64,
    max_len: int | None = None,
) -> list[Trajectory]:
    """`n` agent trajectories: the originals first, then (appendix A.3) copies of sampled ones
    with a synthetic first round of `randint(1, max_first_append)` random tokens and `g_1 = 1`,
    truncated to `max_len` if given. New ids are `"{id}+x{k}"`. A copy waits for no other
    trajectory (`Round.waits_for`): the subagents it would wait for are the original's."""
    if not trajectories:
        raise ValueError("expand needs at least one trajectory")
    out = list(trajectories[:n])
    k = 0
    while len(out) < n:
        src = trajectories[int(rng.integers(len(trajectories)))]
        first = Round(int(rng.integers(1, max_first_append + 1)), 1)
        rounds = tuple(
            dataclasses.replace(r, waits_for=()) if r.waits_for else r for r in src.rounds
        )
        t = Trajectory(f"{src.id}+x{k}", (first, *rounds))
        out.append(truncate(t, max_len) if max_len else t)
        k += 1
    return out


def submit_time(
    ready_s: float, gap_s: float, waited_ends: Iterable[float], *, first: bool
) -> float:
    """When a round is submitted (`Round.gap_s`, `Round.waits_for`): `gap_s` after `ready_s`, the
    end of the previous round (a first round: at its arrival `ready_s`, with no gap), and not
    before `gap_s` after the end of each trajectory it waits for (`waited_ends`). The simulator
    and `rollout.run_trajectories` both follow it."""
    t = ready_s if first else ready_s + gap_s
    for end in waited_ends:
        t = max(t, end + gap_s)
    return t


def check_waits(trajectories: Sequence[Trajectory]) -> None:
    """Raises `TraceError` when trajectories wait for each other in a cycle (`Round.waits_for`;
    a trajectory waiting for itself included, and a round waiting for a trajectory that starts
    after it, `Trajectory.after`): none of them could ever finish. Ids of trajectories not
    among them are ignored."""
    if any(t.after for t in trajectories):
        cycle = round_cycle(
            [(t.id, [r.waits_for for r in t.rounds], t.after) for t in trajectories]
        )
        if cycle:
            raise TraceError(f"rounds wait for each other in a cycle: {' -> '.join(cycle)}")
        return
    waits: dict[str, set[str]] = {}
    for t in trajectories:
        waits.setdefault(t.id, set()).update(w for r in t.rounds for w in r.waits_for)
    cycle = wait_cycle(waits)
    if cycle:
        raise TraceError(f"trajectories wait for each other in a cycle: {' -> '.join(cycle)}")


# --------------------------------------------------------------------------- stats


@dataclasses.dataclass(frozen=True)
class TraceStats:
    """Table 2 columns. Turns and Total are per-trajectory means; Append, Gen and Context are
    per-turn means taken per trajectory and then averaged over trajectories (the reading under
    which Table 2 is self-consistent: with means pooled over all turns, Total would have to be
    Turns x (Append + Gen)). `*_pooled` give the means over all turns together."""

    trajectories: int
    turns: float
    append: float
    gen: float
    total: float
    context: float
    hit_rate: float
    max_total: int
    append_pooled: float
    gen_pooled: float
    context_pooled: float

    def row(self) -> dict[str, float]:
        return {
            "Turns": self.turns,
            "Append": self.append,
            "Gen": self.gen,
            "Total": self.total,
            "Context": self.context,
            "Hit%": 100 * self.hit_rate,
        }


def trace_stats(trajectories: Sequence[Trajectory]) -> TraceStats:
    if not trajectories:
        raise ValueError("no trajectories")
    turns, app, gen, total, ctx = [], [], [], [], []
    all_app = all_gen = all_ctx = n_turns = 0
    for t in trajectories:
        specs = turn_specs(t)
        a = sum(s.append for s in specs)
        g = sum(s.gen for s in specs)
        c = sum(s.context for s in specs)
        turns.append(len(specs))
        app.append(a / len(specs))
        gen.append(g / len(specs))
        ctx.append(c / len(specs))
        total.append(a + g)
        all_app += a
        all_gen += g
        all_ctx += c
        n_turns += len(specs)
    context, append = float(np.mean(ctx)), float(np.mean(app))
    return TraceStats(
        trajectories=len(trajectories),
        turns=float(np.mean(turns)),
        append=append,
        gen=float(np.mean(gen)),
        total=float(np.mean(total)),
        context=context,
        hit_rate=context / (context + append) if context + append else 0.0,
        max_total=int(max(total)),
        append_pooled=all_app / n_turns,
        gen_pooled=all_gen / n_turns,
        context_pooled=all_ctx / n_turns,
    )
