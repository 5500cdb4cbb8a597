"""Time to ready and the first requests' TTFT of `launch/api_server.py`, cold and restarted.

Starts the API server on a config three times, each on a fresh workdir: with warm-up and an
empty compilation cache (cold), again with the cache the first start filled (restart), and
without warm-up (`--nowarmup`, shapes compile on first use) for comparison. Each time it
measures the seconds from launch to `GET /health` answering 200 (time to ready), then runs
`--requests` streamed completions, `--sessions` multi-turn sessions taking turns (each turn
appends text of a random length to the session's history, so requests fall in many length
buckets), one at a time, and reports the first request's TTFT against the median of the last
ten (the steady state). Loopback only; every server it starts is stopped.

    python bench/cold_start.py --config=configs/serve.py --requests=100 --json

The default config emulates no link: with emulated ones (a `cpu_*` config), TTFT waits for an
emulated storage NIC and hides what compiling costs.
"""

from __future__ import annotations

import http.client
import json
import os
import pathlib
import random
import signal
import statistics
import string
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request

ROOT = pathlib.Path(__file__).resolve().parent.parent


def start_server(config: str, workdir: pathlib.Path, sets: list[str], warmup: bool):
    """Launches the server; returns (process, url, seconds to listening, seconds to ready)."""
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    env["PYTHONPATH"] = str(ROOT)
    cmd = [
        sys.executable,
        str(ROOT / "launch/api_server.py"),
        f"--config={config}",
        "--port=0",
        f"--workdir={workdir}",
        "--warmup" if warmup else "--nowarmup",
        *[f"--set={s}" for s in sets],
    ]
    t0 = time.monotonic()
    log = open(workdir.parent / f"{workdir.name}.log", "wb")  # noqa: SIM115 - the child's
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    log.close()
    info = workdir / "api_server.json"
    while not info.exists():
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}; see {log.name}")
        time.sleep(0.1)
    listening = time.monotonic() - t0
    url = json.loads(info.read_text())["url"]
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}; see {log.name}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=10) as r:
                if r.status == 200:
                    break
        except (urllib.error.HTTPError, urllib.error.URLError, ConnectionError):
            pass
        time.sleep(0.1)
    return proc, url, listening, time.monotonic() - t0


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def stream_ttft(url: str, model: str, session: str, prompt: str, max_tokens: int):
    """One streamed completion: (seconds to the first text, the text)."""
    u = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=600)
    body = json.dumps(
        {
            "model": model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "ignore_eos": True,
        }
    )
    t0 = time.monotonic()
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json",
                                                   "X-Session-Id": session})  # fmt: skip
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:300]!r}")
    ttft, text = None, []
    for line in resp:
        line = line.strip()
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        piece = "".join(c.get("text", "") for c in chunk.get("choices", []))
        if piece and ttft is None:
            ttft = time.monotonic() - t0
        text.append(piece)
    conn.close()
    return (ttft if ttft is not None else time.monotonic() - t0), "".join(text)


def run_requests(url: str, requests: int, sessions: int, seed: int) -> list[float]:
    """`requests` streamed completions over `sessions` sessions taking turns; their TTFTs."""
    with urllib.request.urlopen(url + "/v1/models", timeout=30) as r:
        card = json.loads(r.read())["data"][0]
    model, context = card["id"], card["max_model_len"]
    rng = random.Random(seed)
    history = {f"cold-{seed}-{k}": "" for k in range(sessions)}
    ttfts = []
    for i in range(requests):
        sid = list(history)[i % sessions]
        append = "".join(rng.choices(string.ascii_lowercase + " ", k=rng.randint(8, 160)))
        gen = rng.randint(4, 16)
        prompt = history[sid] + append
        # the session is full: start it again (generated text may re-encode to more tokens)
        if 2 * len(prompt.encode()) + gen > context:
            prompt = append
        ttft, text = stream_ttft(url, model, sid, prompt, gen)
        history[sid] = prompt + text
        ttfts.append(ttft)
    return ttfts


def measure(config, sets, requests, sessions, warmup, cache: pathlib.Path, root, name) -> dict:
    workdir = root / name
    workdir.mkdir()
    sets = [*sets, f"cluster.compilation_cache_dir={cache}"]
    proc, url, listening, ready = start_server(config, workdir, sets, warmup)
    try:
        ttfts = run_requests(url, requests, sessions, seed=0) if requests else []
    finally:
        stop_server(proc)
    out = {"listening_s": round(listening, 2), "ready_s": round(ready, 2)}
    if ttfts:
        steady = statistics.median(ttfts[-10:])
        out |= {
            "ttft_first_s": round(ttfts[0], 3),
            "ttft_steady_s": round(steady, 3),
            "ttft_max_s": round(max(ttfts), 3),
            "first_over_steady": round(ttfts[0] / steady, 2),
        }
    return out


def main(argv):
    del argv
    from absl import flags

    f = flags.FLAGS
    with tempfile.TemporaryDirectory(prefix="cold_start_") as tmp:
        root = pathlib.Path(tmp)
        cache = root / "jax_cache"
        runs = {}
        runs["cold"] = measure(f.config, f.set, f.requests, f.sessions, True, cache, root, "cold")
        runs["restart"] = measure(f.config, f.set, f.requests, f.sessions, True, cache, root,
                                  "restart")  # fmt: skip
        if f.compare_nowarmup:
            runs["nowarmup"] = measure(
                f.config, f.set, f.requests, f.sessions, False, root / "empty", root, "nowarmup"
            )
    runs["restart_speedup"] = round(runs["cold"]["ready_s"] / runs["restart"]["ready_s"], 2)
    if f.json:
        print(json.dumps(runs))
        return
    for name, r in runs.items():
        print(f"{name:10s} {r}")


if __name__ == "__main__":
    from absl import app, flags

    flags.DEFINE_string(
        "config",
        "configs/serve.py",
        "config file[:arg]; the default emulates no link, so TTFT is compute (and compiles),"
        " not an emulated storage NIC",
    )
    flags.DEFINE_multi_string("set", [], "config overrides (key=value), as the launchers take")
    flags.DEFINE_integer("requests", 100, "streamed completions per start (0: time to ready only)")
    flags.DEFINE_integer("sessions", 4, "sessions the requests take turns in")
    flags.DEFINE_bool("compare_nowarmup", True, "also start once without warm-up")
    flags.DEFINE_bool("json", False, "print one JSON object")
    app.run(main)
