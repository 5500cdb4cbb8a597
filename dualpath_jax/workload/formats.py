"""Trace formats the field uses, read into trajectories: Mooncake request traces and multi-turn
conversation files (ShareGPT or OpenAI messages) here, coding-agent sessions (Weka, TraceLab) in
`workload.sessions`. docs/traces.md has the rules; in short:

Mooncake (`workload.trace_format="mooncake"`): JSONL, one request a line, `{"timestamp": ms,
"input_length": int, "output_length": int, "hash_ids": [int, ...]}`; hash id `i` names the
content of trace block `i` of the input (`trace_block_tokens`, 512 in the published traces), the
last one possibly partial, so equal leading hash ids mean a shared prefix. A request's input is
the pieces `(hash id, block tokens)` (the last one shortened), so equal hash ids give equal token
blocks (`trace.content_tokens`) and the store finds exactly the prefixes the hash ids share.

- sessions (`trace_sessions=True`): a request whose hash ids start with every full block of an
  earlier request, and whose input is longer than that request's input + output, is the next turn
  of that request's trajectory (appendix A.3: the prompt is the earlier context, the model's own
  generated tokens, then the rest of the input as a private append); otherwise it starts a new
  trajectory whose first round is its whole input. A trajectory arrives at its first request's
  timestamp; its later rounds run when the previous one finishes (their timestamps are not used).
- requests (`trace_sessions=False`): every request is a one-round trajectory arriving at its own
  timestamp; conversations then share prefixes only through their hash ids.

Conversations (`workload.trace_format="conversation"`): a JSON array (or JSONL) of
`{"id": ..., "conversations": [{"from": "human" | "gpt" | "system" | ..., "value": text}, ...]}`
or `{"id": ..., "messages": [{"role": ..., "content": text}, ...]}`. Each conversation is a
trajectory; each assistant message ends a round: the messages since the previous assistant
message are its append (one piece each, content = role + text, so equal messages give equal
tokens), the assistant message's length is its `gen`. Lengths: `max(1, round(utf8 bytes x
length_scale / trace_bytes_per_token))` tokens a message (no tokenizer here).

Lengths scale by `length_scale`; a Mooncake trace block scales to `max(1, round(
trace_block_tokens x length_scale))` tokens and stays the unit of sharing. Errors are `TraceError`s
naming the line (JSONL) or the entry (JSON array, counted from 0) and the problem.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
from collections.abc import Iterable, Sequence

from dualpath_jax.config import WorkloadConfig
from dualpath_jax.workload.sessions import load_tracelab, load_weka
from dualpath_jax.workload.trace import Round, TraceError, Trajectory, json_object, load_trace

FORMATS = ("jsonl", "mooncake", "conversation", "weka", "tracelab")
TIMED_FORMATS = ("mooncake", "weka", "tracelab")  # formats whose traces carry start times
ASSISTANT_ROLES = frozenset({"gpt", "assistant", "chatgpt", "bing", "bard", "model"})
_USER_ROLES = frozenset({"human", "user"})
_MOONCAKE_KEYS = ("timestamp", "input_length", "output_length", "hash_ids")


# --------------------------------------------------------------------------- Mooncake


@dataclasses.dataclass(frozen=True)
class MooncakeRequest:
    """One trace line, lengths scaled: `pieces` are its input's `(hash id, tokens)`; `partial`:
    its last trace block is partial in the trace (before scaling)."""

    lineno: int
    timestamp_ms: float
    input_len: int
    output_len: int
    hash_ids: tuple[int, ...]
    pieces: tuple[tuple[int, int], ...]
    partial: bool

    @property
    def full_blocks(self) -> tuple[int, ...]:
        """The hash ids of its whole trace blocks."""
        return self.hash_ids[:-1] if self.partial else self.hash_ids


def scaled_block_tokens(trace_block_tokens: int, length_scale: float) -> int:
    """Tokens of one trace block after scaling (at least 1)."""
    return max(1, round(trace_block_tokens * length_scale))


def _number(obj: dict, key: str, lineno: int, *, integer: bool, minimum: int) -> float:
    value = obj[key]
    ok = isinstance(value, int) if integer else isinstance(value, int | float)
    if isinstance(value, bool) or not ok:
        kind = "an int" if integer else "a number"
        raise TraceError(f"line {lineno}: {key!r} must be {kind}, got {value!r}")
    if not math.isfinite(value) or value < minimum:
        raise TraceError(f"line {lineno}: {key!r} must be >= {minimum}, got {value!r}")
    return value


def parse_mooncake_request(
    line: str, lineno: int = 1, *, trace_block_tokens: int = 512, length_scale: float = 1.0
) -> MooncakeRequest:
    """One Mooncake JSONL line -> `MooncakeRequest` (lengths scaled), or `TraceError` naming the
    line. Keys other than the four of the format are ignored."""
    if trace_block_tokens < 1 or length_scale <= 0:
        raise ValueError("trace_block_tokens must be >= 1 and length_scale > 0")
    obj = json_object(line, lineno)
    missing = [k for k in _MOONCAKE_KEYS if k not in obj]
    if missing:
        keys = list(_MOONCAKE_KEYS)
        raise TraceError(f"line {lineno}: missing key(s) {missing}; a Mooncake request has {keys}")
    ts = float(_number(obj, "timestamp", lineno, integer=False, minimum=0))
    n_in = int(_number(obj, "input_length", lineno, integer=True, minimum=1))
    n_out = int(_number(obj, "output_length", lineno, integer=True, minimum=0))
    ids = obj["hash_ids"]
    if not isinstance(ids, list) or not all(
        isinstance(h, int) and not isinstance(h, bool) for h in ids
    ):
        raise TraceError(f"line {lineno}: 'hash_ids' must be a list of ints, got {ids!r}")
    blocks = -(-n_in // trace_block_tokens)
    if len(ids) != blocks:
        raise TraceError(
            f"line {lineno}: {len(ids)} hash_ids for input_length {n_in}: at"
            f" {trace_block_tokens} tokens a block it needs {blocks}"
            " (set workload.trace_block_tokens to the trace's block size)"
        )
    bt = scaled_block_tokens(trace_block_tokens, length_scale)
    last = n_in - (blocks - 1) * trace_block_tokens  # tokens of the last trace block
    last_scaled = max(1, round(last * bt / trace_block_tokens))
    pieces = tuple((h, bt) for h in ids[:-1]) + ((ids[-1], last_scaled),)
    return MooncakeRequest(
        lineno=lineno,
        timestamp_ms=ts,
        input_len=(blocks - 1) * bt + last_scaled,
        output_len=max(1, round(n_out * length_scale)),
        hash_ids=tuple(ids),
        pieces=pieces,
        partial=last < trace_block_tokens,
    )


def parse_mooncake(
    lines: Iterable[str],
    *,
    trace_block_tokens: int = 512,
    length_scale: float = 1.0,
    sessions: bool = True,
) -> tuple[list[Trajectory], list[float]]:
    """Mooncake JSONL lines (blank lines skipped) -> trajectories and each one's start time in
    seconds after the trace's first request, both in order of start time. Requests are taken in
    timestamp order (ties: file order). `sessions`: group continuations into trajectories (see
    the module docstring); else one trajectory per request. Ids: `mooncake-<line>` of the first
    request."""
    reqs = [
        parse_mooncake_request(
            line, lineno, trace_block_tokens=trace_block_tokens, length_scale=length_scale
        )
        for lineno, line in enumerate(lines, 1)
        if line.strip()
    ]
    if not reqs:
        raise TraceError("the trace has no requests")
    reqs.sort(key=lambda r: r.timestamp_ms)
    groups = _sessions(reqs) if sessions else [[r] for r in reqs]
    t0 = reqs[0].timestamp_ms
    trajs, starts = [], []
    for group in groups:
        first = group[0]
        rounds = [Round(first.input_len, first.output_len, first.pieces)]
        for prev, r in zip(group, group[1:]):
            rounds.append(Round(r.input_len - prev.input_len - prev.output_len, r.output_len))
        trajs.append(Trajectory(f"mooncake-{first.lineno}", tuple(rounds)))
        starts.append((first.timestamp_ms - t0) / 1000.0)
    return trajs, starts


def _prefix_keys(ids: Sequence[int]) -> list[tuple[int, int]]:
    """`(j, chained hash of ids[:j])` for j = 1 .. len(ids): one hash per block, so a request's
    prefixes are keyed in linear time (a key's blocks are compared in full before grouping)."""
    keys, h = [], 0
    for j, x in enumerate(ids, 1):
        h = hash((h, x))
        keys.append((j, h))
    return keys


def _followers(reqs: Sequence[MooncakeRequest]) -> dict[tuple[int, int], tuple[set, set]]:
    """Prefix key -> (ids of the full blocks, ids of the partial last blocks) that follow that
    prefix anywhere in the trace (at most 2 of each kept: only "more than one" matters)."""
    out: dict[tuple[int, int], tuple[set, set]] = {}
    for r in reqs:
        keys = _prefix_keys(r.hash_ids)
        for j in range(1, len(r.hash_ids)):
            full, partial = out.setdefault(keys[j - 1], (set(), set()))
            ids = partial if (r.partial and j == len(r.hash_ids) - 1) else full
            if len(ids) < 2:
                ids.add(r.hash_ids[j])
    return out


def _sessions(reqs: Sequence[MooncakeRequest]) -> list[list[MooncakeRequest]]:
    """Groups time-ordered requests into conversations. Request r continues the trajectory whose
    last request q has full blocks K when K (at least one block) is a prefix of r's hash ids, r's
    input is longer than q's input + output, and K is a conversation's own prefix: across the
    trace at most one full-block id and one partial-block id ever follow K (several do after a
    prefix that different conversations share, like a system prompt: there the trace cannot tell
    a next turn from another conversation, and r starts its own trajectory). Among candidates:
    the longest K, then the latest trajectory."""
    followers = _followers(reqs)

    def own_prefix(key: tuple[int, int]) -> bool:
        full, partial = followers.get(key, ((), ()))
        return len(full) <= 1 and len(partial) <= 1

    groups: list[list[MooncakeRequest]] = []
    tails: dict[tuple[int, int], list[int]] = {}  # key of a last request's K -> trajectories
    for r in reqs:
        keys = _prefix_keys(r.hash_ids)
        chosen = None
        for j in range(len(keys), 0, -1):
            if keys[j - 1] not in tails or not own_prefix(keys[j - 1]):
                continue
            for g in reversed(tails[keys[j - 1]]):
                q = groups[g][-1]
                if r.hash_ids[:j] == q.full_blocks and r.input_len > q.input_len + q.output_len:
                    chosen = g
                    break
            if chosen is not None:
                break
        if chosen is None:
            chosen = len(groups)
            groups.append([])
        elif groups[chosen][-1].full_blocks:
            tails[_prefix_keys(groups[chosen][-1].full_blocks)[-1]].remove(chosen)
        groups[chosen].append(r)
        if r.full_blocks:
            tails.setdefault(_prefix_keys(r.full_blocks)[-1], []).append(chosen)
    return groups


def load_mooncake(
    path: str | os.PathLike[str],
    *,
    trace_block_tokens: int = 512,
    length_scale: float = 1.0,
    sessions: bool = True,
) -> tuple[list[Trajectory], list[float]]:
    """`parse_mooncake` of a file; errors are prefixed with its name."""
    try:
        with open(path, encoding="utf-8") as f:
            return parse_mooncake(
                f,
                trace_block_tokens=trace_block_tokens,
                length_scale=length_scale,
                sessions=sessions,
            )
    except TraceError as e:
        raise TraceError(f"{os.fspath(path)}: {e}") from None


# --------------------------------------------------------------------------- conversations


def message_tokens(text: str, *, bytes_per_token: float = 4.0, length_scale: float = 1.0) -> int:
    """The token count a message stands for: `max(1, round(utf8 bytes x length_scale /
    bytes_per_token))`."""
    return max(1, round(len(text.encode("utf-8")) * length_scale / bytes_per_token))


def _role(role: str) -> str:
    role = role.lower()
    if role in ASSISTANT_ROLES:
        return "assistant"
    return "user" if role in _USER_ROLES else role


def content_id(role: str, text: str) -> int:
    """A message's content id: a 63-bit hash of its normalized role and text."""
    h = hashlib.blake2b(f"{_role(role)}\0{text}".encode(), digest_size=8)
    return int.from_bytes(h.digest(), "little") >> 1


def _text(content: object, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts: the text ones count
        parts = []
        for part in content:
            if not isinstance(part, dict) or not isinstance(part.get("text", ""), str):
                raise TraceError(f"{where}: content parts must be objects with a string 'text'")
            parts.append(part.get("text", ""))
        return "".join(parts)
    raise TraceError(f"{where}: the text must be a string, got {type(content).__name__}")


def _messages(entry: object, where: str) -> list[tuple[str, str]]:
    if not isinstance(entry, dict):
        raise TraceError(f"{where}: expected an object, got {type(entry).__name__}")
    if "conversations" in entry:
        msgs, role_key, text_key = entry["conversations"], "from", "value"
    elif "messages" in entry:
        msgs, role_key, text_key = entry["messages"], "role", "content"
    else:
        raise TraceError(f"{where}: needs 'conversations' (ShareGPT) or 'messages' (OpenAI)")
    if not isinstance(msgs, list):
        raise TraceError(f"{where}: the messages must be a list, got {type(msgs).__name__}")
    out = []
    for i, m in enumerate(msgs):
        at = f"{where}: message {i}"
        if not isinstance(m, dict) or role_key not in m:
            raise TraceError(f"{at} must be an object with {role_key!r} and {text_key!r}")
        role = m[role_key]
        if not isinstance(role, str) or not role:
            raise TraceError(f"{at}: {role_key!r} must be a non-empty string, got {role!r}")
        out.append((role, _text(m.get(text_key), at)))
    return out


def conversation_rounds(
    messages: Sequence[tuple[str, str]],
    *,
    bytes_per_token: float = 4.0,
    length_scale: float = 1.0,
) -> tuple[Round, ...]:
    """The rounds of one conversation's `(role, text)` messages: each assistant message ends a
    round whose append is the other messages since the previous one (a piece each) and whose
    `gen` is its length. Assistant messages before any other message are context; consecutive
    ones add to the previous round's `gen`; messages after the last assistant one are dropped."""

    def tokens(text: str) -> int:
        return message_tokens(text, bytes_per_token=bytes_per_token, length_scale=length_scale)

    rounds: list[Round] = []
    pending: list[tuple[int, int]] = []
    for role, text in messages:
        if _role(role) != "assistant" or (not rounds and not pending):
            pending.append((content_id(role, text), tokens(text)))
        elif pending:
            n = sum(k for _, k in pending)
            rounds.append(Round(n, tokens(text), tuple(pending)))
            pending = []
        else:
            last = rounds[-1]
            rounds[-1] = Round(last.append, last.gen + tokens(text), last.pieces)
    return tuple(rounds)


def parse_conversations(
    text: str, *, bytes_per_token: float = 4.0, length_scale: float = 1.0
) -> list[Trajectory]:
    """A conversation file's text (a JSON array, or JSONL: one conversation a line) -> one
    trajectory per conversation that has an assistant reply (others are skipped). Ids: the
    entry's `id` (`conversation-<k>` without one; a repeated id gets `~<n>`)."""
    if bytes_per_token <= 0 or length_scale <= 0:
        raise ValueError("bytes_per_token and length_scale must be > 0")
    entries: list[tuple[str, object]] = []
    if text.lstrip().startswith("["):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise TraceError(
                f"line {e.lineno}: not valid JSON ({e.msg} at column {e.colno})"
            ) from None
        entries = [(f"entry {k}", entry) for k, entry in enumerate(data)]
    else:
        for lineno, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                entries.append((f"line {lineno}", json.loads(line)))
            except json.JSONDecodeError as e:
                raise TraceError(
                    f"line {lineno}: not valid JSON ({e.msg} at column {e.colno})"
                ) from None
    out: list[Trajectory] = []
    seen: dict[str, int] = {}  # ids used -> suffixes tried
    for k, (where, entry) in enumerate(entries):
        raw_id = entry.get("id", f"conversation-{k}") if isinstance(entry, dict) else None
        if raw_id is not None and not isinstance(raw_id, str | int):
            raise TraceError(f"{where}: 'id' must be a string or an int, got {raw_id!r}")
        if raw_id is not None:
            where = f"{where} (id {str(raw_id)!r})"
        rounds = conversation_rounds(
            _messages(entry, where), bytes_per_token=bytes_per_token, length_scale=length_scale
        )
        if not rounds:
            continue
        tid = str(raw_id)
        while tid in seen:  # a repeated id: the next free `<id>~<n>`
            seen[str(raw_id)] += 1
            tid = f"{raw_id}~{seen[str(raw_id)]}"
        seen[tid] = 0
        out.append(Trajectory(tid, rounds))
    if not out:
        raise TraceError("no conversation has an assistant reply to replay")
    return out


def load_conversations(
    path: str | os.PathLike[str], *, bytes_per_token: float = 4.0, length_scale: float = 1.0
) -> list[Trajectory]:
    """`parse_conversations` of a file; errors are prefixed with its name."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        return parse_conversations(text, bytes_per_token=bytes_per_token, length_scale=length_scale)
    except TraceError as e:
        raise TraceError(f"{os.fspath(path)}: {e}") from None


# --------------------------------------------------------------------------- dispatch


def read_trace(
    cfg: WorkloadConfig, *, vocab_size: int | None = None
) -> tuple[list[Trajectory], list[float] | None]:
    """The trajectories of `cfg.trace` in `cfg.trace_format`, and their start times in seconds
    when the format has them (Mooncake, Weka, TraceLab: `TIMED_FORMATS`), else None.
    `vocab_size` checks the explicit token ids of the JSONL format."""
    if cfg.trace_format == "jsonl":
        return load_trace(cfg.trace, vocab_size=vocab_size), None
    if cfg.trace_format == "mooncake":
        return load_mooncake(
            cfg.trace,
            trace_block_tokens=cfg.trace_block_tokens,
            length_scale=cfg.length_scale,
            sessions=cfg.trace_sessions,
        )
    if cfg.trace_format == "conversation":
        trajs = load_conversations(
            cfg.trace, bytes_per_token=cfg.trace_bytes_per_token, length_scale=cfg.length_scale
        )
        return trajs, None
    if cfg.trace_format == "weka":
        return load_weka(cfg.trace, length_scale=cfg.length_scale)
    if cfg.trace_format == "tracelab":
        return load_tracelab(cfg.trace, length_scale=cfg.length_scale)
    raise ValueError(
        f"workload.trace_format must be one of {list(FORMATS)}, got {cfg.trace_format!r}"
    )
