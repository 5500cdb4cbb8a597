"""runtimes/malloc.py: arenas capped and free heap pages handed back, through the C library's calls."""

from __future__ import annotations

import threading

from dualpath_jax.runtimes import malloc


class FakeLibc:
    def __init__(self, enough: int = 3):
        self.mallopts: list[tuple[int, int]] = []
        self.trims = 0
        self.enough = enough
        self.trimmed = threading.Event()

    def mallopt(self, param: int, value: int) -> int:
        self.mallopts.append((param, value))
        return 1

    def malloc_trim(self, pad: int) -> int:
        assert pad == 0
        self.trims += 1
        if self.trims >= self.enough:
            self.trimmed.set()
        return 1


def test_tune_caps_the_arenas_and_trims_until_stopped():
    libc = FakeLibc()
    trimmer = malloc.tune(2, 1e-3, libc=libc)
    assert libc.mallopts == [(malloc.M_ARENA_MAX, 2)]
    assert trimmer is not None and libc.trimmed.wait(60)
    trimmer.stop()
    trimmer.join(60)
    assert not trimmer.is_alive() and trimmer.trims == libc.trims >= 3


def test_zeros_leave_the_heap_as_it_is():
    libc = FakeLibc()
    assert malloc.tune(0, 0.0, libc=libc) is None
    assert libc.mallopts == [] and libc.trims == 0


def test_this_process_trims_for_real_where_it_runs_on_glibc():
    libc = malloc.glibc()
    if libc is not None:  # glibc: the real calls answer
        assert libc.malloc_trim(0) in (0, 1)
