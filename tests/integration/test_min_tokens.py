"""`min_tokens` end to end: the HTTP server over an in-process 1P1D cluster, with an end-of-turn id
chosen to be the model's own next greedy token, so that without `min_tokens` the answer would end
at once. With it, the prefill engine (the first token) and the decode engine (the rest) draw no
end-of-turn id before `min_tokens` tokens; the tokens equal a reference that masks the id the same
way on the monolithic model, and the round ends at the first end-of-turn id after that (`stop`)
or at `max_tokens` (`length`)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from dualpath_jax.config import ClusterConfig, ExperimentConfig, StoreConfig
from dualpath_jax.presets import TINY_QWEN2

pytest.importorskip("aiohttp")
from aiohttp.test_utils import TestClient, TestServer  # noqa: E402

from dualpath_jax.serving.server import ApiServer, ServerConfig  # noqa: E402
from dualpath_jax.serving.tokenizer import ByteTokenizer  # noqa: E402

MODEL = "tiny-qwen2"
MAX_LEN = 256


class _EndsWith(ByteTokenizer):
    """The byte tokenizer with another end-of-turn id."""

    def __init__(self, eos: int):
        super().__init__()
        self.eos_ids = [eos]


def _config() -> ExperimentConfig:
    return ExperimentConfig(
        model=TINY_QWEN2,
        cluster=ClusterConfig(
            prefill_nodes=1, decode_nodes=1, decode_max_len=MAX_LEN, runtime="thread"
        ),
        store=StoreConfig(block_tokens=16),
    )


def _reference(prompt: list[int], n: int, eos: int, min_tokens: int) -> list[int]:
    """Greedy tokens of the monolithic model (no KV cache), `eos` masked while fewer than
    `min_tokens` tokens came before, ending after the first `eos` drawn."""
    from dualpath_jax.model.runner import ModelRunner, PrefillBatch
    from dualpath_jax.model.transformer import init_model

    runner = ModelRunner(init_model(TINY_QWEN2, seed=_config().seed))
    out: list[int] = []
    while len(out) < n:
        res, _ = runner.prefill_monolithic(PrefillBatch.build(TINY_QWEN2, [prompt + out], [0]))
        logits = np.array(res.last_logits, dtype=np.float32)[0]
        if len(out) < min_tokens:
            logits[eos] = -np.inf
        out.append(int(logits.argmax()))
        if out[-1] == eos:
            break
    return out


def test_an_early_end_of_turn_waits_for_min_tokens(tmp_path, start_cluster):
    prompt = np.random.RandomState(4).randint(0, 256, 40).tolist()
    free = _reference(prompt, 2, eos=-1, min_tokens=0)  # eos -1: never drawn

    async def ask(client, tok, **body):
        server = ApiServer(client, tok, ServerConfig(MODEL, MAX_LEN, TINY_QWEN2.vocab_size))
        async with TestClient(TestServer(server.app())) as tc:
            r = await tc.post(
                "/v1/completions",
                json={"prompt": prompt, "temperature": 0, "return_token_ids": True, **body},
            )
            assert r.status == 200, await r.text()
            return (await r.json())["choices"][0]

    with start_cluster(_config(), tmp_path, "thread") as cluster:
        client = cluster.client()
        try:
            # the first generated token is the end of turn: the prefill engine holds it back
            first = _EndsWith(free[0])
            plain = asyncio.run(ask(client, first, max_tokens=12))
            assert plain["token_ids"] == [free[0]] and plain["finish_reason"] == "stop"
            held = asyncio.run(ask(client, first, max_tokens=12, min_tokens=5))
            want = _reference(prompt, 12, free[0], 5)
            assert held["token_ids"] == want and len(want) >= 5
            assert free[0] not in want[:5]
            assert held["finish_reason"] == ("stop" if want[-1] == free[0] else "length")
            # the second is: the decode engine holds it back
            second = _EndsWith(free[1])
            plain = asyncio.run(ask(client, second, max_tokens=12))
            assert plain["token_ids"] == free[:2] and plain["finish_reason"] == "stop"
            held = asyncio.run(ask(client, second, max_tokens=12, min_tokens=6))
            want = _reference(prompt, 12, free[1], 6)
            assert held["token_ids"] == want and free[1] not in want[:6]
            assert held["finish_reason"] == ("stop" if want[-1] == free[1] else "length")
        finally:
            client.close()
