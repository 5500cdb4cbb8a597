"""The HTTP server's own logic against a fake router client (no engines, no JAX): error
statuses and Retry-After, stop strings finishing the round, session rewinds, the session
retention headers, text streaming over split UTF-8 and stop strings, the tokenizers, and the
connection limits (slow heads and bodies, idle keep-alive, the cap, writes nobody reads)."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import socket
import threading
import time

import pytest

pytest.importorskip("aiohttp")
import aiohttp  # noqa: E402
from aiohttp import web  # noqa: E402
from aiohttp.test_utils import TestClient, TestServer  # noqa: E402

from dualpath_jax.model.sampling_params import SamplingParams  # noqa: E402
from dualpath_jax.serving import connections  # noqa: E402
from dualpath_jax.serving.server import ApiServer, ServerConfig  # noqa: E402
from dualpath_jax.serving.text import TextStream  # noqa: E402
from dualpath_jax.serving.tokenizer import (  # noqa: E402
    ByteTokenizer,
    TokenizerError,
    load_tokenizer,
)
from dualpath_jax.wire import messages  # noqa: E402
from dualpath_jax.wire.client import RolloutError, RoundFuture  # noqa: E402

MODEL = "fake"


class FakeClient:
    """A router client whose rounds generate b"abcdef..." one token per 10 ms, streamed from a
    thread; `fail` makes every round fail with that RolloutError kind."""

    def __init__(self, fail: str = "", lag: int = 0):
        self.fail = fail
        self.lag = lag  # tokens a round still generates after `finish` (the router's delay)
        self.submits: list[dict] = []
        self.finished: list[str] = []
        self.cancelled: list[str] = []
        self.contexts: dict[str, list[int]] = {}
        self.calls: list[tuple] = []  # sessions' calls other than rounds, in order

    def open_session(self, session, resume=False, *, fork_of=""):
        if fork_of:
            self.calls.append(("fork", session, fork_of))
            self.contexts[session] = list(self.contexts[fork_of])
        self.contexts.setdefault(session, [])

    def close_session(self, session, release=False):
        if release:
            self.calls.append(("release", session))
        self.contexts.pop(session, None)

    def tool_call(self, session, expected_s):
        self.calls.append(("tool_call", session, expected_s))

    def stats(self, timeout_s=30.0):
        return {"counters": {}, "queued": {}, "in_flight": 0}

    def finish(self, request):
        self.finished.append(request)

    def cancel(self, request):
        self.cancelled.append(request)

    def submit(
        self,
        session,
        append,
        gen,
        *,
        sampling,
        keep,
        stop_tokens,
        on_tokens,
        **retention,
    ):
        rid = f"r{len(self.submits)}"
        self.submits.append(
            dict(
                session=session,
                append=list(append),
                gen=gen,
                keep=keep,
                retention=retention,
                sampling=sampling,
            )
        )
        fut = RoundFuture()
        fut.request = rid
        if self.fail:
            fut.set_exception(RolloutError(f"refused ({self.fail})", self.fail))
            return fut
        ctx = self.contexts[session]
        prompt = (ctx if keep < 0 else ctx[:keep]) + list(append)

        def run():
            out = []
            for i in range(gen):
                out.append(ord("a") + i % 26)
                if on_tokens is not None:
                    on_tokens(i, [out[-1]])
                time.sleep(0.01)
                if rid in self.cancelled:
                    fut.set_exception(RolloutError("cancelled", "cancelled"))
                    return
                if rid in self.finished:
                    if self.lag <= 0:
                        break
                    self.lag -= 1
            self.contexts[session] = prompt + out
            fut.set_result(
                messages.RoundResult(
                    request=rid,
                    tokens=out,
                    ttft_s=0.01,
                    ttst_s=0.01,
                    tpot_s=0.01,
                    jct_s=0.1,
                    queue_s=0.0,
                    cached_tokens=16 * (len(prompt) // 16),
                    prompt_tokens=len(prompt),
                    read_path="de",
                    recomputed_blocks=0,
                    finish_reason="finished" if rid in self.finished else "length",
                )
            )

        threading.Thread(target=run, daemon=True).start()
        return fut


def _post(client: FakeClient, *requests: tuple[str, dict, dict], api_key: str = ""):
    """Runs the requests in order against an ApiServer on `client`; returns (status, headers,
    body) of each."""

    async def go():
        cfg = ServerConfig(model=MODEL, max_context=512, vocab_size=257, api_key=api_key)
        server = ApiServer(client, ByteTokenizer(), cfg)
        out = []
        async with TestClient(TestServer(server.app())) as tc:
            for path, body, headers in requests:
                r = await tc.post(path, json=body, headers=headers)
                out.append((r.status, dict(r.headers), await r.json()))
        return out

    return asyncio.run(go())


def _completion(**kw) -> tuple[str, dict, dict]:
    headers = kw.pop("headers", {})
    return "/v1/completions", {"model": MODEL, "temperature": 0, **kw}, headers


@pytest.mark.parametrize(
    "kind, status, retry",
    [
        ("overloaded", 429, True),
        ("connection", 503, True),
        ("engine", 503, True),
        ("store", 500, False),
    ],
)
def test_cluster_errors_map_to_statuses(kind, status, retry):
    [(got, headers, body)] = _post(FakeClient(fail=kind), _completion(prompt="hi", max_tokens=3))
    assert got == status
    assert ("Retry-After" in headers) == retry
    assert "refused" in body["error"]["message"]


def test_a_missing_or_wrong_key_is_401_before_anything_runs():
    client = FakeClient()
    out = _post(
        client,
        _completion(prompt="hi", headers={"Authorization": "Bearer nope"}),
        _completion(prompt="hi"),
        api_key="k",
    )
    assert [s for s, _, _ in out] == [401, 401]
    assert out[0][2]["error"]["type"] == "authentication_error"
    assert client.submits == []


def test_a_stop_string_ends_the_text_and_finishes_the_round():
    client = FakeClient()
    [(status, _, body)] = _post(client, _completion(prompt="hi", max_tokens=40, stop=["de"]))
    assert status == 200
    assert body["choices"][0]["text"] == "abc"
    assert body["choices"][0]["finish_reason"] == "stop"
    assert client.finished == ["r0"]  # completed early (keeps its KV), not cancelled
    assert client.cancelled == []


def test_a_session_sends_only_the_new_tokens_and_rewinds_on_edited_history():
    client = FakeClient()
    h = {"X-Session-Id": "agent"}
    p1 = list(range(40))
    p2 = p1 + [ord("a"), ord("b"), ord("c")] + [7] * 10
    p3 = p1[:30] + [9] * 5
    _post(
        client,
        _completion(prompt=p1, max_tokens=3, headers=h),
        _completion(prompt=p2, max_tokens=3, headers=h),
        _completion(prompt=p3, max_tokens=3, headers=h),
        _completion(prompt=p1, max_tokens=2),  # no session: a fresh one, the whole prompt
    )
    s = client.submits
    assert (s[0]["keep"], s[0]["append"]) == (0, p1)
    assert (s[1]["keep"], s[1]["append"]) == (43, [7] * 10)
    assert (s[2]["keep"], s[2]["append"]) == (30, [9] * 5)
    assert s[0]["session"] == s[1]["session"] == s[2]["session"] == "http:agent"
    assert s[3]["session"].startswith("http-") and s[3]["append"] == p1
    assert s[3]["session"] not in client.contexts  # the one-off session was closed


def test_retention_headers_reach_the_round():
    client = FakeClient()
    agent = {"X-Session-Id": "agent"}
    out = _post(
        client,
        _completion(prompt="hi", max_tokens=2, headers=agent),  # none: nothing is passed
        _completion(
            prompt="hi",
            max_tokens=2,
            headers={**agent, "X-Session-Priority": "-3", "X-Session-TTL": "2.5"},
        ),
        _completion(prompt="hi", max_tokens=2, headers={"X-Session-TTL": "0"}),  # one-off
        _completion(prompt="hi", max_tokens=2, headers={"X-Session-Priority": "7"}),
    )
    assert [s for s, _, _ in out] == [200] * 4
    assert [s["retention"] for s in client.submits] == [
        {},
        {"priority": -3, "ttl_s": 2.5},
        {"ttl_s": 0.0},
        {"priority": 7},
    ]
    assert client.submits[1]["session"] == "http:agent"


@pytest.mark.parametrize(
    "header, value",
    [
        ("X-Session-Priority", "high"),
        ("X-Session-Priority", "1.5"),
        ("X-Session-Priority", str(2**40)),
        ("X-Session-Priority", "101"),  # above the server's max_session_priority (100)
        ("X-Session-TTL", "86401"),  # above its max_session_ttl_s
        ("X-Session-TTL", "-5"),
        ("X-Session-TTL", "1e12"),
        ("X-Session-TTL", "nan"),
        ("X-Session-TTL", "inf"),
        ("X-Session-TTL", "soon"),
    ],
)
def test_a_bad_retention_header_is_400_naming_it(header, value):
    client = FakeClient()
    [(status, _, body)] = _post(
        client, _completion(prompt="hi", max_tokens=2, headers={"X-Session-Id": "a", header: value})
    )
    assert status == 400
    err = body["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == header
    assert header in err["message"] and repr(value) in err["message"]
    assert client.submits == [] and client.contexts == {}  # refused before any session opened


def test_the_sampling_fields_reach_the_round_as_one_value():
    client = FakeClient()
    out = _post(client, _completion(prompt="hi", max_tokens=2, temperature=0.7, top_p=0.5, seed=9))
    assert [s for s, _, _ in out] == [200]
    assert client.submits[0]["sampling"] == SamplingParams(temperature=0.7, top_p=0.5, seed=9)


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("temperature", 3, "temperature must lie in [0, 2], got 3.0"),
        ("temperature", -1, "temperature must be a finite number >= 0, got -1.0"),
        ("top_p", 0, "top_p must lie in (0, 1], got 0.0"),
        ("top_p", 1.5, "top_p must lie in (0, 1], got 1.5"),
        ("seed", -1, "seed must lie in [0, 2**32), got -1"),
        ("seed", 2**32, "seed must lie in [0, 2**32), got 4294967296"),
    ],
)
def test_bad_sampling_is_400_naming_the_field(field, value, message):
    client = FakeClient()
    [(status, _, body)] = _post(client, _completion(prompt="hi", max_tokens=2, **{field: value}))
    assert status == 400
    err = body["error"]
    assert (err["type"], err["param"], err["message"]) == ("invalid_request_error", field, message)
    assert client.submits == []


def test_text_stream_holds_back_split_utf8_and_stop_prefixes():
    tok = ByteTokenizer()
    ts = TextStream(tok, stops=["STOP"], eos_ids=tok.eos_ids)
    snow = "☃".encode()  # three bytes
    assert ts.add([ord("x"), snow[0]]) == "x"
    assert ts.add([snow[1]]) == ""
    assert ts.add([snow[2], ord("S"), ord("T")]) == "☃"  # "ST" may begin STOP
    assert ts.add([ord("A")]) == "STA"
    assert ts.add([ord("S"), ord("T"), ord("O"), ord("P"), ord("z")]) == ""
    assert ts.stopped and ts.text == "x☃STA" and ts.close() == ""
    ts = TextStream(tok, eos_ids=tok.eos_ids)
    assert ts.add([ord("o"), ord("k"), tok.END]) == "ok" and ts.close() == ""
    ts = TextStream(tok)  # a character cut off by the end of the round shows as U+FFFD
    assert ts.add([ord("a"), snow[0]]) == "a" and ts.close() == "\ufffd"


def test_text_stream_decodes_incrementally():
    """Token by token, a long round decodes O(n) ids in all, not O(n^2), and gives the text a
    whole decode gives (with a stop string that never matches, whose tail is held back)."""

    class Counting(ByteTokenizer):
        decoded = 0

        def decode(self, ids):
            Counting.decoded += len(ids)
            return super().decode(ids)

    tok = Counting()
    text = ("naïve ☃ café " * 400).encode()
    ts = TextStream(tok, stops=["never here"])
    out = "".join(ts.add([b]) for b in text) + ts.close()
    assert out == text.decode() == ts.text
    assert Counting.decoded < 8 * len(text)  # a whole decode per token: ~len(text)**2 / 2


def test_byte_tokenizer_and_loading_rules(tmp_path):
    tok = ByteTokenizer()
    assert tok.decode(tok.encode("héllo")) == "héllo"
    ids = tok.chat([{"role": "user", "content": [{"type": "text", "text": "hi"}]}])
    assert tok.decode(ids) == "<|user|>\nhi<|assistant|>\n" and ids.count(tok.END) == 1
    with pytest.raises(TokenizerError, match="not supported"):
        tok.chat([{"role": "user", "content": [{"type": "image_url"}]}])
    assert isinstance(load_tokenizer(None, 257), ByteTokenizer)
    with pytest.raises(TokenizerError, match="cannot use the byte tokenizer"):
        load_tokenizer(tmp_path, 1000)


def test_a_checkpoint_tokenizer_with_its_chat_template(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    from tokenizers import models, pre_tokenizers

    words = ["<unk>", "<|im_end|>", "hello", "world", "user", "assistant"]
    vocab = {w: i for i, w in enumerate(words + ["the", "answer", "is", "42"])}
    raw = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=raw,
        unk_token="<unk>",
        eos_token="<|im_end|>",
        chat_template=(
            "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} <|im_end|> {% endfor %}"
            "{% if add_generation_prompt %}assistant{% endif %}"
        ),
    )
    fast.add_special_tokens({"additional_special_tokens": ["<|im_end|>"]})
    fast.save_pretrained(tmp_path)
    tok = load_tokenizer(tmp_path, 10)
    assert tok.eos_ids == [1]
    assert tok.encode("hello world") == [2, 3]
    assert tok.decode([2, 3, 1]) == "hello world"
    assert tok.chat([{"role": "user", "content": "hello"}]) == [4, 2, 1, 5]
    # beside a Qwen2 config.json, transformers loads it as a BPE Qwen2Tokenizer that encodes
    # nothing: the server takes tokenizer.json as written
    (tmp_path / "config.json").write_text('{"model_type": "qwen2"}')
    tok = load_tokenizer(tmp_path, 10)
    assert tok.encode("hello world") == [2, 3] and type(tok.tok).__name__ != "Qwen2Tokenizer"
    assert tok.chat([{"role": "user", "content": "hello"}]) == [4, 2, 1, 5]
    # a tokenizer that cannot serve is refused at load, naming its files
    with pytest.raises(
        TokenizerError,
        match=r"tokenizer_config\.json\) encodes .* to ids \[8, 9\] outside the model.s 8",
    ):
        load_tokenizer(tmp_path, 8)
    for known, says in ((words, "does not decode its own ids"), (words[:2], "to no known ids")):
        other = tmp_path / f"other{len(known)}"
        raw = tokenizers.Tokenizer(models.WordLevel({w: i for i, w in enumerate(known)}, "<unk>"))
        raw.pre_tokenizer = pre_tokenizers.Whitespace()
        fast = transformers.PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>")
        fast.save_pretrained(other)
        with pytest.raises(TokenizerError, match=rf"tokenizer\.json.*{says}"):
            load_tokenizer(other, len(known))


def test_a_stop_string_bills_and_returns_only_the_answer():
    """Tokens decoded after the stop string completed, before the finish took effect, are not
    the answer's: not in `usage.completion_tokens` nor in `token_ids` (streamed or not)."""
    for stream in (False, True):
        client = FakeClient(lag=3)
        body = dict(prompt="hi", max_tokens=40, stop=["de"], return_token_ids=True)
        if stream:
            body.update(stream=True, stream_options={"include_usage": True})
            [(status, _, events)] = _post_stream(client, _completion(**body))
            ids = [
                i
                for e in events
                if e.get("choices")
                for i in e["choices"][0].get("token_ids") or []
            ]
            usage = next(e["usage"] for e in events if e.get("usage"))
            text = "".join(e["choices"][0].get("text") or "" for e in events if e.get("choices"))
        else:
            [(status, _, out)] = _post(client, _completion(**body))
            ids, usage, text = (
                out["choices"][0]["token_ids"],
                out["usage"],
                out["choices"][0]["text"],
            )
        assert status == 200 and text == "abc"
        assert ids == [ord(c) for c in "abcde"]  # "e" completed the stop string "de"
        assert usage["completion_tokens"] == 5 == usage["total_tokens"] - usage["prompt_tokens"]


def _post_stream(client: FakeClient, *requests):
    """As `_post`, for streamed requests: (status, headers, the events' JSON objects)."""
    import json

    async def go():
        cfg = ServerConfig(model=MODEL, max_context=512, vocab_size=257)
        server = ApiServer(client, ByteTokenizer(), cfg)
        out = []
        async with TestClient(TestServer(server.app())) as tc:
            for path, body, headers in requests:
                r = await tc.post(path, json=body, headers=headers)
                raw = (await r.read()).decode()
                events = [
                    json.loads(line[6:])
                    for line in raw.splitlines()
                    if line.startswith("data: ") and line != "data: [DONE]"
                ]
                out.append((r.status, dict(r.headers), events))
        return out

    return asyncio.run(go())


def test_the_model_is_optional_and_another_is_404_model_not_found():
    client = FakeClient()
    path, body, headers = _completion(prompt="hi", max_tokens=2)
    del body["model"]  # vLLM serves its one model
    out = _post(client, (path, body, headers), _completion(prompt="hi", model="gpt-x"))
    assert out[0][0] == 200 and out[0][2]["model"] == MODEL
    status, _, err = out[1]
    assert status == 404
    assert err["error"]["code"] == "model_not_found"
    assert err["error"]["type"] == "invalid_request_error" and err["error"]["param"] == "model"


def test_peers_session_headers_and_conversation_id_name_the_session():
    client = FakeClient()
    _post(
        client,
        _completion(prompt="hi", max_tokens=1, headers={"X-Session-Affinity": "aff"}),
        _completion(prompt="hi", max_tokens=1, headers={"X-Correlation-ID": "corr"}),
        _completion(prompt="hi", max_tokens=1, conversation_id="conv"),
        # precedence: X-Session-Id, X-Session-Affinity, X-Correlation-Id, conversation_id, user
        _completion(
            prompt="hi",
            max_tokens=1,
            user="u",
            conversation_id="conv2",
            headers={"X-Session-Id": "sid", "X-Session-Affinity": "aff2"},
        ),  # fmt: skip
        _completion(prompt="hi", max_tokens=1, user="u2", conversation_id="conv3"),
    )
    sessions = [s["session"] for s in client.submits]
    assert sessions == ["http:aff", "http:corr", "http:conv", "http:sid", "http:conv3"]


def test_the_official_client_gets_its_exceptions():
    """The `openai` package's own exceptions: NotFoundError for another model (code
    model_not_found), BadRequestError for a bad field; a request without a session works."""
    openai = pytest.importorskip("openai")

    async def go():
        cfg = ServerConfig(model=MODEL, max_context=512, vocab_size=257)
        server = ApiServer(FakeClient(), ByteTokenizer(), cfg)
        async with TestClient(TestServer(server.app())) as tc:
            api = openai.AsyncOpenAI(base_url=str(tc.make_url("/v1")), api_key="x", max_retries=0)
            with pytest.raises(openai.NotFoundError) as e:
                await api.completions.create(model="gpt-x", prompt="hi", max_tokens=2)
            assert e.value.code == "model_not_found"
            with pytest.raises(openai.BadRequestError) as e:
                await api.completions.create(model=MODEL, prompt="hi", max_tokens=2, top_p=7)
            assert e.value.body["param"] == "top_p"
            r = await api.completions.create(model=MODEL, prompt="hi", max_tokens=3, stop=["b"])
            assert r.choices[0].text == "a" and r.usage.completion_tokens == 2
            resp = await tc.get("/v1/completions")  # a wrong method: typed as a client error
            err = await resp.json()
            assert resp.status == 405 and err["error"]["type"] == "invalid_request_error"
            await api.close()

    asyncio.run(go())


def test_deeply_nested_json_is_a_400_and_the_server_keeps_serving():
    async def go():
        cfg = ServerConfig(model=MODEL, max_context=512, vocab_size=257)
        server = ApiServer(FakeClient(), ByteTokenizer(), cfg)
        async with TestClient(TestServer(server.app())) as tc:
            deep = b'{"model": "fake", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
            r = await tc.post("/v1/completions", data=deep)
            err = await r.json()
            ok = await tc.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
            return r.status, err, ok.status

    status, err, after = asyncio.run(go())
    assert status == 400 and "nested too deeply" in err["error"]["message"]
    assert after == 200


def test_a_client_that_leaves_while_its_one_off_session_opens_leaves_no_session():
    """A one-off session is closed after its open completes even when the client disconnected
    during the open (the handler is cancelled; the open runs on in its thread)."""

    class SlowOpen(FakeClient):
        def open_session(self, session, resume=False):
            time.sleep(0.3)
            super().open_session(session, resume)

    client = SlowOpen()

    async def go():
        cfg = ServerConfig(model=MODEL, max_context=512, vocab_size=257)
        server = ApiServer(client, ByteTokenizer(), cfg)
        runner = web.AppRunner(server.app(), handler_cancellation=True)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        async with aiohttp.ClientSession() as http:
            for _ in range(3):
                with contextlib.suppress(asyncio.TimeoutError):
                    await http.post(
                        f"http://127.0.0.1:{port}/v1/completions",
                        json={"prompt": "hi", "max_tokens": 2},
                        timeout=aiohttp.ClientTimeout(total=0.05),
                    )
        for _ in range(100):  # the opens finish, then their sessions close
            await asyncio.sleep(0.05)
            if len(client.submits) == 0 and not client.contexts and not server._closing:
                break
        await runner.cleanup()
        return dict(client.contexts), len(client.submits)

    contexts, submits = asyncio.run(go())
    assert contexts == {} and submits == 0


def test_the_body_limit_follows_the_context():
    assert ServerConfig(model=MODEL, max_context=512, vocab_size=257).body_limit == 2**20
    assert ServerConfig(model=MODEL, max_context=131072, vocab_size=257).body_limit == 2**23
    cfg = ServerConfig(model=MODEL, max_context=512, vocab_size=257, max_body_bytes=1000)
    big = "x" * 2000

    async def go():
        server = ApiServer(FakeClient(), ByteTokenizer(), cfg)
        async with TestClient(TestServer(server.app())) as tc:
            r = await tc.post("/v1/completions", json={"prompt": big, "max_tokens": 1})
            return r.status

    assert asyncio.run(go()) == 413


def test_until_ready_health_and_requests_are_503_and_models_answer():
    """A server whose cluster is still warming up (`ready` false) answers /health and every
    request 503 with Retry-After, /v1/models 200; once ready, both serve."""
    ready = threading.Event()

    async def go():
        cfg = ServerConfig(model=MODEL, max_context=512, vocab_size=257)
        server = ApiServer(FakeClient(), ByteTokenizer(), cfg, ready=ready.is_set)
        out = []
        async with TestClient(TestServer(server.app())) as tc:
            for _ in range(2):
                health = await tc.get("/health")
                models = await tc.get("/v1/models")
                path, body, _ = _completion(prompt="hi", max_tokens=3)
                r = await tc.post(path, json=body)
                out.append((health.status, models.status, r.status, r.headers.get("Retry-After")))
                ready.set()
        return out

    before, after = asyncio.run(go())
    assert before == (503, 200, 503, "5")
    assert after == (200, 200, 200, None)


# --------------------------------------------------------------------------- connection limits


@contextlib.contextmanager
def _listening(**limits):
    """An ApiServer on a FakeClient, listening on a loopback port on its own event-loop thread
    with these `ServerConfig` connection limits; yields (server, port)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    cfg = ServerConfig(model=MODEL, max_context=512, vocab_size=257, **limits)
    server = ApiServer(FakeClient(), ByteTokenizer(), cfg)

    def run(coro):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(60)

    try:
        yield server, run(server.start("127.0.0.1", 0))
    finally:
        run(server.stop())
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def _closed_by_server(sock: socket.socket, trickle: bytes = b"") -> bytes:
    """Reads until the server closes `sock` (EOF or reset), sending one byte of `trickle` between
    reads, as a slowloris client does; returns what the server sent. A server that never closes
    fails the test once the trickle (or a long read) runs out."""
    got = b""
    sock.settimeout(0.05 if trickle else 60)
    for i in range(max(len(trickle), 1) + 1200):
        try:
            if i < len(trickle):
                sock.sendall(trickle[i : i + 1])
            data = sock.recv(65536)
        except TimeoutError:
            continue
        except (ConnectionResetError, BrokenPipeError):
            return got
        if not data:
            return got
        got += data
    raise AssertionError(f"the server kept the connection open; it sent {got!r}")


def _connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=60)


def _http(port: int, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        payload = json.dumps(body).encode() if body is not None else None
        conn.request(method, path, body=payload, headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, json.loads(r.read() or b"{}")
    finally:
        conn.close()


def test_a_stalled_or_trickled_request_head_is_closed_while_others_are_served():
    with _listening(header_timeout_s=0.3) as (server, port):
        stalled = _connect(port)
        stalled.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le")
        trickled = _connect(port)
        # other clients are served meanwhile
        status, body = _http(port, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 3})
        assert status == 200 and body["choices"][0]["text"] == "abc"
        assert _closed_by_server(stalled) == b""
        head = b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"X-Slow: " + b"a" * 5000
        assert _closed_by_server(trickled, trickle=head) == b""
        stalled.close(), trickled.close()
        assert _http(port, "GET", "/health")[0] == 200
        closed = server.metrics.connections_closed.labels("header_timeout")._value.get()
        assert closed == 2


def test_a_keep_alive_connection_serves_its_next_request_and_closes_when_idle():
    with _listening(header_timeout_s=0.3, keepalive_timeout_s=0.6) as (_, port):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        for _ in range(2):  # one connection, two requests
            conn.request("GET", "/health")
            r = conn.getresponse()
            assert r.status == 200 and json.loads(r.read()) == {"status": "ok"}
        assert _closed_by_server(conn.sock) == b""
        conn.close()


def test_a_slow_body_is_a_408_and_the_connection_closes():
    with _listening(header_timeout_s=5.0, body_timeout_s=0.3) as (server, port):
        sock = _connect(port)
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100\r\n\r\n" + b'{"prompt": "h'
        )
        answer = _closed_by_server(sock)
        sock.close()
        assert answer.startswith(b"HTTP/1.1 408 ")
        assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "body_timeout"
        assert server.metrics.connections_closed.labels("body_timeout")._value.get() == 1


def test_connections_past_the_cap_are_answered_503_until_one_closes():
    with _listening(header_timeout_s=30.0, max_connections=2) as (server, port):
        held = [_connect(port), _connect(port)]
        third = _connect(port)
        answer = _closed_by_server(third)
        third.close()
        assert answer.startswith(b"HTTP/1.1 503 ")
        assert b"Retry-After: 1" in answer
        error = json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]
        assert error["code"] == "too_many_connections"
        for s in held:
            s.close()
        for _ in range(600):  # the server notices the closes on its own loop
            if server.site.open_connections == 0:
                break
            time.sleep(0.05)
        assert _http(port, "GET", "/health")[0] == 200
        assert server.metrics.connections_closed.labels("too_many_connections")._value.get() == 1


class _Transport:
    def __init__(self):
        self.aborted = False

    def abort(self):
        self.aborted = True


class _Request:
    def __init__(self):
        self.transport = _Transport()


class _StuckResponse:
    """A response whose writes never drain (a client that stopped reading)."""

    async def write(self, data):
        await asyncio.Event().wait()

    async def prepare(self, request):
        await asyncio.Event().wait()


def test_a_write_the_client_never_reads_aborts_the_connection():
    reasons = []

    async def go(send):
        request = _Request()
        with pytest.raises(ConnectionResetError, match="read nothing for 0.05 s"):
            await send(request)
        return request.transport.aborted

    stuck = _StuckResponse()
    assert asyncio.run(go(lambda r: connections.write(r, stuck, b"x", 0.05, reasons.append)))
    assert asyncio.run(go(lambda r: connections.finish(r, stuck, 0.05, reasons.append)))
    assert reasons == ["write_timeout", "write_timeout"]


def test_min_tokens_reaches_the_round_and_holds_stop_strings_back():
    client = FakeClient()  # generates "abcdefghijklmnopqrstuvwxyzabc..."
    [(status, _, body)] = _post(
        client, _completion(prompt="hi", max_tokens=40, stop=["b"], min_tokens=4)
    )
    assert status == 200
    assert client.submits[0]["sampling"].min_tokens == 4
    # the "b" of token 2 comes before min_tokens: only the next one ends the answer
    assert body["choices"][0]["text"] == "abcdefghijklmnopqrstuvwxyza"
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == 28


@pytest.mark.parametrize("min_tokens", [-1, 9])
def test_min_tokens_outside_0_to_max_tokens_is_400(min_tokens):
    client = FakeClient()
    [(status, _, body)] = _post(
        client, _completion(prompt="hi", max_tokens=8, min_tokens=min_tokens)
    )
    assert status == 400 and body["error"]["param"] == "min_tokens"
    assert body["error"]["type"] == "invalid_request_error"
    assert f"min_tokens must lie in [0, max_tokens=8], got {min_tokens}" in body["error"]["message"]
    assert client.submits == []


def test_text_stream_finds_no_stop_string_before_min_tokens():
    tok = ByteTokenizer()
    one = TextStream(tok, ["b"], tok.eos_ids, min_tokens=3)
    assert [one.add([i]) for i in b"abcb"] == ["a", "b", "c", ""]
    assert one.stopped and one.text == "abc" and one.used == 4
    together = TextStream(tok, ["b"], tok.eos_ids, min_tokens=3)
    assert together.add(list(b"abcbd")) == "abc"  # one delta across min_tokens
    assert together.stopped and together.used == 4
    short = TextStream(tok, ["b"], tok.eos_ids, min_tokens=5)
    short.add(list(b"ab"))
    assert short.close() == "" and not short.stopped and short.text == "ab"


def test_session_hints_over_http_prefetch_fork_and_release():
    """`tool_call` reaches the router after its round; `fork` runs the round on a new session
    with the parent's context, named in X-Session-Id; `release` closes the session after its
    round, and the next request under its id starts afresh."""
    client = FakeClient()
    agent = {"X-Session-Id": "agent"}
    out = _post(
        client,
        _completion(prompt="hi", max_tokens=2, headers=agent),
        _completion(
            prompt="hiab more", max_tokens=2, headers={**agent, "X-Session-Hint": "tool_call:7"}
        ),
        _completion(
            prompt="hiab moreab sub",
            max_tokens=2,
            headers={**agent, "X-Session-Hint": "fork:agent/sub"},
        ),  # fmt: skip
        _completion(
            prompt="hiab moreab sub ab next", max_tokens=2, headers={"X-Session-Id": "agent/sub"}
        ),  # fmt: skip
        _completion(
            prompt="hiab moreab again",
            max_tokens=2,
            headers={**agent, "X-Session-Hint": '{"kind": "release"}'},
        ),  # fmt: skip
        _completion(prompt="fresh", max_tokens=2, headers=agent),
        _completion(prompt="x", max_tokens=2, headers={"X-Session-Hint": "fork"}),  # no session
        _completion(
            prompt="x",
            max_tokens=2,
            headers={"X-Session-Id": "agent", "X-Session-Hint": "fork:agent/sub"},
        ),  # fmt: skip
    )
    assert [s for s, _, _ in out] == [200] * 6 + [400, 400]
    assert [h.get("X-Session-Id") for _, h, _ in out[:6]] == ["agent", "agent", "agent/sub",
                                                              "agent/sub", "agent", "agent"]  # fmt: skip
    assert "exists" in out[7][2]["error"]["message"]
    assert client.calls == [
        ("tool_call", "http:agent", 7.0),
        ("fork", "http:agent/sub", "http:agent"),
        ("release", "http:agent"),
    ]
    subs = client.submits
    assert [s["session"] for s in subs] == ["http:agent"] * 2 + ["http:agent/sub"] * 2 + [
        "http:agent"
    ] * 2
    # the fork's round sends only what follows the parent's context; so does its next one
    assert bytes(subs[2]["append"]) == b" sub" and bytes(subs[3]["append"]) == b" ab next"
    assert subs[1]["retention"] == {"ttl_s": 21.0}  # the tool call's hold
    assert bytes(subs[5]["append"]) == b"fresh"  # after the release: a new context
