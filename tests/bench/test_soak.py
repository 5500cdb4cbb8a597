"""`bench/soak.py`'s report: slopes per minute fitted after the warm-up, per process and per
series, and the process names it gives the server's tree. A short soak of a real server runs
in the full tier."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def soak(bench_modules):
    with bench_modules("soak") as (module,):
        yield module


def test_slopes_are_per_minute_after_the_warmup(soak):
    samples = [
        {
            "t_s": t,
            "router": {"rss_mib": 100 + (t if t < 60 else 60 + 0.001 * t)},
            "store_mib": t / 6,
        }
        for t in range(0, 600, 10)
    ]
    series = soak.summarize(samples, warmup_s=60)
    # flat after warm-up (0.001 MiB/s = 0.06 MiB/min), the store growing 10 MiB/min
    assert series["router.rss_mib"]["slope_per_min"] == pytest.approx(0.06, abs=1e-6)
    assert series["store_mib"]["slope_per_min"] == pytest.approx(10.0)
    assert series["router.rss_mib"]["first"] == pytest.approx(160.06)
    assert soak.slope_per_min([0.0], [1.0]) == 0.0


@pytest.mark.multiprocess
@pytest.mark.timeout(900)
def test_a_short_soak_reports_every_process(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [
            sys.executable,
            "bench/soak.py",
            "--config=configs/cpu_1p1d.py",
            "--duration_s=20",
            "--warmup_s=0",
            "--sample_s=2",
            "--agents=3",
            "--turns=3",
            "--vanish=0.3",
            "--set=cluster.decode_max_len=512",
            "--set=cluster.prefill_max_tokens=128",
            "--set=cluster.prefill_max_batch=2",
            "--json",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=840,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["counts"].get("rounds", 0) > 0
    assert not {k for k in report["counts"] if k.startswith("http_")}
    names = {k.split(".")[0] for k in report["series"]}
    assert {"api_server", "router", "prefill0", "decode1", "store_mib"} <= names
    assert report["series"]["router.fds"]["last"] > 0
    anon, rss = report["series"]["decode1.rss_anon_mib"], report["series"]["decode1.rss_mib"]
    assert 0 < anon["last"] < rss["last"]
