"""Rate limiting of repeated log records, so a flood of identical warnings (a peer sending garbage
frames, a failing link) cannot fill a disk or drown the messages around it.

`install_rate_limit()` is called once per engine/router process after logging is configured.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Iterable

_DECISIONS = "_dualpath_rate_limit"  # record attribute {filter id: passed}: one decision each


class _Bucket:
    __slots__ = ("tokens", "last", "suppressed")

    def __init__(self, tokens: float, last: float):
        self.tokens, self.last, self.suppressed = tokens, last, 0


class RateLimit(logging.Filter):
    """Lets records with the same (logger name, level, message template) through as a token
    bucket: `burst` at once, then `per_s` per second; the rest are dropped and counted, and the
    next one that passes ends with "(N similar messages suppressed)".

    Records of loggers outside `names` (and their children) pass untouched; `names=None` limits
    every record. One instance may sit on several handlers: each record is decided once. At most
    `max_keys` templates are tracked (least recently seen forgotten first, with their counts).
    Thread safe; `clock` (seconds) is injectable for tests.
    """

    def __init__(
        self,
        per_s: float = 10.0,
        burst: int = 5,
        *,
        names: Iterable[str] | None = None,
        max_keys: int = 1024,
        clock: Callable[[], float] = time.monotonic,
    ):
        super().__init__()
        if not per_s > 0:
            raise ValueError(f"per_s must be > 0, got {per_s}")
        if burst < 1 or max_keys < 1:
            raise ValueError(f"burst and max_keys must be >= 1, got {burst}, {max_keys}")
        self.per_s, self.burst, self.max_keys, self.clock = float(per_s), burst, max_keys, clock
        self.names = None if names is None else tuple(names)
        self._buckets: collections.OrderedDict[tuple, _Bucket] = collections.OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        """Templates tracked now."""
        return len(self._buckets)

    def _applies(self, name: str) -> bool:
        return self.names is None or any(name == n or name.startswith(n + ".") for n in self.names)

    def filter(self, record: logging.LogRecord) -> bool:
        decisions = record.__dict__.setdefault(_DECISIONS, {})
        if id(self) in decisions:
            return decisions[id(self)]
        if not self._applies(record.name):
            return True
        msg = record.msg if isinstance(record.msg, str) else str(record.msg)
        key = (record.name, record.levelno, msg)
        with self._lock:
            now = self.clock()
            b = self._buckets.get(key)
            if b is None:
                b = self._buckets[key] = _Bucket(float(self.burst), now)
                while len(self._buckets) > self.max_keys:
                    self._buckets.popitem(last=False)
            else:
                self._buckets.move_to_end(key)
                b.tokens = min(float(self.burst), b.tokens + (now - b.last) * self.per_s)
                b.last = now
            passed = b.tokens >= 1.0 - 1e-9  # a token refilled in float steps is still one
            if passed:
                b.tokens = max(0.0, b.tokens - 1.0)
                suppressed, b.suppressed = b.suppressed, 0
            else:
                b.suppressed += 1
        if passed and suppressed:
            try:
                text = record.getMessage()
            except Exception:  # a broken record: the handler reports it as it would anyway
                text = None
            if text is not None:
                record.msg, record.args = f"{text} ({suppressed} similar messages suppressed)", ()
        decisions[id(self)] = passed
        return passed


def install_rate_limit(
    logger_names: Iterable[str] = ("dualpath_jax",),
    *,
    per_s: float = 10.0,
    burst: int = 5,
    max_keys: int = 1024,
) -> RateLimit:
    """Adds one `RateLimit` for the records of `logger_names` (and their children) to every
    handler those records reach now: the named loggers' own handlers and their ancestors' up to
    the root, or `logging.lastResort` where none is configured. Handlers, not loggers, because a
    logger's filters only see records logged on that exact logger, not on its children. Call it
    after logging is configured; handlers that already hold a RateLimit are left alone."""
    names = tuple(logger_names)
    flt = RateLimit(per_s, burst, names=names, max_keys=max_keys)
    handlers: list[logging.Handler] = []
    for name in names:
        logger: logging.Logger | None = logging.getLogger(name)
        while logger is not None:
            handlers += [h for h in logger.handlers if h not in handlers]
            logger = logger.parent if logger.propagate else None
    if not handlers and logging.lastResort is not None:
        handlers.append(logging.lastResort)
    for h in handlers:
        if not any(isinstance(f, RateLimit) for f in h.filters):
            h.addFilter(flt)
    return flt
