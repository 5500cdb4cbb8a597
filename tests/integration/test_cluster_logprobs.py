"""Log-probabilities through the cluster (`SamplingParams.logprobs`): a 1P1D in-process cluster
returns, for greedy and sampled multi-turn rounds (the first token from the prefill engine, the
rest from the decode step, later turns over stored KV), the same tokens and log-probabilities as
`InProcessBackend` and as the model's own log-softmax at the drawn ids (max abs difference 1e-4),
in the result, in streamed chunks, and over HTTP in OpenAI's shapes, which the `openai` client
parses."""

from __future__ import annotations

import asyncio

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dualpath_jax.config import ClusterConfig, ExperimentConfig, StoreConfig
from dualpath_jax.model.transformer import init_model
from dualpath_jax.presets import TINY_DEEPSEEK, TINY_QWEN2
from dualpath_jax.rollout import InProcessBackend, Session, Step

MAX_LEN = 256
ATOL = 1e-4


def _config(preset) -> ExperimentConfig:
    return ExperimentConfig(
        model=preset,
        cluster=ClusterConfig(
            prefill_nodes=1, decode_nodes=1, decode_max_len=MAX_LEN, runtime="thread"
        ),
        store=StoreConfig(block_tokens=16),
    )


def _model_logprobs(model, seq: list[int], n_prompt: int, t: float = 1.0) -> np.ndarray:
    """log-softmax(logits / t) at each id of `seq` after `n_prompt`, one monolithic forward."""
    logits, _ = model(jnp.asarray([seq], jnp.int32))
    z = np.asarray(logits[0], np.float64) / t
    z = z - z.max(-1, keepdims=True)
    z -= np.log(np.exp(z).sum(-1, keepdims=True))
    return np.array([z[p - 1, seq[p]] for p in range(n_prompt, len(seq))])


ROUNDS = ((0.0, 4), (0.9, 0), (1.0, 2))  # (temperature, top-k) per turn


@pytest.mark.parametrize("preset", [TINY_QWEN2, TINY_DEEPSEEK], ids=["qwen2", "deepseek"])
def test_cluster_logprobs_equal_inprocess_and_the_model(tmp_path, start_cluster, preset):
    cfg = _config(preset)
    model = init_model(preset, seed=cfg.seed)
    local = InProcessBackend(model, max_len=MAX_LEN)
    rs = np.random.RandomState(3)
    appends = [rs.randint(0, preset.vocab_size, n).tolist() for n in (40, 9, 21)]
    with start_cluster(cfg, tmp_path, "thread") as cluster:
        client = cluster.client()
        try:
            remote, mine = Session(client, "lp"), Session(local, "lp")
            context: list[int] = []
            streamed: dict[int, float] = {}
            for turn, ((t, k), append) in enumerate(zip(ROUNDS, appends)):
                key = jax.random.key(turn) if t else None
                kw = dict(temperature=t, key=key, logprobs=k or True)
                got = remote.step(append, 7, **kw)
                want = mine.step(append, 7, **kw)
                assert isinstance(got, Step) and got.tokens == want.tokens
                for field in ("model", "sampled", "top"):
                    np.testing.assert_allclose(
                        np.array(getattr(got.logprobs, field)),
                        np.array(getattr(want.logprobs, field)),
                        atol=ATOL,
                        err_msg=field,
                    )
                assert got.logprobs.top_ids == want.logprobs.top_ids
                context += append
                seq = context + got.tokens
                np.testing.assert_allclose(
                    got.logprobs.model, _model_logprobs(model, seq, len(context)), atol=ATOL
                )
                np.testing.assert_allclose(
                    got.logprobs.sampled,
                    _model_logprobs(model, seq, len(context), t or 1.0),
                    atol=ATOL,
                )
                if turn:
                    assert got.result.cached_tokens > 0  # later turns read stored KV
                context += got.tokens

            # a streamed round: each chunk carries its tokens' log-probabilities
            def on_tokens(start, tokens, lp):
                for i, v in enumerate(lp.model):
                    streamed.setdefault(start + i, v)

            fut = client.submit(
                "lp",
                [5, 6, 7],
                6,
                sampling=remote_sampling(),
                on_tokens=on_tokens,
            )
            res = fut.result(120)
            assert sorted(streamed) == list(range(6))
            np.testing.assert_allclose(
                [streamed[i] for i in range(6)], res.logprobs.model, atol=1e-6
            )
        finally:
            client.close()


def remote_sampling():
    from dualpath_jax.model.sampling_params import SamplingParams

    return SamplingParams(logprobs=0)


pytest.importorskip("aiohttp")


def test_http_logprobs_in_openai_shapes(tmp_path, start_cluster):
    from aiohttp.test_utils import TestClient, TestServer

    from dualpath_jax.serving.server import ApiServer, ServerConfig
    from dualpath_jax.serving.tokenizer import ByteTokenizer

    cfg = _config(TINY_QWEN2)
    model = init_model(TINY_QWEN2, seed=cfg.seed)
    prompt = np.random.RandomState(5).randint(0, 256, 30).tolist()

    async def run(client):
        server = ApiServer(
            client, ByteTokenizer(), ServerConfig("tiny", MAX_LEN, TINY_QWEN2.vocab_size)
        )
        async with TestClient(TestServer(server.app())) as tc:
            body = {"prompt": prompt, "max_tokens": 5, "temperature": 0.7, "seed": 11,
                    "logprobs": 3, "return_token_ids": True, "ignore_eos": True}  # fmt: skip
            comp = await (await tc.post("/v1/completions", json=body)).json()
            chat_body = {"messages": [{"role": "user", "content": "hi there"}], "max_tokens": 4,
                         "temperature": 0, "logprobs": True, "top_logprobs": 2,
                         "return_token_ids": True, "ignore_eos": True}  # fmt: skip
            chat = await (await tc.post("/v1/chat/completions", json=chat_body)).json()
            r = await tc.post("/v1/chat/completions", json={**chat_body, "stream": True})
            events = [
                line[6:] for line in (await r.text()).splitlines() if line.startswith("data: {")
            ]
            bad = await tc.post("/v1/chat/completions", json={**chat_body, "logprobs": False})
            too_many = await tc.post("/v1/completions", json={**body, "logprobs": 21})
            return comp, chat, events, (bad.status, await bad.json()), too_many.status

    with start_cluster(cfg, tmp_path, "thread") as cluster:
        client = cluster.client()
        try:
            comp, chat, events, bad, too_many = asyncio.run(run(client))
        finally:
            client.close()
    import json

    import openai.types as ot

    c = comp["choices"][0]
    ids = c["token_ids"]
    lp = c["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(ids) == 5
    np.testing.assert_allclose(
        lp["token_logprobs"], _model_logprobs(model, prompt + ids, len(prompt)), atol=ATOL
    )
    np.testing.assert_allclose(
        lp["sampling_logprobs"], _model_logprobs(model, prompt + ids, len(prompt), 0.7), atol=ATOL
    )
    assert all(len(d) <= 3 for d in lp["top_logprobs"])
    assert lp["text_offset"][0] == 0
    ot.Completion.model_validate(comp)  # the openai client's own types parse it

    ch = chat["choices"][0]
    content = ch["logprobs"]["content"]
    assert len(content) == len(ch["token_ids"]) == 4
    assert all(len(item["top_logprobs"]) == 2 for item in content)
    for item in content:  # greedy: the drawn token is the most likely
        assert item["top_logprobs"][0]["logprob"] == pytest.approx(item["logprob"], abs=1e-6)
        assert item["sampling_logprob"] == pytest.approx(item["logprob"], abs=1e-6)
    parsed = ot.chat.ChatCompletion.model_validate(chat)
    assert parsed.choices[0].logprobs.content[0].top_logprobs[0].logprob <= 0

    streamed = []
    for e in events:
        chunk = ot.chat.ChatCompletionChunk.model_validate(json.loads(e))
        for choice in chunk.choices:
            if choice.logprobs is not None and choice.logprobs.content:
                streamed += [x.logprob for x in choice.logprobs.content]
    np.testing.assert_allclose(streamed, [x["logprob"] for x in content], atol=1e-6)

    assert bad[0] == 400 and bad[1]["error"]["param"] == "top_logprobs"
    assert too_many == 400
