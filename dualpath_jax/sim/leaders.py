"""When a simulated group leader fetches, as the real engine loops time it.

A leader (a group's first engine) checks once per loop iteration whether `fetch_interval_s` has
passed since its last fetch (`engines/prefill_engine.py`, `engines/decode_engine.py`). While it
runs a forward batch (PE) or a decode step (DE) it cannot check, so it fetches when the batch or
step ends; while idle its loop wakes every interval plus the loop's own overhead, so it polls
with a period of its own. A `Leader` keeps what that needs: `last`, the leader's last fetch (done
or skipped as finding nothing, which the simulator does not run), and `period`.
"""

from __future__ import annotations

import math

_EPS = 1e-9


class Leader:
    """One leader's fetch timing. Times are virtual seconds."""

    __slots__ = ("last", "period")

    def __init__(self, period: float, phase: float):
        """`phase`: the first idle poll (in `[0, period)`), `period`: the idle polling period."""
        self.period = period
        self.last = phase - period

    def next_idle(self, now: float) -> float:
        """The first of `last + k * period` (k >= 1) at or after `now`: the next fetch while
        idle."""
        if self.period <= 0:
            return now
        k = math.ceil((now - self.last) / self.period - _EPS)
        return self.last + max(k, 1) * self.period

    def went_busy(self, now: float) -> None:
        """Starts a batch or step at `now`: its last fetch is its last idle poll up to now."""
        gap = now - self.last
        if self.period > 0 and gap >= self.period:
            self.last += math.floor(gap / self.period + _EPS) * self.period

    def loop_check(self, now: float, interval: float) -> bool:
        """A batch or step ended at `now`: the loop fetches if an interval has passed since the
        last fetch (True; `last` moves to now)."""
        if now - self.last >= interval - 1e-12:
            self.last = now
            return True
        return False
