"""File store specifics: root checks, confinement, atomic writes, reopen, and two processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from dualpath_jax.config import ConfigError, StoreConfig
from dualpath_jax.kvstore import (
    StoreError,
    StoreUnavailable,
    TensorStoreBlockStore,
    block_keys,
    decode_block,
    open_block_store,
)
from dualpath_jax.kvstore.identity import key_from_path, key_path
from dualpath_jax.model.layout import BlockLayout
from dualpath_jax.presets import TINY_QWEN2


def file_store(root, fmt, **kw) -> TensorStoreBlockStore:
    return TensorStoreBlockStore(StoreConfig(root=str(root), block_tokens=4, **kw), fmt)


def stored_files(root) -> list[str]:
    return sorted(
        os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs
    )


def test_files_stay_inside_the_root(tmp_path, fmt, random_blocks):
    root = tmp_path / "store"
    with file_store(root, fmt) as st:
        keys = block_keys(range(40), 4, fmt.fingerprint)
        st.write_full(keys, random_blocks(10)).result()
    files = stored_files(root)
    assert sorted(key_path(k) for k in keys) == files
    assert sorted(os.listdir(tmp_path)) == ["store"]
    for f in files:
        assert os.path.getsize(root / f) == fmt.encoded_bytes


def test_root_unavailable(tmp_path, fmt):
    afile = tmp_path / "afile"
    afile.write_bytes(b"x")
    for root in [afile, afile / "below"]:
        with pytest.raises(StoreUnavailable, match="store root"):
            file_store(root, fmt)
    with pytest.raises(StoreUnavailable, match="empty"):
        TensorStoreBlockStore(StoreConfig(root=""), fmt)
    with pytest.raises(ConfigError):
        TensorStoreBlockStore(StoreConfig(kind="spec", spec_json="{not json"), fmt)
    with pytest.raises(ConfigError):
        TensorStoreBlockStore(StoreConfig(kind="nfs"), fmt)
    with pytest.raises(StoreUnavailable):
        TensorStoreBlockStore(
            StoreConfig(kind="spec", spec_json='{"driver": "no-such-driver"}'), fmt
        )


def test_root_replaced_by_a_file_after_open(tmp_path, fmt, random_blocks):
    root = tmp_path / "store"
    with file_store(root, fmt) as st:
        keys = block_keys(range(8), 4, fmt.fingerprint)
        st.write_full(keys, random_blocks(2)).result()
        for d, _, fs in os.walk(root, topdown=False):
            for f in fs:
                os.remove(os.path.join(d, f))
            os.rmdir(d)
        root.write_bytes(b"not a directory")
        assert st.lookup(keys).result() == 0  # nothing readable is a miss
        with pytest.raises(StoreError, match="write"):
            st.write_full(keys, random_blocks(2)).result()


def test_reopen_sees_stored_blocks(tmp_path, fmt, random_blocks):
    root = tmp_path / "store"
    keys = block_keys(range(24), 4, fmt.fingerprint)
    with file_store(root, fmt) as st:
        st.write_full(keys, random_blocks(6)).result()
    (root / "ab").mkdir(exist_ok=True)
    (root / "ab" / "stray.txt").write_text("not a block")
    with file_store(root, fmt, capacity_bytes=8 * fmt.encoded_bytes) as st:
        assert st.stats().blocks == 6 and st.stats().bytes == 6 * fmt.encoded_bytes
        assert st.read_full(keys).result().hits == 6
        more = block_keys([7] * 16, 4, fmt.fingerprint)
        rep = st.write_full(more, random_blocks(4, seed=1)).result()
        assert rep.written == 4 and st.stats().evictions == 2


def test_fsync_write_and_spec_passthrough(tmp_path, fmt, random_blocks):
    keys = block_keys(range(8), 4, fmt.fingerprint)
    with file_store(tmp_path / "s", fmt, fsync=True) as st:
        assert st.write_full(keys, random_blocks(2)).result().written == 2
    spec = '{"driver": "file", "path": "%s/"}' % (tmp_path / "s")
    with TensorStoreBlockStore(StoreConfig(kind="spec", spec_json=spec), fmt) as st:
        np.testing.assert_array_equal(st.read_full(keys).result().stack(), random_blocks(2))


def test_leftover_partial_temp_file_is_invisible(tmp_path, fmt, random_blocks):
    root = tmp_path / "store"
    keys = block_keys(range(8), 4, fmt.fingerprint)
    with file_store(root, fmt) as st:
        st.write_full(keys[:1], random_blocks(1)).result()
    # What a writer killed before its rename leaves behind: a partial temporary file.
    tmp = root / (key_path(keys[1]) + ".__lock")
    tmp.parent.mkdir(parents=True, exist_ok=True)
    tmp.write_bytes(b"\x00" * 100)
    with file_store(root, fmt) as st:
        assert st.stats().blocks == 1
        assert st.lookup(keys).result() == 1
        assert st.write_full(keys, random_blocks(2)).result().written == 1
        assert st.read_full(keys).result().hits == 2


def test_open_block_store_for_a_model(tmp_path):
    with open_block_store(StoreConfig(root=str(tmp_path / "m")), TINY_QWEN2, "v1") as st:
        assert st.fmt.layout == BlockLayout.for_model(TINY_QWEN2, 64)
        assert st.fmt.dtype == TINY_QWEN2.kv_dtype


WORKER = textwrap.dedent(
    """
    import os, sys, time
    import numpy as np
    from dualpath_jax.config import StoreConfig
    from dualpath_jax.kvstore import BlockFormat, TensorStoreBlockStore, block_keys
    from dualpath_jax.model.layout import BlockLayout

    root, fp, me, mode, n = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
    fmt = BlockFormat(BlockLayout(*{shape}), "float32", fp)
    st = TensorStoreBlockStore(StoreConfig(root=root, block_tokens=4, io_concurrency=4), fmt)
    keys = block_keys(np.arange({tokens}) % 7, 4, fp)
    open(os.path.join(root, f".ready-{{me}}"), "w").close()
    deadline = time.monotonic() + 60
    while not all(os.path.exists(os.path.join(root, f".ready-{{i}}")) for i in range(n)):
        if time.monotonic() > deadline:
            sys.exit("the other worker never started")
        time.sleep(0.001)
    if mode == "race":
        # Both write every key with their own bytes (value = worker id), then read all back.
        blocks = np.full((len(keys), *fmt.layout.shape), me, np.uint8)
        for lo in range(0, len(keys), 8):
            st.write_full(keys[lo:lo + 8], blocks[lo:lo + 8]).result()
        res = st.read_full(keys).result()
        assert res.hits == len(keys), res.miss_reason
        print("ok", sorted(set(int(b[0, 0, 0]) for b in res.blocks)), flush=True)
    else:
        # Rewrite big blocks forever until killed.
        i = 0
        while True:
            st.delete(keys).result()
            st.write_full(keys, np.full((len(keys), *fmt.layout.shape), i % 256, np.uint8)).result()
            i += 1
            print("wrote", i, flush=True)
    """
)


def _run_workers(tmp_path, fmt, shape, tokens, mode, n):
    root = tmp_path / "store"
    root.mkdir(exist_ok=True)
    script = tmp_path / "worker.py"
    script.write_text(WORKER.format(shape=tuple(shape), tokens=tokens))
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(root), fmt.fingerprint, str(i), mode, str(n)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(n)
    ]
    return root, procs


@pytest.mark.multiprocess
def test_two_processes_write_the_same_keys(tmp_path, fmt):
    root, procs = _run_workers(tmp_path, fmt, fmt.layout.shape, 4 * 64, "race", 2)
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, f"worker failed:\n{out}\n{err}"
        outs.append(out)
    keys = block_keys(np.arange(4 * 64) % 7, 4, fmt.fingerprint)
    with file_store(root, fmt) as st:
        res = st.read_full(keys).result()
        assert res.hits == len(keys) and st.stats().checksum_failures == 0
        # Each key holds exactly one writer's block, and both readers saw the same blocks.
        for b in res.blocks:
            assert len(set(b.ravel().tolist())) == 1 and int(b[0, 0, 0]) in (0, 1)
    assert stored_files(root) == sorted([".ready-0", ".ready-1", *(key_path(k) for k in keys)])


@pytest.mark.multiprocess
def test_writer_killed_mid_write_leaves_no_readable_partial_block(tmp_path):
    from dualpath_jax.kvstore import BlockFormat

    fmt = BlockFormat(BlockLayout(8, 64, 4096), "float32", "ab" * 16)  # 2 MiB blocks
    root, procs = _run_workers(tmp_path, fmt, fmt.layout.shape, 4 * 8, "kill", 1)
    (p,) = procs
    try:
        for _ in range(3):  # let it get well into its rewrite loop
            line = p.stdout.readline()
            assert line.startswith("wrote"), p.stderr.read()
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=60)
        p.stdout.close()
        p.stderr.close()
    keys = block_keys(np.arange(4 * 8) % 7, 4, fmt.fingerprint)
    for rel in stored_files(root):
        key = key_from_path(rel)
        if key is None:
            continue
        data = (root / rel).read_bytes()
        blk = decode_block(fmt, key, data)  # raises if a partial block were visible
        assert key in keys and len(set(np.unique(blk).tolist())) == 1
    with file_store(root, fmt) as st:
        res = st.read_full(keys).result()
        assert st.stats().checksum_failures == 0 and res.miss_reason in ("", "missing")
