"""A soak of `launch/api_server.py`: a steady stream of multi-turn sessions for `--duration_s`,
some of whose clients vanish mid-round, with every process's memory, fds and threads, the
store's bytes and the event log's size sampled over time and fitted to slopes.

`--agents` concurrent agents run sessions of `--turns` turns each (a token-id prompt that grows
by a random append per turn, streamed completions with `X-Session-Id`), then start a new
session; `--vanish` of the rounds close their connection after the first streamed chunk (a
client that leaves mid-round: the server cancels the round). Every `--sample_s` seconds it
records, per process of the server's tree (the API server, the router and each engine): RSS and
its anonymous part (RSS less mapped files' pages, which the kernel drops and reads back as the
host's memory requires), open fds and threads (from /proc), plus the block store's bytes on
disk and the size of `events.jsonl` (rotated files included), and the router's session count.
The report gives each series' first and last value and its least-squares slope per minute after
`--warmup_s`. Loopback only; bounded by `--duration_s`; the server it starts is stopped.

    python bench/soak.py --config=configs/cpu_1p1d.py --duration_s=600 --json
"""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import random
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

from cold_start import stop_server  # this directory's

ROOT = pathlib.Path(__file__).resolve().parent.parent
MIB = 1 << 20


def _children(pid: int) -> list[int]:
    """`pid` and its descendants (from /proc)."""
    parent: dict[int, int] = {}
    for stat in pathlib.Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parent[int(stat.parent.name)] = int(fields[1])
    out, frontier = [pid], [pid]
    while frontier:
        p = frontier.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        out += kids
        frontier += kids
    return out


def _name(pid: int, root: int) -> str:
    if pid == root:
        return "api_server"
    try:
        cmd = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return str(pid)
    for arg in cmd:
        if arg.startswith(b"{") and b'"role"' in arg:
            spec = json.loads(arg)
            return spec["role"] if spec["role"] == "router" else f"{spec['role']}{spec['engine']}"
    return str(pid)


def _proc_sample(pid: int) -> dict[str, float] | None:
    try:
        status = pathlib.Path(f"/proc/{pid}/status").read_text()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    return {
        "rss_mib": int(fields["VmRSS"].split()[0]) / 1024,
        # its own memory: RSS less the pages of mapped files (libraries), which the kernel drops
        # and reads back as the host's other work needs memory (RSS moves with them)
        "rss_anon_mib": int(fields["RssAnon"].split()[0]) / 1024,
        "fds": fds,
        "threads": int(fields["Threads"]),
    }


def _du(path: pathlib.Path, pattern: str = "**/*") -> int:
    total = 0
    for p in path.glob(pattern):
        try:
            if p.is_file():
                total += p.stat().st_size
        except OSError:
            pass
    return total


def _router_sessions(url: str) -> float | None:
    """`dualpath_router_sessions` from the server's /metrics (None if unreadable)."""
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
            for line in r.read().decode().splitlines():
                if line.startswith("dualpath_router_sessions "):
                    return float(line.split()[1])
    except OSError:
        return None
    return None


def sample(root_pid: int, workdir: pathlib.Path, t: float, url: str = "") -> dict:
    out: dict = {"t_s": round(t, 1)}
    sessions = _router_sessions(url) if url else None
    if sessions is not None:
        out["router_sessions"] = sessions
    for pid in _children(root_pid):
        s = _proc_sample(pid)
        name = _name(pid, root_pid)
        if s is not None and not name.isdigit():
            out[name] = s
    out["store_mib"] = _du(workdir / "store") / MIB
    out["events_mib"] = _du(workdir, "events.jsonl*") / MIB
    return out


def slope_per_min(ts: list[float], ys: list[float]) -> float:
    if len(ts) < 2:
        return 0.0
    mt, my = statistics.fmean(ts), statistics.fmean(ys)
    den = sum((t - mt) ** 2 for t in ts)
    return 60.0 * sum((t - mt) * (y - my) for t, y in zip(ts, ys)) / den if den else 0.0


def summarize(samples: list[dict], warmup_s: float) -> dict:
    """Per series: first, last and slope per minute over the samples after `warmup_s`."""
    after = [s for s in samples if s["t_s"] >= warmup_s] or samples
    series: dict[str, list[tuple[float, float]]] = {}
    for s in after:
        for key, value in s.items():
            if isinstance(value, dict):
                for metric, v in value.items():
                    series.setdefault(f"{key}.{metric}", []).append((s["t_s"], v))
            elif key != "t_s":
                series.setdefault(key, []).append((s["t_s"], value))
    return {
        key: {
            "first": round(pts[0][1], 2),
            "last": round(pts[-1][1], 2),
            "slope_per_min": round(slope_per_min([t for t, _ in pts], [v for _, v in pts]), 3),
        }
        for key, pts in sorted(series.items())
    }


async def _agent(url, model, k, stop_at, turns, vanish, vocab, counts, rng):
    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as http:
        n = 0
        while time.monotonic() < stop_at:
            sid, prompt = f"soak-{k}-{n}", []
            n += 1
            for _ in range(turns):
                if time.monotonic() >= stop_at:
                    return
                prompt += [rng.randrange(vocab) for _ in range(rng.randint(16, 64))]
                body = {
                    "model": model,
                    "prompt": prompt,
                    "max_tokens": rng.randint(4, 16),
                    "temperature": 0,
                    "stream": True,
                    "return_token_ids": True,
                    "ignore_eos": True,
                }
                leave = rng.random() < vanish
                try:
                    async with http.post(
                        f"{url}/v1/completions", json=body, headers={"X-Session-Id": sid}
                    ) as resp:
                        if resp.status != 200:
                            counts[f"http_{resp.status}"] = counts.get(f"http_{resp.status}", 0) + 1
                            break
                        ids: list[int] = []
                        async for line in resp.content:
                            if leave:  # the client vanishes after the first chunk
                                resp.close()
                                break
                            if line.startswith(b"data: {"):
                                for c in json.loads(line[6:]).get("choices", []):
                                    ids += c.get("token_ids") or []
                except (TimeoutError, aiohttp.ClientError) as e:
                    counts[type(e).__name__] = counts.get(type(e).__name__, 0) + 1
                    break
                if leave:
                    counts["vanished"] = counts.get("vanished", 0) + 1
                    break  # that session is abandoned (its client is gone)
                counts["rounds"] = counts.get("rounds", 0) + 1
                prompt += ids


async def _load(url, model, agents, duration_s, turns, vanish, vocab, seed, counts):
    stop_at = time.monotonic() + duration_s
    rngs = [random.Random(seed * 1000 + k) for k in range(agents)]
    await asyncio.gather(
        *(
            _agent(url, model, k, stop_at, turns, vanish, vocab, counts, rngs[k])
            for k in range(agents)
        )
    )


def main(argv):
    del argv
    from absl import flags

    f = flags.FLAGS
    with tempfile.TemporaryDirectory(prefix="soak_") as tmp:
        workdir = pathlib.Path(tmp) / "run"
        workdir.mkdir()
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        cmd = [
            sys.executable,
            str(ROOT / "launch/api_server.py"),
            f"--config={f.config}",
            "--port=0",
            f"--workdir={workdir}",
            *[f"--set={s}" for s in f.set],
            *([f"--session_idle_s={f.session_idle_s}"] if f.session_idle_s else []),
            *f.server_flag,
        ]
        log = open(pathlib.Path(tmp) / "server.log", "wb")  # noqa: SIM115 - the child's
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        samples: list[dict] = []
        counts: dict[str, int] = {}
        try:
            info = workdir / "api_server.json"
            while not info.exists():
                if proc.poll() is not None:
                    raise RuntimeError(f"the server exited: {log.name}")
                time.sleep(0.2)
            url = json.loads(info.read_text())["url"]
            while True:
                try:
                    with urllib.request.urlopen(url + "/health", timeout=10) as r:
                        if r.status == 200:
                            break
                except OSError:
                    pass
                time.sleep(0.5)
            with urllib.request.urlopen(url + "/v1/models", timeout=10) as r:
                model = json.loads(r.read())["data"][0]["id"]
            t0 = time.monotonic()

            async def run() -> None:
                load = asyncio.create_task(
                    _load(url, model, f.agents, f.duration_s, f.turns, f.vanish, f.vocab, 0, counts)
                )
                while not load.done():
                    samples.append(
                        await asyncio.to_thread(
                            sample, proc.pid, workdir, time.monotonic() - t0, url
                        )
                    )
                    await asyncio.sleep(f.sample_s)
                await load

            asyncio.run(run())
            samples.append(sample(proc.pid, workdir, time.monotonic() - t0, url))
        finally:
            stop_server(proc)
            log.close()
    report = {
        "duration_s": f.duration_s,
        "agents": f.agents,
        "counts": counts,
        "series": summarize(samples, f.warmup_s),
        "samples": len(samples),
    }
    if f.json:
        print(json.dumps(report))
        return
    print(json.dumps(report["counts"]))
    for key, s in report["series"].items():
        print(f"{key:32s} {s['first']:>10} -> {s['last']:>10}  slope {s['slope_per_min']:+.3f}/min")


if __name__ == "__main__":
    from absl import app, flags

    flags.DEFINE_string("config", "configs/cpu_1p1d.py", "config file[:arg]")
    flags.DEFINE_multi_string("set", [], "config overrides (key=value)")
    flags.DEFINE_float("session_idle_s", 0.0, "the API server's --session_idle_s (0: its default)")
    flags.DEFINE_multi_string(
        "server_flag", [], "a flag for launch/api_server.py, e.g. --server_flag=--session_idle_s=60"
    )
    flags.DEFINE_float("duration_s", 600.0, "seconds of load")
    flags.DEFINE_float("warmup_s", 120.0, "slopes are fitted after this many seconds")
    flags.DEFINE_float("sample_s", 10.0, "seconds between samples")
    flags.DEFINE_integer("agents", 8, "concurrent agents")
    flags.DEFINE_integer("turns", 8, "turns per session")
    flags.DEFINE_float("vanish", 0.05, "fraction of rounds whose client leaves mid-round")
    flags.DEFINE_integer("vocab", 250, "token ids drawn below this")
    flags.DEFINE_bool("json", False, "print one JSON object")
    app.run(main)
