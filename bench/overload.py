"""Overload: C two-round sessions submitted at once to a 1P1D cluster; nothing may hang or drift.

Run:
  python bench/overload.py --sessions=100 --workdir=/tmp/dp_overload_100
  python bench/overload.py --sessions=200 --max_queue=64 --workdir=/tmp/dp_overload_200q64

All `--sessions` trajectories start together through `run_trajectories(client, trajs,
max_concurrent=0, timeout_s=--timeout)`, so the router's queue holds up to C rounds at once.
Reported: trajectories completed with the reference tokens (the monolithic reference model's
greedy tokens on the full context, computed here on the CPU before the cluster starts), refused
with kind `overloaded` (the scheduler's queue was full: `--max_queue` sets scheduler.max_queue),
other errors by kind, and hung (no answer within `--timeout`); the router's counters (requeued,
failed, overloaded, ...), the transfer timeouts (`failed` events with failure "transfer" in
WORKDIR/events.jsonl: there must be none), and the peak RSS of the router and each engine
(VmRSS of /proc/PID/status sampled every `--rss_interval` s, and the kernel's VmHWM at the end).

Sizes: the cluster is `configs/cpu_1p1d.py:tiny` (tiny Qwen2, emulated links: 0.5 MB/s storage
NIC per node, 4 MB/s compute NIC, 8 decode slots + 8 queued). Its workload shape (the 64k preset)
is kept, cut at `max_turns=2`, but its lengths are scaled by `--length_scale` (default 1/64
instead of the config's 1/16): first appends of ~170 tokens (21-196), second appends of ~5, a
few generated tokens per round. At 1/16 every session's second round reads ~660 cached tokens
(0.5 MB of KV) through a 0.5 MB/s storage NIC, so 200 sessions need about 100 MB of emulated
storage reads plus as much of persists, several minutes of link time alone on a 2-core host;
at 1/64 a run of 200 sessions takes a couple of minutes and still keeps the queue full long
enough to overload it. Trajectories that the workload cuts to one round are skipped, so every
session has exactly two rounds. `--set` overrides anything else (`--set workload.seed=3`).

Writes WORKDIR/summary.json, WORKDIR/outputs.jsonl (per session: status, kind, error, JCTs) and
WORKDIR/rss.jsonl (every RSS sample, kB) and prints a summary. Exits 1 on a hung round, a wrong token or a transfer timeout.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import pathlib
import shutil
import sys
import threading
import time
from collections.abc import Sequence
from concurrent import futures

import numpy as np
from absl import app, flags

from dualpath_jax.cluster import Client
from dualpath_jax.config import ExperimentConfig, apply_overrides
from dualpath_jax.configs_loader import load_config
from dualpath_jax.experiment import build_trajectories, check_fits
from dualpath_jax.metrics.events import read_events
from dualpath_jax.rollout import Backend, RolloutError, Round, Trajectory, run_trajectories
from dualpath_jax.runtimes.local import LocalCluster

_CONFIG = flags.DEFINE_string("config", "configs/cpu_1p1d.py:tiny", "Experiment file.")
_SET = flags.DEFINE_multi_string("set", [], "Override `section.key=value` (repeatable).")
_SESSIONS = flags.DEFINE_integer("sessions", 100, "Concurrent two-round sessions.")
_ROUNDS = flags.DEFINE_integer("rounds", 2, "Rounds per session.")
_LENGTH_SCALE = flags.DEFINE_float(
    "length_scale", 1 / 64, "workload.length_scale (0: the config's own)."
)
_MAX_QUEUE = flags.DEFINE_integer("max_queue", 0, "scheduler.max_queue (0: the config's).")
_TIMEOUT = flags.DEFINE_float("timeout", 900.0, "Bound on the whole replay (s).")
_RSS_INTERVAL = flags.DEFINE_float("rss_interval", 0.5, "RSS sampling period (s).")
_LOG_COMPILES = flags.DEFINE_bool(
    "log_compiles", False, "Engines log every XLA compile (JAX_LOG_COMPILES=1; see their logs)."
)
_WORKDIR = flags.DEFINE_string("workdir", "/tmp/dp_overload", "Output directory (emptied first).")


def overload_config() -> ExperimentConfig:
    cfg = load_config(_CONFIG.value)
    w = dataclasses.replace(
        cfg.workload,
        agents=_SESSIONS.value,
        trajectories=_SESSIONS.value,
        mode="offline",
        max_turns=_ROUNDS.value,
        **({"length_scale": _LENGTH_SCALE.value} if _LENGTH_SCALE.value else {}),
    )
    cfg = dataclasses.replace(cfg, name=f"{cfg.name}_overload", workload=w)
    if _MAX_QUEUE.value:
        cfg = dataclasses.replace(
            cfg, scheduler=dataclasses.replace(cfg.scheduler, max_queue=_MAX_QUEUE.value)
        )
    return apply_overrides(cfg, _SET.value)


def session_trajectories(cfg: ExperimentConfig, n: int, rounds: int) -> list[Trajectory]:
    """`n` trajectories of the configured workload with exactly `results` rounds (shorter ones
    are skipped; more agents are drawn until there are `n`)."""
    agents = n
    while True:
        w = dataclasses.replace(cfg.workload, agents=agents, trajectories=agents)
        trajs, _ = build_trajectories(dataclasses.replace(cfg, workload=w))
        keep = [t for t in trajs if len(t.rounds) >= rounds][:n]
        if len(keep) == n:
            break
        agents = int(agents * 1.5) + 1
    check_fits(cfg, keep)
    return [  # every round right after the previous one: the gaps would only spread the load
        Trajectory(f"s{k}-{t.id}", tuple(Round(r.append, r.gen) for r in t.rounds[:rounds]))
        for k, t in enumerate(keep)
    ]


def reference_tokens(cfg: ExperimentConfig, trajs: Sequence[Trajectory]) -> list[list[list[int]]]:
    """Greedy tokens of every round from the monolithic reference model (no KV cache) on the
    full context, with the engines' parameters (`init_model(model, cfg.seed)`)."""
    from dualpath_jax.model.generation import reference_rounds
    from dualpath_jax.model.runner import ModelRunner
    from dualpath_jax.model.transformer import init_model

    if cfg.cluster.params_path:
        raise app.UsageError("the overload bench checks tokens against init_model: no params_path")
    runner = ModelRunner(init_model(cfg.model, seed=cfg.seed))
    return [reference_rounds(runner, [(r.append, r.gen) for r in t.rounds]) for t in trajs]


class Recorder(Backend):
    """A `Client` seen through the Backend contract, remembering each session's RolloutError
    kind (run_trajectories keeps only the message) and the rounds still unanswered."""

    def __init__(self, client: Client):
        self.client = client
        self.kinds: dict[str, str] = {}
        self.pending: dict[str, str] = {}  # request -> session
        self._lock = threading.Lock()

    def open_session(self, session: str, resume: bool = False) -> None:
        try:
            self.client.open_session(session, resume)
        except RolloutError as e:
            self.kinds.setdefault(session, e.kind)
            raise

    def submit(self, session, append, gen, **kw) -> futures.Future:
        fut = self.client.submit(session, append, gen, **kw)
        with self._lock:
            self.pending[fut.request] = session

        def done(f: futures.Future) -> None:
            with self._lock:
                self.pending.pop(f.request, None)
            e = f.exception()
            if e is not None:
                self.kinds.setdefault(session, getattr(e, "kind", type(e).__name__))

        fut.add_done_callback(done)
        return fut

    def close_session(self, session: str, release: bool = False) -> None:
        self.client.close_session(session, release)

    def cancel(self, request: str) -> None:
        self.client.cancel(request)


class RssSampler(threading.Thread):
    """Samples VmRSS of every cluster process (and this one) every `interval` s."""

    def __init__(self, cluster: LocalCluster, interval: float):
        super().__init__(name="rss", daemon=True)
        self.cluster, self.interval = cluster, interval
        self.peak_kb: dict[str, int] = collections.defaultdict(int)
        self.samples = 0
        self.timeline: list[dict] = []  # {"t": s since start, name: kB, ...} per sample
        self.t0 = time.monotonic()
        self.stop = threading.Event()

    @staticmethod
    def status_kb(pid: int | str, field: str) -> int | None:
        try:
            for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith(field + ":"):
                    return int(line.split()[1])
        except (OSError, ValueError, IndexError):
            pass
        return None

    def procs(self) -> dict[str, int | str]:
        return {**{n: p.pid for n, p in list(self.cluster.procs.items())}, "bench": "self"}

    def sample(self) -> None:
        row: dict = {"t": round(time.monotonic() - self.t0, 2)}
        for name, pid in self.procs().items():
            kb = self.status_kb(pid, "VmRSS")
            if kb is not None:
                self.peak_kb[name] = max(self.peak_kb[name], kb)
                row[name] = kb
        self.timeline.append(row)
        self.samples += 1

    def quartiles_mib(self) -> dict[str, list[float]]:
        """Each process's RSS (MiB) at 0, 25, 50, 75 and 100 % of the sampled time."""
        rows = self.timeline
        if not rows:
            return {}
        at = [rows[min(len(rows) - 1, round(q * (len(rows) - 1)))] for q in (0, 0.25, 0.5, 0.75, 1)]
        names = sorted({k for r in rows for k in r if k != "t"})
        return {n: [round(r.get(n, 0) / 1024, 1) for r in at] for n in names}

    def run(self) -> None:
        while not self.stop.is_set():
            self.sample()
            self.stop.wait(self.interval)

    def hwm_kb(self) -> dict[str, int | None]:
        return {name: self.status_kb(pid, "VmHWM") for name, pid in self.procs().items()}


def pct(values: Sequence[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)), 3) if values else None


def main(argv):
    del argv
    cfg = overload_config()
    wd = pathlib.Path(_WORKDIR.value).absolute()
    if wd.exists() and any(wd.iterdir()):
        if not (wd / "config.json").exists():
            raise app.UsageError(f"{wd} is not empty and not a cluster workdir; not emptying it")
        shutil.rmtree(wd)
    wd.mkdir(parents=True, exist_ok=True)
    trajs = session_trajectories(cfg, _SESSIONS.value, _ROUNDS.value)
    t_ref = time.monotonic()
    expected = reference_tokens(cfg, trajs)
    ref_s = time.monotonic() - t_ref
    lens = [sum(r.append_len + r.gen for r in t.rounds) for t in trajs]
    print(
        f"{len(trajs)} sessions x {_ROUNDS.value} rounds, {np.mean(lens):.0f} tokens each on "
        f"average (max {max(lens)}); reference tokens in {ref_s:.1f} s",
        flush=True,
    )

    load_before = os.getloadavg()
    t_start = time.monotonic()
    env = {**os.environ, "JAX_LOG_COMPILES": "1"} if _LOG_COMPILES.value else None
    with LocalCluster(cfg, wd, env=env) as cluster:
        start_s = time.monotonic() - t_start
        client = cluster.client(dead_after_s=30.0)
        rec = Recorder(client)
        rss = RssSampler(cluster, _RSS_INTERVAL.value)
        rss.start()
        t0 = time.monotonic()
        try:
            outs = run_trajectories(
                rec, trajs, max_concurrent=0, timeout_s=_TIMEOUT.value, progress=False
            )
        finally:
            run_s = time.monotonic() - t0
            rss.stop.set()
            rss.join(5)
        rss.sample()
        hwm = rss.hwm_kb()
        time.sleep(1.0)  # the router's last events reach the log
        stats = client.stats()
        pending = dict(rec.pending)
        for request in pending:
            client.cancel(request)

    events = read_events(wd / "events.jsonl")
    failed = [e for e in events if e["kind"] == "failed"]
    transfer_failures = [e for e in failed if e.get("failure") == "transfer"]
    transfer_timeouts = [e for e in transfer_failures if "Timeout" in e.get("message", "")]

    status: collections.Counter[str] = collections.Counter()
    kinds: collections.Counter[str] = collections.Counter()
    wrong, hung, rows, jct, queue = [], [], [], [], []
    for t, out, exp in zip(trajs, outs, expected, strict=True):
        tid = t.id
        kind = rec.kinds.get(tid, "")
        if len(out.rounds) == len(t.rounds) and not out.error:
            st = "completed"
        elif out.error.startswith("timed out after") or tid in pending.values():
            st = "hung"
        elif kind == "overloaded":
            st = "overloaded"
        else:
            st = "errored"
            kinds[kind or "unknown"] += 1
        status[st] += 1
        for i, toks in enumerate(out.rounds):
            if toks != exp[i]:
                wrong.append({"session": tid, "round": i, "got": toks, "expected": exp[i]})
        for r in out.results:
            jct.append(r.jct_s)
            queue.append(r.queue_s)
        if st == "hung":
            hung.append({"session": tid, "rounds_done": len(out.rounds), "error": out.error})
        rows.append(
            {
                "session": tid,
                "status": st,
                "kind": kind,
                "error": out.error[:300],
                "rounds_done": len(out.rounds),
                "jct_s": [round(r.jct_s, 3) for r in out.results],
                "queue_s": [round(r.queue_s, 3) for r in out.results],
                "read_path": [r.read_path for r in out.results],
                "persist_error": [r.persist_error for r in out.results if r.persist_error],
            }
        )
    with open(wd / "rss.jsonl", "w") as f:
        for row in rss.timeline:
            f.write(json.dumps(row) + "\n")
    with open(wd / "outputs.jsonl", "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")

    counters = stats["counters"]
    wrong_sessions = {w["session"] for w in wrong}
    failures = []
    if hung:
        failures.append(f"{len(hung)} sessions hung")
    if wrong:
        failures.append(f"{len(wrong)} rounds differ from the reference")
    if transfer_failures:
        failures.append(
            f"{len(transfer_failures)} transfer failures ({len(transfer_timeouts)} timeouts)"
        )
    queued = stats.get("queued")
    queued_total = sum(queued.values()) if isinstance(queued, dict) else int(queued or 0)
    if stats.get("in_flight") or queued_total:
        failures.append(f"the router still holds {stats.get('in_flight')} rounds ({queued} queued)")
    summary = {
        "config": _CONFIG.value,
        "sets": _SET.value,
        "sessions": len(trajs),
        "rounds_per_session": _ROUNDS.value,
        "length_scale": cfg.workload.length_scale,
        "max_queue": cfg.scheduler.max_queue,
        "decode_slots": cfg.cluster.decode_slots,
        "decode_queue": cfg.cluster.decode_queue,
        "tokens_per_session_mean": round(float(np.mean(lens)), 1),
        "completed": status["completed"],
        "completed_with_reference_tokens": sum(
            r["status"] == "completed" and r["session"] not in wrong_sessions for r in rows
        ),
        "overloaded": status["overloaded"],
        "overloaded_at_round": dict(
            collections.Counter(r["rounds_done"] for r in rows if r["status"] == "overloaded")
        ),
        "errored": status["errored"],
        "error_kinds": dict(kinds),
        "hung": status["hung"],
        "hung_sessions": hung[:20],
        "different": wrong[:20],
        "rounds_answered": sum(r["rounds_done"] for r in rows),
        "router_counters": counters,
        "router_in_flight_at_end": stats.get("in_flight"),
        "router_queued_at_end": stats.get("queued"),
        "failed_events": len(failed),
        "failed_by_failure": dict(collections.Counter(e.get("failure") for e in failed)),
        "transfer_failures": len(transfer_failures),
        "transfer_timeouts": len(transfer_timeouts),
        "peak_rss_mib": {k: round(v / 1024, 1) for k, v in sorted(rss.peak_kb.items())},
        "vm_hwm_mib": {k: (round(v / 1024, 1) if v else None) for k, v in sorted(hwm.items())},
        "rss_samples": rss.samples,
        "rss_mib_at_0_25_50_75_100pct": rss.quartiles_mib(),
        "jct_s": {"p50": pct(jct, 50), "p90": pct(jct, 90), "max": pct(jct, 100)},
        "queue_s": {"p50": pct(queue, 50), "p90": pct(queue, 90), "max": pct(queue, 100)},
        "times_s": {
            "reference": round(ref_s, 1),
            "cluster_start": round(start_s, 1),
            "replay": round(run_s, 1),
        },
        "load_average": {
            "before": [round(x, 2) for x in load_before],
            "after": [round(x, 2) for x in os.getloadavg()],
            "cpus": os.cpu_count(),
        },
        "failures": failures,
    }
    (wd / "summary.json").write_text(json.dumps(summary, indent=1))
    print_summary(summary)
    print(f"summary: {wd / 'summary.json'}")
    return 1 if failures else 0


def print_summary(s: dict) -> None:
    print(
        f"\n{s['sessions']} sessions x {s['rounds_per_session']} rounds (max_queue "
        f"{s['max_queue']}, length_scale {s['length_scale']:g}) in {s['times_s']['replay']} s: "
        f"completed {s['completed']} ({s['completed_with_reference_tokens']} with the reference "
        f"tokens), overloaded {s['overloaded']} {s['overloaded_at_round']}, errored "
        f"{s['errored']} {s['error_kinds']}, hung {s['hung']}"
    )
    c = s["router_counters"]
    keys = ("requests_done", "overloaded", "requeued", "failed", "errors", "engine_deaths")
    print("router: " + ", ".join(f"{k} {c.get(k)}" for k in keys))
    print(
        f"failed events {s['failed_events']} {s['failed_by_failure']}; transfer timeouts "
        f"{s['transfer_timeouts']}"
    )
    print(f"peak RSS (MiB, sampled): {s['peak_rss_mib']}; VmHWM: {s['vm_hwm_mib']}")
    print(f"RSS (MiB) at 0/25/50/75/100 % of the replay: {s['rss_mib_at_0_25_50_75_100pct']}")
    print(f"JCT per round (s): {s['jct_s']}; queueing (s): {s['queue_s']}")
    la = s["load_average"]
    print(
        f"load average (1, 5, 15 min) before {la['before']}, after {la['after']} ({la['cpus']} CPUs)"
    )
    for f in s["failures"]:
        print(f"FAILURE: {f}")


def _run(argv) -> None:
    try:
        code = main(argv)
    except KeyboardInterrupt:  # the cluster's processes were stopped on the way out
        print("interrupted; every cluster process was stopped", file=sys.stderr)
        code = 130
    sys.exit(code)


if __name__ == "__main__":
    app.run(_run)
