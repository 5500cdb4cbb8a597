"""Event-loop choice for the simulator: `sim.core.EventLoop` (a heapq of callbacks) vs SimPy.

Run:
  python bench/event_loop.py --events=500000
Both schedule the same workload: `--chains` independent chains, each event scheduling the next
one of its chain after a random delay (the simulator's pattern: a callback schedules follow-ups),
plus one cancelled timer per `--cancel_every` events (link chunks and dispatch timers are
cancelled and re-armed). SimPy is optional (`pip install simpy`); without it only our loop runs.
Prints events per second of each, measured side by side in one run.
"""

from __future__ import annotations

import time

import numpy as np
from absl import app, flags

from dualpath_jax.sim.core import EventLoop

_EVENTS = flags.DEFINE_integer("events", 500_000, "Events to process per loop.")
_CHAINS = flags.DEFINE_integer("chains", 1000, "Concurrent event chains (pending events).")
_CANCEL = flags.DEFINE_integer("cancel_every", 10, "One cancelled timer per this many events.")
_REPS = flags.DEFINE_integer("reps", 3, "Repetitions (best is reported).")


def _delays(n: int) -> np.ndarray:
    return np.random.default_rng(0).exponential(1e-3, n)


def run_ours(n: int, chains: int, cancel_every: int) -> float:
    loop = EventLoop()
    delays = _delays(n + chains)
    count = [0]

    def step() -> None:
        i = count[0] = count[0] + 1
        if i >= n:
            loop.stop()
            return
        loop.after(float(delays[i]), step)
        if i % cancel_every == 0:
            loop.after(1.0, step).cancel()

    for c in range(chains):
        loop.after(float(delays[c]), step)
    t0 = time.perf_counter()
    loop.run()
    return count[0] / (time.perf_counter() - t0)


def run_simpy(n: int, chains: int, cancel_every: int) -> float:
    import simpy

    env = simpy.Environment()
    delays = _delays(n + chains)
    count = [0]
    done = env.event()

    def step(_event) -> None:
        i = count[0] = count[0] + 1
        if i >= n:
            if not done.triggered:
                done.succeed()
            return
        env.timeout(float(delays[i])).callbacks.append(step)
        if i % cancel_every == 0:  # SimPy has no cancel: a timer whose callback ignores it
            env.timeout(1.0).callbacks.append(lambda _e: None)

    for c in range(chains):
        env.timeout(float(delays[c])).callbacks.append(step)
    t0 = time.perf_counter()
    env.run(until=done)
    return count[0] / (time.perf_counter() - t0)


def main(argv):
    del argv
    n, chains, every = _EVENTS.value, _CHAINS.value, _CANCEL.value
    ours = max(run_ours(n, chains, every) for _ in range(_REPS.value))
    print(f"sim.core.EventLoop: {ours:,.0f} events/s")
    try:
        import simpy  # noqa: F401
    except ImportError:
        print("simpy not installed: pip install simpy to compare")
        return
    theirs = max(run_simpy(n, chains, every) for _ in range(_REPS.value))
    print(
        f"simpy {__import__('simpy').__version__} (callbacks on timeouts): {theirs:,.0f} events/s"
    )
    print(f"EventLoop / SimPy: {ours / theirs:.2f}x")


if __name__ == "__main__":
    app.run(main)
