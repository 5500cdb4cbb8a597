"""Parameter updates and session release at the router, driven in-process (no engines): the
drain -> load -> commit protocol of engines/params.py, refusals, engine death mid-update, held
rounds (and their bound, `max_queue`), which engines are in rotation (an engine with other params
gets no work until it has loaded the served ones; rounds it refuses for its params run
elsewhere), sampling fields; and the engine-side `ParamsSlot`."""

from __future__ import annotations

import numpy as np
import pytest
from router_rig import BT, CLIENT, DE, DE_ID, PE, PE_ID, RouterRig, Sent, only

from dualpath_jax.config import ClusterConfig, ConfigError, ExperimentConfig
from dualpath_jax.engines.params import ParamsSlot
from dualpath_jax.kvstore.identity import block_keys, model_fingerprint
from dualpath_jax.model.checkpoint import save_params_tree
from dualpath_jax.model.layout import kv_to_full_blocks
from dualpath_jax.model.runner import ModelRunner
from dualpath_jax.model.sampling_params import SamplingParams
from dualpath_jax.model.transformer import init_model
from dualpath_jax.presets import TINY_QWEN2
from dualpath_jax.router.router import Router
from dualpath_jax.wire import messages
from dualpath_jax.wire.params_protocol import (
    check_params_config,
    check_version,
    initial_params_version,
)


def _with_sessions(rig: RouterRig) -> RouterRig:
    """`rig` with sessions a, b and c open."""
    for s in ("a", "b", "c"):
        rig.handle(messages.OpenSession(session=s))
    return rig


@pytest.fixture()
def rig(router_rig) -> RouterRig:
    """A router with a PE and a DE registered and sessions a, b and c open."""
    return _with_sessions(router_rig())


def _submit(rig: RouterRig, rid: str, session: str, append: list[int], gen: int = 2, **kw) -> Sent:
    return rig.sends(messages.Submit(request=rid, session=session, append=append, gen=gen, **kw))


def _prefill_done(rig: RouterRig, rid: str) -> Sent:
    """The PE reports round `rid` prefilled (first token 5, nothing read)."""
    return rig.sends(
        messages.PrefillDone(
            request=rid,
            engine=PE,
            first_token=5,
            hit_blocks=0,
            recomputed_blocks=0,
            read_s=0.0,
            prefill_s=0.0,
        ),
        PE_ID,
    )


def _run_round(rig: RouterRig, rid: str) -> Sent:
    """Drives a queued round through PE fetch, prefill and decode; returns the last sends."""
    rig.sends(
        messages.Fetch(engine=DE, load=messages.Load(hbm_capacity_tokens=4096, slots=4)), DE_ID
    )
    rig.sends(messages.Fetch(engine=PE, load=messages.Load()), PE_ID)
    st = rig.router.rounds.table.requests[rid]
    assert (st.pe, st.de) == (PE, DE)
    _prefill_done(rig, rid)
    return rig.sends(
        messages.DecodeDone(request=rid, engine=DE, tokens=[5] * st.gen, persisted_blocks=0),
        DE_ID,
    )


def test_update_with_nothing_in_flight_loads_commits_and_changes_the_fingerprint(rig):
    old_fp = rig.router.params.fingerprint
    sent = rig.sends(messages.UpdateParams(version="v1", path="/ckpt/v1"))
    assert sorted(sent) == [
        (DE_ID, messages.LoadParams(version="v1", path="/ckpt/v1")),
        (PE_ID, messages.LoadParams(version="v1", path="/ckpt/v1")),
    ]
    assert (
        rig.sends(messages.ParamsLoaded(engine=PE, version="v1", ok=True), PE_ID) == []
    )  # DE not yet
    sent = rig.sends(messages.ParamsLoaded(engine=DE, version="v1", ok=True), DE_ID)
    assert sorted(sent) == [
        (CLIENT, messages.Ack(ref="params:v1")),
        (DE_ID, messages.CommitParams(version="v1", commit=True)),
        (PE_ID, messages.CommitParams(version="v1", commit=True)),
    ]
    r = rig.router
    assert r.params.version == "v1" and r.params.path == "/ckpt/v1"
    assert r.params.fingerprint == model_fingerprint(TINY_QWEN2, "v1") != old_fp
    assert r.stats()["params_version"] == "v1"


def test_update_waits_for_running_rounds_and_holds_new_ones(rig):
    r = rig.router
    prompt = list(range(2 * BT + 3))
    assert _submit(rig, "r1", "a", prompt) == []
    assert rig.sends(messages.UpdateParams(version="v1", path="/p")) == []  # draining: r1 in flight
    assert _submit(rig, "r2", "b", prompt) == []  # held, not queued
    assert list(r.rounds.table.requests) == ["r1"] and len(r.params.held) == 1
    # r1 runs to the end with the old params (its job carries the old version) ...
    rig.sends(
        messages.Fetch(engine=DE, load=messages.Load(hbm_capacity_tokens=4096, slots=4)), DE_ID
    )
    sent = rig.sends(messages.Fetch(engine=PE, load=messages.Load()), PE_ID)
    assert {m.jobs[0].params_version for _, m in only(sent, messages.Work)} == {""}
    _prefill_done(rig, "r1")
    sent = rig.sends(
        messages.DecodeDone(request="r1", engine=DE, tokens=[5, 6], persisted_blocks=2), DE_ID
    )
    # ... and only then do the engines load the new params.
    assert isinstance(only(sent, messages.RoundResult)[0][1], messages.RoundResult)
    assert len(only(sent, messages.LoadParams)) == 2
    rig.sends(messages.ParamsLoaded(engine=PE, version="v1", ok=True), PE_ID)
    sent = rig.sends(messages.ParamsLoaded(engine=DE, version="v1", ok=True), DE_ID)
    assert (CLIENT, messages.Ack(ref="params:v1")) in sent
    # The held round is submitted now, keyed by the new fingerprint: old blocks are never hit.
    assert len(r.params.held) == 0 and list(r.rounds.table.requests) == ["r2"]
    r2 = r.rounds.table.requests["r2"]
    assert r2.keys == [] and r2.request.cached_tokens == 0
    sent = rig.sends(
        messages.Fetch(engine=DE, load=messages.Load(hbm_capacity_tokens=4096, slots=4)), DE_ID
    )
    sent = rig.sends(messages.Fetch(engine=PE, load=messages.Load()), PE_ID)
    assert {m.jobs[0].params_version for _, m in only(sent, messages.Work)} == {"v1"}


def test_a_refusing_engine_aborts_the_update_everywhere(rig):
    r = rig.router
    rig.sends(messages.UpdateParams(version="v1", path="/p"))
    _submit(rig, "r1", "a", [1, 2, 3])  # held meanwhile
    rig.sends(messages.ParamsLoaded(engine=PE, version="v1", ok=True), PE_ID)
    sent = rig.sends(
        messages.ParamsLoaded(
            engine=DE, version="v1", ok=False, message="CheckpointError: bad shape"
        ),
        DE_ID,
    )
    assert [m for _, m in only(sent, messages.CommitParams)] == [
        messages.CommitParams(version="v1", commit=False)
    ] * 2
    ((_, err),) = only(sent, messages.Error)
    assert err.ref == "params:v1" and "engine 1: CheckpointError: bad shape" in err.message
    assert "still serving ''" in err.message
    assert r.params.version == "" and r.params.fingerprint == model_fingerprint(TINY_QWEN2, "")
    # the held round goes on, old params
    assert list(r.rounds.table.requests) == ["r1"] and r.params.update is None
    # the cluster takes the next update
    assert (
        len(only(rig.sends(messages.UpdateParams(version="v2", path="/q")), messages.LoadParams))
        == 0
    )  # r1 drains first


def test_an_engine_dying_mid_update_is_not_waited_for(rig):
    rig.sends(messages.UpdateParams(version="v1", path="/p"))
    rig.sends(messages.ParamsLoaded(engine=PE, version="v1", ok=True), PE_ID)
    rig.sent.clear()
    rig.router.liveness.declare_dead(rig.router.liveness.registry[DE])
    sent = list(rig.sent)
    assert (CLIENT, messages.Ack(ref="params:v1")) in sent
    assert (PE_ID, messages.CommitParams(version="v1", commit=True)) in sent
    assert rig.router.params.version == "v1"


@pytest.mark.parametrize(
    "msg, problem",
    [
        (messages.UpdateParams(version="", path="/p"), "must be 1-128 characters"),
        (messages.UpdateParams(version="../x", path="/p"), "must be 1-128 characters"),
        (messages.UpdateParams(version="v1", path=""), "needs the path of a parameter checkpoint"),
    ],
)
def test_bad_update_requests_are_refused(rig, msg, problem):
    ((_, err),) = rig.sends(msg)
    assert (
        isinstance(err, messages.Error)
        and problem in err.message
        and rig.router.params.update is None
    )


def test_concurrent_and_repeated_versions_are_refused(rig):
    rig.sends(messages.UpdateParams(version="v1", path="/p"))
    ((_, err),) = rig.sends(messages.UpdateParams(version="v2", path="/p"))
    assert err.kind == "busy" and "'v1' is still in progress" in err.message
    rig.sends(messages.ParamsLoaded(engine=PE, version="v1", ok=True), PE_ID)
    rig.sends(messages.ParamsLoaded(engine=DE, version="v1", ok=True), DE_ID)
    ((_, err),) = rig.sends(messages.UpdateParams(version="v1", path="/other"))
    assert "'v1' is already served" in err.message


def test_stale_or_foreign_acks_are_ignored(rig):
    rig.sends(messages.UpdateParams(version="v1", path="/p"))
    assert (
        rig.sends(messages.ParamsLoaded(engine=PE, version="v0", ok=False, message="old"), PE_ID)
        == []
    )
    assert (
        rig.sends(messages.ParamsLoaded(engine=7, version="v1", ok=False, message="who"), b"x")
        == []
    )
    assert rig.router.params.update is not None and rig.router.params.update.waiting == {PE, DE}


@pytest.mark.parametrize(
    "kw, problem",
    [
        ({"stop_tokens": [300]}, "stop token 300 is out of range [0, 257)"),
        ({"keep": 5}, "keep=5 is outside the session's context of 0 tokens (-1: all)"),
        (
            {"gen": 3, "sampling": SamplingParams(min_tokens=4)},
            "min_tokens (4) exceeds the tokens to generate (3)",
        ),
        (
            {"sampling": SamplingParams(min_tokens=1), "stop_tokens": list(range(17))},
            "a round with min_tokens has at most 16 stop tokens, got 17",
        ),
    ],
)
def test_bad_round_fields_are_refused(rig, kw, problem):
    # (Bad sampling never reaches the router: a `Submit` carrying it does not decode,
    # tests/model/test_sampling.py.)
    ((_, err),) = _submit(rig, "r1", "a", [1, 2], **kw)
    assert err.kind == "bad_request" and err.message == problem


def test_sampling_fields_reach_the_job(rig):
    sampling = SamplingParams(temperature=0.8, top_p=0.5, seed=77, min_tokens=2)
    _submit(rig, "r1", "a", [1, 2], sampling=sampling, stop_tokens=[3], stream=True)
    rig.sends(
        messages.Fetch(engine=DE, load=messages.Load(hbm_capacity_tokens=4096, slots=4)), DE_ID
    )
    (_, work), *_ = only(
        rig.sends(messages.Fetch(engine=PE, load=messages.Load()), PE_ID), messages.Work
    )
    job = work.jobs[0]
    assert (job.sampling, job.stop_tokens, job.stream) == (sampling, [3], True)


# ----------------------------------------------------------------------------- rotation

DE2 = 2


def _commit_update(rig: RouterRig, version: str = "v1", path: str = "/p") -> None:
    """An update every engine in rotation loads: committed."""
    rig.sends(messages.UpdateParams(version=version, path=path))
    for engine, ident in ((PE, PE_ID), (DE, DE_ID), (DE2, b"de2")):
        e = rig.router.liveness.registry.get(engine)
        if e is not None and e.alive and rig.router.params.update is not None:
            rig.sends(messages.ParamsLoaded(engine=engine, version=version, ok=True), ident)
    assert rig.router.params.version == version


def _register_de2(rig: RouterRig, version: str = "") -> Sent:
    return rig.sends(
        messages.Register(
            role="decode", engine=DE2, node=DE2, group=0, address="y", pid=2,
            params_version=version,
        ),
        b"de2",
    )  # fmt: skip


def _fetch_de(rig: RouterRig, engine: int) -> Sent:
    ident = DE_ID if engine == DE else b"de2"
    load = messages.Load(hbm_capacity_tokens=4096, slots=4)
    return rig.sends(messages.Fetch(engine=engine, load=load), ident)


def _tick(rig: RouterRig, t: float) -> list[messages.Msg]:
    """The router's tick at `t` (every engine heard from just before): what DE2 was sent."""
    rig.clock.t = t
    for e in rig.router.liveness.registry.live():
        e.last_seen = t
    rig.sent.clear()
    rig.router.tick(t)
    return [m for i, m in rig.sent if i == b"de2"]


def _serving(rig: RouterRig) -> dict[int, bool]:
    return {int(k): v["serving"] for k, v in rig.router.stats()["engines"].items()}


def test_an_engine_registering_with_other_params_gets_no_work_until_it_has_loaded_them(rig):
    r = rig.router
    _commit_update(rig)
    sent = _register_de2(rig)  # restarted after the update: it serves the initial params
    assert sent == [
        (b"de2", messages.Ack(ref=str(DE2))),
        (b"de2", messages.LoadParams(version="v1", path="/p")),  # no commit before it answers
    ]
    assert _serving(rig) == {PE: True, DE: True, DE2: False}
    _submit(rig, "r1", "a", [1, 2, 3])
    assert _fetch_de(rig, DE2) == [] and r.rounds.table.requests["r1"].de == -1  # nothing for it
    _fetch_de(rig, DE)
    assert r.rounds.table.requests["r1"].de == DE
    sent = rig.sends(messages.ParamsLoaded(engine=DE2, version="v1", ok=True), b"de2")
    assert sent == [(b"de2", messages.CommitParams(version="v1", commit=True))]
    assert _serving(rig) == {PE: True, DE: True, DE2: True}
    assert r.stats()["engines"][str(DE2)]["params_version"] == "v1"


def test_an_engine_that_cannot_load_the_served_params_stays_out_and_is_asked_again(rig):
    r = rig.router
    retry = r.cfg.cluster.params_retry_s
    _commit_update(rig)
    _register_de2(rig)
    sent = rig.sends(
        messages.ParamsLoaded(engine=DE2, version="v1", ok=False, message="OSError: gone"),
        b"de2",
    )
    assert sent == []  # no commit: it keeps its params, and gets no work
    assert _serving(rig)[DE2] is False
    _submit(rig, "r1", "a", [1, 2, 3])
    assert _fetch_de(rig, DE2) == [] and r.rounds.table.requests["r1"].de == -1
    assert _tick(rig, retry - 1) == []  # not yet
    assert _tick(rig, retry + 1) == [messages.LoadParams(version="v1", path="/p")]
    # a load that is never answered fails too, and is asked again the same way
    limit = r.cfg.cluster.params_load_timeout_s
    assert _tick(rig, retry + 1 + limit + 1) == []
    assert _tick(rig, retry + 1 + limit + 1 + retry + 1) == [
        messages.LoadParams(version="v1", path="/p")
    ]
    assert _serving(rig)[DE2] is False


def test_rounds_an_engine_refuses_for_its_params_run_on_another_engine(rig):
    r = rig.router
    _register_de2(rig)
    _commit_update(rig)  # every engine serves v1 (the PE, DE and DE2 loaded it)
    assert _serving(rig) == {PE: True, DE: True, DE2: True}
    _submit(rig, "r1", "a", [1, 2, 3])
    _fetch_de(rig, DE)
    sent = rig.sends(messages.Fetch(engine=PE, load=messages.Load()), PE_ID)
    st = r.rounds.table.requests["r1"]
    bad, bad_ident = st.de, (DE_ID if st.de == DE else b"de2")
    (job,) = [j for i, m in sent if isinstance(m, messages.Work) for j in m.jobs]
    # the DE could not apply the commit (it serves other params): it refuses the job
    text = "ParamsMismatch: job r1 needs params version 'v1'; this engine serves ''"
    sent = rig.sends(
        messages.Failed(request="r1", engine=bad, message=text, kind="params", attempt=job.attempt),
        bad_ident,
    )
    assert not only(sent, messages.Error)  # the round is not over
    assert (bad_ident, messages.LoadParams(version="v1", path="/p")) in sent  # caught up
    assert _serving(rig)[bad] is False and st.de == -1
    other = DE2 if bad == DE else DE
    _fetch_de(rig, bad)
    _fetch_de(rig, other)
    rig.sends(messages.Fetch(engine=PE, load=messages.Load()), PE_ID)
    assert st.de == other and st.attempts == 2
    _prefill_done(rig, "r1")
    sent = rig.sends(
        messages.DecodeDone(request="r1", engine=other, tokens=[5, 5], persisted_blocks=0),
        DE_ID if other == DE else b"de2",
    )
    assert isinstance(sent[-1][1], messages.RoundResult)


def test_an_engine_registering_during_a_load_is_caught_up_after_the_update(rig):
    r = rig.router
    rig.sends(messages.UpdateParams(version="v1", path="/p"))  # loading: PE and DE asked
    sent = _register_de2(rig)  # with the served (old) params, after the engines were asked
    assert sent == [(b"de2", messages.Ack(ref=str(DE2)))]
    rig.sends(messages.ParamsLoaded(engine=PE, version="v1", ok=True), PE_ID)
    sent = rig.sends(messages.ParamsLoaded(engine=DE, version="v1", ok=True), DE_ID)
    # commits go to the engines that loaded v1 only; DE2 is told to load it first
    assert only(sent, messages.CommitParams) == [
        (PE_ID, messages.CommitParams(version="v1", commit=True)),
        (DE_ID, messages.CommitParams(version="v1", commit=True)),
    ]
    assert (b"de2", messages.LoadParams(version="v1", path="/p")) in sent
    assert r.params.version == "v1" and _serving(rig) == {PE: True, DE: True, DE2: False}
    rig.sends(messages.ParamsLoaded(engine=DE2, version="v1", ok=True), b"de2")
    assert _serving(rig)[DE2] is True


def test_an_engine_registering_while_rounds_drain_loads_the_update_with_the_others(rig):
    _submit(rig, "r1", "a", [1, 2, 3])
    rig.sends(messages.UpdateParams(version="v1", path="/p"))  # draining: r1 in flight
    assert _register_de2(rig) == [(b"de2", messages.Ack(ref=str(DE2)))]
    sent = rig.sends(messages.CancelRound(request="r1"))  # nothing in flight: the engines load
    assert sorted(i for i, m in sent if isinstance(m, messages.LoadParams)) == [
        DE_ID,
        b"de2",
        PE_ID,
    ]


def test_an_engine_with_other_params_registering_during_an_update_waits_for_its_end(rig):
    """(Here the update is refused and the served params, the initial ones, have no checkpoint
    to load: the engine stays out of rotation.)"""
    rig.sends(messages.UpdateParams(version="v1", path="/p"))
    sent = _register_de2(rig, version="v0")
    assert sent == [(b"de2", messages.Ack(ref=str(DE2)))]  # neither v1 nor the served ''
    rig.sends(messages.ParamsLoaded(engine=PE, version="v1", ok=True), PE_ID)
    sent = rig.sends(messages.ParamsLoaded(engine=DE, version="v1", ok=False, message="bad"), DE_ID)
    # refused: the cluster serves '' still, and DE2 is told to load that (no checkpoint of
    # the initial params: it stays out)
    assert rig.router.params.version == ""
    assert [m for i, m in sent if i == b"de2"] == []
    assert _serving(rig) == {PE: True, DE: True, DE2: False}


def test_held_rounds_count_against_max_queue(router_rig):
    rig = _with_sessions(router_rig(max_queue=2))
    _submit(rig, "r1", "a", [1, 2, 3])  # queued
    rig.sends(messages.UpdateParams(version="v1", path="/p"))  # draining: r1 in flight
    assert _submit(rig, "r2", "b", [1, 2, 3]) == []  # held
    ((ident, err),) = _submit(rig, "r3", "c", [1, 2, 3])
    assert ident == CLIENT and err.kind == "overloaded"
    assert err.message.startswith("overloaded: 2 requests queued (max_queue=2)")
    assert "1 of them held for params update 'v1'" in err.message
    assert [m.request for _, m in rig.router.params.held.rounds] == ["r2"]
    assert rig.router.stats()["counters"]["overloaded"] == 1
    # the same kind as a submission over the bound with no update in progress
    rig.sends(messages.CancelRound(request="r1"))  # the update loads, then commits
    rig.sends(messages.ParamsLoaded(engine=PE, version="v1", ok=True), PE_ID)
    rig.sends(messages.ParamsLoaded(engine=DE, version="v1", ok=True), DE_ID)
    assert list(rig.router.rounds.table.requests) == ["r2"]
    assert _submit(rig, "r4", "a", [1]) == []
    ((_, err),) = _submit(rig, "r5", "c", [1])
    assert err.kind == "overloaded"
    assert err.message == "overloaded: 2 requests queued (max_queue=2)"


# ----------------------------------------------------------------------------- release


def _store_blocks(router: Router, tokens: list[int]) -> list[str]:
    keys = block_keys(tokens, BT, router.params.fingerprint)
    width = TINY_QWEN2.kv_width
    kv = np.zeros((TINY_QWEN2.num_layers, len(keys) * BT, width), np.float32)
    router.store.write_full(keys, kv_to_full_blocks(kv, BT)).result(10)
    return keys


def test_close_with_release_deletes_the_sessions_blocks_but_not_shared_ones(rig):
    r = rig.router
    shared = list(range(BT))
    a_tokens = shared + [7] * (2 * BT)
    b_tokens = shared + [9] * BT
    _submit(rig, "ra", "a", a_tokens, gen=2)
    _run_round(rig, "ra")
    _submit(rig, "rb", "b", b_tokens, gen=2)
    _run_round(rig, "rb")
    a_keys = _store_blocks(r, a_tokens + [5])  # what a's DE persisted: prompt + gen - 1 tokens
    b_keys = _store_blocks(r, b_tokens + [5])
    assert a_keys[0] == b_keys[0]
    assert r.store.lookup(a_keys).result(10) == 3
    assert rig.sends(messages.CloseSession(session="a", release=True)) == [
        (CLIENT, messages.Ack(ref="a"))
    ]
    assert r.store.lookup(a_keys[:1]).result(10) == 1  # b still uses the shared first block
    assert (
        r.store.lookup(a_keys[1:2]).result(10) == 0 and r.store.lookup(a_keys[2:]).result(10) == 0
    )
    assert r.store.lookup(b_keys).result(10) == 2
    rig.sends(messages.CloseSession(session="b", release=True))
    assert r.store.lookup(b_keys[:1]).result(10) == 0


def test_close_without_release_keeps_blocks(rig):
    r = rig.router
    tokens = list(range(2 * BT))
    _submit(rig, "ra", "a", tokens, gen=2)
    _run_round(rig, "ra")
    keys = _store_blocks(r, tokens + [5])
    assert rig.sends(messages.CloseSession(session="a")) == [(CLIENT, messages.Ack(ref="a"))]
    assert r.store.lookup(keys).result(10) == 2


def test_release_of_a_busy_session_is_refused(rig):
    _submit(rig, "ra", "a", [1, 2, 3])
    ((_, err),) = rig.sends(messages.CloseSession(session="a", release=True))
    assert "has a round running" in err.message and "a" in rig.router.rounds.table


# ----------------------------------------------------------------------------- engine side


@pytest.fixture(scope="module")
def runner():
    return ModelRunner(init_model(TINY_QWEN2, seed=0))


def _job(version: str) -> messages.LoadJobMsg:
    return messages.LoadJobMsg(
        request="r1",
        keys=[],
        pe_blocks=0,
        de_blocks=0,
        prompt=[1],
        gen=1,
        pe_engine=0,
        pe_node=0,
        pe_address="",
        de_engine=1,
        de_node=1,
        de_address="",
        oracle=False,
        layerwise=True,
        params_version=version,
    )


def test_params_slot_stages_then_commits(runner, tmp_path):
    new = init_model(TINY_QWEN2, seed=3)
    save_params_tree(new, tmp_path / "v1")
    slot = ParamsSlot(runner, "", 4)
    before = np.asarray(runner.embedding)
    sent = []
    assert slot.handle(messages.LoadParams(version="v1", path=str(tmp_path / "v1")), sent.append)
    assert sent == [messages.ParamsLoaded(engine=4, version="v1", ok=True)]
    np.testing.assert_array_equal(np.asarray(runner.embedding), before)  # staged, not served
    slot.check_job(_job(""))
    assert slot.handle(messages.CommitParams(version="v1", commit=True), sent.append)
    assert slot.version == "v1"
    np.testing.assert_array_equal(
        np.asarray(runner.embedding), np.asarray(new.embed.embedding[...])
    )
    with pytest.raises(RuntimeError, match="needs params version ''; this engine serves 'v1'"):
        slot.check_job(_job(""))
    slot.runner.update_params(init_model(TINY_QWEN2, seed=0))  # the module's runner again


def test_params_slot_refuses_bad_params_and_keeps_serving(runner, tmp_path):
    from dualpath_jax.model.checkpoint import params_state

    tree = params_state(init_model(TINY_QWEN2, seed=3))
    tree["layers"][0]["mlp"]["up_proj"]["kernel"] = tree["layers"][0]["mlp"]["up_proj"]["kernel"][
        :, :8
    ]
    save_params_tree(tree, tmp_path / "bad")
    slot = ParamsSlot(runner, "v0", 0)
    before = np.asarray(runner.embedding)
    reply = slot.stage(messages.LoadParams(version="v1", path=str(tmp_path / "bad")))
    assert (
        not reply.ok
        and "layers/0/mlp/up_proj/kernel: float32[64, 8] but the model has float32[64, 96]"
        in reply.message
    )
    reply = slot.stage(messages.LoadParams(version="v1", path=str(tmp_path / "missing")))
    assert not reply.ok and "does not exist" in reply.message
    nan = params_state(init_model(TINY_QWEN2, seed=3))  # a diverged step's weights
    nan["layers"][1]["self_attn"]["o_proj"]["kernel"] *= float("nan")
    save_params_tree(nan, tmp_path / "nan")
    reply = slot.stage(messages.LoadParams(version="v1", path=str(tmp_path / "nan")))
    assert not reply.ok and "NaN or Inf values: layers/1/self_attn/o_proj/kernel" in reply.message
    slot.commit(messages.CommitParams(version="v1", commit=True))  # nothing staged: ignored
    assert slot.version == "v0"
    np.testing.assert_array_equal(np.asarray(runner.embedding), before)


def test_initial_version_and_params_path_checks(tmp_path):
    assert initial_params_version(ClusterConfig()) == ""
    assert initial_params_version(ClusterConfig(params_path=str(tmp_path))) == f"path:{tmp_path}"
    assert (
        initial_params_version(ClusterConfig(params_path=str(tmp_path), params_version="x")) == "x"
    )
    with pytest.raises(ConfigError, match="is not a directory"):
        check_params_config(ClusterConfig(params_path=str(tmp_path / "nope")))
    with pytest.raises(ConfigError, match="neither an orbax checkpoint"):
        check_params_config(ClusterConfig(params_path=str(tmp_path)))
    save_params_tree(init_model(TINY_QWEN2, seed=1), tmp_path / "ok")
    check_params_config(ClusterConfig(params_path=str(tmp_path / "ok")))
    assert check_version("step-12.a:b+c") == "step-12.a:b+c"
    for bad in ("", "a/b", "-x", "x" * 129, "a..b"):
        with pytest.raises(ValueError):
            check_version(bad)


def test_local_cluster_refuses_a_bad_params_path_before_starting_anything(tmp_path):
    from dualpath_jax.runtimes.local import LocalCluster

    cfg = ExperimentConfig(
        model=TINY_QWEN2, cluster=ClusterConfig(params_path=str(tmp_path / "nope"))
    )
    with pytest.raises(ConfigError, match="cluster.params_path=.* is not a directory"):
        LocalCluster(cfg, tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_an_update_whose_engines_do_not_answer_is_aborted_after_the_timeout(rig):
    limit = rig.router.cfg.cluster.params_load_timeout_s
    rig.sends(messages.UpdateParams(version="v1", path="/p"))
    rig.sends(messages.ParamsLoaded(engine=PE, version="v1", ok=True), PE_ID)
    rig.sent.clear()
    rig.router.params.check_timeout(limit)  # not yet
    assert rig.sent == [] and rig.router.params.update is not None
    rig.router.params.check_timeout(limit + 1)
    ((_, err),) = only(rig.sent, messages.Error)
    assert "engine 1: no answer within 600 s" in err.message and rig.router.params.version == ""
    assert [m for _, m in only(rig.sent, messages.CommitParams)] == [
        messages.CommitParams(version="v1", commit=False)
    ] * 2
    assert rig.router.params.update is None
