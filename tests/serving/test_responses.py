"""RoundStream: what a streamed round leaves behind when its handler is cancelled."""

from __future__ import annotations

import asyncio
from concurrent import futures

from dualpath_jax.serving.responses import RoundStream


def test_a_cancelled_stream_leaves_no_pending_task():
    # A client that leaves mid-round cancels its handler while the stream waits for tokens: the
    # queue read it was waiting on must go too (else a pending task per vanished client).
    async def main() -> set:
        rnd = RoundStream(asyncio.get_running_loop())
        rnd.fut = futures.Future()
        got: list[list[int]] = []

        async def consume() -> None:
            async for new in rnd.deltas(timeout_s=60.0):
                got.append(new)

        task = asyncio.create_task(consume())
        rnd.on_tokens(0, [7])
        for _ in range(5):
            await asyncio.sleep(0)
        assert got == [[7]]
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        for _ in range(5):
            await asyncio.sleep(0)
        rnd.fut.cancel()
        return asyncio.all_tasks() - {asyncio.current_task()}

    assert asyncio.run(main()) == set()


def test_a_stream_yields_its_tokens_then_the_rest_of_its_result():
    async def main() -> list[list[int]]:
        rnd = RoundStream(asyncio.get_running_loop())
        rnd.fut = futures.Future()
        out = []

        async def consume() -> None:
            async for new in rnd.deltas(timeout_s=60.0):
                out.append(new)

        task = asyncio.create_task(consume())
        rnd.on_tokens(0, [1, 2])
        for _ in range(5):
            await asyncio.sleep(0)

        class Res:
            tokens = [1, 2, 3]
            logprobs = None

        rnd.fut.set_result(Res())
        await task
        return out

    assert asyncio.run(main()) == [[1, 2], [3]]
