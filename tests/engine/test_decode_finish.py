"""Why the decode engine ends a round after its latest token (`DecodeEngine.finish_reason`): a
stop token ends it only once `min_tokens` tokens came before it, `gen` tokens always do."""

from __future__ import annotations

from dualpath_jax.engines.decode_engine import DecodeEngine, _Req
from dualpath_jax.model.sampling_params import SamplingParams
from dualpath_jax.wire import messages


def _req(tokens: list[int], min_tokens: int = 0, gen: int = 8) -> _Req:
    job = messages.LoadJobMsg(
        request="r", keys=[], pe_blocks=0, de_blocks=0, prompt=[1, 2], gen=gen,
        pe_engine=0, pe_node=0, pe_address="", de_engine=1, de_node=1, de_address="",
        oracle=False, layerwise=True, params_version="", stop_tokens=[9],
        sampling=SamplingParams(min_tokens=min_tokens),
    )  # fmt: skip
    return _Req(msg=job, load=None, tokens=tokens)


def test_a_stop_token_ends_the_round_only_after_min_tokens():
    assert DecodeEngine.finish_reason(_req([4, 9])) == "stop"
    assert DecodeEngine.finish_reason(_req([4, 9], min_tokens=2)) == ""  # the 2nd token
    assert DecodeEngine.finish_reason(_req([4, 5, 9], min_tokens=2)) == "stop"
    assert DecodeEngine.finish_reason(_req([4, 9], min_tokens=2, gen=2)) == "length"


def test_a_closed_session_leaves_the_decode_engines_index():
    """`Retain(ended)` (its session closed or expired): the DE's store forgets the session's
    claims on the blocks it persisted and keeps the blocks; other states set its retention."""
    import types

    from dualpath_jax.config import StoreConfig
    from dualpath_jax.kvstore.store import open_block_store
    from dualpath_jax.presets import TINY_QWEN2

    store = open_block_store(StoreConfig(kind="memory", eviction="retention"), TINY_QWEN2)
    try:
        de = DecodeEngine.__new__(DecodeEngine)
        de.ctx = types.SimpleNamespace(store=store)
        store.claim("s", ["1" * 32, "2" * 32])
        de.handle(messages.Retain(session="s", state="idle", priority=1, ttl_s=60.0))
        assert store.index.claims() == 2 and store.index.retained("s")
        de.handle(messages.Retain(session="s", state="ended"))
        assert store.index.claims() == 0 and not store.index.retained("s")
    finally:
        store.close()
