"""One conformance suite for every rollout backend (`dualpath_jax.rollout.Backend`): the `Client`
of an in-process 1P1D cluster, and `InProcessBackend` with one slot and with four.

Each test states one behaviour of the contract and checks it on every backend alike: sessions
open, step, fork and close; greedy tokens are the reference model's (so equal between
backends); a group draws what separate rounds draw; `abort`, `cancel` and `finish` end a round
(or find it finished) and its session steps on from what it kept; params updates serve the new
model and refuse a malformed one; hints map onto the session; `stats()` has the contract's keys;
what a backend documents as unsupported raises kind "unsupported" naming it; bad input gets a
"bad_request" and the backend keeps serving. The backends share one model (`init_model(TINY_QWEN2,
seed=0)`) and, per backend, one module-scoped instance (the cluster's tests run on one pytest
worker: `xdist_group`).
"""

from __future__ import annotations

import dataclasses
import itertools

import jax
import numpy as np
import pytest

from dualpath_jax.config import ClusterConfig, ExperimentConfig, StoreConfig
from dualpath_jax.model.checkpoint import params_state, save_params_tree
from dualpath_jax.model.generation import reference_generate
from dualpath_jax.model.runner import ModelRunner
from dualpath_jax.model.sampling_params import GREEDY, SamplingParams
from dualpath_jax.model.transformer import init_model
from dualpath_jax.presets import TINY_CPU_PREFILL_COST, TINY_QWEN2
from dualpath_jax.rollout import (
    Backend,
    InProcessBackend,
    RolloutError,
    Round,
    Session,
    Trajectory,
    run_trajectories,
)
from dualpath_jax.runtimes.inprocess import InProcessCluster
from dualpath_jax.wire.client import Client, RoundFuture

pytestmark = pytest.mark.xdist_group("backend_conformance")

MAX_LEN = 512
WAIT_S = 120.0  # bounds a broken test; healthy rounds take well under a second
LONG = 300  # a round long enough to be ended early
# What each backend documents as unsupported (everything else it runs).
UNSUPPORTED = {
    "cluster": (),
    "inprocess-1": ("pause", "resume"),
    "inprocess-4": ("pause", "resume"),
}
_names = itertools.count()


def config() -> ExperimentConfig:
    return ExperimentConfig(
        model=TINY_QWEN2,
        cluster=ClusterConfig(
            prefill_cost_json=TINY_CPU_PREFILL_COST.to_json(),  # the PE starts uncalibrated
            decode_max_len=MAX_LEN,
            runtime="thread",
        ),
        store=StoreConfig(block_tokens=16),
    )


@pytest.fixture(scope="module")
def model():
    return init_model(TINY_QWEN2, seed=config().seed)


@pytest.fixture(scope="module")
def oracle(model):
    """Greedy tokens of the reference model (no KV cache) on a full context, and a one-slot
    in-process backend for what the reference is too slow for (long and sampled rounds)."""
    runner = ModelRunner(model)
    local = InProcessBackend(model, max_len=MAX_LEN)
    memo: dict[str, list[int]] = {}  # (every backend asks the same questions)

    class Oracle:
        @staticmethod
        def greedy(context: list[int], gen: int) -> list[int]:
            key = repr(("greedy", context, gen))
            if key not in memo:
                memo[key] = reference_generate(runner, context, gen)
            return memo[key]

        @staticmethod
        def drawn(context: list[int], gen: int, sampling: SamplingParams = GREEDY) -> list[int]:
            key = repr(("drawn", context, gen, sampling))
            if key not in memo:
                sid = f"oracle-{next(_names)}"
                local.open_session(sid)
                try:
                    got = local.submit(sid, context, gen, sampling=sampling).result()
                finally:
                    local.close_session(sid)
                memo[key] = list(got.tokens)
            return memo[key]

    return Oracle


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with InProcessCluster(config(), tmp_path_factory.mktemp("conformance")) as c:
        yield c


@pytest.fixture(scope="module", params=["cluster", "inprocess-1", "inprocess-4"])
def kind(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def backend(kind, model, request):
    if kind == "cluster":
        b = request.getfixturevalue("cluster").client()
    else:
        b = InProcessBackend(model, max_len=MAX_LEN, slots=int(kind.split("-")[1]))
    yield b
    b.close()


def fresh(backend: Backend, **kw) -> str:
    """A new open session's id."""
    sid = f"conf-{next(_names)}"
    backend.open_session(sid, **kw)
    return sid


def prompt(seed: int, n: int = 24) -> list[int]:
    return np.random.RandomState(seed).randint(1, TINY_QWEN2.vocab_size, n).tolist()


def run(backend: Backend, sid: str, append: list[int], gen: int, **kw) -> list[int]:
    return list(backend.submit(sid, append, gen, **kw).result(WAIT_S).tokens)


# ----------------------------------------------------------------------------- the contract


def test_both_backends_implement_the_contract(backend):
    assert isinstance(backend, Backend)
    assert isinstance(backend, Client | InProcessBackend)


def test_open_submit_close_and_a_second_round_builds_on_the_first(backend, oracle):
    sid = fresh(backend)
    a, b = prompt(1), prompt(2, 9)
    first = run(backend, sid, a, 6)
    assert first == oracle.greedy(a, 6)
    assert run(backend, sid, b, 5) == oracle.greedy(a + first + b, 5)
    with pytest.raises(RolloutError) as e:
        backend.open_session(sid)  # open already
    assert e.value.kind == "bad_request"
    backend.open_session(sid, resume=True)
    backend.close_session(sid)
    backend.open_session(sid)  # closed: the id opens afresh
    assert run(backend, sid, a, 6) == first
    backend.close_session(sid)


def test_a_fork_starts_with_its_parents_context(backend, oracle):
    parent = fresh(backend)
    a = prompt(3)
    first = run(backend, parent, a, 4)
    child = fresh(backend, fork_of=parent)
    assert run(backend, child, [5, 6, 7], 4) == oracle.greedy(a + first + [5, 6, 7], 4)
    for sid in (parent, child):
        backend.close_session(sid)


def test_run_trajectories_gives_the_reference_tokens(backend, oracle):
    trajs = [
        Trajectory(f"conf-traj-{next(_names)}", (Round(tuple(prompt(k)), 3), Round((9, 8), 4)))
        for k in range(3)
    ]
    outs = run_trajectories(backend, trajs, progress=False, timeout_s=WAIT_S)
    for t, o in zip(trajs, outs):
        assert o.error == ""
        first = oracle.greedy(list(t.rounds[0].append), 3)
        assert o.rounds == [first, oracle.greedy([*t.rounds[0].append, *first, 9, 8], 4)]


def test_a_group_draws_what_separate_rounds_draw(backend, oracle):
    parent = fresh(backend)
    a = prompt(4)
    kids = [fresh(backend, fork_of=parent) for _ in range(3)]
    seeds = [int(x) for x in jax.random.randint(jax.random.key(3), (3,), 0, 2**31 - 1)]
    samplings = [SamplingParams(temperature=1.0, seed=s) for s in seeds]
    futs = backend.submit_group(kids, a, 5, samplings=samplings)
    got = [list(f.result(WAIT_S).tokens) for f in futs]
    assert got == [oracle.drawn(a, 5, p) for p in samplings]
    greedy = backend.submit_group(kids, [1, 2], 3, samplings=[GREEDY] * 3)
    for k, f in enumerate(greedy):
        assert list(f.result(WAIT_S).tokens) == oracle.drawn(a + got[k] + [1, 2], 3)
    for sid in (parent, *kids):
        backend.close_session(sid)


@pytest.mark.parametrize("how", ["abort", "finish", "cancel"])
def test_a_round_ended_early_leaves_its_session_stepping_on(backend, kind, oracle, how):
    """`abort` / `finish` end a round with a prefix of its tokens (or, where no round is in
    flight between calls, find it finished); `cancel` fails it with kind "cancelled" (or finds
    it finished); the session's next round builds on what the round left."""
    sid = fresh(backend)
    a = prompt(5)
    full = oracle.drawn(a, LONG)
    fut = backend.submit(sid, a, LONG)
    if how == "abort":
        ended = backend.abort(fut.request)
        assert backend.abort("no-such-round") == []
    else:
        getattr(backend, how)(fut.request)
    try:
        res = fut.result(WAIT_S)
    except RolloutError as e:  # cancelled: the round left nothing, its append neither
        assert how == "cancel" and e.kind == "cancelled", e
        assert run(backend, sid, a, 4) == full[:4]
    else:
        kept = list(res.tokens)
        assert kept == full[: len(kept)]
        early = {"abort": "abort", "finish": "finished", "cancel": "length"}[how]
        assert res.finish_reason in (early, "length")
        if how == "abort":
            assert (fut.request in ended) == (res.finish_reason == "abort")
        if kind != "inprocess-1":  # rounds are in flight between calls: this one ended early
            assert how != "cancel", "a round in flight was not cancelled"
            assert res.finish_reason == early and len(kept) < LONG
        assert run(backend, sid, [3, 4], 4) == oracle.drawn(a + kept + [3, 4], 4)
    backend.close_session(sid)


def test_params_updates_serve_the_new_model_and_refuse_a_malformed_one(backend, oracle, tmp_path):
    other = init_model(TINY_QWEN2, seed=7)
    a = prompt(6)
    assert backend.update_params(other, version=f"conf-b-{next(_names)}").startswith("conf-b")
    version = backend.stats()["params_version"]
    sid = fresh(backend)
    assert run(backend, sid, a, 5) == reference_generate(ModelRunner(other), a, 5)
    bad = params_state(other)
    bad["embed"]["embedding"] = bad["embed"]["embedding"][:, :8]
    with pytest.raises(RolloutError):
        backend.update_params(bad, version="conf-broken")
    assert backend.stats()["params_version"] == version  # still serving the last good ones
    # back to the shared model, from a checkpoint
    path = save_params_tree(init_model(TINY_QWEN2, seed=config().seed), tmp_path / "a")
    assert backend.update_params_from_checkpoint(path, "conf-a") == "conf-a"
    assert backend.stats()["params_version"] == "conf-a"
    assert run(backend, sid, [1, 2], 3) == oracle.greedy(
        a + reference_generate(ModelRunner(other), a, 5) + [1, 2], 3
    )
    backend.close_session(sid)


def test_hints_map_onto_the_session(backend, oracle):
    sid = fresh(backend)
    a = prompt(8)
    first = run(backend, sid, a, 3)
    for h in ("ttl:60", "pin", {"kind": "tool_call", "expected_s": 1.5}):
        assert backend.hint(sid, h) == sid
    child = backend.hint(sid, "fork")
    assert child.startswith(f"{sid}/")
    assert run(backend, child, [4], 3) == oracle.greedy(a + first + [4], 3)
    with pytest.raises(RolloutError) as e:
        backend.hint(sid, "warp")
    assert e.value.kind == "bad_request"
    assert backend.hint(sid, "release") == sid  # closes it
    backend.open_session(sid)  # (a fresh one: the id is free again)
    for s in (sid, child):
        backend.close_session(s)


def test_stats_have_the_contracts_keys_and_count_rounds(backend):
    before = backend.stats()
    assert {"sessions", "in_flight", "params_version", "counters"} <= set(before)
    assert isinstance(before["sessions"], int) and isinstance(before["in_flight"], int)
    assert isinstance(before["params_version"], str)
    keys = ("requests_done", "aborted", "cancelled", "finished_early")
    assert all(isinstance(before["counters"].get(k), int) for k in keys), before["counters"]
    sid = fresh(backend)
    run(backend, sid, [1, 2, 3], 2)
    after = backend.stats()
    assert after["counters"]["requests_done"] == before["counters"]["requests_done"] + 1
    assert after["sessions"] == before["sessions"] + 1 and after["in_flight"] == 0
    backend.close_session(sid)
    assert backend.stats()["sessions"] == before["sessions"]


def test_what_a_backend_cannot_do_raises_unsupported_naming_it(backend, kind):
    calls = {"pause": lambda: backend.pause("wait", 5.0), "resume": lambda: backend.resume(5.0)}
    for method in UNSUPPORTED[kind]:
        with pytest.raises(RolloutError) as e:
            calls[method]()
        assert e.value.kind == "unsupported"
        assert type(backend).__name__ in str(e.value) and method in str(e.value)
    if kind == "cluster":  # it supports them: a pause with nothing in flight, then resume
        backend.pause("wait")
        backend.resume()


@pytest.mark.parametrize(
    "append, gen, sampling",
    [
        ([-1], 2, GREEDY),
        ([1, "2"], 2, GREEDY),
        ([1, 2**31], 2, GREEDY),
        ([1, 2], 0, GREEDY),
        ([1, 2], True, GREEDY),
        ([1, 2], 2, "greedy"),
        ([], 2, GREEDY),
    ],
)
def test_bad_input_is_a_bad_request_and_the_backend_keeps_serving(
    backend, oracle, append, gen, sampling
):
    sid = fresh(backend)
    with pytest.raises(RolloutError) as e:
        backend.submit(sid, append, gen, sampling=sampling).result(WAIT_S)
    assert e.value.kind == "bad_request", e.value
    assert run(backend, sid, [1, 2, 3], 3) == oracle.greedy([1, 2, 3], 3)
    backend.close_session(sid)


def test_bad_sessions_are_bad_requests(backend):
    for bad in ("", 7, "x" * 5000):
        with pytest.raises(RolloutError) as e:
            backend.open_session(bad)
        assert e.value.kind == "bad_request"
    with pytest.raises(RolloutError) as e:
        backend.submit(f"never-opened-{next(_names)}", [1], 1).result(WAIT_S)
    assert e.value.kind == "bad_request"
    with pytest.raises(RolloutError) as e:
        backend.open_session(f"conf-{next(_names)}", fork_of="no-such-session")
    assert e.value.kind == "bad_request"


# ----------------------------------------------------------------------------- the defaults


class Minimal(Backend):
    """A backend of the three abstract methods only: rounds answered at once, one token each."""

    def __init__(self):
        self.open: dict[str, list[int]] = {}

    def open_session(self, session, resume=False, *, priority=None, ttl_s=None, fork_of=""):
        self.open[session] = list(self.open.get(fork_of, []))

    def close_session(self, session, release=False):
        self.open.pop(session)

    def submit(self, session, append, gen, *, sampling=GREEDY, stop_tokens=()):
        from dualpath_jax.results import RoundResult

        fut = RoundFuture()
        fut.request = f"{session}#{len(self.open[session])}"
        self.open[session] += [*append, 0]
        fut.set_result(RoundResult.timed(
            fut.request, [0], t_submit=0, t_assign=0, t_first=0, t_second=0, t_done=0,
            cached_tokens=0, prompt_tokens=len(self.open[session]) - 1, read_path="none",
            recomputed_blocks=0,
        ))  # fmt: skip
        return fut


def test_the_defaults_raise_unsupported_and_groups_run_one_by_one():
    b = Minimal()
    calls = {
        "cancel": lambda: b.cancel("r"),
        "finish": lambda: b.finish("r"),
        "abort": lambda: b.abort(all=True),
        "pause": b.pause,
        "resume": b.resume,
        "update_params": lambda: b.update_params({}),
        "update_params_from_checkpoint": lambda: b.update_params_from_checkpoint("/nowhere"),
        "tool_call": lambda: b.tool_call("s", 1.0),
        "stats": b.stats,
    }
    for method, call in calls.items():
        with pytest.raises(RolloutError, match=f"Minimal does not support {method}") as e:
            call()
        assert e.value.kind == "unsupported"
    # what the defaults do run: groups one by one, hints through the session methods
    with b:
        parent = Session(b, "p")
        kids = parent.fork(2)
        futs = b.submit_group([k.id for k in kids], [5], 1, samplings=[GREEDY, GREEDY])
        assert [list(f.result().tokens) for f in futs] == [[0], [0]]
        assert b.hint("p", "ttl:5") == "p" and b.hint("p", "fork") in b.open
        with pytest.raises(RolloutError, match="does not support tool_call"):
            b.hint("p", "tool_call:3")  # its retention part ran; the prefetch cannot
        assert parent.step([1], 1, timeout_s=5) == [0]
    assert dataclasses.is_dataclass(Round)  # (the records run_trajectories takes)
