"""Parameter updates and sampling over the in-process backend, and the checked loading of served
parameters (`model.checkpoint.load_params`, `model_from_params`)."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from dualpath_jax.model.checkpoint import (
    CheckpointError,
    load_params,
    model_from_params,
    params_state,
    save_params,
    save_params_tree,
)
from dualpath_jax.model.generation import reference_generate
from dualpath_jax.model.runner import ModelRunner
from dualpath_jax.model.sampler import sample_at
from dualpath_jax.model.sampling_params import SamplingParams
from dualpath_jax.model.transformer import init_model
from dualpath_jax.presets import TINY_QWEN2
from dualpath_jax.rollout import (
    InProcessBackend,
    RolloutError,
    Round,
    Session,
    Trajectory,
    run_trajectories,
)

A_SEED, B_SEED = 21, 22


@pytest.fixture(scope="module")
def models():
    return init_model(TINY_QWEN2, seed=A_SEED), init_model(TINY_QWEN2, seed=B_SEED)


@pytest.fixture(scope="module")
def refs(models):
    return tuple(ModelRunner(m) for m in models)


def _leaves_equal(a, b) -> bool:
    return all(
        np.array_equal(x, y)
        for x, y in zip(jax.tree.leaves(nnx.state(a)), jax.tree.leaves(nnx.state(b)))
    )


# ----------------------------------------------------------------------------- checkpoints


@pytest.mark.parametrize("saver", ["tree", "state"])
def test_load_params_round_trips_both_layouts(models, tmp_path, saver):
    a, _ = models
    (save_params_tree if saver == "tree" else save_params)(a, tmp_path)
    assert _leaves_equal(load_params(tmp_path, TINY_QWEN2), a)


def test_save_params_tree_takes_a_state_or_a_pure_dict(models, tmp_path):
    a, _ = models
    save_params_tree(nnx.state(a), tmp_path / "s")
    save_params_tree(nnx.to_pure_dict(nnx.state(a)), tmp_path / "d")
    assert _leaves_equal(load_params(tmp_path / "s", TINY_QWEN2), a)
    assert _leaves_equal(load_params(tmp_path / "d", TINY_QWEN2), a)


def _mangled(model, how: str) -> dict:
    tree = params_state(model)
    if how == "shape":
        tree["embed"]["embedding"] = tree["embed"]["embedding"][:, :32]
    elif how == "dtype":
        tree["head"]["norm"]["weight"] = tree["head"]["norm"]["weight"].astype(jax.numpy.bfloat16)
    elif how == "missing":
        del tree["layers"][2]
    elif how == "extra":
        tree["head"]["bonus"] = np.zeros(3, np.float32)
    return tree


@pytest.mark.parametrize(
    "how, problem",
    [
        ("shape", "embed/embedding: float32[257, 32] but the model has float32[257, 64]"),
        ("dtype", "head/norm/weight: bfloat16[64] but the model has float32[64]"),
        ("missing", "missing 12 leaves, e.g. ['layers/2/input_layernorm/weight'"),
        ("extra", "unexpected 1 leaf, e.g. ['head/bonus']"),
    ],
)
def test_bad_trees_are_refused_naming_the_leaf(models, tmp_path, how, problem):
    a, _ = models
    save_params_tree(_mangled(a, how), tmp_path)
    with pytest.raises(CheckpointError, match="parameters do not match the model") as e:
        load_params(tmp_path, TINY_QWEN2)
    assert problem in str(e.value)
    with pytest.raises(CheckpointError) as e:
        model_from_params(_mangled(a, how), TINY_QWEN2)
    assert problem in str(e.value)


def test_a_checkpoint_of_another_model_config_is_refused(tmp_path):
    import dataclasses

    other = dataclasses.replace(TINY_QWEN2, num_layers=2)
    save_params(init_model(other, seed=0), tmp_path)
    with pytest.raises(
        CheckpointError, match=r"saved for another model config \(differs in \['num_layers'\]\)"
    ):
        load_params(tmp_path, TINY_QWEN2)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no params/ .orbax. and no config.json"):
        load_params(tmp_path / "empty", TINY_QWEN2)


# ----------------------------------------------------------------------------- sampling


def test_sample_at_is_keyed_by_seed_and_position_only():
    logits = jax.random.normal(jax.random.key(0), (3, 257))
    greedy = sample_at(logits, [SamplingParams(seed=s) for s in (1, 2, 3)], [4, 5, 6])
    np.testing.assert_array_equal(greedy, np.asarray(logits).argmax(-1))
    hot = SamplingParams(temperature=1.0, seed=7)
    a = sample_at(logits, [hot, hot, SamplingParams(seed=7)], [10, 11, 12])
    assert a[2] == greedy[2]
    # the same (seed, position, logits row) anywhere in any batch gives the same token
    b = sample_at(logits[::-1], [SamplingParams(), hot, hot], [0, 11, 10])
    assert (b[1], b[2]) == (a[1], a[0])
    draws = {
        int(sample_at(logits[:1], [SamplingParams(temperature=1.0, seed=s)], [10])[0])
        for s in range(40)
    }
    assert len(draws) > 10  # temperature 1 over a near-uniform row really samples


# ----------------------------------------------------------------------------- in-process backend


def _ref_rounds(runner, rounds):
    ctx, out = [], []
    for append, gen in rounds:
        ctx += append
        out.append(reference_generate(runner, ctx, gen))
        ctx += out[-1]
    return out


def test_update_params_mid_session_recomputes_with_the_new_params(models, refs):
    a, b = models
    eng = InProcessBackend(a, max_len=256)
    rs = np.random.RandomState(0)
    rounds = [(rs.randint(0, 257, n).tolist(), g) for n, g in ((20, 4), (9, 5), (7, 3))]
    s = Session(eng, "s")
    got = [s.step(*rounds[0])]
    version = eng.update_params(b, version="step-1")
    assert version == eng.params_version == "step-1"
    got += [s.step(*r) for r in rounds[1:]]
    # the expected tokens: params A for round 1, then params B on the same full context
    want = _ref_rounds(refs[0], rounds[:1])
    ctx = rounds[0][0] + want[0]
    for append, gen in rounds[1:]:
        ctx += append
        want.append(reference_generate(refs[1], ctx, gen))
        ctx += want[-1]
    assert got == want
    assert s.results[1].cached_tokens == 0  # old KV dropped ...
    assert s.results[2].cached_tokens == len(rounds[0][0]) + 4 + 9 + 5 - 1  # ... new KV reused


@pytest.mark.parametrize("how", ["shape", "dtype", "missing"])
def test_bad_params_are_refused_and_the_old_ones_keep_serving(models, refs, how):
    a, b = models
    eng = InProcessBackend(a, max_len=256)
    with pytest.raises(RolloutError, match="refused: parameters do not match the model") as e:
        eng.update_params(_mangled(b, how))
    assert e.value.kind == "bad_request" and eng.params_version == ""
    prompt = list(range(30))
    assert Session(eng).step(prompt, 4) == reference_generate(refs[0], prompt, 4)


def test_update_params_from_checkpoint(models, refs, tmp_path):
    a, b = models
    eng = InProcessBackend(a, max_len=256)
    save_params_tree(b, tmp_path / "b")
    assert eng.update_params_from_checkpoint(tmp_path / "b", "b") == "b"
    prompt = list(range(5, 40))
    assert Session(eng).step(prompt, 4) == reference_generate(refs[1], prompt, 4)
    with pytest.raises(RolloutError, match="does not exist"):
        eng.update_params_from_checkpoint(tmp_path / "nope")
    assert eng.params_version == "b"


def test_sampled_rounds_are_reproducible_and_keyed(models):
    a, _ = models
    eng = InProcessBackend(a, max_len=256)
    prompt = list(range(12))
    key = jax.random.key(5)
    x = Session(eng).step(prompt, 8, temperature=1.0, key=key)
    y = Session(eng).step(prompt, 8, temperature=1.0, key=key)
    z = Session(eng).step(prompt, 8, temperature=1.0, key=jax.random.key(6))
    assert x == y and x != z
    with pytest.raises(ValueError, match="needs a PRNG key"):
        Session(eng).step(prompt, 2, temperature=1.0)
    trajs = [Trajectory(f"t{k}", (Round(tuple(prompt), 3), Round((1, 2), 3))) for k in range(3)]
    # release=True closes each session, so the second run starts the same ids afresh
    o1 = run_trajectories(eng, trajs, temperature=0.7, key=key, progress=False, release=True)
    o2 = run_trajectories(eng, trajs, temperature=0.7, key=key, progress=False, release=True)
    assert [o.rounds for o in o1] == [o.rounds for o in o2]
    assert len({str(o.rounds) for o in o1}) > 1  # each trajectory its own key
