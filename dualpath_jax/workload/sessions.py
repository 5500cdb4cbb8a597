"""Coding-agent session traces read into trajectories: the Weka/kv-cache-tester JSON (AIPerf's
"agentic coding" traces) and TraceLab's round JSONL. docs/traces.md has the rules; in short:

Weka (`workload.trace_format="weka"`): one JSON object per session (a file, a JSON list of them,
or a directory of `*.json` files, one session each): `{"id", "block_size", "hash_id_scope",
"requests": [...]}`. A request is `{"t": s since the session start, "in", "out", "hash_ids",
"think_time": s, "api_time": s, ...}`; its hash ids name its input's full `block_size`-token
blocks in order (a `"local"` scope: per session, so ids are namespaced by the session; `"global"`:
as they are), and the input's tokens past them are the request's own. A `{"type": "subagent",
"t", "agent_id", "requests": [...]}` entry is a child session: its requests' `t` count from its
own `t`, it runs beside its parent and shares the parent's hash-id namespace.

- A session (and each subagent) is a trajectory whose rounds are its requests in order. The first
  round's append is its input as content pieces (`(hash id, block tokens)`, then the unhashed
  tail), so equal hash ids give equal tokens in every trajectory (as for Mooncake). A later round
  is appendix A.3's: the prompt is the earlier context and generated tokens, then a private
  append of `max(1, in - previous prompt - previous gen)` tokens, so each prompt is the
  recorded input length whenever that covers the context so far. Its `gap_s` is the request's
  `think_time` (the client's tool/think time before it).
- Where a request keeps less than half of the previous request's input as its hash-id prefix (a
  compacted or rebuilt context), the session goes on as a new trajectory `<id>:<k>` (k = 2, 3,
  ...) starting at that request's time, its first round the whole input as pieces again.
- Start times: a session starts at 0 (the format has no absolute times), a subagent at its
  parent's start + its `t`, a continuation at its request's `t`. Subagents and continuations
  are trajectories of their own that arrive at those times and run beside their parent.
- Waiting for subagents: a subagent ends at its `t` + `duration_ms` (else its last request's
  `t` + `api_time`). The parent's first own request after it in the file whose `t` is at or
  after that end waited for it (the trace's timing says so): its round gets the subagent in
  `Round.after` and, as its gap, the time from the subagent's end to the request (instead of
  its `think_time`). A request sent before its subagents ended (they ran in the background)
  waits for nothing. A round that starts a continuation waits for nothing either (it arrives at
  its recorded time).
  Ids: the session's `id` (the file's stem without one), a subagent `<parent>:<agent_id>`.

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
    api_s: float = 0.0
    after: tuple[str, ...] = ()  # the subagents it waited for (`walk`)


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
    )


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
) -> list[tuple[Trajectory, float]]:
    """One (sub)session's requests (`start`: its origin, seconds) -> its trajectory and the
    continuations after rebuilt contexts, each with its start time."""
    bt = max(1, round(block * length_scale))
    out: list[tuple[Trajectory, float]] = []
    rounds: list[Round] = []
    seg_start = start + reqs[0].t
    prompt = gen = 0
    prev: WekaRequest | None = None
    for r in reqs:
        scaled_in = sum(n for _, n in _pieces(r, namespace, tail_ns, block, bt))
        kept = prev is not None and 2 * _shared_blocks(prev.hash_ids, r.hash_ids) * block >= (
            prev.input_len
        )
        if rounds and kept:
            app = max(1, scaled_in - prompt - gen)
            gen_r = _scaled(r.output_len, length_scale)
            rounds.append(Round(app, gen_r, gap_s=r.think_s, after=r.after))
            prompt += gen + app
        else:
            if rounds:
                k = len(out) + 1
                out.append((Trajectory(tid if k == 1 else f"{tid}:{k}", tuple(rounds)), seg_start))
                seg_start = start + r.t
            pieces = _pieces(r, namespace, tail_ns, block, bt)
            rounds = [Round(scaled_in, _scaled(r.output_len, length_scale), pieces)]
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
    out: list[tuple[Trajectory, float]] = []

    def walk(requests: object, tid: str, start: float) -> float:
        """Parses a (sub)session starting at `start`; returns when it ended (s)."""
        if not isinstance(requests, list) or not requests:
            raise TraceError(f"{tid}: 'requests' must be a non-empty list")
        own: list[WekaRequest] = []
        children: list[tuple[str, float, object, float | None]] = []
        running: list[int] = []  # children not yet waited for, by index
        ends: dict[int, float] = {}
        for k, r in enumerate(requests):
            where = f"{tid} request {k}"
            if isinstance(r, dict) and r.get("type") == "subagent":
                agent = r.get("agent_id", f"sub{k}")
                t = float(_field(r, "t", where, integer=False))
                dur = r.get("duration_ms")
                dur_s = float(dur) / 1000 if isinstance(dur, int | float) and dur >= 0 else None
                running.append(len(children))
                children.append((f"{tid}:{agent}", start + t, r.get("requests"), dur_s))
                ends[running[-1]] = walk(r.get("requests"), f"{tid}:{agent}", start + t)
                if dur_s is not None:
                    ends[running[-1]] = start + t + dur_s
            else:
                req = _weka_request(r, where, block)
                at = start + req.t
                done = [c for c in running if ends[c] <= at]
                if done and own:  # it waited for them: its gap runs from the last one's end
                    running = [c for c in running if c not in done]
                    gap = max(0.0, at - max(ends[c] for c in done))
                    after = tuple(children[c][0] for c in done)
                    req = dataclasses.replace(req, think_s=gap, after=after)
                own.append(req)
        if own:
            out.extend(_chain(own, tid, start, namespace, sid, block, length_scale))
        last = own[-1] if own else None
        end = start + (last.t + last.api_s if last is not None else 0.0)
        return max([end, *ends.values()])

    walk(obj.get("requests"), sid, 0.0)
    return out


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
