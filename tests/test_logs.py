"""`logs.RateLimit`: repeated records are suppressed and counted; distinct ones are independent."""

from __future__ import annotations

import logging
import threading

import pytest

from dualpath_jax.logs import RateLimit, install_rate_limit


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class Collect(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@pytest.fixture
def tree(request):
    """A private logger with a collecting handler, detached from the root."""
    logger = logging.getLogger(f"dp_logs_test.{request.node.name}")
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    handler = Collect()
    logger.addHandler(handler)
    yield logger, handler
    logger.removeHandler(handler)


def uninstall(flt: RateLimit, logger: logging.Logger) -> None:
    for h in logger.handlers:
        h.removeFilter(flt)


def limited(tree, **kw):
    logger, handler = tree
    clock = Clock()
    flt = RateLimit(clock=clock, **kw)
    handler.addFilter(flt)
    return logger, handler, clock, flt


def test_burst_passes_then_suppressed_then_reported(tree):
    log, out, clock, _ = limited(tree, per_s=10.0, burst=5)
    for i in range(5000):
        log.warning("rejected a frame: %s", i)
    assert out.lines == [f"rejected a frame: {i}" for i in range(5)]
    clock.t += 0.05  # half a token
    log.warning("rejected a frame: %s", "x")
    assert len(out.lines) == 5
    clock.t += 0.05
    log.warning("rejected a frame: %s", "y")
    assert out.lines[-1] == "rejected a frame: y (4996 similar messages suppressed)"
    log.warning("rejected a frame: %s", "z")
    assert len(out.lines) == 6


def test_refills_at_most_to_burst(tree):
    log, out, clock, _ = limited(tree, per_s=2.0, burst=3)
    for _ in range(3):
        log.warning("same")
    clock.t += 3600.0
    for _ in range(10):
        log.warning("same")
    assert out.lines == ["same"] * 6
    clock.t += 1.0  # two tokens
    for _ in range(10):
        log.warning("same")
    assert out.lines[6:] == ["same (7 similar messages suppressed)", "same"]


def test_distinct_templates_levels_and_loggers_are_independent(tree):
    log, out, _, _ = limited(tree, burst=2)
    child = log.getChild("child")
    for _ in range(10):
        log.warning("a %d", 1)
        log.warning("b %d", 1)
        log.error("a %d", 1)
        child.warning("a %d", 1)
    assert sorted(out.lines) == sorted(["a 1", "b 1", "a 1", "a 1"] * 2)


def test_args_do_not_make_a_record_distinct(tree):
    log, out, _, _ = limited(tree, burst=1)
    log.warning("peer %s failed", "a")
    log.warning("peer %s failed", "b")
    assert out.lines == ["peer a failed"]


def test_memory_is_capped(tree):
    log, out, _, flt = limited(tree, burst=1, max_keys=3)
    for i in range(100):
        log.warning(f"message {i}")
    assert len(flt) == 3 and len(out.lines) == 100
    log.warning("message 99")  # still tracked: suppressed
    log.warning("message 0")  # forgotten: passes again
    assert out.lines[100:] == ["message 0"]


def test_threads_share_one_budget(tree):
    log, out, _, _ = limited(tree, burst=7)

    def spam():
        for _ in range(500):
            log.warning("flood")

    threads = [threading.Thread(target=spam) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert out.lines == ["flood"] * 7


def test_one_filter_on_two_handlers_decides_each_record_once(tree):
    log, first, clock, flt = limited(tree, burst=2)
    second = Collect()
    second.addFilter(flt)
    log.addHandler(second)
    try:
        for _ in range(10):
            log.warning("twice")
        clock.t += 1.0
        log.warning("twice")
    finally:
        log.removeHandler(second)
    expected = ["twice", "twice", "twice (8 similar messages suppressed)"]
    assert first.lines == expected and second.lines == expected


def test_names_scope_the_filter(tree):
    logger, handler = tree
    flt = RateLimit(burst=1, names=[logger.name + ".limited"], clock=Clock())
    handler.addFilter(flt)
    for _ in range(3):
        logger.warning("free")
        logger.getChild("limited").getChild("x").warning("held")
        logger.getChild("limitedness").warning("free too")
    assert handler.lines.count("free") == 3 and handler.lines.count("free too") == 3
    assert handler.lines.count("held") == 1


def test_bad_arguments():
    with pytest.raises(ValueError):
        RateLimit(per_s=0)
    with pytest.raises(ValueError):
        RateLimit(burst=0)
    with pytest.raises(ValueError):
        RateLimit(max_keys=0)


def test_install_covers_children_through_handlers(tree):
    logger, handler = tree
    flt = install_rate_limit([logger.name], burst=2)
    flt.clock = Clock()
    try:
        assert install_rate_limit([logger.name]) is not flt
        assert [f for f in handler.filters if isinstance(f, RateLimit)] == [flt]
        for _ in range(10):
            logger.getChild("engine.rpc").warning("rejected a frame: %s", "bad")
        assert handler.lines == ["rejected a frame: bad"] * 2
    finally:
        uninstall(flt, logger)


def test_install_reaches_ancestor_handlers(tree):
    parent, handler = tree
    child = parent.getChild("pkg")
    flt = install_rate_limit([child.name], burst=1)
    flt.clock = Clock()
    try:
        for _ in range(5):
            child.getChild("mod").warning("x")
            parent.warning("outside")
        assert handler.lines.count("x") == 1 and handler.lines.count("outside") == 5
    finally:
        uninstall(flt, parent)


def test_install_without_handlers_uses_last_resort(tree):
    logger, _ = tree
    saved = logger.handlers[:]  # pytest's capture handlers too
    logger.handlers.clear()
    flt = install_rate_limit([logger.name])
    try:
        assert flt in logging.lastResort.filters
    finally:
        logging.lastResort.removeFilter(flt)
        logger.handlers[:] = saved
