"""The OpenAI-compatible server on a 1P1D cluster, driven by the official `openai` client.

Completions and chat, streamed and not, token-id prompts; two turns of one agent session, where
the second loads the first turn's KV (`cached_tokens` > 0) and its greedy tokens equal the
reference model's `generate` on the same ids; OpenAI-shaped errors (400, 401); a client that
disconnects mid-stream frees its round; `/metrics` parses as Prometheus text.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.request

import pytest

from dualpath_jax.config import (
    ClusterConfig,
    ExperimentConfig,
    Policy,
    SchedulerConfig,
    StoreConfig,
)
from dualpath_jax.presets import TINY_QWEN2

openai = pytest.importorskip("openai")
pytest.importorskip("aiohttp")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from dualpath_jax.serving.server import ApiServer, ServerConfig  # noqa: E402
from dualpath_jax.serving.tokenizer import ByteTokenizer  # noqa: E402

pytestmark = pytest.mark.multiprocess

KEY = "test-key"
MODEL = "tiny-qwen2"
MAX_LEN = 1024
TIMEOUT_S = 180.0


def _config() -> ExperimentConfig:
    return ExperimentConfig(
        model=TINY_QWEN2,
        cluster=ClusterConfig(prefill_nodes=1, decode_nodes=1, decode_max_len=MAX_LEN),
        store=StoreConfig(block_tokens=16),
        scheduler=SchedulerConfig(policy=Policy.DUALPATH),
    )


class _Serving:
    """An ApiServer on its own event-loop thread in this process."""

    def __init__(self, client, cfg: ServerConfig):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server = ApiServer(client, ByteTokenizer(), cfg)
        port = self._run(self.server.start("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{port}"

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(60)

    def close(self) -> None:
        self._run(self.server.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def served(tmp_path_factory, start_cluster):
    with start_cluster(_config(), tmp_path_factory.mktemp("api")) as cluster:
        client = cluster.client()
        cfg = ServerConfig(model=MODEL, max_context=MAX_LEN, vocab_size=257, api_key=KEY)
        serving = _Serving(client, cfg)
        try:
            yield serving
        finally:
            serving.close()
            client.close()


@pytest.fixture(scope="module")
def api(served):
    return openai.OpenAI(base_url=served.url + "/v1", api_key=KEY, max_retries=0, timeout=TIMEOUT_S)


@pytest.fixture(scope="module")
def reference():
    """Greedy tokens of the monolithic reference model with the engines' parameters."""
    from dualpath_jax.model.generation import generate
    from dualpath_jax.model.runner import ModelRunner
    from dualpath_jax.model.transformer import init_model

    runner = ModelRunner(init_model(TINY_QWEN2, seed=_config().seed))
    return lambda ids, n: generate(runner, list(ids), n)


def _ids(n: int, seed: int) -> list[int]:
    import numpy as np

    return np.random.RandomState(seed).randint(0, 256, n).tolist()


def _extra(resp) -> dict:
    return resp.model_extra or {}


def test_completions_with_token_ids_match_the_reference(api, reference):
    prompt = _ids(40, 1)
    want = reference(prompt, 8)
    r = api.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    choice = r.choices[0]
    assert choice.model_extra["token_ids"] == want
    assert choice.text == ByteTokenizer().decode(want)
    assert choice.finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (40, 8)
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    assert _extra(r)["dualpath"]["read_path"] == "none"

    chunks = list(
        api.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
    )
    streamed = [
        t for c in chunks for ch in c.choices for t in (ch.model_extra or {}).get("token_ids", [])
    ]
    assert streamed == want
    assert "".join(ch.text for c in chunks for ch in c.choices) == choice.text
    assert chunks[-1].usage.completion_tokens == 8
    assert [ch.finish_reason for c in chunks for ch in c.choices][-1] == "length"


def test_string_prompts_and_chat_streamed_and_not(api, reference):
    tok = ByteTokenizer()
    r = api.completions.create(model=MODEL, prompt="Hello, agent.", max_tokens=6, temperature=0)
    want = reference(tok.encode("Hello, agent."), 6)
    if tok.END in want:  # the end-of-turn id stops a round (unless ignore_eos)
        want = want[: want.index(tok.END) + 1]
    assert r.choices[0].text == tok.decode(want)
    assert r.usage.completion_tokens == len(want)

    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a prime."},
    ]
    full = api.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    want = reference(tok.chat(messages), 6)
    assert full.choices[0].message.role == "assistant"
    assert full.choices[0].message.content == tok.decode(want)
    assert full.usage.prompt_tokens == len(tok.chat(messages))
    stream = api.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=6,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    parts = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert "".join(parts) == full.choices[0].message.content


def test_two_turns_of_a_session_load_the_first_turns_kv(api, reference):
    """The second turn's prompt extends the first turn's prompt and answer: its earlier KV is
    read from the store (cached_tokens > 0), and its greedy tokens equal `generate` on the same
    token ids."""
    extra = {"ignore_eos": True, "return_token_ids": True}
    turn1 = _ids(70, 2)
    r1 = api.completions.create(
        model=MODEL,
        prompt=turn1,
        max_tokens=5,
        temperature=0,
        extra_body=extra,
        extra_headers={"X-Session-Id": "agent-1"},
    )
    got1 = r1.choices[0].model_extra["token_ids"]
    assert got1 == reference(turn1, 5)
    turn2 = turn1 + got1 + _ids(30, 3)
    r2 = api.completions.with_raw_response.create(
        model=MODEL,
        prompt=turn2,
        max_tokens=7,
        temperature=0,
        extra_body=extra,
        extra_headers={"X-Session-Id": "agent-1"},
    )
    c2 = r2.parse()
    assert c2.usage.prompt_tokens_details.cached_tokens > 0
    assert c2.usage.prompt_tokens_details.cached_tokens % 16 == 0
    want = reference(turn2, 7)
    assert c2.choices[0].model_extra["token_ids"] == want
    assert c2.choices[0].text == ByteTokenizer().decode(want)
    assert r2.headers["X-DualPath-Read-Path"] in ("pe", "de", "split")
    assert _extra(c2)["dualpath"]["session"] == "agent-1"

    # An edited history (the session rewinds to the common prefix) still matches the reference.
    turn3 = turn1 + _ids(20, 4)
    r3 = api.completions.create(
        model=MODEL, prompt=turn3, max_tokens=4, temperature=0, extra_body=extra, user="agent-1"
    )
    assert r3.choices[0].model_extra["token_ids"] == reference(turn3, 4)
    assert r3.usage.prompt_tokens_details.cached_tokens > 0


def test_chat_sessions_reuse_kv_across_turns(api):
    messages = [{"role": "user", "content": "Plan a trip in three steps, then call the tools."}]
    r1 = api.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=4,
        temperature=0,
        extra_headers={"X-Session-Id": "chat-1"},
    )
    messages += [
        {"role": "assistant", "content": r1.choices[0].message.content},
        {"role": "user", "content": "Tool result: ok. Continue."},
    ]
    r2 = api.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=4,
        temperature=0,
        extra_headers={"X-Session-Id": "chat-1"},
    )
    assert r2.usage.prompt_tokens_details.cached_tokens >= 32


def test_stop_strings_end_the_text_and_the_round(api, reference):
    tok = ByteTokenizer()
    prompt = _ids(24, 5)
    want = tok.decode(reference(prompt, 12))
    stop = want[4:6]
    r = api.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=12,
        temperature=0,
        stop=[stop],
        extra_body={"ignore_eos": True},
    )
    assert r.choices[0].text == want[: want.index(stop)]
    assert r.choices[0].finish_reason == "stop"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"model": MODEL, "prompt": [1] * (MAX_LEN + 1)}, "context"),
        ({"model": MODEL, "prompt": "x", "max_tokens": MAX_LEN}, "exceeds this model's context"),
        ({"model": MODEL, "prompt": [5, 300]}, r"token id 300 is out of range"),
        ({"model": MODEL, "prompt": "x", "temperature": 3}, "temperature must lie in"),
        ({"model": MODEL, "prompt": "x", "n": 0}, r"n must lie in \[1, 64\]"),
        ({"model": MODEL, "prompt": "x", "max_tokens": 0}, "max_tokens must be >= 1"),
        ({"model": MODEL, "prompt": []}, "prompt must be"),
    ],
)
def test_bad_input_is_a_400_in_openai_shape(api, kwargs, message):
    with pytest.raises(openai.BadRequestError, match=message) as err:
        api.completions.create(**kwargs)
    assert err.value.status_code == 400
    assert err.value.body["type"] == "invalid_request_error"


def test_another_model_is_a_404_model_not_found(api):
    with pytest.raises(openai.NotFoundError, match="does not exist here") as err:
        api.completions.create(model="other", prompt="x", max_tokens=1)
    assert err.value.code == "model_not_found"
    assert err.value.body["type"] == "invalid_request_error"


def test_a_wrong_key_is_a_401_and_health_models_metrics_work(served, api):
    bad = openai.OpenAI(base_url=served.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as err:
        bad.completions.create(model=MODEL, prompt="x", max_tokens=1)
    assert err.value.status_code == 401
    assert [m.id for m in api.models.list()] == [MODEL]
    with urllib.request.urlopen(served.url + "/health", timeout=30) as r:
        assert json.load(r) == {"status": "ok"}
    with urllib.request.urlopen(served.url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert families["dualpath_router_up"].samples[0].value == 1
    assert sum(s.value for s in families["dualpath_prompt_tokens"].samples) > 0
    for name in (
        "dualpath_time_to_first_token_seconds",
        "dualpath_time_per_output_token_seconds",
        "dualpath_round_latency_seconds",
        "dualpath_cached_tokens",
        "dualpath_read_bytes",
        "dualpath_link_bytes",
        "dualpath_storage_read_queue_tokens",
        "dualpath_engine_batch_size",
        "dualpath_router_queued",
    ):
        assert name in families, name


def test_a_client_that_disconnects_mid_stream_frees_its_round(served, api):
    client = served.server.client
    before = client.stats()["counters"]["cancelled"]
    stream = api.completions.create(
        model=MODEL,
        prompt=_ids(20, 6),
        max_tokens=600,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    next(iter(stream))  # the first token is out
    stream.close()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        stats = client.stats()
        if stats["counters"]["cancelled"] > before and stats["in_flight"] == 0:
            break
        time.sleep(0.2)
    assert stats["counters"]["cancelled"] == before + 1
    assert stats["in_flight"] == 0
    # and the server keeps serving
    r = api.completions.create(model=MODEL, prompt="ok", max_tokens=2, temperature=0)
    assert r.usage.completion_tokens >= 1
