"""Multi-turn agents against the OpenAI-compatible HTTP server, one server per policy.

Run:
  python bench/serve_multiturn.py --config=configs/cpu_1p2d.py --policies=basic,dualpath --workdir=bench_out/serve_multiturn

For each policy the script starts `launch/api_server.py --policy=P` (workdir WORKDIR/P, emptied
first so the store starts empty; its log in WORKDIR/P/server.log), waits for `/health`, sends
`--warmup` short unmeasured two-round sessions of random token ids (so the measured run does not
pay for compiles), then replays the config's workload as an online run: agents arrive as a
Poisson process at `--aps` agents per second (the same arrival times for every policy),
`workload.agents` of them, or for `--duration_s` seconds when that is set; each agent runs its
rounds in order over streamed `POST /v1/completions` with `X-Session-Id: <agent id>`. Round i's
prompt is the agent's whole context (earlier appends and the token ids the server returned) plus
append i; `max_tokens` is the round's generation length, greedy, `ignore_eos`.

`--aps` defaults to the config's `workload.aps`, or DEFAULT_APS (1.0) when that is 0. On
`cpu_1p2d` an agent reads ~5.7 MB of hit KV, so Basic's one 0.5 MB/s prefill-side storage NIC
carries ~0.09 agents/s and DualPath's three NICs ~0.26: 1 agent/s saturates both. Its 16 agents
arrive within ~20 s, well inside either policy's makespan (the in-process offline JCTs are 73 s
and 193 s), so the makespan measures each policy's throughput; at 0.5 agents/s the arrivals
(~44 s with the default seed) are a large part of DualPath's makespan, which then measures them.

Measured on the client: TTFT (request sent -> first chunk with token ids; a round that was
refused with 429/503 and retried after Retry-After counts from its first attempt), TPOT ((last
token - first token) / (tokens - 1)), round JCT; from the server: usage (prompt, completion and
cached tokens) and the `dualpath` extension (read path, router-measured times). SLO attainment
is over completed rounds (TTFT <= workload.ttft_slo_s and TPOT <= workload.tpot_slo_s), as in
the in-process benchmarks. Writes WORKDIR/serve_multiturn.json, per policy WORKDIR/P/rounds.jsonl
(one line per round), WORKDIR/P/outputs.jsonl (each agent's generated ids per round) and
WORKDIR/P/metrics.txt (a `/metrics` scrape after the run), and prints a table and
`DualPath/Basic throughput: X.XXx` (rounds/s) when both ran.

With `--url` the script talks to a server that is already running (one label: the single name
in --policies, else `server`); it starts and stops nothing, and its session ids get a random
prefix so a second run does not continue the first one's sessions.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import ipaddress
import json
import math
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time
import urllib.parse
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
from absl import app, flags

from dualpath_jax.configs_loader import load_config
from dualpath_jax.launcher import run_config
from dualpath_jax.metrics.summary import dist

ROOT = pathlib.Path(__file__).resolve().parents[1]
DEFAULT_APS = 1.0  # saturates both policies on the CPU configs (module docstring)
RETRY_STATUSES = (429, 503)
STOP_GRACE_S = 30.0


def _define_flags() -> None:
    """The command line's flags, defined when the script runs (not when a test imports it: other
    bench scripts define some of the same names)."""
    global \
        _CONFIG, \
        _SET, \
        _POLICIES, \
        _APS, \
        _AGENTS, \
        _DURATION, \
        _WORKDIR, \
        _URL, \
        _API_KEY, \
        _TIMEOUT, \
        _WARMUP, \
        _RETRIES, \
        _PROGRESS
    _CONFIG = flags.DEFINE_string("config", "configs/cpu_1p2d.py", "Experiment file.")
    _SET = flags.DEFINE_multi_string(
        "set", [], "Override `section.key=value` (repeatable; passed to the server too)."
    )
    _POLICIES = flags.DEFINE_list("policies", ["basic", "dualpath"], "Policies, one server each.")
    _APS = flags.DEFINE_float(
        "aps", None, f"Agent arrivals per second (default: workload.aps, or {DEFAULT_APS} if 0)."
    )
    _AGENTS = flags.DEFINE_integer("agents", None, "Agents (overrides workload.agents).")
    _DURATION = flags.DEFINE_float(
        "duration_s", None, "Arrivals stop after this many seconds (overrides workload.duration_s)."
    )
    _WORKDIR = flags.DEFINE_string("workdir", "bench_out/serve_multiturn", "Output directory.")
    _URL = flags.DEFINE_string(
        "url", None, "Use this running server (loopback) instead of starting."
    )
    _API_KEY = flags.DEFINE_string("api_key", None, "Bearer key (also given to started servers).")
    _TIMEOUT = flags.DEFINE_float(
        "timeout_s", 1200.0, "Bound on the whole run (s), servers included."
    )
    _WARMUP = flags.DEFINE_integer("warmup", 2, "Unmeasured two-round warmup sessions per server.")
    _RETRIES = flags.DEFINE_integer("max_retries", 3, "Retries of a round refused with 429/503.")
    _PROGRESS = flags.DEFINE_bool("progress", True, "Show a progress bar.")


Trajectory = tuple[str, list[tuple[list[int], int]]]


# --------------------------------------------------------------------------- server-sent events


class SSEParser:
    """Incremental `text/event-stream` parser: `feed(bytes)` returns the data of each event the
    bytes completed (data lines joined by newlines); comments and other fields are skipped."""

    def __init__(self) -> None:
        self._buf = b""
        self._data: list[str] = []

    def feed(self, chunk: bytes) -> list[str]:
        self._buf += chunk
        *lines, self._buf = self._buf.split(b"\n")
        events = []
        for raw in lines:
            line = raw.rstrip(b"\r").decode()
            if not line:
                if self._data:
                    events.append("\n".join(self._data))
                    self._data = []
            elif line.startswith("data:"):
                value = line[5:]
                self._data.append(value[1:] if value.startswith(" ") else value)
        return events


# --------------------------------------------------------------------------- one round


class RoundFailed(Exception):
    """A request that got no usable answer; `kind` is the HTTP status (as text) or what broke."""

    def __init__(self, kind: str, message: str, retry_after_s: float | None = None):
        super().__init__(f"{kind}: {message}")
        self.kind = kind
        self.retry_after_s = retry_after_s


@dataclasses.dataclass
class RoundRecord:
    """One completed round; times in seconds on the run's clock (0 = measurement start)."""

    agent: str
    round: int
    sent_s: float  # first attempt
    first_token_s: float
    last_token_s: float
    end_s: float
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    max_tokens: int
    attempts: int
    read_path: str
    server: dict[str, float]  # the router-measured times of the `dualpath` extension
    token_ids: list[int]

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.sent_s

    @property
    def tpot_s(self) -> float:
        n = self.completion_tokens
        return (self.last_token_s - self.first_token_s) / (n - 1) if n > 1 else math.nan

    @property
    def jct_s(self) -> float:
        return self.end_s - self.sent_s


def _error_message(body: str) -> str:
    try:
        err = json.loads(body)["error"]
        return f"{err.get('type')}/{err.get('code')}: {err.get('message')}"
    except (ValueError, KeyError, TypeError, AttributeError):
        return body[:200]


def _retry_after(value: str | None) -> float | None:
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None  # an HTTP date: not sent by this server


async def stream_completion(
    http: Any, url: str, body: dict[str, Any], headers: dict[str, str], clock: Any
) -> dict[str, Any]:
    """One streamed `POST url/v1/completions`; returns the token ids, the arrival times of the
    first and last chunk that carried ids, usage and the `dualpath` extension. Raises
    RoundFailed on an error status, an error event or a stream that ends before `[DONE]`."""
    async with http.post(f"{url}/v1/completions", json=body, headers=headers) as resp:
        if resp.status >= 400:
            raise RoundFailed(
                str(resp.status),
                _error_message(await resp.text()),
                _retry_after(resp.headers.get("Retry-After")),
            )
        parser = SSEParser()
        out: dict[str, Any] = {"token_ids": [], "first": None, "last": None, "usage": None}
        out["dualpath"] = {}
        async for chunk in resp.content.iter_any():
            now = clock()
            for data in parser.feed(chunk):
                if data.strip() == "[DONE]":
                    return out
                event = json.loads(data)
                if "error" in event:
                    raise RoundFailed("stream", _error_message(data))
                for choice in event.get("choices") or ():
                    ids = choice.get("token_ids") or []
                    if ids:
                        out["first"] = now if out["first"] is None else out["first"]
                        out["last"] = now
                        out["token_ids"].extend(int(t) for t in ids)
                if event.get("usage"):
                    out["usage"] = event["usage"]
                if event.get("dualpath"):
                    out["dualpath"] = event["dualpath"]
        raise RoundFailed("stream", "the stream ended before [DONE]")


# --------------------------------------------------------------------------- the load


@dataclasses.dataclass
class LoadResult:
    records: list[RoundRecord]
    outputs: dict[str, list[list[int]]]  # agent -> generated ids per completed round
    errors: dict[str, int]  # error responses (retried ones included) by HTTP status or kind
    rounds_planned: int
    rounds_failed: int  # rounds given up on (their agent stopped there)
    first_arrival_s: float
    timed_out: bool


async def run_load(
    url: str,
    model: str,
    trajectories: Sequence[Trajectory],
    arrivals: Sequence[float],
    *,
    api_key: str | None = None,
    timeout_s: float | None = None,
    max_retries: int = 3,
    session_prefix: str = "",
    progress: bool = False,
) -> LoadResult:
    """Replays `trajectories` against the server at `url`: agent k starts `arrivals[k]` seconds
    after the call and runs its rounds in order; a failed round ends its agent. After
    `timeout_s` the agents still running are cancelled (`timed_out`)."""
    import aiohttp
    from tqdm import tqdm

    if len(arrivals) != len(trajectories):
        raise ValueError(f"{len(arrivals)} arrival times for {len(trajectories)} trajectories")
    t0 = time.monotonic()

    def clock() -> float:
        return time.monotonic() - t0

    records: list[RoundRecord] = []
    outputs: dict[str, list[list[int]]] = {tid: [] for tid, _ in trajectories}
    errors: collections.Counter[str] = collections.Counter()
    failed = [0]
    planned = sum(len(r) for _, r in trajectories)
    bar = tqdm(total=planned, desc="rounds", unit="round", disable=not progress)

    async def one_round(http, sid: str, tid: str, i: int, prompt: list[int], gen: int):
        body = {
            "model": model,
            "prompt": prompt,
            "max_tokens": gen,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": True,
            "return_token_ids": True,
        }
        headers = {"X-Session-Id": sid}
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        sent = clock()
        for attempt in range(1, max_retries + 2):
            try:
                r = await stream_completion(http, url, body, headers, clock)
            except RoundFailed as e:
                errors[e.kind] += 1
                if e.kind.isdigit() and int(e.kind) in RETRY_STATUSES and attempt <= max_retries:
                    await asyncio.sleep(1.0 if e.retry_after_s is None else e.retry_after_s)
                    continue
                raise
            except (aiohttp.ClientError, OSError, ValueError) as e:  # ValueError: bad JSON
                errors[type(e).__name__] += 1
                raise RoundFailed(type(e).__name__, str(e)) from e
            break
        end = clock()
        ids = r["token_ids"]
        if not ids:
            errors["no_tokens"] += 1
            raise RoundFailed("no_tokens", "the stream carried no token ids")
        usage = r["usage"] or {}
        dp = r["dualpath"]
        return RoundRecord(
            agent=tid,
            round=i,
            sent_s=sent,
            first_token_s=r["first"],
            last_token_s=r["last"],
            end_s=end,
            prompt_tokens=int(usage.get("prompt_tokens", len(prompt))),
            completion_tokens=int(usage.get("completion_tokens", len(ids))),
            cached_tokens=int((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)),
            max_tokens=gen,
            attempts=attempt,
            read_path=str(dp.get("read_path", "unknown")),
            server={
                k: float(v)
                for k, v in dp.items()
                if k.endswith("_s") and isinstance(v, int | float)
            },
            token_ids=ids,
        )

    async def agent(http, tid: str, rounds, start_s: float) -> None:
        await asyncio.sleep(max(0.0, start_s - clock()))
        context: list[int] = []
        for i, (append, gen) in enumerate(rounds):
            prompt = context + list(append)
            try:
                rec = await one_round(http, session_prefix + tid, tid, i, prompt, gen)
            except RoundFailed:
                failed[0] += 1
                return
            records.append(rec)
            outputs[tid].append(rec.token_ids)
            context = prompt + rec.token_ids
            bar.update(1)

    timed_out = False
    # No per-request timeout: under saturation a round may queue for minutes; `timeout_s`
    # bounds the whole load. limit=0: the client never queues a request behind another.
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=None)
    ) as http:
        tasks = [
            asyncio.ensure_future(agent(http, tid, rounds, float(a)))
            for (tid, rounds), a in zip(trajectories, arrivals, strict=True)
        ]
        try:
            async with asyncio.timeout(timeout_s):
                await asyncio.gather(*tasks)
        except TimeoutError:
            timed_out = True
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    bar.close()
    return LoadResult(
        records=sorted(records, key=lambda r: (r.sent_s, r.agent)),
        outputs=outputs,
        errors=dict(sorted(errors.items())),
        rounds_planned=planned,
        rounds_failed=failed[0],
        first_arrival_s=min(arrivals, default=0.0),
        timed_out=timed_out,
    )


def warmup_trajectories(
    trajectories: Sequence[Trajectory], n: int, vocab_size: int, seed: int = 0
) -> list[Trajectory]:
    """`n` throwaway two-round sessions shaped like the workload's first two rounds (random
    token ids, at most 4 generated tokens per round): a fresh prefill, then a prefix hit."""
    rng = np.random.default_rng(seed)
    tag = uuid.uuid4().hex[:8]
    out = []
    for k in range(min(n, len(trajectories))):
        rounds = trajectories[k][1][:2]
        out.append(
            (
                f"warmup-{tag}-{k}",
                [(rng.integers(0, vocab_size, len(a)).tolist(), min(g, 4)) for a, g in rounds],
            )
        )
    return out


# --------------------------------------------------------------------------- report


def summarize(result: LoadResult, ttft_slo_s: float, tpot_slo_s: float) -> dict[str, Any]:
    """Throughput, latency and cache figures of one load (module docstring)."""
    recs = result.records
    end = max((r.end_s for r in recs), default=result.first_arrival_s)
    makespan = end - result.first_arrival_s
    prompt = sum(r.prompt_tokens for r in recs)
    completion = sum(r.completion_tokens for r in recs)
    cached = sum(r.cached_tokens for r in recs)
    ok = [
        r
        for r in recs
        if r.ttft_s <= ttft_slo_s and (r.completion_tokens < 2 or r.tpot_s <= tpot_slo_s)
    ]

    def rate(x: float) -> float:
        return x / makespan if makespan > 0 else 0.0

    paths = collections.Counter(r.read_path for r in recs)
    server_keys = sorted({k for r in recs for k in r.server})
    return {
        "rounds_planned": result.rounds_planned,
        "rounds_done": len(recs),
        "rounds_failed": result.rounds_failed,
        "errors": result.errors,
        "timed_out": result.timed_out,
        "short_rounds": sum(r.completion_tokens != r.max_tokens for r in recs),
        "retried_rounds": sum(r.attempts > 1 for r in recs),
        "makespan_s": makespan,
        "rounds_per_s": rate(len(recs)),
        "tokens_per_s": rate(prompt + completion),
        "generated_tokens_per_s": rate(completion),
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "cached_tokens": cached,
        "cached_ratio": cached / prompt if prompt else 0.0,
        "ttft_s": dist(r.ttft_s for r in recs),
        "tpot_s": dist(r.tpot_s for r in recs if r.completion_tokens > 1),
        "round_jct_s": dist(r.jct_s for r in recs),
        "slo_attainment": len(ok) / len(recs) if recs else 0.0,
        "read_paths": dict(sorted(paths.items())),
        "server": {k: dist(r.server.get(k, math.nan) for r in recs) for k in server_keys},
    }


def tokens_identical(runs: Sequence[dict[str, list[list[int]]]]) -> bool:
    """Whether every agent's generated ids agree across runs on the rounds all of them
    completed (greedy decoding: the policy moves KV, it must not change tokens)."""
    first, *rest = runs
    for other in rest:
        for agent, rounds in first.items():
            theirs = other.get(agent, [])
            n = min(len(rounds), len(theirs))
            if rounds[:n] != theirs[:n]:
                return False
    return True


def format_table(summaries: dict[str, dict[str, Any]]) -> str:
    head = (
        f"{'policy':<10} {'rounds':>7} {'errors':>7} {'makespan s':>10} {'rounds/s':>8} "
        f"{'tok/s':>8} {'gen tok/s':>9} {'TTFT p50/p90 s':>15} {'TPOT p50/p90 ms':>16} "
        f"{'cached':>6} {'SLO':>5}  read paths"
    )
    lines = [head, "-" * len(head)]
    for p, s in summaries.items():
        t, o = s["ttft_s"], s["tpot_s"]
        paths = " ".join(f"{k}:{v}" for k, v in s["read_paths"].items())
        lines.append(
            f"{p:<10} {s['rounds_done']:>3}/{s['rounds_planned']:<3} "
            f"{sum(s['errors'].values()):>7} {s['makespan_s']:>10.1f} {s['rounds_per_s']:>8.3f} "
            f"{s['tokens_per_s']:>8.0f} {s['generated_tokens_per_s']:>9.1f} "
            f"{t['p50']:>7.2f}/{t['p90']:<7.2f} {o['p50'] * 1e3:>7.0f}/{o['p90'] * 1e3:<8.0f} "
            f"{s['cached_ratio']:>6.3f} {s['slo_attainment']:>5.2f}  {paths}"
        )
        if s["errors"] or s["timed_out"]:
            lines.append(f"{'':<10} errors {s['errors']}, timed out: {s['timed_out']}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- the server


def check_loopback(url: str) -> None:
    host = urllib.parse.urlparse(url).hostname or ""
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise app.UsageError(f"{url}: this benchmark talks to loopback servers only")


class ApiServer:
    """A server process started with `command` in a session of its own, ready once it wrote
    `workdir/api_server.json` and answers `GET /health` with 200. `stop` sends SIGTERM (the
    server stops its engines), then after STOP_GRACE_S SIGTERM and SIGKILL to its whole group."""

    def __init__(
        self, command: Sequence[str], workdir: pathlib.Path, env: dict[str, str] | None = None
    ):
        """`env`: the process's environment (default: this one's)."""
        self.workdir = pathlib.Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        (self.workdir / "api_server.json").unlink(missing_ok=True)
        self.log_path = self.workdir / "server.log"
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            list(command),
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=env,
        )
        self.info: dict[str, Any] = {}

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def _read_info(self) -> None:
        """Sets `info` (url, model, pid) once the server wrote it (`api_server.json`)."""
        path = self.workdir / "api_server.json"
        if not self.info and path.is_file():
            with contextlib.suppress(ValueError):  # still being written
                self.info = json.loads(path.read_text())
                check_loopback(self.info["url"])

    async def wait_ready(self, timeout_s: float) -> dict[str, Any]:
        import aiohttp

        deadline = time.monotonic() + timeout_s
        async with aiohttp.ClientSession() as http:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(
                        f"the server exited with {self.proc.returncode}:\n{self.log_tail()}"
                    )
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the server was not ready in {timeout_s:.0f} s")
                self._read_info()
                if self.info:
                    with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                        async with http.get(
                            f"{self.info['url']}/health", timeout=aiohttp.ClientTimeout(total=5)
                        ) as r:
                            if r.status == 200:
                                return self.info
                await asyncio.sleep(0.5)

    def stop(self, grace_s: float = STOP_GRACE_S) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(grace_s)
        # Whatever of its group is left (its engines, if it could not stop them).
        for sig, wait_s in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 0.0)):
            try:
                os.killpg(self.proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                break
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline and _group_alive(self.proc.pid):
                time.sleep(0.2)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)
        self._log.close()
        return self.proc.returncode


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


async def scrape(url: str, api_key: str | None) -> str:
    import aiohttp

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with aiohttp.ClientSession() as http:
        async with http.get(
            f"{url}/metrics", headers=headers, timeout=aiohttp.ClientTimeout(total=30)
        ) as r:
            return await r.text()


async def models(url: str, api_key: str | None) -> list[str]:
    import aiohttp

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with aiohttp.ClientSession() as http:
        async with http.get(
            f"{url}/v1/models", headers=headers, timeout=aiohttp.ClientTimeout(total=30)
        ) as r:
            return [m["id"] for m in (await r.json())["data"]]


# --------------------------------------------------------------------------- main


def server_command(policy: str, workdir: pathlib.Path) -> list[str]:
    cmd = [
        sys.executable,
        str(ROOT / "launch" / "api_server.py"),
        f"--config={_CONFIG.value}",
        f"--policy={policy}",
        "--port=0",
        f"--workdir={workdir}",
        *(f"--set={s}" for s in _SET.value),
    ]
    return cmd + ([f"--api_key={_API_KEY.value}"] if _API_KEY.value else [])


def write_run(wd: pathlib.Path, result: LoadResult) -> None:
    with open(wd / "rounds.jsonl", "w") as f:
        for r in result.records:
            d = dataclasses.asdict(r)
            del d["token_ids"]
            d.update(ttft_s=r.ttft_s, tpot_s=r.tpot_s, jct_s=r.jct_s)
            f.write(json.dumps(d) + "\n")
    with open(wd / "outputs.jsonl", "w") as f:
        for agent, rounds in result.outputs.items():
            f.write(json.dumps({"id": agent, "rounds": rounds}) + "\n")


async def measure(
    label: str,
    url: str,
    model: str,
    trajs: list[Trajectory],
    arrivals: list[float],
    wd: pathlib.Path,
    vocab_size: int,
    deadline: float,
    session_prefix: str = "",
) -> LoadResult:
    common = dict(api_key=_API_KEY.value, max_retries=_RETRIES.value)
    if _WARMUP.value:
        warm = warmup_trajectories(trajs, _WARMUP.value, vocab_size)
        t = time.monotonic()
        w = await run_load(
            url, model, warm, [0.0] * len(warm), timeout_s=deadline - time.monotonic(), **common
        )
        print(
            f"{label}: warmup {len(w.records)}/{w.rounds_planned} rounds in "
            f"{time.monotonic() - t:.1f} s, errors {w.errors or 'none'}",
            flush=True,
        )
    result = await run_load(
        url,
        model,
        trajs,
        arrivals,
        timeout_s=max(0.0, deadline - time.monotonic()),
        session_prefix=session_prefix,
        progress=_PROGRESS.value,
        **common,
    )
    try:
        (wd / "metrics.txt").write_text(await scrape(url, _API_KEY.value))
    except Exception as e:  # noqa: BLE001 - the figures are the client's; a scrape is extra
        print(f"{label}: /metrics scrape failed: {e!r}", flush=True)
    write_run(wd, result)
    return result


def running_server(url: str, fallback_model: str) -> tuple[str, str]:
    """`(url, model)` of a server started elsewhere (its first `/v1/models` entry)."""
    url = url.rstrip("/")
    try:
        return url, asyncio.run(models(url, _API_KEY.value))[0]
    except Exception as e:  # noqa: BLE001 - /v1/models is optional here
        print(f"GET /v1/models failed ({e!r}); model {fallback_model!r}", flush=True)
        return url, fallback_model


@contextlib.contextmanager
def started_server(label: str, wd: pathlib.Path, deadline: float) -> Iterator[tuple[str, str]]:
    """`(url, model)` of a `launch/api_server.py --policy=label` run in `wd`, stopped on exit."""
    server = ApiServer(server_command(label, wd), wd)
    try:
        t = time.monotonic()
        info = asyncio.run(server.wait_ready(deadline - time.monotonic()))
        print(f"{label}: server ready in {time.monotonic() - t:.1f} s", flush=True)
        if info.get("pid") != server.proc.pid:
            print(f"{label}: api_server.json names pid {info.get('pid')}, not {server.proc.pid}")
        yield info["url"], info["model"]
    except BaseException:
        print(f"{label}: server log tail:\n{server.log_tail()}", flush=True)
        raise
    finally:
        rc = server.stop()
        print(f"{label}: server stopped (exit status {rc})", flush=True)


def main(argv: Sequence[str]) -> None:
    del argv
    deadline = time.monotonic() + _TIMEOUT.value
    cfg = load_config(_CONFIG.value)
    aps = _APS.value or cfg.workload.aps or DEFAULT_APS
    cfg = run_config(
        cfg,
        "online",
        overrides=_SET.value,
        agents=_AGENTS.value,
        aps=aps,
        duration_s=_DURATION.value,
    )
    from dualpath_jax.rollout import workload_trajectories

    records, arrivals = workload_trajectories(cfg)
    trajs = [(t.id, [(list(r.append), r.gen) for r in t.rounds]) for t in records]
    root = pathlib.Path(_WORKDIR.value)
    root.mkdir(parents=True, exist_ok=True)
    print(
        f"{cfg.name}: {len(trajs)} agents at {aps:g} agents/s (arrivals over "
        f"{max(arrivals, default=0):.1f} s), {sum(len(r) for _, r in trajs)} rounds",
        flush=True,
    )
    labels = _POLICIES.value
    if _URL.value:
        check_loopback(_URL.value)
        labels = labels if len(labels) == 1 else ["server"]
    summaries: dict[str, dict[str, Any]] = {}
    outputs: dict[str, dict[str, list[list[int]]]] = {}
    for label in labels:
        if time.monotonic() >= deadline:
            print(f"{label}: skipped, --timeout_s={_TIMEOUT.value:g} has passed", flush=True)
            continue
        wd = root / label
        if _URL.value:
            target: Any = contextlib.nullcontext(running_server(_URL.value, cfg.model.name))
            prefix = f"{uuid.uuid4().hex[:8]}-"
        else:
            # A fresh store: a server restarted in a workdir finds the blocks the last run stored
            # (first rounds would hit the cache).
            shutil.rmtree(wd, ignore_errors=True)
            target, prefix = started_server(label, wd, deadline), ""
        wd.mkdir(parents=True, exist_ok=True)
        with target as (url, model):
            result = asyncio.run(
                measure(
                    label, url, model, trajs, arrivals, wd, cfg.model.vocab_size, deadline, prefix
                )
            )
        summaries[label] = summarize(result, cfg.workload.ttft_slo_s, cfg.workload.tpot_slo_s)
        outputs[label] = result.outputs
    report: dict[str, Any] = {
        "config": cfg.name,
        "emulated": cfg.hardware.emulated,
        "aps": aps,
        "agents": len(trajs),
        "duration_s": cfg.workload.duration_s,
        "slo": {"ttft_s": cfg.workload.ttft_slo_s, "tpot_s": cfg.workload.tpot_slo_s},
        "summaries": summaries,
    }
    print(format_table(summaries))
    if len(outputs) > 1:
        same = tokens_identical(list(outputs.values()))
        report["tokens_identical"] = same
        print(f"generated tokens identical across policies: {'yes' if same else 'no'}")
    if {"basic", "dualpath"} <= set(summaries) and summaries["basic"]["rounds_per_s"] > 0:
        ratio = summaries["dualpath"]["rounds_per_s"] / summaries["basic"]["rounds_per_s"]
        report["dualpath_over_basic_throughput"] = ratio
        print(f"DualPath/Basic throughput: {ratio:.2f}x")
    (root / "serve_multiturn.json").write_text(json.dumps(report, indent=1))
    print(f"wrote {root / 'serve_multiturn.json'}")


if __name__ == "__main__":
    _define_flags()
    app.run(main)
