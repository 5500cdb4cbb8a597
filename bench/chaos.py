"""Chaos on a local cluster: trajectories run while faults are injected at random (seeded).

Run:
  python bench/chaos.py --trajectories=12 --rounds=3 --workdir=/tmp/dp_chaos
  python bench/chaos.py --prefill=2 --decode=1 --faults=kill,transfer_hang --seed=3

The default cluster is the tiny-Qwen2 1P2D of tests/integration (16-token blocks, DualPath
policy) with small timeouts, so that every fault resolves in seconds: heartbeat_timeout_s=8 (an
engine silent that long is declared dead and its rounds requeued), transfer_timeout_s=3 (a hung
pull fails as a transfer error and is retried), max_attempts=4, no_engine_timeout_s=90 (covers a
restart of the only engine of a role). `--config` takes an experiment file instead; the same
timeouts and the fault file are then set on it (`--set` overrides everything).

First as many other trajectories run without faults (`--warmup`): the engines compile their
batch shapes there, since a compile on this 2-core host can outlast transfer_timeout_s and would
show up as transfer timeouts nobody injected. Then `--trajectories` trajectories of `--rounds`
rounds run, all at once (one thread each, pausing up to `--think` s before each later round),
while a chaos thread sleeps an exponential time of mean `--fault_interval` s and injects the next
fault of `--faults` (in passes that hold each type once, in a seeded random order):

  kill           kills an engine process (`LocalCluster.kill`) and restarts it at once
                 (`restart`, on a thread of its own while other faults go on), so no role is
                 left without a live engine for longer than a restart; one engine down at a time
  store_write    ENOSPC or EROFS on block writes (DE persists): rounds still answer, with
                 `RoundResult.persist_error`
  store_read     EIO on block reads: the round fails with kind `store` (not retried)
  slow_read      block reads delayed 0.5-1.5 s (less than transfer_timeout_s)
  transfer_hang  channel.pull hangs until transfer_timeout_s, then fails: the router retries
  garbage        a raw zmq DEALER sends malformed frames, frames with a wrong or no secret and
                 client-signed engine-only messages (Shutdown, Failed for a live round,
                 Heartbeat) to the router's control port; the router must refuse each (answering
                 `Error`) and still answer `GetStats`

The 3 s transfer timeout (`--transfer_timeout`) also bounds each layer a DE waits for while its
PE computes it, so when other processes load the host's cores (load average above the core
count) PE forwards outlast it and rounds fail `transfer` with nothing injected: the summary
splits the engines' `failed` reports into injected and not, and records the load average.

Store and transfer faults are rules of the JSON fault plan `WORKDIR/faults.json`
(`cluster.fault_file`, dualpath_jax/testing/fault_plan.py), written with `os.replace`; each holds
for a 1-3 s window (and at most a few operations per engine) and is then cleared.

Every round's future is waited for at most `--round_timeout` s, and the whole run at most
`--duration` s. A trajectory ends `completed` (every round answered), `errored` (a RolloutError,
by kind; it stops at that round) or `hung` (no answer within the bound). Each answered round's
tokens must equal the reference model's greedy tokens on the full context (computed here, on the
CPU, before the cluster starts); rounds with `persist_error` count as completed and are checked
the same way. After the chaos, one fresh trajectory runs without faults (`post_check`).

Writes WORKDIR/summary.json (counts, error kinds, faults injected by type, faults fired as the
engines logged them, the engines' `failed` reports split into injected and not injected, hung
and differing rounds, router counters, the chaos log) and prints a summary. Exits 1 if
a round hung or differed, the post-chaos trajectory failed, the router stopped answering, or a
killed engine could not be restarted. Every process is ended on exit, Ctrl-C included.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import pathlib
import random
import re
import shutil
import sys
import threading
import time
from collections.abc import Callable
from concurrent import futures

import numpy as np
from absl import app, flags

from dualpath_jax.cluster import Client
from dualpath_jax.config import (
    ClusterConfig,
    ExperimentConfig,
    Policy,
    SchedulerConfig,
    StoreConfig,
    apply_overrides,
)
from dualpath_jax.configs_loader import load_config
from dualpath_jax.presets import TINY_QWEN2
from dualpath_jax.rollout import RolloutError, Session
from dualpath_jax.runtimes.local import LocalCluster
from dualpath_jax.testing.fault_plan import write_plan
from dualpath_jax.wire import frames, messages

FAULTS = ("kill", "store_write", "store_read", "slow_read", "transfer_hang", "garbage")

_TRAJ = flags.DEFINE_integer("trajectories", 12, "Trajectories, all running at once.")
_ROUNDS = flags.DEFINE_integer("rounds", 3, "Rounds per trajectory.")
_CONFIG = flags.DEFINE_string(
    "config", "", "Experiment file (default: the tiny-Qwen2 cluster of tests/integration)."
)
_SET = flags.DEFINE_multi_string("set", [], "Override `section.key=value` (repeatable).")
_PREFILL = flags.DEFINE_integer("prefill", 1, "Prefill engines of the default cluster.")
_DECODE = flags.DEFINE_integer("decode", 2, "Decode engines of the default cluster.")
_SEED = flags.DEFINE_integer("seed", 0, "Seeds the trajectories and the chaos.")
_DURATION = flags.DEFINE_float("duration", 600.0, "Bound on the whole run (s), chaos included.")
_ROUND_TIMEOUT = flags.DEFINE_float("round_timeout", 150.0, "Bound on one round's answer (s).")
_FAULT_INTERVAL = flags.DEFINE_float("fault_interval", 1.5, "Mean seconds between faults.")
_THINK = flags.DEFINE_float(
    "think", 6.0, "A trajectory pauses uniform(0, THINK) s before each later round (tool time)."
)
_FAULT_LIST = flags.DEFINE_list("faults", list(FAULTS), f"Fault types, of {', '.join(FAULTS)}.")
_GEN = flags.DEFINE_list("gen", ["8", "20"], "Tokens generated per round: LOW,HIGH (exclusive).")
_TRANSFER_TIMEOUT = flags.DEFINE_float(
    "transfer_timeout", 3.0, "cluster.transfer_timeout_s (a hung pull fails after this long)."
)
_HEARTBEAT_TIMEOUT = flags.DEFINE_float(
    "heartbeat_timeout", 8.0, "cluster.heartbeat_timeout_s (a killed engine is dead after this)."
)
_WARMUP = flags.DEFINE_bool(
    "warmup",
    True,
    "First run as many other trajectories without faults (the engines compile their shapes).",
)
_WORKDIR = flags.DEFINE_string("workdir", "/tmp/dp_chaos", "Output directory (emptied first).")

BLOCK_TOKENS = 16

Trajectory = tuple[str, list[tuple[list[int], int]]]


def default_config(prefill: int, decode: int) -> ExperimentConfig:
    """tests/integration's `cluster_config`: tiny Qwen2, 16-token blocks, DualPath."""
    return ExperimentConfig(
        name=f"chaos_{prefill}p{decode}d",
        model=TINY_QWEN2,
        cluster=ClusterConfig(prefill_nodes=prefill, decode_nodes=decode, decode_max_len=1024),
        store=StoreConfig(block_tokens=BLOCK_TOKENS),
        scheduler=SchedulerConfig(policy=Policy("dualpath")),
    )


def chaos_config(
    cfg: ExperimentConfig,
    fault_file: pathlib.Path,
    transfer_timeout_s: float = 3.0,
    heartbeat_timeout_s: float = 8.0,
) -> ExperimentConfig:
    """Small timeouts, so that faults resolve in seconds, and the fault plan file."""
    cluster = dataclasses.replace(
        cfg.cluster,
        heartbeat_timeout_s=heartbeat_timeout_s,
        transfer_timeout_s=transfer_timeout_s,
        max_attempts=4,
        no_engine_timeout_s=90.0,
        fault_file=str(fault_file),
    )
    store = dataclasses.replace(cfg.store, timeout_s=10.0)
    return dataclasses.replace(cfg, cluster=cluster, store=store)


def make_trajectories(n: int, rounds: int, seed: int, vocab: int, gen: tuple[int, int]):
    """As tests/integration: a first append of 33-47 tokens, later ones of 16-31 (at least a
    block, so every later round hits the blocks its earlier rounds persisted)."""
    rs = np.random.RandomState(seed)
    out: list[Trajectory] = []
    for k in range(n):
        rr = []
        for i in range(rounds):
            append = int(rs.randint(33, 48) if i == 0 else rs.randint(BLOCK_TOKENS, 32))
            rr.append((rs.randint(0, vocab, append).tolist(), int(rs.randint(*gen))))
        out.append((f"chaos{seed}-{k}", rr))
    return out


def reference_tokens(cfg: ExperimentConfig, trajs: list[Trajectory]) -> list[list[list[int]]]:
    """Greedy tokens of every round from the monolithic reference model (no KV cache) on the
    full context, with the engines' parameters (`init_model(model, cfg.seed)`)."""
    from dualpath_jax.model.generation import reference_rounds
    from dualpath_jax.model.runner import ModelRunner
    from dualpath_jax.model.transformer import init_model

    if cfg.cluster.params_path:
        raise app.UsageError("the chaos bench checks tokens against init_model: no params_path")
    runner = ModelRunner(init_model(cfg.model, seed=cfg.seed))
    return [reference_rounds(runner, rounds) for _, rounds in trajs]


# ----------------------------------------------------------------------------- trajectories


@dataclasses.dataclass
class TrajRecord:
    id: str
    status: str = "running"  # completed | errored | hung
    kind: str = ""  # errored: the RolloutError kind
    error: str = ""
    rounds_done: int = 0
    persist_errors: int = 0
    different: list[dict] = dataclasses.field(default_factory=list)


def run_trajectory(
    client: Client,
    traj: Trajectory,
    expected: list[list[int]],
    rec: TrajRecord,
    round_timeout: float,
    deadline: float,
    think: float = 0.0,
) -> None:
    """Runs one trajectory's rounds in order, each waited for at most `round_timeout` (and not
    past `deadline`); fills `rec`."""
    tid, rounds = traj
    try:
        session = Session(client, tid)
    except RolloutError as e:
        rec.status, rec.kind, rec.error = "errored", e.kind, f"open_session: {e}"
        return
    except futures.TimeoutError:
        rec.status, rec.error = "hung", "open_session: no answer"
        return
    rng = random.Random(tid)
    for i, (append, gen) in enumerate(rounds):
        if i and think:
            time.sleep(rng.uniform(0, think))
        fut = session.step_async(append, gen)
        bound = max(0.0, min(round_timeout, deadline - time.monotonic()))
        try:
            res = fut.result(bound)
        except futures.TimeoutError:
            rec.status, rec.error = "hung", f"round {i}: no answer within {bound:.0f} s"
            client.cancel(fut.request)
            return
        except RolloutError as e:
            rec.status, rec.kind, rec.error = "errored", e.kind, f"round {i}: {e}"
            return
        tokens = list(res.tokens)
        if tokens != expected[i]:
            rec.different.append(
                {"round": i, "got": tokens, "expected": expected[i], "read_path": res.read_path}
            )
        rec.rounds_done += 1
        rec.persist_errors += bool(res.persist_error)
    rec.status = "completed"


# ----------------------------------------------------------------------------- faults


class FaultPlanFile:
    """The fault plan file the engines re-read; one rule (or none) at a time."""

    def __init__(self, path: pathlib.Path):
        self.path = path
        self.version = 0
        self.write([])

    def write(self, rules: list[dict]) -> None:
        self.version += 1
        write_plan(self.path, rules, seed=self.version)


def send_garbage(cluster: LocalCluster, rng: random.Random, live_request: str) -> dict:
    """Sends bad frames to the router's control port from a raw DEALER; returns what came back
    and whether the router still answers a real client's GetStats."""
    import zmq

    client_secret = cluster.credentials.client
    valid = frames.encode(messages.Ping(), client_secret)
    bad: list[tuple[str, list[bytes]]] = []
    for _ in range(rng.randint(3, 8)):
        bad.append(("random", [rng.randbytes(rng.randint(1, 2048))]))
    bad += [
        ("empty", [b""]),
        ("truncated", [valid[: len(valid) // 2]]),
        ("msgpack_not_envelope", [b"\x93\x01\xa3abc\xc0"]),
        ("wrong_version", [valid.replace(b"\x01", b"\x07", 1)]),
        ("no_secret", [frames.encode(messages.GetStats(), "")]),
        ("wrong_secret", [frames.encode(messages.GetStats(), "not-the-secret")]),
        ("client_shutdown", [frames.encode(messages.Shutdown(), client_secret)]),
        ("client_heartbeat", [frames.encode(messages.Heartbeat(engine=0), client_secret)]),
        (
            "client_failed",
            [
                frames.encode(
                    messages.Failed(request=live_request or "x#0", engine=0, message="forged"),
                    client_secret,
                )
            ],
        ),
        ("multipart", [b"", rng.randbytes(64)]),
    ]
    rng.shuffle(bad)
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(cluster.address)
    replies: collections.Counter[str] = collections.Counter()
    try:
        for _, parts in bad:
            sock.send_multipart(parts)
        end = time.monotonic() + 3.0
        while time.monotonic() < end and sum(replies.values()) < len(bad):
            if not sock.poll(100):
                continue
            frame = sock.recv()
            err = frames.decode_unsigned_error(frame)
            if err is not None:
                replies[f"error:{err.kind}"] += 1
                continue
            try:  # the client-signed messages are refused with an answer signed for clients
                msg = frames.decode(frame, client_secret)
                replies[f"{type(msg).__name__}:{getattr(msg, 'kind', '')}"] += 1
            except frames.FrameError:
                replies["undecodable"] += 1
    finally:
        sock.close(0)
    t0 = time.monotonic()
    probe = cluster.client()
    try:
        probe.stats(timeout_s=20)
        answered, stats_s = True, time.monotonic() - t0
    except (RolloutError, futures.TimeoutError):
        answered, stats_s = False, None
    finally:
        probe.close()
    return {
        "sent": collections.Counter(k for k, _ in bad),
        "replies": dict(replies),
        "router_answered": answered,
        "stats_s": stats_s,
    }


class Chaos(threading.Thread):
    """Injects one fault every exponential(`interval`) seconds until `stop` is set; the types
    come in passes that hold each of `kinds` once, in a random order."""

    def __init__(
        self,
        cluster: LocalCluster,
        plan: FaultPlanFile,
        kinds: list[str],
        interval: float,
        seed: int,
        stop: threading.Event,
        t0: float,
        live_request,
    ):
        super().__init__(name="chaos", daemon=True)
        self.cluster, self.plan, self.kinds, self.interval = cluster, plan, kinds, interval
        self.rng = random.Random(seed)
        self.stop, self.t0, self.live_request = stop, t0, live_request
        self.log: list[dict] = []
        self.injected: collections.Counter[str] = collections.Counter()
        self.problems: list[str] = []
        self.restarting: threading.Thread | None = None

    def note(self, kind: str, **detail) -> None:
        entry = {"t": round(time.monotonic() - self.t0, 2), "fault": kind, **detail}
        self.log.append(entry)
        print(f"[chaos] {json.dumps(entry)}", flush=True)

    def run(self) -> None:
        try:
            deck: list[str] = []
            while not self.stop.wait(self.rng.expovariate(1.0 / self.interval)):
                if not deck:  # every type once per pass, in a random order
                    deck = self.rng.sample(self.kinds, len(self.kinds))
                kind = deck.pop()
                try:
                    if getattr(self, f"do_{kind}")() is not False:
                        self.injected[kind] += 1
                except Exception as e:  # noqa: BLE001 - recorded; the chaos goes on
                    self.injected[kind] += 1
                    self.problems.append(f"{kind}: {type(e).__name__}: {e}")
                    self.note(kind, problem=str(e))
        finally:
            self.plan.write([])
            if self.restarting is not None:  # the cluster is whole again before we return
                self.restarting.join(150)

    def engines(self) -> list[str]:
        return sorted(self.cluster.engine_ids)

    def some_engines(self) -> list[str] | None:
        """None (every engine) half of the time, else a random non-empty subset."""
        if self.rng.random() < 0.5:
            return None
        names = self.engines()
        return sorted(self.rng.sample(names, self.rng.randint(1, len(names))))

    def window(self, rule: dict, **detail) -> None:
        engines = self.some_engines()
        if engines is not None:
            rule["engines"] = engines
        hold = self.rng.uniform(1.0, 3.0)
        self.note(rule["op"], rule=rule, hold_s=round(hold, 2), **detail)
        self.plan.write([rule])
        self.stop.wait(hold)
        self.plan.write([])

    def do_kill(self) -> bool:
        """Kills a random engine; a thread of its own restarts it (other faults go on
        meanwhile). One engine is down at a time: while a restart runs, no kill."""
        if self.restarting is not None and self.restarting.is_alive():
            return False
        name = self.rng.choice(self.engines())
        pid = self.cluster.procs[name].pid
        t = time.monotonic()
        self.cluster.kill(name)
        self.note("kill", engine=name, pid=pid)

        def restart() -> None:
            try:
                self.cluster.restart(name, timeout_s=120)
            except Exception as e:  # noqa: BLE001 - recorded
                self.problems.append(f"restart {name}: {type(e).__name__}: {e}")
                self.note("restart", engine=name, problem=str(e))
                return
            self.note(
                "restart",
                engine=name,
                pid=self.cluster.procs[name].pid,
                down_s=round(time.monotonic() - t, 1),
            )

        self.restarting = threading.Thread(target=restart, name=f"restart-{name}", daemon=True)
        self.restarting.start()
        return True

    def do_store_write(self) -> None:
        error = self.rng.choice(["ENOSPC", "EROFS"])
        self.window({"op": "store.write", "error": error, "count": self.rng.randint(1, 3)})

    def do_store_read(self) -> None:
        self.window({"op": "store.read", "error": "EIO", "count": 1})

    def do_slow_read(self) -> None:
        self.window({"op": "store.read", "delay_s": round(self.rng.uniform(0.5, 1.5), 2)})

    def do_transfer_hang(self) -> None:
        self.window({"op": "channel.pull", "hang": True, "count": self.rng.randint(1, 2)})

    def do_garbage(self) -> None:
        got = send_garbage(self.cluster, self.rng, self.live_request())
        if not got["router_answered"]:
            self.problems.append("garbage: the router stopped answering GetStats")
        accepted = {k: v for k, v in got["replies"].items() if not k.lower().startswith("error")}
        if accepted:
            self.problems.append(f"garbage: the router answered bad frames with {accepted}")
        self.note("garbage", **got)


def fired_faults(workdir: pathlib.Path) -> dict[str, int]:
    """Faults the engines logged as fired: each rule's first fault per plan version and engine
    (dualpath_jax.testing.fault_plan logs only those), as "op what" -> engines that logged it."""
    pat = re.compile(
        r"dualpath_jax\.testing\.fault_plan: injected (.+?) into (\S+) \(rule \d+\) for "
    )
    out: collections.Counter[str] = collections.Counter()
    for log in (workdir / "logs").glob("*.log"):
        for m in pat.finditer(log.read_text(errors="replace")):
            out[f"{m.group(2)} {m.group(1)}"] += 1
    return dict(sorted(out.items()))


# ----------------------------------------------------------------------------- main


def run_concurrently(
    client: Client,
    trajs: list[Trajectory],
    expected: list[list[list[int]]],
    round_timeout: float,
    deadline: float,
    think: float,
    started: Callable[[], None] = lambda: None,
) -> list[TrajRecord]:
    """Runs every trajectory at once, one thread each (`started()` once they are going), until
    all are done or `deadline`; a trajectory still running then is `hung`."""
    recs = [TrajRecord(tid) for tid, _ in trajs]
    threads = [
        threading.Thread(
            target=run_trajectory,
            args=(client, trajs[k], expected[k], recs[k], round_timeout, deadline, think),
            name=f"traj-{trajs[k][0]}",
            daemon=True,
        )
        for k in range(len(trajs))
    ]
    for t in threads:
        t.start()
    started()
    for t in threads:
        while t.is_alive() and time.monotonic() < deadline + 5:
            t.join(0.5)
    for r in recs:
        if r.status == "running":
            r.status, r.error = "hung", "no answer before the deadline"
    return recs


def main(argv):
    del argv
    kinds = _FAULT_LIST.value
    unknown = sorted(set(kinds) - set(FAULTS))
    if unknown:
        raise app.UsageError(f"unknown fault types {unknown}; choose from {', '.join(FAULTS)}")
    gen = tuple(int(g) for g in _GEN.value)
    wd = pathlib.Path(_WORKDIR.value).absolute()
    if wd.exists() and any(wd.iterdir()):
        if not (wd / "config.json").exists():
            raise app.UsageError(f"{wd} is not empty and not a cluster workdir; not emptying it")
        shutil.rmtree(wd)
    wd.mkdir(parents=True, exist_ok=True)
    if _CONFIG.value:
        base = load_config(_CONFIG.value)
    else:
        base = default_config(_PREFILL.value, _DECODE.value)
    cfg = chaos_config(base, wd / "faults.json", _TRANSFER_TIMEOUT.value, _HEARTBEAT_TIMEOUT.value)
    cfg = apply_overrides(cfg, _SET.value)
    load_before = os.getloadavg()
    plan = FaultPlanFile(pathlib.Path(cfg.cluster.fault_file))
    n, rounds, seed, vocab = _TRAJ.value, _ROUNDS.value, _SEED.value, cfg.model.vocab_size
    trajs = make_trajectories(n, rounds, seed, vocab, gen)
    post = [(f"post{seed}", make_trajectories(1, rounds, seed + 10_000, vocab, gen)[0][1])]
    warm = make_trajectories(n if _WARMUP.value else 0, rounds, seed + 20_000, vocab, gen)
    warm = [(f"warmup-{tid}", r) for tid, r in warm]

    t_ref = time.monotonic()
    expected = reference_tokens(cfg, trajs + post + warm)
    ref_s = time.monotonic() - t_ref
    print(f"reference tokens: {len(expected)} trajectories in {ref_s:.1f} s", flush=True)
    post_expected = expected[n : n + 1]
    warm_expected = expected[n + 1 :]
    expected = expected[:n]

    stop = threading.Event()
    chaos = None
    summary: dict = {}
    t_start = time.monotonic()
    try:
        with LocalCluster(cfg, wd) as cluster:
            start_s = time.monotonic() - t_start
            print(f"cluster up in {start_s:.1f} s: {sorted(cluster.engine_ids)}", flush=True)
            client = cluster.client(dead_after_s=15.0)
            # The same concurrency without faults first: the engines compile their batch shapes
            # here, not while the chaos runs (a compile can outlast transfer_timeout_s).
            t_warm = time.monotonic()
            warm_recs = run_concurrently(
                client,
                warm,
                warm_expected,
                _ROUND_TIMEOUT.value,
                t_warm + _DURATION.value,
                _THINK.value,
            )
            warm_s = time.monotonic() - t_warm
            warm_stats = client.stats()["counters"]
            if warm:
                done = sum(r.status == "completed" for r in warm_recs)
                print(f"warmup: {done}/{len(warm)} trajectories completed in {warm_s:.1f} s")

            def live_request() -> str:
                try:
                    events = (wd / "events.jsonl").read_text().splitlines()
                    sub = [json.loads(x) for x in events[-50:] if '"submit"' in x]
                    return sub[-1]["request"] if sub else ""
                except (OSError, ValueError, KeyError):
                    return ""

            t0 = time.monotonic()
            chaos = Chaos(cluster, plan, kinds, _FAULT_INTERVAL.value, seed, stop, t0, live_request)
            recs = run_concurrently(
                client,
                trajs,
                expected,
                _ROUND_TIMEOUT.value,
                t0 + _DURATION.value,
                _THINK.value,
                started=chaos.start,
            )
            stop.set()
            chaos.join(180)
            run_s = time.monotonic() - t0
            plan.write([])
            time.sleep(0.5)  # the engines see the empty plan before the post-chaos trajectory

            (post_rec,) = run_concurrently(
                client,
                post,
                post_expected,
                _ROUND_TIMEOUT.value,
                time.monotonic() + _ROUND_TIMEOUT.value,
                0.0,
            )
            try:
                stats = client.stats()
            except (RolloutError, futures.TimeoutError) as e:
                stats = {"error": str(e)}
            summary = build_summary(
                cfg,
                wd,
                recs,
                chaos,
                post_rec,
                stats,
                run_s=run_s,
                start_s=start_s,
                ref_s=ref_s,
                warmup_s=warm_s,
            )
            summary["load_average"] = {
                "before": [round(x, 2) for x in load_before],
                "after": [round(x, 2) for x in os.getloadavg()],
                "cpus": os.cpu_count(),
            }
            summary["timeouts_s"] = {
                "transfer": cfg.cluster.transfer_timeout_s,
                "heartbeat": cfg.cluster.heartbeat_timeout_s,
                "max_attempts": cfg.cluster.max_attempts,
                "no_engine": cfg.cluster.no_engine_timeout_s,
                "round": _ROUND_TIMEOUT.value,
            }
            summary["warmup"] = {
                "trajectories": len(warm),
                "status": dict(collections.Counter(r.status for r in warm_recs)),
                "router_counters_after": warm_stats,
            }
            bad = [{"trajectory": r.id, **d} for r in warm_recs for d in r.different]
            summary["different"] += bad
            if bad:
                summary["failures"].append(f"{len(bad)} warmup rounds differ from the reference")
            if any(r.status == "hung" for r in warm_recs):
                summary["failures"].append("a warmup trajectory hung")
    finally:
        stop.set()
        if chaos is not None and chaos.is_alive():
            chaos.join(30)
    if not summary:
        return 1
    (wd / "summary.json").write_text(json.dumps(summary, indent=1))
    print_summary(summary)
    print(f"summary: {wd / 'summary.json'}")
    return 1 if summary["failures"] else 0


def build_summary(cfg, wd, recs, chaos, post_rec, stats, **times) -> dict:
    status = collections.Counter(r.status for r in recs)
    kinds = collections.Counter(r.kind for r in recs if r.status == "errored")
    different = [{"trajectory": r.id, **d} for r in recs + [post_rec] for d in r.different]
    hung = [{"trajectory": r.id, "error": r.error} for r in recs if r.status == "hung"]
    failures = []
    if hung:
        failures.append(f"{len(hung)} trajectories hung")
    if different:
        failures.append(f"{len(different)} rounds differ from the reference")
    if post_rec.status != "completed":
        failures.append(f"the post-chaos trajectory {post_rec.status}: {post_rec.error}")
    failures += [p for p in chaos.problems if p.startswith(("restart", "garbage"))]
    if "error" in stats:
        failures.append(f"the router did not answer GetStats at the end: {stats['error']}")
    garbage = [e for e in chaos.log if e["fault"] == "garbage"]
    failed = collections.Counter()
    path = wd / "events.jsonl"
    for line in path.read_text().splitlines() if path.exists() else []:
        if '"failed"' in line:
            e = json.loads(line)
            if e.get("kind") == "failed":
                how = "injected" if "injected" in e.get("message", "") else "not injected"
                failed[f"{e.get('failure')} ({how})"] += 1
    return {
        "config": cfg.name,
        "engines": {"prefill": cfg.cluster.prefill_nodes, "decode": cfg.cluster.decode_nodes},
        "trajectories": len(recs),
        "rounds_per_trajectory": _ROUNDS.value,
        "seed": _SEED.value,
        "completed": status["completed"],
        "errored": status["errored"],
        "hung": status["hung"],
        "error_kinds": dict(kinds),
        "rounds_completed": sum(r.rounds_done for r in recs),
        "rounds_total": len(recs) * _ROUNDS.value,
        "rounds_with_persist_error": sum(r.persist_errors for r in recs),
        "different": different,
        "hung_trajectories": hung,
        "errors": [
            {"trajectory": r.id, "kind": r.kind, "error": r.error[:300]}
            for r in recs
            if r.status == "errored"
        ],
        "faults_injected": dict(chaos.injected),
        "faults_fired_logged": fired_faults(wd),
        "garbage_frames_sent": sum(sum(g["sent"].values()) for g in garbage),
        "garbage_replies": dict(
            sum((collections.Counter(g["replies"]) for g in garbage), collections.Counter())
        ),
        "chaos_problems": chaos.problems,
        "chaos_log": chaos.log,
        "post_check": dataclasses.asdict(post_rec),
        "router_counters": stats.get("counters", {}),
        "failed_events": dict(failed),
        "engines_alive": {k: v["alive"] for k, v in stats.get("engines", {}).items()},
        "times_s": {k: round(v, 1) for k, v in times.items()},
        "failures": failures,
    }


def print_summary(s: dict) -> None:
    print(
        f"\n{s['trajectories']} trajectories x {s['rounds_per_trajectory']} rounds on "
        f"{s['engines']['prefill']}P{s['engines']['decode']}D (seed {s['seed']}): "
        f"completed {s['completed']}, errored {s['errored']} {s['error_kinds']}, hung {s['hung']}"
    )
    print(
        f"rounds answered {s['rounds_completed']}/{s['rounds_total']} "
        f"({s['rounds_with_persist_error']} with persist_error); "
        f"different from the reference: {len(s['different'])}"
    )
    print(f"faults injected: {s['faults_injected']}")
    print(f"faults fired (first per rule and engine, from the logs): {s['faults_fired_logged']}")
    print(f"garbage frames: {s['garbage_frames_sent']} sent, replies {s['garbage_replies']}")
    c = s["router_counters"]
    keys = ("requests_done", "requeued", "failed", "engine_deaths", "persist_errors", "errors")
    print("router: " + ", ".join(f"{k} {c.get(k)}" for k in keys))
    print(f"failed events (engine reports): {s['failed_events']}")
    print(f"post-chaos trajectory: {s['post_check']['status']}; times {s['times_s']}")
    print(
        f"load average (1, 5, 15 min) before {s['load_average']['before']}, after "
        f"{s['load_average']['after']} on {s['load_average']['cpus']} CPUs"
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
