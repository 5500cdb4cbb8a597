"""Streamed rounds of several sessions at once through an in-process 1P1D cluster's `Client`
(each decode step's tokens travel as one `TokensOut`, then one `Partial` per client): every
round's callback sees its positions in order and once each, the result's tokens with the same
per-token log-probabilities, and greedy tokens are the reference model's; over HTTP each
streamed chunk carries its tokens in order."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dualpath_jax.config import ClusterConfig, ExperimentConfig, StoreConfig
from dualpath_jax.model.sampling_params import SamplingParams
from dualpath_jax.presets import TINY_QWEN2
from dualpath_jax.results import Logprobs

RESULT_TIMEOUT_S = 120


def _config() -> ExperimentConfig:
    return ExperimentConfig(
        model=TINY_QWEN2,
        cluster=ClusterConfig(
            prefill_nodes=1, decode_nodes=1, decode_max_len=256, runtime="thread"
        ),
        store=StoreConfig(block_tokens=16),
    )


def _trajectories(n: int) -> list[tuple[str, list[tuple[list[int], int]]]]:
    rs = np.random.RandomState(5)
    v = TINY_QWEN2.vocab_size
    return [
        (f"s{k}", [(rs.randint(0, v, 20 + 7 * k).tolist(), 9), (rs.randint(0, v, 5).tolist(), 6)])
        for k in range(n)
    ]


def test_concurrent_streams_keep_their_order_and_logprobs(
    tmp_path, start_cluster, reference_tokens
):
    trajs = _trajectories(3)
    asks = {"s0": 2, "s1": None, "s2": 0}  # logprobs: top-2, none, the drawn tokens'
    with start_cluster(_config(), tmp_path, "thread") as cluster:
        client = cluster.client()
        try:
            for sid, _ in trajs:
                client.open_session(sid)
            for turn in range(2):
                seen: dict[str, list] = {sid: [] for sid, _ in trajs}
                futs = {}
                for sid, rounds in trajs:
                    append, gen = rounds[turn]

                    def on_tokens(start, tokens, lp=None, sid=sid):
                        seen[sid].append((start, list(tokens), lp))

                    futs[sid] = client.submit(
                        sid,
                        append,
                        gen,
                        sampling=SamplingParams(logprobs=asks[sid]),
                        on_tokens=on_tokens,
                    )
                for traj in trajs:
                    sid = traj[0]
                    res = futs[sid].result(RESULT_TIMEOUT_S)
                    assert res.tokens == reference_tokens(traj)[turn]
                    chunks = seen[sid]
                    at = [s + i for s, toks, _ in chunks for i in range(len(toks))]
                    assert at == list(range(len(res.tokens)))  # in order, once each
                    assert [t for _, toks, _ in chunks for t in toks] == res.tokens
                    if asks[sid] is None:
                        assert all(lp is None for *_, lp in chunks) and res.logprobs is None
                        continue
                    streamed = Logprobs()
                    for _, toks, lp in chunks:
                        assert len(lp) == len(toks)
                        streamed.extend(lp)
                    assert streamed == res.logprobs and len(streamed) == len(res.tokens)
                    assert all(len(k) == asks[sid] for k in streamed.top_ids)
        finally:
            client.close()


pytest.importorskip("aiohttp")


def test_http_streams_of_several_requests_carry_their_tokens_in_order(tmp_path, start_cluster):
    import asyncio

    from aiohttp.test_utils import TestClient, TestServer

    from dualpath_jax.serving.server import ApiServer, ServerConfig
    from dualpath_jax.serving.tokenizer import ByteTokenizer

    rs = np.random.RandomState(7)
    prompts = [rs.randint(0, 256, n).tolist() for n in (30, 41, 17)]
    gen = 12

    async def stream(tc, prompt: list[int]) -> tuple[list[int], list[int]]:
        body = {"prompt": prompt, "max_tokens": gen, "temperature": 0, "stream": True,
                "ignore_eos": True, "return_token_ids": True}  # fmt: skip
        r = await tc.post("/v1/completions", json=body)
        assert r.status == 200
        streamed = []
        for line in (await r.text()).splitlines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    streamed += choice.get("token_ids") or []
        whole = await (await tc.post("/v1/completions", json={**body, "stream": False})).json()
        return streamed, whole["choices"][0]["token_ids"]

    async def run(client):
        server = ApiServer(
            client, ByteTokenizer(), ServerConfig("tiny", 256, TINY_QWEN2.vocab_size)
        )
        async with TestClient(TestServer(server.app())) as tc:
            return await asyncio.gather(*(stream(tc, p) for p in prompts))

    with start_cluster(_config(), tmp_path, "thread") as cluster:
        client = cluster.client()
        try:
            got = asyncio.run(run(client))
        finally:
            client.close()
    for streamed, whole in got:
        assert len(streamed) == gen and streamed == whole  # greedy: the same tokens, in order
