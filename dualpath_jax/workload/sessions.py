"""Coding-agent session traces read into trajectories: the Weka/kv-cache-tester JSON (AIPerf's
"agentic coding" traces) and TraceLab's round JSONL. docs/traces.md has the rules; in short:

Weka (`workload.trace_format="weka"`): one JSON object per session (a file, a JSON list of them,
or a directory of `*.json` files, one session each): `{"id", "block_size", "hash_id_scope",
"requests": [...]}`. A request is `{"t": s since the session start, "in", "out", "hash_ids",
"think_time": s, "api_time": s, ...}`; its hash ids name its input's full `block_size`-token
blocks in order (a `"local"` scope: per session, so ids are namespaced by the session; `"global"`:
as they are), and the input's tokens past them are the request's own. A `{"type": "subagent",
"t", "duration_ms", "agent_id", "requests": [...]}` entry is a child session that returned at
`t` after running `duration_ms` (without it: the span of its requests, `t + api_time` of the
last); its requests' `t` count from its start, `t - duration_ms / 1000`. It runs beside its
parent and shares the parent's hash-id namespace.

- A session (and each subagent) is a trajectory whose rounds are its requests in order. The first
  round's append is its input as content pieces (`(hash id, block tokens)`, then the unhashed
  tail), so equal hash ids give equal tokens in every trajectory (as for Mooncake). A later round
  is appendix A.3's: the prompt is the earlier context and generated tokens, then a private
  append of `max(1, in - previous prompt - previous gen)` tokens, so each prompt is the
  recorded input length whenever that covers the context so far. Its `gap_s` is the request's
  `think_time` (the client's tool/think time before it); when the previous request's `stop` is
  `"end_turn"` (the model finished, the user speaks next) the gap is not a tool call
  (`Round.tool_call=False`: no prefetch, no `tool_call` hint in a replay).
- Where a request keeps less than half of the previous request's input as its hash-id prefix (a
  compacted or rebuilt context), the session goes on as a new trajectory `<id>:<k>` (k = 2, 3,
  ...) starting at that request's time, its first round the whole input as pieces again.
- Start times: a session starts at 0 (the format has no absolute times), a subagent at its
  parent's start + its `t - duration_ms / 1000`, a continuation at its request's `t`. Subagents
  and continuations are trajectories of their own that arrive at those times; a subagent's
  first trajectory is also `Trajectory.after` the round of its parent's last request sent
  before its start (the one whose answer called it), by the recorded time from that answer
  (`t + api_time`) to its start: a replay starts it when that round actually ends. Ids: the
  session's `id` (the file's stem without one), a subagent `<parent>:<agent_id>`.
- Waiting for subagents: the parent's first request after a subagent's start waits for it when
  its recorded `t` is at or after the subagent's end (it blocked on the tool that ran it);
  its round then has the subagent's trajectories in `Round.waits_for` and, as its gap, the
  time from the last such end to the request (not its `think_time`, which includes the wait).
  Where the parent's next request came before the subagent's end, it went on without it.

TraceLab (`workload.trace_format="tracelab"`): JSONL, one round a line, `{"session_id",
"round_index", "input_tokens_total" (or "prefix_tokens" + "newly_append_tokens"),
"output_tokens", "timing_events": [{"event_type", "timestamp": ISO 8601}, ...]}`. A session is a
trajectory of its rounds in `round_index` order, appends as for Weka's later rounds (the first
round's whole input is private: the format has no hash ids). A round is submitted at its last
input event (`user_message`, `tool_result`) and ends at its last other event; `gap_s` is the time
from the previous round's end to the submission (at least 0). A session starts at its first
round's submission, counted from the trace's first.

Lengths scale by `length_scale` (`max(1, round(n x length_scale))`; a Weka block scales to
`max(1, round(block_size x length_scale))` tokens and stays the unit of sharing).
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import math
import os
import pathlib
from collections.abc import Iterable, Sequence

from dualpath_jax.workload.trace import Round, TraceError, Trajectory, json_object

# A request continues its trajectory when its hash-id prefix shared with the previous request
# covers at least this fraction of that request's input (else the context was rebuilt).
KEEP_FRACTION = 0.5
_INPUT_EVENTS = frozenset({"user_message", "tool_result"})


def _scaled(n: float, length_scale: float) -> int:
    return max(1, round(n * length_scale))


def _content(namespace: str | None, h: int) -> int:
    """Content id of hash id `h`: `h` itself in a global scope, else a 63-bit hash of the
    session's namespace and `h`."""
    if namespace is None:
        return h
    d = hashlib.blake2b(f"weka\0{namespace}\0{h}".encode(), digest_size=8)
    return int.from_bytes(d.digest(), "little") >> 1


def _private(namespace: str, where: str) -> int:
    d = hashlib.blake2b(f"weka-tail\0{namespace}\0{where}".encode(), digest_size=8)
    return int.from_bytes(d.digest(), "little") >> 1


# --------------------------------------------------------------------------- Weka


@dataclasses.dataclass(frozen=True)
class WekaRequest:
    """One request of a session, unscaled: `t` seconds from its (sub)session's start."""

    where: str  # for errors: "<session> request <k>"
    t: float
    input_len: int
    output_len: int
    hash_ids: tuple[int, ...]
    think_s: float
    api_s: float = 0.0  # the recorded time to its answer
    stop: str = ""  # why its answer stopped: "tool_use", "end_turn" (the user speaks next), ...


@dataclasses.dataclass(frozen=True)
class WekaSubagent:
    """A subagent entry, unscaled: it returned at `t` seconds from its parent's origin after
    running `duration_s` (its `duration_ms`, else the span of its own requests); its requests'
    times count from its start, `t - duration_s`."""

    tid: str
    t: float
    duration_s: float
    own: tuple[WekaRequest, ...]
    subagents: tuple[WekaSubagent, ...]


def _field(obj: dict, key: str, where: str, *, integer: bool, default: object = None) -> float:
    if key not in obj:
        if default is not None:
            return default  # type: ignore[return-value]
        raise TraceError(f"{where}: missing {key!r}")
    value = obj[key]
    ok = isinstance(value, int) if integer else isinstance(value, int | float)
    if isinstance(value, bool) or not ok or not math.isfinite(value) or value < 0:
        kind = "an int" if integer else "a number"
        raise TraceError(f"{where}: {key!r} must be {kind} >= 0, got {value!r}")
    return value


def _weka_request(obj: object, where: str, block: int) -> WekaRequest:
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: expected an object, got {type(obj).__name__}")
    n_in = int(_field(obj, "in", where, integer=True))
    if n_in < 1:
        raise TraceError(f"{where}: 'in' must be >= 1, got {n_in}")
    ids = obj.get("hash_ids", [])
    if not isinstance(ids, list) or not all(
        isinstance(h, int) and not isinstance(h, bool) for h in ids
    ):
        raise TraceError(f"{where}: 'hash_ids' must be a list of ints")
    if len(ids) > -(-n_in // block):
        raise TraceError(
            f"{where}: {len(ids)} hash_ids for 'in' {n_in}: at {block} tokens a block it has"
            f" at most {-(-n_in // block)}"
        )
    return WekaRequest(
        where=where,
        t=float(_field(obj, "t", where, integer=False)),
        input_len=n_in,
        output_len=int(_field(obj, "out", where, integer=True)),
        hash_ids=tuple(ids),
        think_s=float(_field(obj, "think_time", where, integer=False, default=0.0)),
        api_s=float(_field(obj, "api_time", where, integer=False, default=0.0)),
        stop=str(obj.get("stop") or ""),
    )


def _weka_requests(
    requests: object, tid: str, block: int
) -> tuple[list[WekaRequest], list[WekaSubagent]]:
    """A (sub)session's `requests` list -> its own requests and its subagents, validated."""
    if not isinstance(requests, list) or not requests:
        raise TraceError(f"{tid}: 'requests' must be a non-empty list")
    own: list[WekaRequest] = []
    subagents: list[WekaSubagent] = []
    for k, r in enumerate(requests):
        where = f"{tid} request {k}"
        if isinstance(r, dict) and r.get("type") == "subagent":
            child = f"{tid}:{r.get('agent_id', f'sub{k}')}"
            t = float(_field(r, "t", where, integer=False))
            c_own, c_subs = _weka_requests(r.get("requests"), child, block)
            if "duration_ms" in r:
                duration = float(_field(r, "duration_ms", where, integer=False)) / 1000
            else:
                duration = max((q.t + q.api_s for q in c_own), default=0.0)
            subagents.append(WekaSubagent(child, t, duration, tuple(c_own), tuple(c_subs)))
        else:
            own.append(_weka_request(r, where, block))
    return own, subagents


def _pieces(
    r: WekaRequest, namespace: str | None, tail_ns: str, block: int, bt: int
) -> tuple[tuple[int, int], ...]:
    """The request's input as content pieces, scaled: a piece per hash id (a last one covering
    a partial block shortened), then the unhashed tail as a private piece."""
    full = min(len(r.hash_ids), r.input_len // block)
    pieces = [(_content(namespace, h), bt) for h in r.hash_ids[:full]]
    if len(r.hash_ids) > full:  # the last hash id names a partial block
        rest = r.input_len - full * block
        pieces.append((_content(namespace, r.hash_ids[-1]), max(1, round(rest * bt / block))))
    else:
        tail = round((r.input_len - full * block) * bt / block)
        if tail > 0 or not pieces:
            pieces.append((_private(tail_ns, r.where), max(1, tail)))
    return tuple(pieces)


def _shared_blocks(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _chain(
    reqs: Sequence[WekaRequest],
    tid: str,
    start: float,
    namespace: str | None,
    tail_ns: str,
    block: int,
    length_scale: float,
    waits: dict[int, tuple[tuple[str, ...], float]],
) -> list[tuple[Trajectory, float]]:
    """One (sub)session's requests (`start`: its origin, seconds) -> its trajectory and the
    continuations after rebuilt contexts, each with its start time. `waits`: request index ->
    the subagent trajectories its round waits for and their last recorded end (seconds); its
    gap is then the time from that end to the request."""
    bt = max(1, round(block * length_scale))
    out: list[tuple[Trajectory, float]] = []
    rounds: list[Round] = []
    seg_start = start + reqs[0].t
    prompt = gen = 0
    prev: WekaRequest | None = None
    for j, r in enumerate(reqs):
        scaled_in = sum(n for _, n in _pieces(r, namespace, tail_ns, block, bt))
        kept = prev is not None and 2 * _shared_blocks(prev.hash_ids, r.hash_ids) * block >= (
            prev.input_len
        )
        waits_for, end = waits.get(j, ((), 0.0))
        wait = {"waits_for": waits_for, "gap_s": round(max(0.0, start + r.t - end), 6)}
        if rounds and kept:
            app = max(1, scaled_in - prompt - gen)
            gap = wait if waits_for else {"gap_s": r.think_s}
            # a gap after the model ended its turn is the user's, not a tool call
            think = {"tool_call": False} if prev is not None and prev.stop == "end_turn" else {}
            rounds.append(Round(app, _scaled(r.output_len, length_scale), **gap, **think))
            prompt += gen + app
        else:
            if rounds:
                k = len(out) + 1
                out.append((Trajectory(tid if k == 1 else f"{tid}:{k}", tuple(rounds)), seg_start))
                seg_start = start + r.t
            pieces = _pieces(r, namespace, tail_ns, block, bt)
            gap = wait if waits_for else {}
            rounds = [Round(scaled_in, _scaled(r.output_len, length_scale), pieces, **gap)]
            prompt = scaled_in
        gen = rounds[-1].gen
        prev = r
    if rounds:
        k = len(out) + 1
        out.append((Trajectory(tid if k == 1 else f"{tid}:{k}", tuple(rounds)), seg_start))
    return out


def parse_weka_session(
    obj: object, *, name: str = "session", length_scale: float = 1.0
) -> list[tuple[Trajectory, float]]:
    """One Weka session object -> its trajectories (the session's, its continuations and its
    subagents') with their start times in seconds from the session's start. `name`: the id
    when the object has none."""
    if length_scale <= 0:
        raise ValueError(f"length_scale must be > 0, got {length_scale}")
    if not isinstance(obj, dict):
        raise TraceError(f"{name}: a session must be an object, got {type(obj).__name__}")
    sid = obj.get("id", name)
    if not isinstance(sid, str) or not sid:
        raise TraceError(f"{name}: 'id' must be a non-empty string, got {sid!r}")
    block = obj.get("block_size", 64)
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise TraceError(f"{sid}: 'block_size' must be an int >= 1, got {block!r}")
    scope = obj.get("hash_id_scope", "local")
    if scope not in ("local", "global"):
        raise TraceError(f"{sid}: 'hash_id_scope' must be 'local' or 'global', got {scope!r}")
    namespace = sid if scope == "local" else None

    def walk(
        own: list[WekaRequest], subagents: Sequence[WekaSubagent], tid: str, start: float
    ) -> tuple[list[str], list[tuple[Trajectory, float]]]:
        """The trajectories of a (sub)session whose origin is `start` (seconds), its own first,
        and the ids of its own (not its subagents')."""
        below: list[tuple[Trajectory, float]] = []
        waits: dict[int, tuple[tuple[str, ...], float]] = {}
        spawned: list[tuple[int, int, float]] = []  # (index in below, request, delay)
        for c in subagents:
            c_start, c_end = start + max(0.0, c.t - c.duration_s), start + c.t
            ids, pairs = walk(list(c.own), c.subagents, c.tid, c_start)
            # It starts after the last request of the parent sent before it (whose answer
            # called it), as long after that answer as recorded.
            j = max((j for j, r in enumerate(own) if start + r.t <= c_start), default=None)
            if ids and j is not None:
                delay = max(0.0, c_start - (start + own[j].t + own[j].api_s))
                spawned.append((len(below), j, round(delay, 6)))
            below.extend(pairs)
            # The parent's next request after the spawn waits for the child when it came after
            # the child's end; else the parent went on without it.
            k = next((k for k, r in enumerate(own) if start + r.t > c_start), None)
            if ids and k is not None and start + own[k].t >= c_end:
                before, end = waits.get(k, ((), c_end))
                waits[k] = (before + tuple(ids), max(end, c_end))
        if not own:
            return [], below
        mine = _chain(own, tid, start, namespace, sid, block, length_scale, waits)
        # request j is round j - first of the segment (continuation) holding it
        seg, first = [], 0
        for t, _ in mine:
            seg.extend((t.id, j - first) for j in range(first, first + len(t.rounds)))
            first += len(t.rounds)
        for b, j, delay in spawned:
            t, at = below[b]
            below[b] = (dataclasses.replace(t, after=(*seg[j], delay)), at)
        return [t.id for t, _ in mine], mine + below

    own, subagents = _weka_requests(obj.get("requests"), sid, block)
    return walk(own, subagents, sid, 0.0)[1]


def _sorted(pairs: list[tuple[Trajectory, float]]) -> tuple[list[Trajectory], list[float]]:
    pairs = sorted(pairs, key=lambda p: p[1])  # stable: ties keep file order
    return [t for t, _ in pairs], [s for _, s in pairs]


def parse_weka(
    sessions: Iterable[tuple[str, object]], *, length_scale: float = 1.0
) -> tuple[list[Trajectory], list[float]]:
    """`(name, session object)` pairs -> every trajectory and its start time in seconds (each
    session starting at 0), in order of start time. Ids must be unique."""
    pairs: list[tuple[Trajectory, float]] = []
    for name, obj in sessions:
        pairs.extend(parse_weka_session(obj, name=name, length_scale=length_scale))
    if not pairs:
        raise TraceError("the trace has no sessions")
    seen: set[str] = set()
    for t, _ in pairs:
        if t.id in seen:
            raise TraceError(f"duplicate trajectory id {t.id!r} (two sessions with one id?)")
        seen.add(t.id)
    return _sorted(pairs)


def _read_json(path: pathlib.Path) -> object:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise TraceError(
            f"{path}: line {e.lineno}: not valid JSON ({e.msg} at column {e.colno})"
        ) from None


def load_weka(
    path: str | os.PathLike[str], *, length_scale: float = 1.0
) -> tuple[list[Trajectory], list[float]]:
    """`parse_weka` of a session file (one session object or a list of them) or of a directory
    of `*.json` session files (in name order); errors are prefixed with the file's name."""
    p = pathlib.Path(path)
    files = sorted(p.glob("*.json")) if p.is_dir() else [p]
    if not files:
        raise TraceError(f"{p}: no *.json session files")
    sessions: list[tuple[str, object]] = []
    for f in files:
        data = _read_json(f)
        if isinstance(data, list):
            sessions.extend((f"{f.stem}[{k}]", s) for k, s in enumerate(data))
        else:
            sessions.append((f.stem, data))
    try:
        return parse_weka(sessions, length_scale=length_scale)
    except TraceError as e:
        raise TraceError(f"{os.fspath(path)}: {e}") from None


# --------------------------------------------------------------------------- TraceLab


def _when(stamp: object, where: str) -> float:
    if not isinstance(stamp, str):
        raise TraceError(f"{where}: 'timestamp' must be an ISO 8601 string, got {stamp!r}")
    try:
        t = datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00"))
    except ValueError:
        raise TraceError(f"{where}: 'timestamp' {stamp!r} is not ISO 8601") from None
    if t.tzinfo is None:
        t = t.replace(tzinfo=datetime.UTC)
    return t.timestamp()


@dataclasses.dataclass(frozen=True)
class TraceLabRound:
    lineno: int
    session: str
    index: int
    input_len: int
    output_len: int
    submit_s: float | None  # its last input event (else its first event); None: no events
    end_s: float | None  # its last other event


def _tracelab_round(line: str, lineno: int) -> TraceLabRound:
    obj = json_object(line, lineno)
    where = f"line {lineno}"
    sid = obj.get("session_id")
    if not isinstance(sid, str) or not sid:
        raise TraceError(f"{where}: 'session_id' must be a non-empty string, got {sid!r}")
    index = int(_field(obj, "round_index", where, integer=True))
    if "input_tokens_total" in obj:
        n_in = int(_field(obj, "input_tokens_total", where, integer=True))
    else:
        n_in = int(_field(obj, "prefix_tokens", where, integer=True)) + int(
            _field(obj, "newly_append_tokens", where, integer=True)
        )
    if n_in < 1:
        raise TraceError(f"{where}: the round has no input tokens")
    n_out = int(_field(obj, "output_tokens", where, integer=True))
    events = obj.get("timing_events", [])
    if not isinstance(events, list):
        raise TraceError(f"{where}: 'timing_events' must be a list")
    inputs, others = [], []
    for e in events:
        if not isinstance(e, dict) or "timestamp" not in e:
            raise TraceError(f"{where}: a timing event must be an object with a 'timestamp'")
        t = _when(e["timestamp"], where)
        (inputs if e.get("event_type") in _INPUT_EVENTS else others).append(t)
    submit = max(inputs) if inputs else (min(others) if others else None)
    end = max(others) if others else None
    return TraceLabRound(lineno, sid, index, n_in, n_out, submit, end)


def parse_tracelab(
    lines: Iterable[str], *, length_scale: float = 1.0
) -> tuple[list[Trajectory], list[float]]:
    """TraceLab round JSONL (blank lines skipped) -> one trajectory per session and its start in
    seconds after the trace's first session starts (0 for sessions without timing events), in
    order of start time."""
    if length_scale <= 0:
        raise ValueError(f"length_scale must be > 0, got {length_scale}")
    by_session: dict[str, list[TraceLabRound]] = {}
    for lineno, line in enumerate(lines, 1):
        if line.strip():
            r = _tracelab_round(line, lineno)
            by_session.setdefault(r.session, []).append(r)
    if not by_session:
        raise TraceError("the trace has no rounds")
    pairs: list[tuple[Trajectory, float | None]] = []
    for sid, rs in by_session.items():
        rs.sort(key=lambda r: r.index)
        for a, b in zip(rs, rs[1:]):
            if a.index == b.index:
                raise TraceError(
                    f"line {b.lineno}: session {sid!r} has round_index {b.index} twice"
                    f" (first on line {a.lineno})"
                )
        rounds: list[Round] = []
        prompt = gen = 0
        prev: TraceLabRound | None = None
        for r in rs:
            n_in = _scaled(r.input_len, length_scale)
            out = _scaled(r.output_len, length_scale)
            if prev is None:
                rounds.append(Round(n_in, out))
                prompt = n_in
            else:
                gap = 0.0
                if r.submit_s is not None and prev.end_s is not None:
                    gap = max(0.0, r.submit_s - prev.end_s)
                app = max(1, n_in - prompt - gen)
                rounds.append(Round(app, out, gap_s=gap))
                prompt += gen + app
            gen = out
            prev = r
        pairs.append((Trajectory(sid, tuple(rounds)), rs[0].submit_s))
    known = [s for _, s in pairs if s is not None]
    t0 = min(known) if known else 0.0
    return _sorted([(t, 0.0 if s is None else s - t0) for t, s in pairs])


def load_tracelab(
    path: str | os.PathLike[str], *, length_scale: float = 1.0
) -> tuple[list[Trajectory], list[float]]:
    """`parse_tracelab` of a file; errors are prefixed with its name."""
    try:
        with open(path, encoding="utf-8") as f:
            return parse_tracelab(f, length_scale=length_scale)
    except TraceError as e:
        raise TraceError(f"{os.fspath(path)}: {e}") from None
