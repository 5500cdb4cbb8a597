"""The streaming safetensors reader: views of mapped files, lazy stacks, FP8 kept FP8."""

from __future__ import annotations

import jax
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from dualpath_jax.model import streaming
from dualpath_jax.model.streaming import CheckpointError, Fp8, Stacked, Tensors


@pytest.fixture
def tensors(tmp_path):
    rng = np.random.default_rng(0)
    data = {
        "a": rng.standard_normal((6, 10)).astype(np.float32),
        "b": rng.standard_normal((6, 10)).astype(ml_dtypes.bfloat16),
        "e.0": rng.standard_normal((4, 3)).astype(np.float32),
        "e.1": rng.standard_normal((4, 3)).astype(np.float32),
    }
    save_file({k: v for k, v in data.items() if k != "b"}, str(tmp_path / "one.safetensors"))
    save_file({"b": data["b"]}, str(tmp_path / "two.safetensors"))
    with Tensors(tmp_path) as t:
        yield t, data


def test_views_are_the_tensors_without_reading_them(tensors):
    t, data = tensors
    assert t.keys() == ["a", "b", "e.0", "e.1"]
    view = t.get("a", (6, 10))
    assert not view.flags.writeable and not view.flags.owndata  # a view of the mapping
    np.testing.assert_array_equal(view, data["a"])
    np.testing.assert_array_equal(np.asarray(t.get("b"), np.float32), data["b"].astype(np.float32))
    with pytest.raises(CheckpointError, match="model expects"):
        t.get("a", (10, 6))
    with pytest.raises(CheckpointError, match="lacks tensor 'zz'"):
        t.get("zz")
    t.release()  # pages dropped; the views still read the file
    np.testing.assert_array_equal(view[2], data["a"][2])


def test_stacked_reads_only_what_is_indexed(tensors):
    t, data = tensors
    s = streaming.stack([t.get("e.0").T, t.get("e.1").T])
    full = np.stack([data["e.0"].T, data["e.1"].T])
    assert isinstance(s, Stacked) and s.shape == full.shape
    np.testing.assert_array_equal(s[1:2, :, 1:], full[1:2, :, 1:])
    np.testing.assert_array_equal(s.transpose(0, 2, 1)[:], full.transpose(0, 2, 1))
    np.testing.assert_array_equal(np.asarray(s), full)


def test_fp8_transposes_stay_fp8_and_dequantize_like_the_blocks():
    rng = np.random.default_rng(1)
    w = rng.standard_normal((5, 7)).astype(ml_dtypes.float8_e4m3fn)
    s = rng.uniform(0.5, 2, (3, 2)).astype(np.float32)  # 2x4 blocks
    f = Fp8(w, s, (2, 4))
    want = w.astype(np.float32) * np.repeat(np.repeat(s, 2, 0), 4, 1)[:5, :7]
    np.testing.assert_array_equal(np.asarray(f), want)
    np.testing.assert_array_equal(np.asarray(f.T), want.T)
    both = streaming.stack([f.T, f.T])
    assert isinstance(both, Fp8) and both.shape == (2, 7, 5)
    np.testing.assert_array_equal(np.asarray(both.transpose(0, 2, 1)), np.stack([want, want]))


def test_place_builds_the_array_and_dequantizes_fp8_on_the_device(tensors):
    t, data = tensors
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    got = streaming.place(t.get("a").T, one, "bfloat16")
    assert got.dtype == jax.numpy.bfloat16
    np.testing.assert_array_equal(np.asarray(got), data["a"].T.astype(ml_dtypes.bfloat16))
    w = np.arange(12, dtype=np.float32).reshape(3, 4).astype(ml_dtypes.float8_e4m3fn)
    f = Fp8(w, np.array([[2.0, 4.0]], np.float32), (4, 2))
    np.testing.assert_array_equal(np.asarray(streaming.place(f.T, one, "float32")), np.asarray(f.T))


def test_a_truncated_file_is_refused(tmp_path):
    save_file({"a": np.zeros((64, 64), np.float32)}, str(tmp_path / "x.safetensors"))
    raw = (tmp_path / "x.safetensors").read_bytes()
    (tmp_path / "x.safetensors").write_bytes(raw[:-100])
    with pytest.raises(CheckpointError, match="bad data offsets"):
        Tensors(tmp_path)
