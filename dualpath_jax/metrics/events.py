"""The run's event log: one JSON object per line, written by one process (the router).

A long-running server's log is rotated by size (`max_bytes`): the live file `events.jsonl` is
renamed `events.jsonl.1` (the older ones shift to `.2` ..., at most `keep` of them, the oldest
deleted) and a new live file started. `read_events` reads the rotated files oldest first, then
the live one, so every reader sees what is kept, in order.
"""

from __future__ import annotations

import json
import pathlib
import threading
from typing import Any


class EventLog:
    """Appends `{"kind": ..., **fields}` lines to `path` (flushed per line). Thread safe. With
    `max_bytes > 0` the file is rotated once it holds that many bytes, keeping `keep` rotated
    files (`path.1` the newest)."""

    def __init__(self, path: str | pathlib.Path, max_bytes: int = 0, keep: int = 4):
        if max_bytes < 0 or keep < 0:
            raise ValueError(f"max_bytes and keep must be >= 0, got {max_bytes}, {keep}")
        self.path = pathlib.Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.max_bytes, self.keep = max_bytes, keep
        self._f = self.path.open("a", encoding="utf-8")
        self._size = self._f.tell()
        self._lock = threading.Lock()
        self.rotations = 0

    def write(self, kind: str, **fields: Any) -> None:
        line = json.dumps({"kind": kind, **fields}, default=str) + "\n"
        with self._lock:
            self._f.write(line)
            self._f.flush()
            self._size += len(line.encode("utf-8"))
            if self.max_bytes and self._size >= self.max_bytes:
                self._rotate()

    def _rotate(self) -> None:
        self._f.close()
        for i in range(self.keep, 0, -1):
            older = rotated(self.path, i)
            if i == self.keep:
                older.unlink(missing_ok=True)
            elif older.exists():
                older.rename(rotated(self.path, i + 1))
        if self.keep:
            self.path.rename(rotated(self.path, 1))
        else:
            self.path.unlink(missing_ok=True)
        self._f = self.path.open("a", encoding="utf-8")
        self._size = 0
        self.rotations += 1

    def close(self) -> None:
        with self._lock:
            self._f.close()

    def __enter__(self) -> EventLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def rotated(path: str | pathlib.Path, i: int) -> pathlib.Path:
    """The `i`-th newest rotated file of the log at `path` (`events.jsonl.1`, ...)."""
    path = pathlib.Path(path)
    return path.with_name(f"{path.name}.{i}")


def log_files(path: str | pathlib.Path) -> list[pathlib.Path]:
    """The log's files that exist, oldest first: the rotated ones, then the live one."""
    path = pathlib.Path(path)
    olds, i = [], 1
    while rotated(path, i).exists():
        olds.append(rotated(path, i))
        i += 1
    return [*reversed(olds), *([path] if path.exists() or not olds else [])]


def read_events(path: str | pathlib.Path) -> list[dict[str, Any]]:
    """The log's events, its rotated files first; complete lines only, so it can be read while
    the router writes."""
    events = []
    for f in log_files(path):
        text = f.read_text(encoding="utf-8")
        lines = text[: text.rfind("\n") + 1].splitlines()
        events += [json.loads(line) for line in lines if line.strip()]
    return events
