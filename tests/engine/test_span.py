"""Engines spanning several processes (`engines.span`): the calls a leader sends, the decoder
methods it mirrors, the prefill segments it describes, each process's devices, and what is
refused. The cluster itself runs
in tests/integration/test_engine_meshes.py."""

from __future__ import annotations

import inspect

import numpy as np
import pytest

from dualpath_jax.config import ClusterConfig, ConfigError, ExperimentConfig, validate
from dualpath_jax.engines import span
from dualpath_jax.engines.params import ParamsSlot, replay_params
from dualpath_jax.model.decode import Decoder
from dualpath_jax.model.sampling_params import SamplingParams
from dualpath_jax.runtimes import devices
from dualpath_jax.wire import messages


def test_a_call_round_trips_with_its_arrays_bit_for_bit():
    blocks = np.random.RandomState(0).randn(2, 3, 16, 8).astype(np.float32).view(np.uint8)
    sampling = SamplingParams(temperature=0.5, seed=5)
    frame = span.encode_call("insert_blocks", (3, blocks, 20, np.int64(7)), {"sampling": sampling})
    method, args, kwargs = span.decode_call(frame)
    assert method == "insert_blocks" and kwargs == {"sampling": sampling}
    assert type(kwargs["sampling"]) is SamplingParams
    assert args[0] == 3 and args[2] == 20 and args[3] == 7 and type(args[3]) is int
    assert args[1].dtype == blocks.dtype and args[1].shape == blocks.shape
    assert args[1].tobytes() == blocks.tobytes()
    empty = np.zeros((0, 4), np.int32)
    (got,) = span.decode_call(span.encode_call("rows", (empty,), {}))[1]
    assert got.shape == (0, 4) and got.dtype == np.int32
    with pytest.raises(TypeError, match="cannot send"):
        span.encode_call("free", (object(),), {})


# Decoder methods that only read host state the mirrored calls keep equal in every process.
HOST_QUERIES = {"free_slots", "pages_needed", "can_insert", "fork_pages"}


def test_every_decoder_method_is_mirrored_or_a_host_query():
    """A new Decoder method that runs a program must be replayed by the followers (or the
    processes of a spanning engine stop running the same programs and hang)."""
    public = {
        name
        for name, fn in inspect.getmembers(Decoder, inspect.isfunction)
        if not name.startswith("_")
    }
    assert public == span.MIRRORED | HOST_QUERIES, public ^ (span.MIRRORED | HOST_QUERIES)


class _Recorder:
    def __init__(self):
        self.sent = []

    def send(self, method, args=(), kwargs=None):
        self.sent.append((method, args, kwargs or {}))


class _FakeDecoder:
    slots, max_len, min_bucket, page_size, num_pages = 4, 128, 64, 16, 32

    def __init__(self):
        self.calls = []

    def free(self, slot):
        self.calls.append(("free", slot))

    def free_slots(self):
        return [0, 1]


def test_the_leader_sends_the_decoder_shape_then_each_mirrored_call_before_running_it():
    leader, dec = _Recorder(), _FakeDecoder()
    mirrored = span.MirroredDecoder(dec, leader)
    assert leader.sent[0] == (
        "_init",
        (),
        {"slots": 4, "max_len": 128, "min_bucket": 64, "page_size": 16, "num_pages": 32},
    )
    mirrored.free(2)
    assert leader.sent[-1] == ("free", (2,), {}) and dec.calls == [("free", 2)]
    assert mirrored.free_slots() == [0, 1] and len(leader.sent) == 2  # a query is not sent
    assert mirrored.page_size == 16


def test_each_process_of_a_spanning_engine_gets_its_share_of_the_devices():
    cpu = ClusterConfig(platform="cpu", decode_mesh="tensor=4", decode_processes=2)
    for rank in (0, 1):
        env = devices.engine_env(cpu, 1, (), {}, rank)
        assert env["XLA_FLAGS"] == "--xla_force_host_platform_device_count=2"
    gpu = ClusterConfig(platform="gpu", prefill_mesh="tensor=2", decode_mesh="tensor=4",
                        decode_processes=2)  # fmt: skip
    host = [str(i) for i in range(8)]
    got = [devices.engine_env(gpu, 1, host, {}, rank)["CUDA_VISIBLE_DEVICES"] for rank in (0, 1)]
    assert got == ["2,3", "4,5"]
    assert devices.engine_env(gpu, 0, host, {})["CUDA_VISIBLE_DEVICES"] == "0,1"  # PEs span one
    pe = ClusterConfig(platform="gpu", prefill_mesh="tensor=4", prefill_processes=2)
    got = [devices.engine_env(pe, 0, host, {}, rank)["CUDA_VISIBLE_DEVICES"] for rank in (0, 1)]
    assert got == ["0,1", "2,3"]
    tpu = ClusterConfig(platform="tpu", decode_mesh="tensor=4", decode_processes=2)
    with pytest.raises(ConfigError, match="cpu or gpu"):
        devices.engine_env(tpu, 1, host, {}, 1)


def test_the_processes_must_divide_the_mesh():
    bad = ExperimentConfig(cluster=ClusterConfig(decode_mesh="tensor=2", decode_processes=3))
    with pytest.raises(ConfigError, match="cluster.decode_processes"):
        validate(bad)
    bad = ExperimentConfig(cluster=ClusterConfig(prefill_mesh="tensor=4", prefill_processes=3))
    with pytest.raises(ConfigError, match="cluster.prefill_processes: must divide"):
        validate(bad)
    with pytest.raises(ConfigError, match="cluster.decode_processes"):
        validate(ExperimentConfig(cluster=ClusterConfig(decode_processes=0)))
    validate(ExperimentConfig(cluster=ClusterConfig(decode_mesh="tensor=4", decode_processes=2)))


def test_a_spanning_engines_params_updates_reach_its_followers_first(tmp_path):
    """The leader sends each load and commit before doing it; a follower replays them (here
    both fail alike on a directory that is no checkpoint, and the old version stays)."""

    class Runner:
        cfg, mesh = ExperimentConfig().model, None

    leader = _Recorder()
    slot = ParamsSlot(Runner(), "v0", 1, mirror=leader)
    got = slot.stage(messages.LoadParams(version="v1", path=str(tmp_path)))
    assert not got.ok and leader.sent == [("_params_stage", ("v1", str(tmp_path), "", 0), {})]
    slot.commit(messages.CommitParams(version="v1", commit=True))
    assert leader.sent[-1] == ("_params_commit", ("v1", True), {}) and slot.version == "v0"
    follower = ParamsSlot(Runner(), "v0", -1)
    for method, args, _ in leader.sent:
        assert replay_params(follower, method, args)
    assert follower.version == "v0"
    assert not replay_params(follower, "free", (1,))


def test_prefill_segments_travel_as_host_rows_and_kept_run_references():
    """A spanning PE's layer segments: host rows as they are, hit pages by their pieces' offers
    (each process resolves them to its own pages over the mesh), kept row runs by their place
    in the lists each process keeps (resolved to its own runs); pages of one device cannot be
    told."""
    import jax.numpy as jnp

    from dualpath_jax.engines.prefill_forward import describe, resolve
    from dualpath_jax.model.cached_kv import DevicePages, DeviceRowRun
    from dualpath_jax.transfer.row_offers import SpanPages, hit_meta

    host = np.arange(12, dtype=np.float32).reshape(3, 4)
    meta = hit_meta("127.0.0.1:1", "r1", 0, 0, 4, 2, "de")
    pages = SpanPages(jnp.zeros((4, 4, 4)), blocks=2, meta=meta)
    lead = {0: [DeviceRowRun(jnp.zeros((1, 8, 4)), 0, 8)]}
    done = {0: [DeviceRowRun(jnp.ones((1, 8, 4)), 0, 5)]}
    desc = describe([lead[0][0], host, pages, done[0][0]], lead, done, 0)
    assert [d[0] for d in desc] == ["lead", "rows", "pieces", "done"]
    frame = span.encode_call("layer", (0,), {"requests": [desc]})
    got = span.decode_call(frame)[2]["requests"][0]
    theirs_lead = {0: [DeviceRowRun(jnp.zeros((1, 8, 4)), 0, 8)]}  # another process's own runs
    theirs_done = {0: [DeviceRowRun(jnp.ones((1, 8, 4)), 0, 5)]}
    theirs = SpanPages(jnp.ones((4, 4, 4)), blocks=2, meta=meta)  # as it pulled its pieces
    segs = resolve(got, theirs_lead, theirs_done, 0, lambda m: theirs if m == meta else None)
    assert segs[0] is theirs_lead[0][0] and segs[3] is theirs_done[0][0]
    assert segs[1].tobytes() == host.tobytes()
    assert segs[2] is theirs
    with pytest.raises(TypeError, match="cannot be told"):
        describe([DevicePages(jnp.zeros((4, 4, 4)), blocks=2)], lead, done, 0)
