"""Params updates streamed over the transfer layer (transfer/params_sync.py), in-process: the
offer's buckets and checksums, an engine's `ParamsSlot` pulling, checking and staging them (over
`InProcessChannel`s), refusals (wrong tree, corrupted bucket, a vanished offer), the fault
plan's `params.bucket` rules, and the router's side (copies per engine process, fail-stop when
an engine dies or restarts mid-pull)."""

from __future__ import annotations

import numpy as np
import pytest
from router_rig import CLIENT, DE, DE_ID, PE, PE_ID, only, registration

from dualpath_jax.engines.params import ParamsSlot, served_params
from dualpath_jax.model.checkpoint import params_state
from dualpath_jax.model.generation import reference_generate
from dualpath_jax.model.runner import ModelRunner
from dualpath_jax.model.transformer import init_model
from dualpath_jax.presets import TINY_QWEN2
from dualpath_jax.transfer.inprocess_channel import InProcessChannel, InProcessFabric
from dualpath_jax.transfer.params_offer import ParamsBucket, ParamsLeaf, ParamsOffer
from dualpath_jax.transfer.params_sync import (
    bucket_checksum,
    flat_params,
    offer_params,
    plan_buckets,
)
from dualpath_jax.wire import frames, messages

BUCKET = 60_000  # bytes: the tiny model (~0.5 MB) in about ten buckets


@pytest.fixture(scope="module")
def runner():
    return ModelRunner(init_model(TINY_QWEN2, seed=0))


@pytest.fixture()
def fabric():
    return InProcessFabric()


def _slot(runner, fabric, **kw) -> ParamsSlot:
    return ParamsSlot(
        runner, "v0", 3, channel=InProcessChannel(fabric, "engine"), load_timeout_s=30.0, **kw
    )


def test_plan_buckets_keeps_leaves_whole_and_in_order():
    assert plan_buckets([4, 4, 4, 10, 1], 8) == [[0, 1], [2], [3], [4]]
    assert plan_buckets([1, 1, 1], 100) == [[0, 1, 2]]
    with pytest.raises(ValueError):
        plan_buckets([1], 0)


def test_the_checksum_covers_bytes_and_paths():
    a = np.arange(64, dtype=np.float32)
    b = a.copy()
    b.view(np.uint8)[5] ^= 1
    assert bucket_checksum(["x"], [a]) == bucket_checksum(["x"], [a.copy()])
    assert bucket_checksum(["x"], [a]) != bucket_checksum(["x"], [b])
    assert bucket_checksum(["x"], [a]) != bucket_checksum(["y"], [a])


def test_the_offer_lists_every_leaf_in_buckets(fabric):
    model = init_model(TINY_QWEN2, seed=1)
    flat = flat_params(params_state(model))
    with offer_params(model, InProcessChannel(fabric, "client"), 2, bucket_bytes=BUCKET) as h:
        offer = h.offer
        assert [leaf.path for b in offer.buckets for leaf in b.leaves] == [p for p, _ in flat]
        assert offer.nbytes == sum(int(x.nbytes) for _, x in flat)
        assert len(offer.buckets) > 5 and all(
            b.nbytes <= BUCKET or len(b.leaves) == 1 for b in offer.buckets
        )
        assert offer.copies == 2 and offer.uuid_of(1, 0) == offer.uuid + len(offer.buckets)
        # the manifest travels in a control frame
        msg = messages.UpdateParams(version="v1", offer=offer)
        assert frames.decode(frames.encode(msg, "t"), "t") == msg


def test_a_slot_pulls_checks_stages_then_commits(runner, fabric):
    new = init_model(TINY_QWEN2, seed=3)
    prompt = list(range(1, 40))
    want = reference_generate(ModelRunner(new), prompt, 4)
    old_tokens = reference_generate(runner, prompt, 4)
    before = np.asarray(runner.embedding)
    slot = _slot(runner, fabric)
    with offer_params(new, InProcessChannel(fabric, "client"), 2, bucket_bytes=BUCKET) as h:
        got = slot.stage(messages.LoadParams(version="v1", offer=h.offer, copy=1))
    assert got == messages.ParamsLoaded(engine=3, version="v1", ok=True)
    np.testing.assert_array_equal(np.asarray(runner.embedding), before)  # staged, not served
    assert reference_generate(runner, prompt, 4) == old_tokens
    slot.commit(messages.CommitParams(version="v1", commit=True))
    assert slot.version == "v1" and reference_generate(runner, prompt, 4) == want
    runner.update_params(init_model(TINY_QWEN2, seed=0))  # the module's runner again


def test_a_corrupted_bucket_is_refused_and_the_old_params_serve(runner, fabric):
    from dualpath_jax.testing.faulty import _flip_bytes

    seen = []

    def corrupt(arrays):  # the third bucket's first bytes flipped on arrival
        seen.append(len(arrays))
        return [_flip_bytes(arrays[0]), *arrays[1:]] if len(seen) == 3 else arrays

    before = np.asarray(runner.embedding)
    slot = _slot(runner, fabric, corrupt_bucket=corrupt)
    new = init_model(TINY_QWEN2, seed=3)
    with offer_params(new, InProcessChannel(fabric, "client"), 1, bucket_bytes=BUCKET) as h:
        got = slot.stage(messages.LoadParams(version="v1", offer=h.offer))
        n = len(h.offer.buckets)
    assert not got.ok and f"bucket 3/{n}" in got.message and "arrived corrupted" in got.message
    assert len(seen) == 3  # nothing pulled after the bad bucket
    slot.commit(messages.CommitParams(version="v1", commit=True))  # nothing staged: ignored
    assert slot.version == "v0"
    np.testing.assert_array_equal(np.asarray(runner.embedding), before)


def test_a_wrong_tree_is_refused_before_anything_is_pulled(runner, fabric):
    tree = params_state(init_model(TINY_QWEN2, seed=3))
    tree["layers"][0]["mlp"]["up_proj"]["kernel"] = tree["layers"][0]["mlp"]["up_proj"]["kernel"][
        :, :8
    ]
    pulls = []
    slot = _slot(runner, fabric, corrupt_bucket=lambda a: pulls.append(a) or a)
    with offer_params(tree, InProcessChannel(fabric, "client"), 1, bucket_bytes=BUCKET) as h:
        got = slot.stage(messages.LoadParams(version="v1", offer=h.offer))
    assert not got.ok and "layers/0/mlp/up_proj/kernel: float32[64, 8]" in got.message
    assert pulls == []
    tree = params_state(init_model(TINY_QWEN2, seed=3))
    tree["embed"]["embedding"] = tree["embed"]["embedding"].astype(np.float16)
    with offer_params(tree, InProcessChannel(fabric, "client"), 1, bucket_bytes=BUCKET) as h:
        got = slot.stage(messages.LoadParams(version="v1", offer=h.offer))
    assert not got.ok and "embed/embedding: float16" in got.message


def test_an_offer_that_vanished_fails_the_pull(runner, fabric):
    slot = _slot(runner, fabric)
    h = offer_params(
        init_model(TINY_QWEN2, seed=3), InProcessChannel(fabric, "client"), 1, bucket_bytes=BUCKET
    )
    fabric.kill(h.offer.address)  # the trainer's process died
    got = slot.stage(messages.LoadParams(version="v1", offer=h.offer))
    assert not got.ok and "ParamsTransferError: pulling bucket 1/" in got.message
    h.close()
    assert slot.version == "v0"


def test_served_params_is_the_model_tree(runner):
    model = init_model(TINY_QWEN2, seed=0)
    want = flat_params(params_state(model))
    got = flat_params(served_params(runner))
    assert [p for p, _ in got] == [p for p, _ in want]


def test_the_fault_plan_corrupts_delays_or_fails_params_buckets(tmp_path):
    import json

    from dualpath_jax.testing.fault_plan import FaultPlan, parse_plan
    from dualpath_jax.testing.faulty import Injector

    path = tmp_path / "plan.json"
    path.write_text(
        json.dumps(
            {
                "rules": [
                    {"op": "params.bucket", "corrupt": True, "count": 1, "engines": ["de1"]},
                    {"op": "params.bucket", "error": "EIO", "engines": ["pe0"]},
                ]
            }
        )
    )
    a = np.arange(8, dtype=np.float32)
    de = Injector(FaultPlan(path), "de1")
    (bad,) = de.params_bucket([a])
    assert bucket_checksum(["x"], [bad]) != bucket_checksum(["x"], [a])
    assert de.params_bucket([a])[0] is a  # the rule is spent
    with pytest.raises(OSError, match="injected EIO into params.bucket"):
        Injector(FaultPlan(path), "pe0").params_bucket([a])
    for rule, problem in [
        ({"op": "channel.pull", "corrupt": True}, "corrupt is for op params.bucket only"),
        ({"op": "params.bucket", "hang": True}, "hang is not for op params.bucket"),
        ({"op": "params.bucket", "corrupt": 1}, "corrupt must be true or false"),
    ]:
        with pytest.raises(ValueError, match=problem):
            parse_plan(json.dumps({"rules": [rule]}))


# ----------------------------------------------------------------------------- the router


def _offer(copies: int = 3) -> ParamsOffer:
    leaf = ParamsLeaf(path="embed/embedding", shape=[4], dtype="float32")
    bucket = ParamsBucket(leaves=[leaf], nbytes=16, checksum="0")
    return ParamsOffer(address="a:1", uuid=5, copies=copies, buckets=[bucket])


def test_a_streamed_update_gives_each_engine_its_copy_and_commits(rig):
    assert rig.router.stats()["params_pullers"] == 2
    offer = _offer()
    sent = rig.sends(messages.UpdateParams(version="v1", offer=offer))
    loads = {ident: m for ident, m in only(sent, messages.LoadParams)}
    assert {i: (m.offer, m.path) for i, m in loads.items()} == {
        PE_ID: (offer, ""),
        DE_ID: (offer, ""),
    }
    assert sorted(m.copy for m in loads.values()) == [0, 1]
    rig.sends(messages.ParamsLoaded(engine=PE, version="v1", ok=True), PE_ID)
    sent = rig.sends(messages.ParamsLoaded(engine=DE, version="v1", ok=True), DE_ID)
    assert (CLIENT, messages.Ack(ref="params:v1")) in sent
    assert rig.router.params.version == "v1" and rig.router.params.path == ""


def test_an_offer_with_too_few_copies_is_refused_before_any_load(rig):
    sent = rig.sends(messages.UpdateParams(version="v1", offer=_offer(copies=1)))
    assert only(sent, messages.LoadParams) == []
    ((_, err),) = only(sent, messages.Error)
    assert "the offer holds 1 copies" in err.message and "pull 2" in err.message
    assert rig.router.params.version == "" and rig.router.params.update is None


def test_a_path_and_an_offer_together_are_refused(rig):
    ((_, err),) = rig.sends(messages.UpdateParams(version="v1", path="/p", offer=_offer()))
    assert "(one of them)" in err.message


@pytest.mark.parametrize("how", ["dies", "restarts"])
def test_an_engine_dying_or_restarting_mid_pull_fails_the_update_everywhere(rig, how):
    rig.sends(messages.UpdateParams(version="v1", offer=_offer()))
    rig.sends(messages.ParamsLoaded(engine=PE, version="v1", ok=True), PE_ID)
    rig.sent.clear()
    if how == "dies":
        rig.router.liveness.declare_dead(rig.router.liveness.registry[DE])
        sent = list(rig.sent)
    else:
        # (the registration of the process the rig registered)
        sent = rig.sends(registration(DE, "decode", pid=100 + DE), DE_ID)
    assert (PE_ID, messages.CommitParams(version="v1", commit=False)) in sent
    ((_, err),) = only(sent, messages.Error)
    verb = "died" if how == "dies" else "restarted"
    assert f"engine 1: {verb} while pulling the params" in err.message
    assert "still serving ''" in err.message
    assert rig.router.params.version == ""
    assert all(e.params_version == "" for e in rig.router.liveness.registry.live())


def test_a_streamed_update_after_a_checkpoint_one(runner, fabric, tmp_path):
    """Params an orbax checkpoint restored (host arrays, no sharding) are replaced alike."""
    from dualpath_jax.model.checkpoint import save_params_tree

    save_params_tree(init_model(TINY_QWEN2, seed=5), tmp_path / "ckpt")
    slot = _slot(runner, fabric)
    assert slot.stage(messages.LoadParams(version="v1", path=str(tmp_path / "ckpt"))).ok
    slot.commit(messages.CommitParams(version="v1", commit=True))
    new = init_model(TINY_QWEN2, seed=6)
    with offer_params(new, InProcessChannel(fabric, "client"), 1, bucket_bytes=BUCKET) as h:
        assert slot.stage(messages.LoadParams(version="v2", offer=h.offer)).ok
    slot.commit(messages.CommitParams(version="v2", commit=True))
    prompt = list(range(2, 30))
    assert reference_generate(runner, prompt, 3) == reference_generate(ModelRunner(new), prompt, 3)
    runner.update_params(init_model(TINY_QWEN2, seed=0))
