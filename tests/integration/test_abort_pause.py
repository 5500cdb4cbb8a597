"""Abort and pause (what RL trainers drive around weight updates), on an in-process 1P1D cluster:
an aborted round returns the tokens it generated so far (a prefix of the unaborted round's),
marked `finish_reason="abort"`, and its session steps on from there; a paused router holds new
rounds until resumed and `pause("abort")` ends the running ones; `update_params(pause="abort")`
ends them and serves the new params; `pause="keep"` halts them, serves the new params under
them and lets them decode on (the result records which params drew which tokens); the HTTP
admin endpoints do the same over HTTP."""

from __future__ import annotations

import asyncio
import threading
from concurrent import futures

import numpy as np
import pytest

from dualpath_jax.config import ClusterConfig, ExperimentConfig, StoreConfig
from dualpath_jax.model.transformer import init_model
from dualpath_jax.presets import TINY_QWEN2
from dualpath_jax.rollout import InProcessBackend, Session
from dualpath_jax.wire.client import RolloutError

MAX_LEN = 512
LONG = 400  # a round long enough to be aborted mid-way


def _config() -> ExperimentConfig:
    return ExperimentConfig(
        model=TINY_QWEN2,
        cluster=ClusterConfig(
            prefill_nodes=1, decode_nodes=1, decode_max_len=MAX_LEN, runtime="thread"
        ),
        store=StoreConfig(block_tokens=16),
    )


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, start_cluster):
    with start_cluster(_config(), tmp_path_factory.mktemp("abort"), "thread") as c:
        yield c


@pytest.fixture(scope="module")
def local():
    return InProcessBackend(init_model(TINY_QWEN2, seed=_config().seed), max_len=MAX_LEN)


def _started(client, session: str, append, gen: int):
    """Submits a streamed round; returns its future once its first tokens arrived."""
    seen = threading.Event()
    fut = client.submit(session, append, gen, on_tokens=lambda start, toks: seen.set())
    assert seen.wait(120), "no token streamed"
    return fut


def test_abort_returns_a_prefix_and_the_session_goes_on(cluster, local):
    client = cluster.client()
    try:
        prompt = np.random.RandomState(0).randint(0, 256, 30).tolist()
        client.open_session("a")
        fut = _started(client, "a", prompt, LONG)
        assert client.abort(fut.request) == [fut.request]
        res = fut.result(60)
        assert res.finish_reason == "abort"
        assert 0 < len(res.tokens) < LONG
        want = Session(local, "a-ref").step(prompt, len(res.tokens))
        assert list(res.tokens) == want  # what it generated, unchanged
        # the session goes on from prompt + the partial tokens
        nxt = client.submit("a", [7, 8, 9], 5).result(60)
        ref = Session(local, "a-ref2")
        assert list(nxt.tokens) == ref.step(prompt + list(res.tokens) + [7, 8, 9], 5)
        assert client.abort("no-such-request") == []
    finally:
        client.close()


def test_pause_holds_new_rounds_and_abort_ends_running_and_held_ones(cluster, local):
    client = cluster.client()
    try:
        for s in ("p1", "p2", "p3"):
            client.open_session(s)
        prompt = np.random.RandomState(1).randint(0, 256, 20).tolist()
        running = _started(client, "p1", prompt, LONG)
        client.pause("abort")  # ends `running` now, answers once nothing is in flight
        res = running.result(10)
        assert res.finish_reason == "abort" and len(res.tokens) < LONG
        held = client.submit("p2", prompt, 4)
        dropped = client.submit("p3", prompt, 4)
        with pytest.raises(futures.TimeoutError):
            held.result(1.0)  # held while paused
        assert client.abort(sessions="p3") == [dropped.request]
        gone = dropped.result(30)
        assert gone.finish_reason == "abort" and list(gone.tokens) == []
        client.resume()
        assert list(held.result(60).tokens) == Session(local, "p-ref").step(prompt, 4)
        # the session of the round aborted before its first token keeps its append
        nxt = client.submit("p3", [1, 2], 3).result(60)
        assert list(nxt.tokens) == Session(local, "p3-ref").step(prompt + [1, 2], 3)
        with pytest.raises(RolloutError, match="pause mode"):
            client.pause("sideways")
    finally:
        client.close()


def test_update_params_with_pause_abort_ends_running_rounds(cluster):
    client = cluster.client()
    try:
        client.open_session("u")
        prompt = np.random.RandomState(2).randint(0, 256, 20).tolist()
        running = _started(client, "u", prompt, LONG)
        new = init_model(TINY_QWEN2, seed=7)
        version = client.update_params(new, version="step-abort", pause="abort")
        res = running.result(10)
        assert res.finish_reason == "abort" and len(res.tokens) < LONG
        assert client.stats()["params_version"] == version == "step-abort"
        client.open_session("u2")
        got = client.submit("u2", prompt, 4).result(60)
        want = Session(InProcessBackend(new, max_len=MAX_LEN), "ref").step(prompt, 4)
        assert list(got.tokens) == want  # the new params serve
    finally:
        client.close()


pytest.importorskip("aiohttp")


def test_admin_endpoints(cluster, tmp_path):
    from aiohttp.test_utils import TestClient, TestServer

    from dualpath_jax.model.checkpoint import save_params_tree
    from dualpath_jax.serving.server import ApiServer, ServerConfig
    from dualpath_jax.serving.tokenizer import ByteTokenizer

    client = cluster.client()
    ckpt = save_params_tree(init_model(TINY_QWEN2, seed=11), tmp_path / "ckpt")
    key = {"Authorization": "Bearer k"}

    async def run():
        cfg = ServerConfig("tiny", MAX_LEN, TINY_QWEN2.vocab_size, api_key="k")
        server = ApiServer(client, ByteTokenizer(), cfg)
        async with TestClient(TestServer(server.app())) as tc:
            out = {}
            out["no_key"] = (await tc.post("/pause_generation", json={"mode": "wait"})).status
            out["health"] = await (await tc.get("/health_generate", headers=key)).json()
            r = await tc.post("/pause_generation", json={"mode": "wait"}, headers=key)
            out["pause"] = await r.json()
            body = {"prompt": [5] * 20, "max_tokens": 3, "ignore_eos": True}
            comp = asyncio.ensure_future(tc.post("/v1/completions", json=body, headers=key))
            await asyncio.sleep(1.0)
            out["held"] = not comp.done()
            r = await tc.post("/abort_requests", json={"abort_all": True}, headers=key)
            out["abort"] = await r.json()
            out["aborted"] = await (await comp).json()
            out["resume"] = await (await tc.post("/resume_generation", headers=key)).json()
            body = {"model_path": str(ckpt), "weight_version": "w1", "pause": "abort"}
            r = await tc.post("/update_weights_from_disk", json=body, headers=key)
            out["update"] = await r.json()
            out["info"] = await (await tc.get("/get_model_info", headers=key)).json()
            bad = {"model_path": str(tmp_path / "missing")}
            r = await tc.post("/update_weights_from_disk", json=bad, headers=key)
            out["bad_update"] = (r.status, await r.json())
            r = await tc.post("/pause_generation", json={"mode": "nope"}, headers=key)
            out["bad_mode"] = r.status
            return out

    try:
        out = asyncio.run(run())
    finally:
        client.close()
    assert out["no_key"] == 401
    assert out["health"] == {"status": "ok"}
    assert out["pause"]["success"] and out["held"]
    assert out["abort"]["aborted"] == 1
    choice = out["aborted"]["choices"][0]
    assert choice["finish_reason"] == "abort" and choice["text"] == ""
    assert out["resume"]["success"]
    assert out["update"] == {"success": True, "message": "weights updated", "weight_version": "w1"}
    assert out["info"]["weight_version"] == "w1" and out["info"]["max_model_len"] == MAX_LEN
    assert out["bad_update"][0] == 400 and not out["bad_update"][1]["success"]
    assert out["bad_mode"] == 400


def test_update_params_with_pause_keep_decodes_on_with_the_new_params(cluster):
    client = cluster.client()
    try:
        old, new = init_model(TINY_QWEN2, seed=5), init_model(TINY_QWEN2, seed=9)
        client.update_params(old, version="keep-old")
        client.open_session("k")
        prompt = np.random.RandomState(3).randint(0, 256, 20).tolist()
        running = _started(client, "k", prompt, LONG)
        client.update_params(new, version="keep-new", pause="keep")
        res = running.result(120)
        assert res.finish_reason == "length" and len(res.tokens) == LONG  # not ended
        (start, v0), (k, v1) = res.params_versions
        assert (start, v0, v1) == (0, "keep-old", "keep-new") and 0 < k < LONG
        ref = Session(InProcessBackend(old, max_len=MAX_LEN), "ref").step(prompt, LONG)
        assert list(res.tokens[:k]) == ref[:k]  # the old params' tokens up to the update
        assert list(res.tokens[k:]) != ref[k:]  # the new params' after it
        nxt = client.submit("k", [1, 2], 3).result(60)
        assert nxt.params_versions == [(0, "keep-new")]
        # pause("keep") halts decoding until resume
        client.open_session("k2")
        held = _started(client, "k2", prompt, LONG)
        client.pause("keep")
        with pytest.raises(futures.TimeoutError):
            held.result(1.5)
        client.resume()
        assert len(held.result(120).tokens) == LONG
    finally:
        client.close()
