"""`bench/serve_multiturn.py` against a fake server that speaks the API server's protocol
(streamed completions with token ids, usage and the `dualpath` extension, OpenAI errors with
Retry-After): the context each round sends, the retries, the error counts and the figures."""

from __future__ import annotations

import asyncio
import json
import math
import sys
import textwrap
import time

import pytest

web = pytest.importorskip("aiohttp.web")

MODEL = "fake-model"
FIRST_S = 0.05  # first token after this long
TOKEN_S = 0.01  # then one token per chunk every TOKEN_S


def next_ids(prompt: list[int], gen: int) -> list[int]:
    return [(sum(prompt) + 7 * j) % 97 for j in range(gen)]


def fake_app(refuse_once: set[str], fail_round: dict[str, int]) -> web.Application:
    """Sessions must grow: a round's prompt starts with the previous prompt and the ids returned
    for it (else 400). `refuse_once`: sessions whose first request gets 429 (Retry-After: 0);
    `fail_round[s]`: the round of session s that gets a 500."""
    contexts: dict[str, list[int]] = {}
    rounds: dict[str, int] = {}

    def error(status: int, message: str, **headers: str) -> web.Response:
        body = {"error": {"message": message, "type": "fake", "code": status}}
        return web.json_response(body, status=status, headers=headers)

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        sid = request.headers.get("X-Session-Id")
        if not sid or body.get("model") != MODEL or not body.get("stream"):
            return error(400, "bad request")
        if not (body["ignore_eos"] and body["return_token_ids"] and body["temperature"] == 0):
            return error(400, "bad options")
        if sid in refuse_once:
            refuse_once.discard(sid)
            return error(429, "busy", **{"Retry-After": "0"})
        prompt, known = body["prompt"], contexts.get(sid, [])
        if prompt[: len(known)] != known:
            return error(400, "the prompt does not extend the session")
        i = rounds.get(sid, 0)
        if fail_round.get(sid) == i:
            return error(500, "engine failed")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await asyncio.sleep(FIRST_S)
        ids = next_ids(prompt, body["max_tokens"])
        for j, t in enumerate(ids):
            if j:
                await asyncio.sleep(TOKEN_S)
            last = j == len(ids) - 1
            chunk = {
                "id": "cmpl-1",
                "object": "text_completion",
                "choices": [
                    {
                        "index": 0,
                        "text": f"<{t}>",
                        "token_ids": [t],
                        "finish_reason": "length" if last else None,
                    }
                ],
            }
            # A keep-alive comment and a CRLF event split in two writes, as a proxy might.
            await resp.write(b": keep-alive\n\n")
            data = f"data: {json.dumps(chunk)}\r\n\r\n".encode()
            await resp.write(data[:7])
            await resp.write(data[7:])
        usage = {
            "prompt_tokens": len(prompt),
            "completion_tokens": len(ids),
            "prompt_tokens_details": {"cached_tokens": len(known)},
        }
        dp = {"read_path": "none" if not known else "de", "ttft_s": FIRST_S, "queue_s": 0.0}
        await resp.write(
            f"data: {json.dumps({'choices': [], 'usage': usage, 'dualpath': dp})}\n\n".encode()
        )
        await resp.write(b"data: [DONE]\n\n")
        contexts[sid], rounds[sid] = prompt + ids, i + 1
        return resp

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(text="# fake\nrequests_total 1\n")

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/metrics", metrics)
    return app


async def serve(app: web.Application):
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    return runner, f"http://{host}:{port}"


TRAJS = [
    ("a0", [([1, 2, 3], 3), ([4, 5], 2), ([6], 1)]),
    ("a1", [([9] * 20, 4), ([8, 8], 3)]),
    ("busy", [([5, 5], 2), ([1], 2)]),
    ("broken", [([3, 1], 2), ([2], 2), ([7], 2)]),
]
ARRIVALS = [0.0, 0.05, 0.1, 0.0]


def expected_outputs() -> dict[str, list[list[int]]]:
    out = {}
    for tid, rounds in TRAJS:
        ctx, out[tid] = [], []
        for append, gen in rounds:
            prompt = ctx + append
            ids = next_ids(prompt, gen)
            out[tid].append(ids)
            ctx = prompt + ids
        if tid == "broken":
            out[tid] = out[tid][:1]  # its round 1 fails
    return out


def test_sse_parser_joins_split_events_and_skips_comments(bench_modules):
    with bench_modules("serve_multiturn") as (m,):
        p = m.SSEParser()
        assert p.feed(b": hi\n\nda") == []
        assert p.feed(b'ta: {"a": 1}\r\n') == []
        assert p.feed(b"\r\ndata:x\ndata: y\n\ndata: [DONE]\n") == ['{"a": 1}', "x\ny"]
        assert p.feed(b"\n") == ["[DONE]"]


def test_run_load_against_a_fake_server(bench_modules):
    with bench_modules("serve_multiturn") as (m,):

        async def go():
            runner, url = await serve(fake_app({"busy"}, {"broken": 1}))
            try:
                result = await m.run_load(url, MODEL, TRAJS, ARRIVALS, timeout_s=30)
                page = await m.scrape(url, None)
            finally:
                await runner.cleanup()
            return result, page

        result, page = asyncio.run(go())
        assert "requests_total" in page
        assert result.outputs == expected_outputs()
        assert result.errors == {"429": 1, "500": 1}
        assert (result.rounds_planned, result.rounds_failed, result.timed_out) == (10, 1, False)
        recs = {(r.agent, r.round): r for r in result.records}
        assert len(recs) == 8
        assert recs[("busy", 0)].attempts == 2 and recs[("busy", 1)].attempts == 1
        for r in recs.values():
            assert r.ttft_s >= FIRST_S - 1e-3
            assert r.sent_s >= ARRIVALS[[t for t, _ in TRAJS].index(r.agent)]
            assert r.end_s >= r.last_token_s >= r.first_token_s
            if r.completion_tokens > 1:  # (a loaded host may deliver the first chunk late)
                assert r.tpot_s > 0
            assert r.server == {"ttft_s": FIRST_S, "queue_s": 0.0}
        # a1 round 1: prompt 20 + 4 + 2 = 26 tokens, of which the 24 of round 0 are cached.
        a1 = recs[("a1", 1)]
        assert (a1.prompt_tokens, a1.cached_tokens, a1.completion_tokens) == (26, 24, 3)

        s = m.summarize(result, ttft_slo_s=10.0, tpot_slo_s=10.0)
        prompt = sum(r.prompt_tokens for r in recs.values())
        cached = sum(r.cached_tokens for r in recs.values())
        assert (s["rounds_done"], s["rounds_failed"], s["short_rounds"]) == (8, 1, 0)
        assert s["retried_rounds"] == 1
        assert s["read_paths"] == {"de": 4, "none": 4}
        assert s["cached_ratio"] == pytest.approx(cached / prompt)
        assert s["completion_tokens"] == 3 + 2 + 1 + 4 + 3 + 2 + 2 + 2
        end = max(r.end_s for r in recs.values())
        assert s["makespan_s"] == pytest.approx(end)  # first arrival at 0
        assert s["rounds_per_s"] == pytest.approx(8 / end)
        assert s["tokens_per_s"] == pytest.approx((prompt + s["completion_tokens"]) / end)
        assert s["slo_attainment"] == 1.0
        assert s["ttft_s"]["p50"] >= FIRST_S - 1e-3
        assert s["server"]["ttft_s"]["p50"] == pytest.approx(FIRST_S)
        # TTFT over the limit fails every round; a TPOT limit only rounds of 2+ tokens.
        assert m.summarize(result, ttft_slo_s=FIRST_S / 2, tpot_slo_s=10.0)["slo_attainment"] == 0
        only_one = sum(r.completion_tokens < 2 for r in recs.values()) / 8
        assert m.summarize(result, 10.0, TOKEN_S / 10)["slo_attainment"] == only_one
        assert "DualPath" not in m.format_table({"basic": s})
        assert m.tokens_identical([result.outputs, {"a0": result.outputs["a0"][:1]}])
        assert not m.tokens_identical([result.outputs, {"a0": [[0]]}])


def test_run_load_stops_at_its_timeout(bench_modules):
    with bench_modules("serve_multiturn") as (m,):

        async def go():
            runner, url = await serve(fake_app(set(), {}))
            try:
                t = time.monotonic()
                r = await m.run_load(url, MODEL, TRAJS[:1], [5.0], timeout_s=0.3)
                return r, time.monotonic() - t
            finally:
                await runner.cleanup()

        result, took = asyncio.run(go())
        assert result.timed_out and result.records == [] and took < 2
        s = m.summarize(result, 1.0, 1.0)
        assert (s["rounds_done"], s["makespan_s"], s["rounds_per_s"]) == (0, 0.0, 0.0)
        assert math.isfinite(s["ttft_s"]["p50"])


FAKE_LAUNCHER = textwrap.dedent(
    """
    import asyncio, json, os, pathlib, signal, subprocess, sys
    from aiohttp import web

    workdir = pathlib.Path(sys.argv[1])
    # A child that outlives its parent unless the whole group is stopped.
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])

    async def health(request):
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/health", health)

    async def main():
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        (workdir / "api_server.json").write_text(
            json.dumps({"url": f"http://127.0.0.1:{port}", "pid": os.getpid(), "model": "m"})
        )
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        await stop.wait()
        await runner.cleanup()

    asyncio.run(main())
    """
)


def test_api_server_waits_for_health_and_stops_its_group(bench_modules, tmp_path):
    import os

    script = tmp_path / "fake_api_server.py"
    script.write_text(FAKE_LAUNCHER)
    with bench_modules("serve_multiturn") as (m,):
        server = m.ApiServer([sys.executable, str(script), str(tmp_path / "wd")], tmp_path / "wd")
        try:
            info = asyncio.run(server.wait_ready(60))
            assert info["model"] == "m" and info["pid"] == server.proc.pid
            pgid = server.proc.pid
            assert m._group_alive(pgid)
        finally:
            rc = server.stop(grace_s=10)
        assert rc == 0
        assert not m._group_alive(pgid)
        with pytest.raises(ProcessLookupError):
            os.killpg(pgid, 0)


def test_api_server_that_exits_reports_its_log(bench_modules, tmp_path):
    with bench_modules("serve_multiturn") as (m,):
        cmd = [sys.executable, "-c", "print('no such flag'); raise SystemExit(2)"]
        server = m.ApiServer(cmd, tmp_path)
        try:
            with pytest.raises(RuntimeError, match="no such flag"):
                asyncio.run(server.wait_ready(30))
        finally:
            assert server.stop() == 2


def test_loopback_only(bench_modules):
    from absl import app

    with bench_modules("serve_multiturn") as (m,):
        for ok in ("http://127.0.0.1:80", "http://localhost:1", "http://[::1]:8000"):
            m.check_loopback(ok)
        for bad in ("http://10.0.0.1:80", "http://example.com"):
            with pytest.raises(app.UsageError):
                m.check_loopback(bad)
