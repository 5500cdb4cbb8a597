"""The program store (dualpath_jax/program_store.py): executables kept under a key known before
tracing, loaded by the next process without tracing or lowering, and the same results as the
jitted functions they stand for."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import textwrap
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dualpath_jax import program_store


@pytest.fixture
def store(tmp_path):
    where = program_store.enable(tmp_path / "programs")
    try:
        yield where
    finally:
        program_store.disable()


def _scaled(factor, x, y):
    return x * factor + y


def test_a_call_keys_shapes_dtypes_and_static_arguments(store):
    fn = program_store.StoredProgram(jax.jit(_scaled, static_argnums=0), (0,))
    x = jnp.arange(4.0)
    assert np.array_equal(fn(2.0, x, x), np.arange(4.0) * 3)
    assert np.array_equal(fn(2.0, x + 1, x), (np.arange(4.0) + 1) * 2 + np.arange(4.0))
    assert len(list(store.iterdir())) == 1  # same shapes: one program
    fn(3.0, x, x)  # another static value
    fn(2.0, jnp.arange(8.0), jnp.arange(8.0))  # another shape
    fn(2.0, jnp.arange(4), jnp.arange(4))  # another dtype
    assert len(list(store.iterdir())) == 4
    assert np.array_equal(fn(3.0, x, x), np.arange(4.0) * 4)


def test_without_the_store_a_call_is_the_jitted_functions(tmp_path):
    assert program_store.directory() is None
    fn = program_store.StoredProgram(jax.jit(_scaled, static_argnums=0), (0,))
    assert np.array_equal(fn(2.0, jnp.ones(3), jnp.ones(3)), np.full(3, 3.0))
    assert fn._loaded == {} and fn._cache_size() == 1  # the jitted function's own cache


def test_a_damaged_entry_is_compiled_again_and_replaced(store, caplog):
    first = program_store.StoredProgram(jax.jit(_scaled, static_argnums=0), (0,))
    first(2.0, jnp.ones(3), jnp.ones(3))
    (entry,) = store.iterdir()
    entry.write_bytes(entry.read_bytes()[:100])
    again = program_store.StoredProgram(jax.jit(_scaled, static_argnums=0), (0,))
    assert np.array_equal(again(2.0, jnp.ones(3), jnp.ones(3)), np.full(3, 3.0))
    assert "did not load" in caplog.text
    assert entry.stat().st_size > 100  # rewritten whole


class _Affine(nnx.Module):
    def __init__(self, seed: int):
        self.w = nnx.Param(jax.random.normal(jax.random.key(seed), (4, 4)))

    def __call__(self, x):
        return x @ self.w[...]


def _apply(gd, state, x):
    return nnx.merge(gd, state)(x)


def test_new_params_of_the_same_shapes_run_the_same_program_with_their_values(store):
    """A params update replaces the State the fast key holds by identity: the program is
    the same, the values are the new ones, and the old params are not kept alive."""
    fn = program_store.StoredProgram(jax.jit(_apply, static_argnums=0), (0,))
    x = jnp.ones((2, 4))
    gd, old = nnx.split(_Affine(0))
    want_old = np.asarray(x @ old["w"][...])
    np.testing.assert_array_equal(fn(gd, old, x), want_old)
    ref = weakref.ref(old)
    del old
    gc.collect()
    assert ref() is None  # the store does not hold params
    _, new = nnx.split(_Affine(1))
    np.testing.assert_array_equal(fn(gd, new, x), np.asarray(x @ new["w"][...]))
    assert len(list(store.iterdir())) == 1


_PROCESS = textwrap.dedent(
    """
    import collections, json, sys
    import numpy as np
    from jax._src import monitoring
    from dualpath_jax import model as dm, program_store
    from dualpath_jax.model.cached_kv import LayerPages
    from dualpath_jax.model.runner import ModelRunner, PrefillBatch

    events = collections.Counter()  # traces of the model's programs (runner.py's)
    MODEL = {"_embed", "_layer", "_layer_paged", "_head"}
    monitoring.register_event_duration_secs_listener(
        lambda e, d, fun_name="", **k: events.update([e]) if fun_name in MODEL else None
    )
    if sys.argv[1]:
        program_store.enable(sys.argv[1])
    cfg = dm.get_preset("tiny-qwen2")
    runner = ModelRunner(dm.init_model(cfg, seed=0))
    rng = np.random.default_rng(0)
    rows = rng.standard_normal((cfg.num_layers, 40, cfg.kv_width)).astype(np.float32)
    tail = PrefillBatch.build(cfg, [[7, 8, 9], [1, 2]], [40, 0])
    pages = [
        LayerPages.from_rows([rows[i], rows[i, :0]], 16, cfg.kv_width, rows.dtype)
        for i in range(cfg.num_layers)
    ]
    before = events["/jax/core/compile/jaxpr_trace_duration"]
    out = runner.prefill_layerwise(tail, lambda i: pages[i])
    traced = events["/jax/core/compile/jaxpr_trace_duration"] - before
    print(json.dumps({"logits": np.asarray(out.last_logits).tolist(), "traced": traced}))
    """
)


@pytest.mark.slow
def test_a_second_process_loads_the_layers_without_tracing_them(tmp_path):
    """The layerwise prefill of a tiny Qwen2 in a process, then in another over the same
    store: the second traces none of the model's programs; both give the logits of a process
    without the store (the jitted functions)."""

    def run(where=str(tmp_path / "programs")):
        proc = subprocess.run(
            [sys.executable, "-c", _PROCESS, where],
            capture_output=True,
            text=True,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])

    first, second, jitted = run(), run(), run("")
    assert first["traced"] > 0 and second["traced"] == 0
    assert first["logits"] == second["logits"] == jitted["logits"]
    names = sorted(p.name.split("-")[0] for p in (tmp_path / "programs").iterdir())
    assert names == ["embed", "head", "layer_paged"]
