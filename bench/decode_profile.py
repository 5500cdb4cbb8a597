"""Where a decode step's time goes on the serving path: TPOT and a sampled profile of each process.

Run:
  python bench/decode_profile.py --workdir=bench_out/decode_profile
  python bench/decode_profile.py --workdir=bench_out/decode_profile --http   # via the HTTP server

A 1P1D cluster of the tiny model (`--config`, default `configs/serve.py`) runs with no emulated
link (every `hardware.*_bytes_per_s` set to 0, unlimited, for configs that emulate some, such
as `configs/cpu_1p1d.py:tiny`: docs/emulation.md; `--set` changes more). `--sessions` sessions
stream `--turns` rounds each, all at once, greedy: a first round of `--prompt` random token ids,
then `--append` more per round on top of the context, `--gen` tokens each. Without `--http` the
script starts a `LocalCluster` and streams through its `Client` (`on_tokens`); with `--http` it
starts `launch/api_server.py --nowarmup` and streams `POST /v1/completions`
(bench/serve_multiturn.py's load). The whole load runs once unmeasured (it compiles what the
load runs), once measured, and once more under `py-spy` (`--profile`, the default, when py-spy
is installed: `pip install py-spy`), so the sampler's cost does not enter the measured figures.

TPOT is measured on the client: (last token - first token) / (tokens - 1) of each round, at the
times its tokens arrived; the table gives its median and 90th percentile over the rounds, the
router's own figure (`RoundResult.tpot_s`, the server's `dualpath.tpot_s`: first token to
`DecodeDone`, persistence included), TTFT (submit to first token) and a session's wall time per
token it received (the pass's wall time x sessions / tokens: what a client waiting on its turns
sees, prefills and handoffs included).

The profile: `py-spy record --idle` samples every Python thread of the router, the engines and
the client's (or the server's) process at `--rate` Hz, wall time, waits included. The loop
threads' samples are sorted by what their stack is doing (`RULES`: the decode engine's loop into
the wait for the jitted step's tokens (the step's compute), its dispatch, the per-token host
work of `consume`, messages, fetches, admission, polling; the router's loop by the message it
handles; the client's thread; the server's event loop), as a share of the thread's wall time
and in microseconds per generated token (share x the profiled pass's wall time / its tokens;
with every round decoding, a step yields one token of each). The router's time per message is
its busy time over the messages it handled (`counters.messages`). Writes
WORKDIR/decode_profile.json, the raw profiles (WORKDIR/profile/*.txt, py-spy's collapsed
stacks) and prints the table.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Sequence
from typing import Any

import numpy as np
from absl import app, flags

from dualpath_jax.config.serialize import apply_overrides
from dualpath_jax.configs_loader import load_config

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Every emulated link unlimited (a rate of 0): the host's own overheads alone.
UNTHROTTLED = (
    "hardware.snic_bytes_per_s=0",
    "hardware.cnic_bytes_per_s=0",
    "hardware.h2d_bytes_per_s=0",
    "hardware.d2h_bytes_per_s=0",
    "hardware.dram_bytes_per_s=0",
    "hardware.emulated=false",
)

_CONFIG = flags.DEFINE_string("config", "configs/serve.py", "Experiment file[:ARG].")
_SET = flags.DEFINE_multi_string("set", [], "More `section.key=value` overrides (repeatable).")
_SESSIONS = flags.DEFINE_integer("sessions", 4, "Sessions streaming at once.")
_TURNS = flags.DEFINE_integer("turns", 6, "Rounds per session.")
_GEN = flags.DEFINE_integer("gen", 32, "Tokens generated per round.")
_PROMPT = flags.DEFINE_integer("prompt", 64, "The first round's prompt tokens.")
_APPEND = flags.DEFINE_integer("append", 16, "New tokens each later round appends.")
_HTTP = flags.DEFINE_bool("http", False, "Stream through launch/api_server.py (HTTP, SSE).")
_PROFILE = flags.DEFINE_bool("profile", True, "Profile a third pass with py-spy (if installed).")
_RATE = flags.DEFINE_integer("rate", 200, "py-spy samples per second and thread.")
_WORKDIR = flags.DEFINE_string("workdir", "bench_out/decode_profile", "Output directory.")
_REPEAT = flags.DEFINE_integer(
    "repeat", 1, "Times the measured and the profiled pass each run the load (fresh sessions)."
)
_TIMEOUT = flags.DEFINE_float("timeout_s", 600.0, "Bound on each pass of the load (s).")

Plan = list[tuple[str, list[tuple[list[int], int]]]]  # (session, [(append, gen), ...])


def plan(sessions: int, turns: int, prompt: int, append: int, gen: int, vocab: int, seed: int):
    """Each session's rounds: random ids (`seed`), a `prompt`-token first round, then
    `append` tokens per round; every round generates `gen` tokens."""
    rng = np.random.default_rng(seed)
    tag = uuid.uuid4().hex[:6]
    out: Plan = []
    for s in range(sessions):
        rounds = [
            (rng.integers(0, vocab, prompt if t == 0 else append).tolist(), gen)
            for t in range(turns)
        ]
        out.append((f"s{s}-{tag}", rounds))
    return out


@dataclasses.dataclass
class Rounds:
    """One pass of the load: each round's token arrival times (first, last) and count."""

    sent: list[float]
    first: list[float]
    last: list[float]
    tokens: list[int]
    router_tpot_s: list[float]  # each round's `RoundResult.tpot_s` (the server's `dualpath`)
    wall_s: float

    def __add__(self, other: Rounds) -> Rounds:
        return Rounds(
            *(a + b for a, b in zip(dataclasses.astuple(self)[:-1], dataclasses.astuple(other))),
            self.wall_s + other.wall_s,
        )

    def tpot(self) -> np.ndarray:
        return np.array(
            [(b - a) / (n - 1) for a, b, n in zip(self.first, self.last, self.tokens) if n > 1]
        )

    def summary(self, sessions: int) -> dict[str, float]:
        t = self.tpot()
        return {
            "rounds": len(self.tokens),
            "tokens": int(sum(self.tokens)),
            "wall_s": self.wall_s,
            # a session's wall time per token it got: what a client waiting on it sees
            "session_ms_per_token": self.wall_s * sessions / max(1, sum(self.tokens)) * 1e3,
            "ttft_p50_ms": float(np.median(np.subtract(self.first, self.sent)) * 1e3),
            "tpot_p50_ms": float(np.percentile(t, 50) * 1e3) if len(t) else float("nan"),
            "tpot_p90_ms": float(np.percentile(t, 90) * 1e3) if len(t) else float("nan"),
            "router_tpot_p50_ms": float(np.median(self.router_tpot_s) * 1e3),
        }


def run_client(client: Any, load: Plan, timeout_s: float) -> Rounds:
    """Streams `load` through a `Client`, a thread per session (rounds in order)."""
    sent: list[float] = []
    first: list[float] = []
    last: list[float] = []
    count: list[int] = []
    router: list[float] = []
    lock = threading.Lock()
    errors: list[BaseException] = []

    def session(sid: str, rounds: list[tuple[list[int], int]]) -> None:
        try:
            client.open_session(sid)
            for append, gen in rounds:
                seen: list[float] = []
                n = [0]

                def on_tokens(start: int, tokens: list[int], *_: Any) -> None:
                    seen.append(time.monotonic())
                    n[0] = max(n[0], start + len(tokens))

                t = time.monotonic()
                res = client.submit(sid, append, gen, on_tokens=on_tokens).result(timeout_s)
                if n[0] != len(res.tokens):
                    raise RuntimeError(f"{sid}: streamed {n[0]} tokens of {len(res.tokens)}")
                with lock:
                    sent.append(t)
                    first.append(seen[0])
                    last.append(seen[-1])
                    count.append(len(res.tokens))
                    router.append(res.tpot_s)
            client.close_session(sid)
        except BaseException as e:  # noqa: BLE001 - raised on the main thread
            errors.append(e)

    t0 = time.monotonic()
    threads = [threading.Thread(target=session, args=s, name=f"session-{s[0]}") for s in load]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return Rounds(sent, first, last, count, router, time.monotonic() - t0)


def run_http(url: str, model: str, load: Plan, timeout_s: float) -> Rounds:
    """Streams `load` as `POST /v1/completions` (bench/serve_multiturn.py's `run_load`)."""
    import serve_multiturn  # this directory's

    t0 = time.monotonic()
    res = asyncio.run(
        serve_multiturn.run_load(url, model, load, [0.0] * len(load), timeout_s=timeout_s)
    )
    if res.rounds_failed or res.timed_out:
        raise RuntimeError(f"{res.rounds_failed} rounds failed (errors {res.errors})")
    recs = res.records
    return Rounds(
        [r.sent_s for r in recs],
        [r.first_token_s for r in recs],
        [r.last_token_s for r in recs],
        [r.completion_tokens for r in recs],
        [r.server.get("tpot_s", float("nan")) for r in recs],
        time.monotonic() - t0,
    )


# --------------------------------------------------------------------------- the profile

# Which thread a stack is on: a function of it (name, file) -> the thread's label.
THREADS = (
    ("drive", "core.py", "engine loop"),
    ("serve", "router.py", "router loop"),
    ("_loop", "client.py", "client thread"),
    ("_run_once", "base_events.py", "server event loop"),
)

# What a loop thread's stack is doing: the first rule all of whose functions it holds.
RULES: dict[str, list[tuple[str, tuple[str, ...]]]] = {
    "engine loop": [
        ("prefill: run a batch", ("run_batch",)),  # (a PE's)
        ("wait for the step's tokens", ("consume", "host_value")),
        ("send TokensOut", ("consume", "send")),
        ("consume: per-token host work", ("consume",)),
        ("dispatch the jitted step", ("advance_many",)),
        ("dispatch the jitted step", ("top_logprobs",)),
        ("complete: read blocks to persist", ("complete",)),
        ("fetch: load report", ("fetch",)),
        ("handle router messages", ("handle",)),
        ("wait for messages (poll)", ("pump",)),
        ("send the outbox", ("send",)),
        ("admit, start loads", ("admit",)),
        ("admit, start loads", ("start_waiting",)),
    ],
    "router loop": [
        ("encode + send", ("send",)),
        ("decode frames", ("decode_role",)),
        ("wait for messages (poll)", ("recv",)),
        ("TokensOut", ("on_tokens",)),
        ("Fetch (scheduling)", ("on_fetch",)),
        ("Heartbeat", ("on_heartbeat",)),
        ("DecodeDone", ("on_decode_done",)),
        ("PrefillDone", ("on_prefill_done",)),
        ("Submit", ("on_submit",)),
        ("other messages", ("handle",)),
        ("tick", ("tick",)),
        ("publish KV events", ("publish",)),
    ],
    "client thread": [
        ("token callbacks", ("on_tokens",)),
        ("decode frames", ("decode",)),
        ("wait for messages (poll)", ("recv",)),
        ("send", ("send_frame",)),
    ],
    "server event loop": [
        ("write the stream", ("_send",)),
        ("relay tokens to chunks", ("relay",)),
        ("wait (select)", ("select",)),
    ],
}


def _frame(text: str) -> tuple[str, str]:
    """py-spy's `Class.name (path:line)` -> (name, file name)."""
    name, _, where = text.partition(" (")
    return name.rpartition(".")[2], pathlib.PurePath(where.rstrip(")").split(":")[0]).name


def read_profile(path: pathlib.Path) -> collections.Counter:
    """py-spy's collapsed stacks (`--format raw --threads`: `thread (TID): NAME;frame;...
    count`): (thread name, frames root first as (name, file)) -> samples."""
    out: collections.Counter = collections.Counter()
    for line in path.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        thread, *frames = stack.split(";")
        out[(thread.partition(": ")[2], tuple(_frame(f) for f in frames))] += int(n)
    return out


def thread_of(stack: tuple[tuple[str, str], ...]) -> str:
    for name, file, label in THREADS:
        if (name, file) in stack:
            return label
    return "other threads"


def breakdown(stacks: collections.Counter) -> dict[str, dict[str, float]]:
    """Each loop thread's samples (`THREADS` with `RULES`) as shares by what it did."""
    out: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for (_, stack), n in stacks.items():
        label = thread_of(stack)
        if label in RULES:
            names = {f[0] for f in stack}
            out[label][next((w for w, need in RULES[label] if names >= set(need)), "other")] += n
    return {k: {w: n / sum(v.values()) for w, n in v.most_common()} for k, v in out.items()}


class Sampler:
    """`py-spy record` on each of `pids` ({name: pid}) until `stop()` (SIGINT: it writes its
    collapsed stacks to `out/NAME.txt`)."""

    def __init__(self, pyspy: str, pids: dict[str, int], out: pathlib.Path, rate: int):
        out.mkdir(parents=True, exist_ok=True)
        self.files = {name: out / f"{name}.txt" for name in pids}
        self.procs = {
            name: subprocess.Popen(
                [
                    pyspy,
                    "record",
                    "--pid",
                    str(pid),
                    "--rate",
                    str(rate),
                    "--idle",
                    "--threads",
                    "--function",
                    "--nonblocking",
                    "--format",
                    "raw",
                    "--output",
                    str(self.files[name]),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
            )  # fmt: skip
            for name, pid in pids.items()
        }
        time.sleep(1.0)  # py-spy attaches

    def stop(self) -> dict[str, collections.Counter]:
        for p in self.procs.values():
            p.send_signal(signal.SIGINT)
        out = {}
        for name, p in self.procs.items():
            _, err = p.communicate(timeout=60)
            if not self.files[name].is_file():
                print(f"py-spy on {name} wrote nothing: {err.decode()[-500:]}", flush=True)
                continue
            out[name] = read_profile(self.files[name])
        return out


def children(pid: int) -> list[int]:
    """`pid`'s child processes (Linux)."""
    out = []
    for task in pathlib.Path(f"/proc/{pid}/task").iterdir():
        out += [int(c) for c in (task / "children").read_text().split()]
    return out


def process_name(pid: int) -> str:
    """A cluster process's role from its command line (`python -m dualpath_jax.runtimes
    SPEC CONFIG`: the spec's role and engine)."""
    args = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    for a in args:
        if a.startswith(b'{"role"'):
            spec = json.loads(a)
            return spec["role"] if spec["role"] == "router" else f"{spec['role']}{spec['engine']}"
    return f"pid{pid}"


# --------------------------------------------------------------------------- main


def _idle(what: str) -> bool:
    """A loop thread waiting for work (not a step's tokens: that wait is the step)."""
    return what.startswith("wait for messages") or what == "wait (select)"


def report(passes: dict[str, dict], profile: dict[str, dict], messages: int) -> str:
    """The passes' TPOT, then each loop thread's time by what it did: its share of the
    thread's wall time, and microseconds per generated token (share x the profiled pass's
    wall time / its tokens)."""
    lines = [
        f"{'pass':<10} {'rounds':>6} {'tokens':>6} {'wall s':>7} {'TPOT p50':>9} {'p90':>8}"
        f" {'router p50':>11} {'TTFT p50':>9} {'session/token':>14}"
    ]
    for name, s in passes.items():
        lines.append(
            f"{name:<10} {s['rounds']:>6} {s['tokens']:>6} {s['wall_s']:>7.1f}"
            f" {s['tpot_p50_ms']:>7.2f}ms {s['tpot_p90_ms']:>6.2f}ms"
            f" {s['router_tpot_p50_ms']:>9.2f}ms {s['ttft_p50_ms']:>7.1f}ms"
            f" {s['session_ms_per_token']:>12.2f}ms"
        )
    p = passes.get("profiled")
    if p is None:
        return "\n".join(lines)
    per_token_us = p["wall_s"] / p["tokens"] * 1e6
    for proc, threads in profile.items():
        for thread, what in threads.items():
            busy = 1 - sum(v for w, v in what.items() if _idle(w))
            head = f"{proc} / {thread} (busy {busy:.0%})"
            lines.append(f"\n{head:<38} {'share':>6} {'of busy':>7} {'us/token':>8}")
            for w, share in what.items():
                of_busy = "" if _idle(w) or not busy else f"{share / busy:.1%}"
                lines.append(f"  {w:<36} {share:>6.1%} {of_busy:>7} {share * per_token_us:>8.1f}")
    router = profile.get("router", {}).get("router loop", {})
    busy = 1 - sum(v for w, v in router.items() if _idle(w))
    if messages and "router" in profile:
        lines.append(
            f"\nrouter: {messages} messages, {busy * p['wall_s'] / messages * 1e6:.0f} us busy"
            f" per message, {messages / p['tokens']:.2f} messages per generated token"
        )
    return "\n".join(lines)


def main(argv: Sequence[str]) -> None:
    del argv
    wd = pathlib.Path(_WORKDIR.value).absolute()
    shutil.rmtree(wd, ignore_errors=True)
    wd.mkdir(parents=True)
    overrides = [*UNTHROTTLED, *_SET.value]
    cfg = apply_overrides(load_config(_CONFIG.value), overrides)
    vocab = cfg.model.vocab_size
    shape = (_SESSIONS.value, _TURNS.value, _PROMPT.value, _APPEND.value, _GEN.value, vocab)
    pyspy = shutil.which("py-spy") or str(pathlib.Path(sys.executable).parent / "py-spy")
    profiling = _PROFILE.value and os.access(pyspy, os.X_OK)
    if _PROFILE.value and not profiling:
        print("py-spy not found (pip install py-spy): no profile", flush=True)
    passes: dict[str, dict] = {}
    profile: dict[str, dict] = {}
    messages = [0]

    def run_passes(run, pids: dict[str, int], stats) -> None:
        for k, name in enumerate(("warmup", "measured", "profiled")):
            if name == "profiled" and not profiling:
                break
            sampler = Sampler(pyspy, pids, wd / "profile", _RATE.value) if k == 2 else None
            before = stats()
            rounds = run(plan(*shape, seed=k * 100))
            for r in range(1, _REPEAT.value if k else 1):
                rounds = rounds + run(plan(*shape, seed=k * 100 + r))
            if sampler is not None:
                profile.update({p: breakdown(s) for p, s in sampler.stop().items()})
                messages[0] = stats() - before
            passes[name] = rounds.summary(_SESSIONS.value)
            print(f"{name}: {passes[name]}", flush=True)

    if _HTTP.value:
        import serve_multiturn  # this directory's

        cmd = [
            sys.executable, str(ROOT / "launch" / "api_server.py"), f"--config={_CONFIG.value}",
            "--port=0", f"--workdir={wd / 'server'}", *(f"--set={s}" for s in overrides),
            "--nowarmup",  # (the unmeasured pass compiles what the load runs)
        ]  # fmt: skip
        server = serve_multiturn.ApiServer(cmd, wd / "server")
        try:
            info = asyncio.run(server.wait_ready(_TIMEOUT.value))
            pid = server.proc.pid
            pids = {"server": pid, **{process_name(c): c for c in children(pid)}}

            def stats() -> int:
                return 0  # (the server's client is not this process's)

            run_passes(
                lambda load: run_http(info["url"], info["model"], load, _TIMEOUT.value),
                pids,
                stats,
            )
        finally:
            server.stop()
    else:
        from dualpath_jax.runtimes.local import LocalCluster

        with LocalCluster(cfg, wd / "cluster") as cluster:
            client = cluster.client()
            pids = {"client": os.getpid()}
            pids.update({name: p.pid for name, p in cluster.procs.items()})

            def stats() -> int:
                return int(client.stats()["counters"].get("messages", 0))

            run_passes(lambda load: run_client(client, load, _TIMEOUT.value), pids, stats)
    out = {
        "config": _CONFIG.value,
        "overrides": overrides,
        "via": "http" if _HTTP.value else "client",
        "sessions": _SESSIONS.value,
        "turns": _TURNS.value,
        "gen": _GEN.value,
        "passes": passes,
        "profile_shares": profile,
        "router_messages": messages[0],
    }
    (wd / "decode_profile.json").write_text(json.dumps(out, indent=1))
    print(report(passes, profile, messages[0]), flush=True)


if __name__ == "__main__":
    app.run(main)
