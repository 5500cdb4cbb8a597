"""A fault plan: which store and channel operations fail, slow down or hang, from a JSON file.

Not for production. The wrappers of `testing.faulty` apply a `FaultPlan` to a real block store
and KV channel; the engines build them from `cluster.fault_file` (`engines.fault_hook`).

The plan is a JSON file. It is re-read when it changes (a `stat` at most every 50 ms, done by the
next faultable operation), so a test injects faults mid-run into separate engine processes by
rewriting it: write a temporary file, then `os.replace` it onto the path. A missing file is a
plan without faults; removing the file clears them. A file that fails validation raises
ValueError when the plan is created; one that appears later is logged once and the last good
plan stays in force. A new version of the file starts afresh: counts, random streams, the
`injected` counters and the once-per-rule log messages restart.

File format:

    {"seed": 0,
     "rules": [
       {"op": "store.write", "error": "ENOSPC", "count": 3, "prob": 1.0},
       {"op": "store.read", "delay_s": 2.0},
       {"op": "channel.pull", "hang": true, "engines": ["de1"]},
       {"op": "params.bucket", "corrupt": true, "count": 1}]}

Top-level keys: `rules` (required list) and `seed` (int, default 0). Rule fields:
  op       store.lookup | store.read (read_full and read_layers) | store.write | store.delete |
           channel.offer | channel.pull | params.bucket (a bucket of a streamed params update,
           as an engine pulled it, before its checksum is checked; transfer/params_sync.py)
           (required)
  error    an errno name (ENOSPC, EROFS, EIO, ...): fail with OSError(errno, strerror) wrapped
           in the operation's own error type
  delay_s  sleep this long, then do the real operation (or fail, with `error`)
  hang     true: block until the operation's own timeout, then fail as a timeout (not for
           params.bucket)
  corrupt  true: flip the first bytes of the bucket's first array (params.bucket only)
  count    fault at most this many operations (per process), then the rule is spent
  prob     probability per operation, from a random stream seeded by `seed` and the rule index
  engines  only wrappers whose `who` is listed (e.g. ["de1", "pe0"]) obey the rule
A rule needs `error`, `delay_s`, `hang` or `corrupt` (`hang` goes alone). Rules are tried in order and the
first that fires applies: one fault per operation. Store calls on an empty batch of keys are
never faulted (they do no I/O).
Each rule's first fault is logged at WARNING ("injected ENOSPC into store.write (rule 0)"); every
fault is counted in `FaultPlan.injected` (rule index -> faults). How each fault surfaces is
`testing.faulty`'s docstring.
"""

from __future__ import annotations

import collections
import dataclasses
import errno as errno_mod
import json
import logging
import math
import os
import pathlib
import random
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

log = logging.getLogger(__name__)

OPS = (
    "store.lookup",
    "store.read",
    "store.write",
    "store.delete",
    "channel.offer",
    "channel.pull",
    "params.bucket",
)
_RULE_FIELDS = ("op", "error", "delay_s", "hang", "corrupt", "count", "prob", "engines")
_PLAN_FIELDS = ("rules", "seed")
DEFAULT_CHECK_EVERY_S = 0.05


def _errno_of(name: str) -> int | None:
    value = getattr(errno_mod, name, None)
    if name.startswith("E") and name.isupper() and isinstance(value, int):
        return value
    return None


@dataclasses.dataclass(frozen=True)
class FaultRule:
    """One validated rule of a fault plan (see the module docstring for the fields)."""

    op: str
    error: str | None = None
    delay_s: float = 0.0
    hang: bool = False
    count: int | None = None  # None: unlimited
    prob: float = 1.0
    engines: tuple[str, ...] | None = None  # None: every engine
    corrupt: bool = False

    @property
    def errno(self) -> int | None:
        return None if self.error is None else _errno_of(self.error)

    def oserror(self) -> OSError:
        """The OSError this rule injects (only for rules with `error`)."""
        code = self.errno
        assert code is not None
        return OSError(code, os.strerror(code))

    def describe(self) -> str:
        """What the rule injects, for messages: "ENOSPC", "delay 2s", "delay 2s + EIO", "hang"."""
        if self.hang:
            return "hang"
        parts = [f"delay {self.delay_s:g}s"] if self.delay_s else []
        if self.error:
            parts.append(self.error)
        if self.corrupt:
            parts.append("corruption")
        return " + ".join(parts)

    def applies_to(self, op: str, who: str) -> bool:
        return self.op == op and (self.engines is None or who in self.engines)


def _number(v: Any, where: str, lo: float, hi: float = math.inf) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float) or not lo <= v <= hi:
        bound = f"[{lo:g}, {hi:g}]" if hi != math.inf else f">= {lo:g}"
        raise ValueError(f"{where} must be a number {bound}, got {v!r}")
    return float(v)


def _parse_rule(i: int, raw: Any, source: str) -> FaultRule:
    where = f"{source}: rule {i}"
    if not isinstance(raw, dict):
        raise ValueError(f"{where} must be an object, got {raw!r}")
    unknown = sorted(set(raw) - set(_RULE_FIELDS))
    if unknown:
        raise ValueError(
            f"{where}: unknown field {unknown[0]!r} (fields: {', '.join(_RULE_FIELDS)})"
        )
    op = raw.get("op")
    if op not in OPS:
        raise ValueError(f"{where}: unknown op {op!r} (ops: {', '.join(OPS)})")
    error = raw.get("error")
    if error is not None and (not isinstance(error, str) or _errno_of(error) is None):
        raise ValueError(f"{where}: unknown errno name {error!r} (e.g. ENOSPC, EROFS, EIO)")
    delay_s = _number(raw.get("delay_s", 0.0), f"{where}: delay_s", 0.0)
    hang = raw.get("hang", False)
    if not isinstance(hang, bool):
        raise ValueError(f"{where}: hang must be true or false, got {hang!r}")
    count = raw.get("count")
    if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 1):
        raise ValueError(f"{where}: count must be a positive integer, got {count!r}")
    prob = _number(raw.get("prob", 1.0), f"{where}: prob", 0.0, 1.0)
    engines = raw.get("engines")
    if engines is not None:
        if not isinstance(engines, list) or not all(isinstance(e, str) and e for e in engines):
            raise ValueError(f"{where}: engines must be a list of engine names, got {engines!r}")
        engines = tuple(engines)
    corrupt = raw.get("corrupt", False)
    if not isinstance(corrupt, bool):
        raise ValueError(f"{where}: corrupt must be true or false, got {corrupt!r}")
    if corrupt and op != "params.bucket":
        raise ValueError(f"{where}: corrupt is for op params.bucket only")
    if hang and op == "params.bucket":
        raise ValueError(f"{where}: hang is not for op params.bucket (give delay_s)")
    if hang and (error is not None or delay_s):
        raise ValueError(f"{where}: hang cannot be combined with error or delay_s")
    if not (hang or error is not None or delay_s or corrupt):
        raise ValueError(f"{where}: says nothing to inject (give error, delay_s, hang or corrupt)")
    return FaultRule(op, error, delay_s, hang, count, prob, engines, corrupt)


def parse_plan(text: str | bytes, source: str = "fault plan") -> tuple[tuple[FaultRule, ...], int]:
    """Validates a fault plan's JSON text; returns (rules, seed) or raises ValueError naming the
    first problem (unknown op, field or errno name, a value out of range, bad JSON)."""
    try:
        data = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{source} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{source} must be a JSON object with a 'rules' list")
    unknown = sorted(set(data) - set(_PLAN_FIELDS))
    if unknown:
        raise ValueError(f"{source}: unknown key {unknown[0]!r} (keys: rules, seed)")
    if not isinstance(data.get("rules"), list):
        raise ValueError(f"{source}: 'rules' must be a list")
    seed = data.get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"{source}: seed must be an integer, got {seed!r}")
    return tuple(_parse_rule(i, r, source) for i, r in enumerate(data["rules"])), seed


def _signature(st: os.stat_result) -> tuple[int, ...]:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


class FaultPlan:
    """The rules of a fault plan file, re-read when the file changes. Thread-safe; one per
    process, shared by its wrappers.

    `check_every_s` bounds how often the file is stat-ed; `sleep` is what delays and hangs call
    (tests pass a fake to control time). `generation` counts the plan versions installed.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        check_every_s: float = DEFAULT_CHECK_EVERY_S,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.path = os.fspath(path)
        self.check_every_s = check_every_s
        self.sleep = sleep
        self._clock = clock
        self._lock = threading.Lock()
        self.injected: collections.Counter[int] = collections.Counter()
        self.generation = 0
        self._sig: tuple[int, ...] | None = None  # the installed file's; None: no file
        self._bad_sig: tuple[int, ...] | None = None  # the last rejected file's
        self._warned: tuple[Any, str] | None = None  # the last warning's (signature, text)
        self._install((), 0)
        with self._lock:
            self._refresh(strict=True)
        self._next_check = self._clock() + check_every_s

    @property
    def rules(self) -> tuple[FaultRule, ...]:
        with self._lock:
            return self._rules

    def refresh(self) -> None:
        """Re-reads the file now if it changed (faultable operations do this on their own)."""
        with self._lock:
            self._refresh(strict=False)

    def pick(self, op: str, who: str) -> tuple[int, FaultRule] | None:
        """The fault (rule index, rule) to apply to one `op` of engine `who`, or None; uses up
        one of the rule's count."""
        if op not in OPS:
            raise ValueError(f"unknown fault op {op!r} (ops: {', '.join(OPS)})")
        now = self._clock()
        with self._lock:
            if now >= self._next_check:
                self._next_check = now + self.check_every_s
                self._refresh(strict=False)
            for i, rule in enumerate(self._rules):
                if not rule.applies_to(op, who) or self._left[i] == 0:
                    continue
                if rule.prob < 1.0 and self._rngs[i].random() >= rule.prob:
                    continue
                if self._left[i] is not None:
                    self._left[i] -= 1
                self.injected[i] += 1
                first = i not in self._logged
                self._logged.add(i)
                break
            else:
                return None
        if first:
            log.warning(
                "injected %s into %s (rule %d) for %s; further faults of this rule are "
                "counted, not logged",
                rule.describe(),
                op,
                i,
                who or "?",
            )
        return i, rule

    # -- internals (called with the lock held)

    def _install(self, rules: tuple[FaultRule, ...], seed: int) -> None:
        self._rules = rules
        self._left: list[int | None] = [r.count for r in rules]
        self._rngs = [random.Random(seed * 1_000_003 + i) for i in range(len(rules))]
        self._logged: set[int] = set()
        self.injected.clear()
        self.generation += 1

    def _refresh(self, strict: bool) -> None:
        try:
            sig: tuple[int, ...] | None = _signature(os.stat(self.path))
        except FileNotFoundError:
            sig = None
        except OSError as e:
            self._reject(None, e, strict)
            return
        if sig == self._sig or (sig is not None and sig == self._bad_sig):
            return
        text = None
        if sig is not None:
            try:
                with open(self.path, "rb") as f:
                    sig = _signature(os.fstat(f.fileno()))
                    text = f.read()
            except FileNotFoundError:
                sig = None
            except OSError as e:
                self._reject(sig, e, strict)
                return
        if text is None:
            self._sig, self._bad_sig = None, None
            if self._rules:
                log.info("fault plan %s is gone: no faults", self.path)
            self._install((), 0)
            return
        try:
            rules, seed = parse_plan(text, f"fault plan {self.path}")
        except ValueError as e:
            self._reject(sig, e, strict)
            return
        self._sig, self._bad_sig = sig, None
        self._install(rules, seed)
        log.info("fault plan %s: %d rule(s), version %d", self.path, len(rules), self.generation)

    def _reject(self, sig: tuple[int, ...] | None, err: Exception, strict: bool) -> None:
        if strict:
            raise err
        if self._warned != (sig, str(err)):  # once per bad version, not at every check
            log.warning("%s; keeping the previous fault plan", err)
            self._warned = (sig, str(err))
        self._bad_sig = sig


def write_plan(path: str | os.PathLike[str], rules: Sequence[dict], seed: int = 0) -> None:
    """Writes a plan file atomically (a temp file, then `os.replace`: a new inode, which every
    process reading the plan notices), so running engines pick the new rules up."""
    path = pathlib.Path(path)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"seed": seed, "rules": list(rules)}))
    os.replace(tmp, path)


def load_plan(path: str | os.PathLike[str]) -> FaultPlan | None:
    """The fault plan at `path`, or None for "" (no fault injection). A missing file is a plan
    without faults (it may appear later); an invalid one raises ValueError."""
    return FaultPlan(path) if os.fspath(path) else None
