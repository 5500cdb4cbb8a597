"""The event log rotates by size and is read back whole, rotated files first, in order."""

from __future__ import annotations

import pytest

from dualpath_jax.metrics.events import EventLog, log_files, read_events, rotated


def test_the_log_rotates_by_size_and_reads_back_in_order(tmp_path):
    path = tmp_path / "events.jsonl"
    with EventLog(path, max_bytes=200, keep=3) as log:
        for i in range(40):
            log.write("done", i=i, pad="x" * 20)
        rotations = log.rotations
    assert rotations > 3  # so the oldest files were deleted
    files = log_files(path)
    assert files[-1] == path and files[:-1] == [rotated(path, i) for i in (3, 2, 1)]
    assert all(f.stat().st_size < 200 + 60 for f in files)  # at most one line past the bound
    got = [e["i"] for e in read_events(path)]
    assert got == list(range(40 - len(got), 40))  # the newest events, in order, none twice


def test_no_rotation_when_unbounded_and_reopening_appends(tmp_path):
    path = tmp_path / "events.jsonl"
    with EventLog(path) as log:
        for i in range(50):
            log.write("e", i=i)
    with EventLog(path, max_bytes=10**6) as log:  # a restart appends, counting what is there
        log.write("e", i=50)
    assert log_files(path) == [path]
    assert [e["i"] for e in read_events(path)] == list(range(51))


def test_keep_zero_drops_the_full_file(tmp_path):
    path = tmp_path / "events.jsonl"
    with EventLog(path, max_bytes=50, keep=0) as log:
        for i in range(10):
            log.write("e", i=i)
    assert log_files(path) == [path] and not rotated(path, 1).exists()


def test_a_partly_written_last_line_is_not_read(tmp_path):
    path = tmp_path / "events.jsonl"
    with EventLog(path, max_bytes=100, keep=2) as log:
        for i in range(6):
            log.write("e", i=i)
    with path.open("a") as f:
        f.write('{"kind": "e", "i":')
    assert [e["i"] for e in read_events(path)][-1] == 5


def test_bad_bounds_are_refused(tmp_path):
    with pytest.raises(ValueError, match="max_bytes"):
        EventLog(tmp_path / "e.jsonl", max_bytes=-1)
