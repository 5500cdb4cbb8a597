"""The C heap of a cluster process: fewer malloc arenas, and free memory handed back in time.

A long-running engine allocates and frees host buffers of every size from dozens of threads
(store reads and writes, KV transfers, the loop): glibc's malloc gives threads arenas of their
own and keeps what they free for reuse, so the process's resident memory creeps up over hours
with free memory nobody reuses, not with live data. `tune` caps the arenas
(`cluster.malloc_arena_max`, `mallopt(M_ARENA_MAX)`: set before the threads start, the arenas
they share are reused) and starts a thread that hands the free pages back every
`cluster.malloc_trim_s` seconds (`malloc_trim(0)`: a millisecond or so). Where the C library is
not glibc both are skipped.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)

M_ARENA_MAX = -8  # glibc's mallopt parameter


def glibc() -> ctypes.CDLL | None:
    """The process's C library if it is glibc (it has `malloc_trim` and `mallopt`), else None."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    if not (hasattr(libc, "malloc_trim") and hasattr(libc, "mallopt")):
        return None
    return libc


class Trimmer(threading.Thread):
    """Calls `trim()` every `every_s` seconds until `stop()` (`wait` is the pause: an
    `Event.wait`, so that a stop ends it at once)."""

    def __init__(self, trim: Callable[[], object], every_s: float):
        super().__init__(name="malloc-trim", daemon=True)
        self.trim, self.every_s = trim, every_s
        self.trims = 0
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.wait(self.every_s):
            self.trim()
            self.trims += 1

    def stop(self) -> None:
        self._halt.set()


def tune(arena_max: int, trim_s: float, libc: ctypes.CDLL | None = None) -> Trimmer | None:
    """Caps malloc's arenas at `arena_max` (0: glibc's default) and, with `trim_s` > 0, starts a
    `Trimmer` handing free heap pages back every `trim_s` seconds (returned; None if none)."""
    libc = libc if libc is not None else glibc()
    if libc is None:
        if arena_max or trim_s:
            log.info("not glibc: malloc arenas and trimming left as they are")
        return None
    if arena_max > 0 and not libc.mallopt(M_ARENA_MAX, arena_max):
        log.warning("mallopt(M_ARENA_MAX, %d) failed", arena_max)
    if trim_s <= 0:
        return None
    trimmer = Trimmer(lambda: libc.malloc_trim(0), trim_s)
    trimmer.start()
    return trimmer
