"""A server says when its cluster's links are emulated: a warning line at start naming each link
kind and its rate, `"emulated_links"` in `GET /health`, a gauge in `/metrics`; a server of the
serving config (every link at the host's speed) says nothing of the kind. The server is started
on loopback over a router client that answers stats only (no engines, no JAX)."""

from __future__ import annotations

import asyncio
import logging

import pytest

pytest.importorskip("aiohttp")
import aiohttp  # noqa: E402

from dualpath_jax import load_config  # noqa: E402
from dualpath_jax.serving.run import server_config  # noqa: E402
from dualpath_jax.serving.server import ApiServer  # noqa: E402
from dualpath_jax.serving.tokenizer import ByteTokenizer  # noqa: E402

GAUGE = "dualpath_emulated_link_bytes_per_second"


class _StatsOnly:
    """A router client with no rounds: what `/health` and `/metrics` ask of it."""

    def stats(self, timeout_s: float = 30.0) -> dict:
        return {"counters": {}, "queued": {}, "in_flight": 0}


def _started(config: str, ready: bool = True) -> tuple[int, dict, str]:
    """Starts a server for `config` on a free loopback port; returns `/health`'s status and
    body and `/metrics`' text, then stops it."""

    async def go():
        cfg = server_config(load_config(config), "tiny-qwen2")
        server = ApiServer(_StatsOnly(), ByteTokenizer(), cfg, ready=lambda: ready)
        port = await server.start("127.0.0.1", 0)
        try:
            async with aiohttp.ClientSession(f"http://127.0.0.1:{port}") as http:
                async with http.get("/health") as r:
                    health = (r.status, await r.json())
                async with http.get("/metrics") as r:
                    metrics = await r.text()
        finally:
            await server.stop()
        return (*health, metrics)

    return asyncio.run(go())


def _warnings(caplog) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "dualpath_jax.serving.server" and r.levelno == logging.WARNING
    ]


def test_a_server_of_emulated_links_warns_and_reports_them(caplog):
    caplog.set_level(logging.INFO)
    status, health, metrics = _started("configs/cpu_1p1d.py:tiny")
    rates = {
        "snic_rx": 5e5,
        "snic_tx": 5e5,
        "cnic_rx": 4e6,
        "cnic_tx": 4e6,
        "h2d": 8e6,
        "d2h": 8e6,
    }
    assert (status, health) == (200, {"status": "ok", "emulated_links": rates})
    (line,) = _warnings(caplog)
    assert line.startswith("emulated links")
    assert "snic_rx 0.5 MB/s" in line and "cnic_tx 4 MB/s" in line and "h2d 8 MB/s" in line
    assert f'{GAUGE}{{link="snic_rx"}} 500000.0' in metrics
    assert f'{GAUGE}{{link="d2h"}} 8e+06' in metrics


def test_a_warming_server_reports_them_too():
    status, health, _ = _started("configs/balanced.py", ready=False)
    assert status == 503 and health["status"] == "starting"
    assert health["emulated_links"]["snic_rx"] == 200e6


def test_a_server_of_the_serving_config_reports_no_emulated_link(caplog):
    caplog.set_level(logging.INFO)
    status, health, metrics = _started("configs/serve.py:tiny")
    assert (status, health) == (200, {"status": "ok"})
    assert _warnings(caplog) == []
    assert f"{GAUGE}{{" not in metrics  # the family, with no sample
