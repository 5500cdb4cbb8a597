"""The PE's prefill cost model: calibrated on its own runner at start, or pinned by
`cluster.prefill_cost_json`; the router derives beta from the models PEs report."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from dualpath_jax.config import (
    ClusterConfig,
    ConfigError,
    ExperimentConfig,
    Policy,
    SchedulerConfig,
    StoreConfig,
    apply_overrides,
    from_json,
    to_json,
    validate,
)
from dualpath_jax.engines.calibrate import calibrate, calibration_shapes, prefill_cost
from dualpath_jax.kvstore.store import open_block_store
from dualpath_jax.presets import TINY_QWEN2
from dualpath_jax.router.router import Router
from dualpath_jax.sched.cost import BETA_REFERENCE, FittedCostModel, derive_beta, engines_beta
from dualpath_jax.sched.scheduler import GlobalScheduler
from dualpath_jax.wire import messages
from dualpath_jax.wire.rpc import RpcServer

BT = 16


def experiment(model=TINY_QWEN2, **cluster) -> ExperimentConfig:
    return ExperimentConfig(
        model=model,
        cluster=ClusterConfig(**{"decode_max_len": 256, **cluster}),
        store=StoreConfig(kind="memory", block_tokens=BT),
    )


# ----------------------------------------------------------------------------- calibration


def test_calibration_times_its_shapes_and_fits_them(tiny_runner_gqa_first):
    cfg = experiment(tiny_runner_gqa_first.cfg)
    cal = calibrate(tiny_runner_gqa_first, cfg)  # the real clock: only what noise cannot move
    assert [(c, n) for c, n, _ in cal.samples] == list(calibration_shapes(cfg))
    assert all(math.isfinite(v) and v >= 0 for v in cal.model.prefill)
    assert cal.seconds >= sum(s for *_, s in cal.samples)
    # A clock whose forwards last exactly a known cost model's time: the fit recovers it.
    want = FittedCostModel(prefill=(2e-3, 4e-5, 1e-7))
    shapes = list(calibration_shapes(cfg))
    t, values = 0.0, [0.0]
    for c, n in shapes:
        for d in [100.0] + [want.prefill_time([(c, n)])] * 3:
            values += [t, t + d]
            t += d
    values.append(t)
    it = iter(values)
    cal = calibrate(tiny_runner_gqa_first, cfg, shapes=shapes, clock=lambda: next(it))
    assert cal.model.prefill == pytest.approx(want.prefill, rel=1e-6)
    for c, n, s in cal.samples:
        assert cal.model.prefill_time([(c, n)]) == pytest.approx(s, rel=1e-6)


def test_each_sample_is_the_median_of_its_timed_runs(tiny_runner_gqa_first):
    # A fake clock: every shape's untimed first run takes 100, its three timed runs 3, 1, 2.
    shapes = [(0, 16), (0, 32), (BT * 3, 16)]
    clock = _clock_readings(shapes, [100, 3, 1, 2])
    cal = calibrate(
        tiny_runner_gqa_first, experiment(tiny_runner_gqa_first.cfg), shapes=shapes, clock=clock
    )
    assert cal.samples == tuple((c, n, 2.0) for c, n in shapes)
    assert cal.model.prefill == pytest.approx((2.0, 0.0, 0.0), abs=1e-9)
    assert cal.seconds == 3 * (100 + 3 + 1 + 2)


def _clock_readings(shapes, durations):
    """A clock for `calibrate(shapes=shapes)` whose forwards of every shape last `durations`
    (warm-up first): calibrate reads it once at the start, twice per forward, once at the end."""
    t, values = 0.0, [0.0]
    for _ in shapes:
        for d in durations:
            values += [t, t + d]
            t += d
    values.append(t)
    it = iter(values)
    return lambda: next(it)


@pytest.mark.parametrize(
    "cluster, model, policy",
    [
        ({}, {}, Policy.DUALPATH),
        ({"decode_max_len": 4096, "prefill_max_tokens": 0}, {}, Policy.DUALPATH),
        ({"decode_max_len": 4096, "prefill_max_tokens": 64}, {}, Policy.DUALPATH),
        ({"decode_max_len": 4096}, {"max_seq_len": 300}, Policy.DUALPATH),
        ({"decode_max_len": 4096, "prefill_max_kv_tokens": 200}, {}, Policy.BASIC),
        ({"decode_max_len": 4096, "prefill_max_kv_tokens": 200}, {}, Policy.LAYERWISE),
        ({"decode_max_len": 40}, {}, Policy.DUALPATH),
    ],
)
def test_shapes_stay_within_what_a_pe_can_be_given(cluster, model, policy):
    cfg = dataclasses.replace(
        experiment(dataclasses.replace(TINY_QWEN2, **model), **cluster),
        scheduler=SchedulerConfig(policy=policy),
    )
    cl = cfg.cluster
    context = min(cfg.model.max_seq_len, cl.decode_max_len)
    if cl.prefill_max_kv_tokens:
        layers = 1 if policy == Policy.BASIC else cfg.model.num_layers
        context = min(context, cl.prefill_max_kv_tokens * layers)
    shapes = calibration_shapes(cfg)
    # Distinct shapes that separate the three terms (a context below two length buckets has
    # only one bucket of new tokens to time).
    assert len(shapes) == len(set(shapes)) >= (3 if context >= 64 else 2)
    assert any(c > 0 for c, _ in shapes) and any(c == 0 for c, _ in shapes)
    for c, n in shapes:
        assert c % BT == 0 and n >= 1 and c + n <= context
        assert n <= (cl.prefill_max_tokens or n)


def test_the_config_knob_bypasses_calibration():
    pinned = FittedCostModel(prefill=(0.01, 3e-5, 4e-9))
    cfg = experiment(prefill_cost_json=pinned.to_json())
    assert validate(cfg) is cfg
    # The runner is never touched: no calibration runs.
    got = prefill_cost(cfg, runner=None)
    assert got == messages.PrefillCost(prefill=pinned.prefill, calibrated=False)
    # The knob round-trips through config.json and takes a --set override as written.
    assert from_json(ExperimentConfig, to_json(cfg)) == cfg
    text = '{"prefill": [0.01, 3e-05, 4e-09]}'
    assert apply_overrides(
        experiment(), [f"cluster.prefill_cost_json={text}"]
    ) == dataclasses.replace(
        experiment(), cluster=dataclasses.replace(experiment().cluster, prefill_cost_json=text)
    )


@pytest.mark.parametrize(
    "text, problem",
    [
        ("{prefill: 1}", "is not JSON"),
        ("[0.01, 1e-5, 1e-9]", 'must be a JSON object with "prefill"'),
        ('{"decode": [0, 0, 0]}', 'must be a JSON object with "prefill"'),
        ('{"prefill": [0.01, 1e-5]}', '"prefill" must be 3 finite numbers >= 0'),
        ('{"prefill": [0.01, -1e-5, 0]}', '"prefill" must be 3 finite numbers >= 0'),
        ('{"prefill": [0.01, "1e-5", 0]}', '"prefill" must be 3 finite numbers >= 0'),
        ('{"prefill": [0.01, 1e-5, Infinity]}', '"prefill" must be 3 finite numbers >= 0'),
        ('{"prefill": [0.01, 1e-5, 0], "decode": [1]}', '"decode" must be 3 finite numbers >= 0'),
    ],
)
def test_a_bad_cost_json_is_a_config_error_naming_the_key(text, problem):
    with pytest.raises(ConfigError) as e:
        validate(experiment(prefill_cost_json=text))
    assert str(e.value).startswith(f"cluster.prefill_cost_json: {problem}"), str(e.value)
    with pytest.raises(ValueError, match="not a FittedCostModel"):
        FittedCostModel.from_json(text)


# ----------------------------------------------------------------------------- router beta


@pytest.fixture()
def router(monkeypatch, tmp_path):
    """A router recording its events in `tmp_path/events.jsonl`."""
    from dualpath_jax.metrics.events import EventLog

    cfg = experiment()
    server = RpcServer("127.0.0.1", 0)
    store = open_block_store(cfg.store, cfg.model)
    sched = GlobalScheduler(Policy.DUALPATH, beta=math.inf)
    events = EventLog(tmp_path / "events.jsonl")
    r = Router(cfg, server, store, sched, events, clock=lambda: 0.0, store_wait_s=60.0)
    monkeypatch.setattr(server, "send", lambda ident, msg: None)
    yield r
    events.close()
    server.close()
    store.close()


def register(router: Router, engine: int, prefill: tuple[float, float, float] | None) -> None:
    cost = None if prefill is None else messages.PrefillCost(prefill=prefill, calibrated=True)
    role = "decode" if prefill is None else "prefill"
    msg = messages.Register(
        role=role, engine=engine, node=engine, group=0, address="", pid=engine, prefill_cost=cost
    )
    router.handle(f"e{engine}".encode(), msg)


def beta_of(router: Router, prefill: tuple[float, float, float]) -> float:
    return derive_beta(
        router.cfg.scheduler,
        FittedCostModel(prefill=prefill),
        ref_cached=BETA_REFERENCE[0],
        ref_new=BETA_REFERENCE[1],
        max_batch=router.cfg.cluster.prefill_max_batch,
    )


def test_beta_follows_the_registered_pes_slowest_model(router):
    fast, slow = (0.001, 1e-5, 1e-9), (0.01, 1e-4, 1e-8)
    assert router.scheduler.beta == math.inf  # nothing reported yet
    register(router, 1, None)  # a DE reports no model: beta stays
    assert router.scheduler.beta == math.inf
    register(router, 0, fast)
    assert router.scheduler.beta == pytest.approx(beta_of(router, fast))
    register(router, 2, slow)
    assert beta_of(router, slow) < beta_of(router, fast)
    assert router.scheduler.beta == pytest.approx(beta_of(router, slow))
    assert router.stats()["prefill_costs"] == {"0": list(fast), "2": list(slow)}
    # The slow PE dies: beta is the remaining PE's again.
    router.liveness.declare_dead(router.liveness.registry[2])
    assert router.scheduler.beta == pytest.approx(beta_of(router, fast))
    # A PE that registers again (restarted) replaces its model.
    register(router, 0, slow)
    assert router.scheduler.beta == pytest.approx(beta_of(router, slow))


def test_an_unusable_model_is_ignored(router):
    register(router, 0, (0.01, math.nan, 0.0))
    assert router.scheduler.beta == math.inf and router.dispatch.prefill_costs() == {}


def test_beta_tokens_wins_over_reported_models():
    cfg = SchedulerConfig(beta_tokens=123.0)
    assert engines_beta(cfg, [FittedCostModel(prefill=(0.01, 1e-4, 1e-8))], max_batch=8) == 123.0
    assert engines_beta(SchedulerConfig(), [], max_batch=8) == math.inf
    assert engines_beta(cfg, [], max_batch=8) == 123.0


def test_the_register_event_records_the_model(router, tmp_path):
    from dualpath_jax.metrics.events import read_events

    register(router, 0, (0.01, 1e-4, 1e-8))
    reg, beta = read_events(tmp_path / "events.jsonl")
    assert reg["kind"] == "register" and reg["prefill_cost"]["prefill"] == [0.01, 1e-4, 1e-8]
    assert reg["prefill_cost"]["calibrated"] is True
    assert beta == {
        "kind": "beta",
        "t": 0.0,
        "beta": pytest.approx(beta_of(router, (0.01, 1e-4, 1e-8))),
        "engines": [0],
    }
    json.dumps(reg)
