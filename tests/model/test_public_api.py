"""The `dualpath_jax.model` namespace: lazy names, and `generate` on a model directly."""

from __future__ import annotations

import subprocess
import sys

import pytest

from dualpath_jax import model as dm


def test_the_namespace_exports_the_model_api():
    for name in ("from_pretrained", "generate", "init_model", "get_preset", "save_params",
                 "load_params", "ModelRunner", "Transformer"):  # fmt: skip
        assert callable(getattr(dm, name)), name
    assert set(dm.__all__) <= set(dir(dm))
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        dm.nope  # noqa: B018


def test_importing_the_namespace_imports_no_model_code():
    code = "import sys, dualpath_jax.model; print('dualpath_jax.model.transformer' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_generate_takes_a_model_and_a_flat_prompt():
    net = dm.init_model(dm.get_preset("tiny-qwen2"), seed=0)
    flat = dm.generate(net, [1, 2, 3], 5)
    batch = dm.generate(net, [[1, 2, 3], [4, 5]], 5)
    assert isinstance(flat, list) and all(isinstance(t, int) for t in flat)
    assert flat == batch[0] == dm.generate(dm.ModelRunner(net), [[1, 2, 3]], 5)[0]
    assert flat == dm.reference_generate(dm.ModelRunner(net), [1, 2, 3], 5)


def test_the_cluster_namespace():
    from dualpath_jax import cluster
    from dualpath_jax.cluster import Client
    from dualpath_jax.runtimes.local import LocalCluster

    assert cluster.LocalCluster is LocalCluster and cluster.Client is Client
    assert set(cluster.__all__) <= set(dir(cluster))
