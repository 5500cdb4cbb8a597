"""The run's event log: one JSON object per line, written by one process (the router)."""

from __future__ import annotations

import json
import pathlib
import threading
from typing import Any


class EventLog:
    """Appends `{"kind": ..., **fields}` lines to `path` (flushed per line). Thread safe."""

    def __init__(self, path: str | pathlib.Path):
        self.path = pathlib.Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = self.path.open("a", encoding="utf-8")
        self._lock = threading.Lock()

    def write(self, kind: str, **fields: Any) -> None:
        line = json.dumps({"kind": kind, **fields}, default=str)
        with self._lock:
            self._f.write(line + "\n")
            self._f.flush()

    def close(self) -> None:
        with self._lock:
            self._f.close()

    def __enter__(self) -> EventLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_events(path: str | pathlib.Path) -> list[dict[str, Any]]:
    """The log's events; complete lines only, so it can be read while the router writes."""
    text = pathlib.Path(path).read_text(encoding="utf-8")
    return [json.loads(line) for line in text[: text.rfind("\n") + 1].splitlines() if line.strip()]
