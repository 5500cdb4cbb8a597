"""Group sampling (GRPO's G completions of one prompt) on an in-process 1P1D cluster: the
prompt is prefilled once, and the G continuations fork its pages on the decode engine (or read
it from the store and compute the tail after its last whole block); they are distinct,
reproducible, equal to the in-process backend's, and each is a session of its own for later
turns. Over HTTP: `n`."""

from __future__ import annotations

import asyncio
import json

import jax
import numpy as np
import pytest

from dualpath_jax.config import ClusterConfig, ExperimentConfig, StoreConfig
from dualpath_jax.model.sampling_params import SamplingParams
from dualpath_jax.model.transformer import init_model
from dualpath_jax.presets import TINY_QWEN2
from dualpath_jax.rollout import InProcessBackend, Session, Step, step_group

MAX_LEN = 512
BT = 16


def _config() -> ExperimentConfig:
    return ExperimentConfig(
        model=TINY_QWEN2,
        cluster=ClusterConfig(
            prefill_nodes=1, decode_nodes=1, decode_max_len=MAX_LEN, runtime="thread"
        ),
        store=StoreConfig(block_tokens=BT),
    )


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, start_cluster):
    with start_cluster(_config(), tmp_path_factory.mktemp("group"), "thread") as c:
        yield c


@pytest.mark.parametrize("share", ["fork", "store"])
def test_a_group_prefills_its_prompt_once(cluster, share):
    """`fork`: one round prefills the prompt, the others start from its pages on its DE and
    compute its last token only; `store`: a prefix round stores the prompt, each sample reads it
    and computes the tail after its last whole block. Either way the samples are distinct,
    reproducible, the in-process backend's, and sessions of their own."""
    local = InProcessBackend(init_model(TINY_QWEN2, seed=_config().seed), max_len=MAX_LEN)
    client = cluster.client()
    rs = np.random.RandomState(0)
    first, append = rs.randint(0, 256, 37).tolist(), rs.randint(0, 256, 150).tolist()
    key = jax.random.key(42)
    try:
        parent, mine = Session(client, f"g-{share}"), Session(local, "g")
        assert parent.step(first, 3) == mine.step(first, 3)
        kids = parent.fork(4)
        forks_before = client.stats()["counters"]["forks"]
        futs = client.submit_group(
            [k.id for k in kids],
            append,
            6,
            samplings=_samplings(4, key),  # those step_group uses
            share=share,
        )
        results = [f.result(120) for f in futs]
        prompt = len(first) + 3 + len(append)
        computed = [r.prompt_tokens - r.cached_tokens for r in results]
        separate = 4 * (prompt - parent.results[-1].prompt_tokens - 3)  # what 4 new turns cost
        if share == "fork":
            assert futs.prefix is None
            assert [r.read_path for r in results[1:]] == ["fork"] * 3
            assert computed[1:] == [1, 1, 1]  # the prompt's last token, on the DE
            assert all(r.ttft_s > 0 and r.ttst_s > 0 and not r.persist_error for r in results)
            assert computed[0] == prompt - results[0].cached_tokens
            assert client.stats()["counters"]["forks"] - forks_before == 3
            group = sum(computed)
        else:
            prefix = futs.prefix.result(1)
            assert prefix.prompt_tokens == prompt
            # each continuation computes the tail after the prompt's last whole block, no more
            assert all(1 <= c <= BT for c in computed), computed
            group = (prefix.prompt_tokens - prefix.cached_tokens) + sum(computed)
        assert group < separate / 2
        tokens = [list(r.tokens) for r in results]
        assert len({tuple(t) for t in tokens}) == 4  # distinct
        # the same as the in-process backend's group, and reproducible
        local_kids = mine.fork(4)
        want = step_group(local_kids, append, 6, temperature=1.0, key=key)
        assert tokens == want
        again = step_group(parent.fork(4), append, 6, temperature=1.0, key=key, logprobs=True)
        assert [s.tokens for s in again] == tokens and all(isinstance(s, Step) for s in again)
        # each continuation is a session of its own
        nxt = kids[1].step([9, 9], 4)
        assert nxt == local_kids[1].step([9, 9], 4)
        # ... which finds the prompt's blocks and its own generated ones stored
        assert kids[1].results[-1].cached_tokens == (prompt + 5) // BT * BT
    finally:
        client.close()


def test_forks_that_outlive_their_first_round_or_have_none(cluster):
    """A group of one-token rounds (the first round ends as its forks are taken: they hold its
    pages), and a round following a request that is not there (it runs on its own)."""
    client = cluster.client()
    local = InProcessBackend(init_model(TINY_QWEN2, seed=_config().seed), max_len=MAX_LEN)
    prompt = np.random.RandomState(7).randint(0, 256, 48).tolist()  # 3 whole blocks
    key = jax.random.key(3)
    try:
        sessions = [f"one-{i}" for i in range(3)]
        for sid in sessions:
            client.open_session(sid)
        futs = client.submit_group(sessions, prompt, 1, samplings=_samplings(3, key))
        got = [list(f.result(120).tokens) for f in futs]
        mine = [Session(local, f"one-{i}") for i in range(3)]
        assert got == step_group(mine, prompt, 1, temperature=1.0, key=key)
        client.open_session("alone")
        res = client.submit("alone", prompt, 3, follows="no-such-request").result(120)
        assert res.read_path != "fork"
        assert list(res.tokens) == Session(local, "alone").step(prompt, 3)
    finally:
        client.close()


def _samplings(n, key):
    from dualpath_jax.rollout import round_sampling

    return [round_sampling(1.0, 1.0, jax.random.fold_in(key, i)) for i in range(n)]


def test_stop_tokens_on_the_cluster_equal_the_in_process_engines(cluster):
    """Rounds that stop at a stop token, one session's and a group's (each sample on its own),
    give the in-process backend's tokens; the next round goes on from the stop."""
    client = cluster.client()
    local = InProcessBackend(init_model(TINY_QWEN2, seed=_config().seed), max_len=MAX_LEN)
    rs = np.random.RandomState(12)
    prompt, nxt = rs.randint(0, 256, 50).tolist(), rs.randint(0, 256, 20).tolist()
    stop, key = list(range(0, 256, 5)), jax.random.key(7)
    try:
        mine, theirs = Session(local, "st"), Session(client, "st")
        kw = {"temperature": 1.0, "key": key, "stop_tokens": stop}
        assert theirs.step(prompt, 12, **kw) == mine.step(prompt, 12, **kw)
        assert theirs.results[-1].finish_reason == mine.results[-1].finish_reason
        group = step_group(theirs.fork(3), nxt, 12, **kw)
        assert group == step_group(mine.fork(3), nxt, 12, **kw)
        assert any(len(g) < 12 for g in group)  # (a fifth of the vocabulary stops a round)
        assert theirs.step([3], 4) == mine.step([3], 4)
    finally:
        client.close()


def test_an_aborted_group_ends_each_sample_with_its_tokens_so_far(cluster):
    """`Client.abort` on a group's rounds mid-way: each sample (forks included) ends with the
    tokens it has, a prefix of the others' (greedy), and its session steps on."""
    import threading

    client = cluster.client()
    prompt = np.random.RandomState(31).randint(0, 256, 40).tolist()
    sids = [f"ab{k}" for k in range(3)]
    seen = [threading.Event() for _ in sids]
    try:
        for sid in sids:
            client.open_session(sid)
        futs = client.submit_group(
            sids, prompt, 400, samplings=[SamplingParams()] * 3,
            on_tokens=[lambda start, toks, *_, e=e: e.set() for e in seen],
        )  # fmt: skip
        assert all(e.wait(120) for e in seen)
        client.abort([f.request for f in futs])
        results = [f.result(120) for f in futs]
        assert all(r.finish_reason == "abort" and 1 <= len(r.tokens) < 400 for r in results)
        longest = max((list(r.tokens) for r in results), key=len)
        assert all(list(r.tokens) == longest[: len(r.tokens)] for r in results)
        assert all(len(client.submit(sid, [5, 6], 2).result(120).tokens) == 2 for sid in sids)
    finally:
        client.close()


pytest.importorskip("aiohttp")


def test_http_n_choices(cluster):
    from aiohttp.test_utils import TestClient, TestServer

    from dualpath_jax.serving.server import ApiServer, ServerConfig
    from dualpath_jax.serving.tokenizer import ByteTokenizer

    client = cluster.client()
    prompt = np.random.RandomState(1).randint(0, 256, 70).tolist()

    async def run():
        server = ApiServer(
            client, ByteTokenizer(), ServerConfig("tiny", MAX_LEN, TINY_QWEN2.vocab_size)
        )
        async with TestClient(TestServer(server.app())) as tc:
            body = {"prompt": prompt, "n": 3, "max_tokens": 5, "temperature": 1.0, "seed": 3,
                    "return_token_ids": True, "ignore_eos": True, "logprobs": 1}  # fmt: skip
            a = await (await tc.post("/v1/completions", json=body)).json()
            b = await (await tc.post("/v1/completions", json=body)).json()
            stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
            r = await tc.post("/v1/completions", json=stream)
            events = [
                line[6:] for line in (await r.text()).splitlines() if line.startswith("data: ")
            ]
            chat = await tc.post(
                "/v1/chat/completions",
                json={"messages": [{"role": "user", "content": "hi"}], "n": 2, "max_tokens": 3,
                      "stream": True, "ignore_eos": True, "temperature": 1.0, "seed": 5},
            )  # fmt: skip
            chat_events = [
                ln[6:] for ln in (await chat.text()).splitlines() if ln.startswith("data: ")
            ]
            big = await tc.post("/v1/completions", json={**body, "n": 1000})
            # a stop string, whole and streamed: each choice ends at it
            greedy = {"prompt": prompt, "n": 2, "max_tokens": 12, "temperature": 0,
                      "ignore_eos": True}  # fmt: skip
            want = (await (await tc.post("/v1/completions", json=greedy)).json())["choices"]
            stop = want[0]["text"][4:6]
            cut = await (await tc.post("/v1/completions", json={**greedy, "stop": [stop]})).json()
            live = await tc.post("/v1/completions", json={**greedy, "stop": [stop], "stream": True})
            lines = [ln[6:] for ln in (await live.text()).splitlines() if ln.startswith("data: ")]
            stops = (want, stop, cut, [json.loads(x) for x in lines[:-1]])
            return a, b, r.status, events, chat.status, chat_events, big.status, stops

    try:
        a, b, status, events, chat_status, chat_events, big, stops = asyncio.run(run())
    finally:
        client.close()
    ids = [c["token_ids"] for c in a["choices"]]
    assert [c["index"] for c in a["choices"]] == [0, 1, 2]
    assert len({tuple(i) for i in ids}) == 3 and all(len(i) == 5 for i in ids)
    assert ids == [c["token_ids"] for c in b["choices"]]  # the same seed: the same choices
    assert all(len(c["logprobs"]["token_logprobs"]) == 5 for c in a["choices"])
    assert a["usage"]["completion_tokens"] == 15 and a["usage"]["prompt_tokens"] == 70
    assert big == 400
    # streamed: each choice's chunks carry its index; together they are the whole answers
    assert status == 200 and events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    got: dict[int, list[int]] = {}
    finish = {}
    for c in chunks[:-1]:
        (ch,) = c["choices"]
        got.setdefault(ch["index"], []).extend(ch.get("token_ids") or [])
        if ch["finish_reason"]:
            finish[ch["index"]] = ch["finish_reason"]
    assert [got[i] for i in range(3)] == ids  # the same seed as the whole answers
    assert finish == {0: "length", 1: "length", 2: "length"}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 15
    assert chat_status == 200 and chat_events[-1] == "[DONE]"
    roles = [json.loads(e)["choices"][0] for e in chat_events[:-1]]
    assert sorted(c["index"] for c in roles if c["delta"].get("role")) == [0, 1]
    assert sorted(c["index"] for c in roles if c["finish_reason"]) == [0, 1]
    want, stop, cut, streamed = stops
    text = want[0]["text"]
    assert want[1]["text"] == text  # greedy: the same choice twice
    assert [c["text"] for c in cut["choices"]] == [text[: text.index(stop)]] * 2
    assert [c["finish_reason"] for c in cut["choices"]] == ["stop", "stop"]
    pieces: dict[int, str] = {}
    for c in streamed:
        (ch,) = c["choices"]
        pieces[ch["index"]] = pieces.get(ch["index"], "") + ch["text"]
    assert pieces == {0: text[: text.index(stop)], 1: text[: text.index(stop)]}


def test_identical_prompts_in_flight_fork_with_fork_identical(tmp_path, start_cluster):
    """`scheduler.fork_identical`: rounds of one prompt submitted together (no group call)
    follow the first one and fork its prompt on the decode engine; the tokens are the same."""
    import dataclasses

    cfg = _config()
    cfg = dataclasses.replace(
        cfg, scheduler=dataclasses.replace(cfg.scheduler, fork_identical=True)
    )
    prompt = np.random.RandomState(21).randint(0, 256, 60).tolist()
    with start_cluster(cfg, tmp_path, "thread") as c:
        client = c.client()
        try:
            for k in range(3):
                client.open_session(f"same{k}")
            # held by a pause, the three are admitted together on resume: none can be past
            # its prefill before the others arrive, however loaded the machine
            client.pause()
            futs = [client.submit(f"same{k}", prompt, 5) for k in range(3)]
            client.resume()
            results = [f.result(120) for f in futs]
            other = client.submit("same0", [1, 2], 3).result(120)  # a later, different prompt
        finally:
            client.close()
    paths = [r.read_path for r in results]  # one leads (the first whose lookup answers)
    assert paths.count("fork") == 2 and paths.count("none") == 1, paths
    assert len({tuple(r.tokens) for r in results}) == 1  # greedy: the same tokens
    assert other.read_path != "fork"
