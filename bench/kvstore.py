"""Block store benchmarks: file-store reads and writes against plain Python file I/O.

  python bench/kvstore.py [--cases=ds-fp8,qwen-fp16] [--blocks=96] [--reps=3] [--root=DIR]
                          [--json=out.json]

For each case (a Full Block layout of a full-size model, 64-token blocks) it writes `--blocks`
blocks into a fresh file store and measures, in one run:
  write          write_full throughput, fsync off and on (io_concurrency 16)
  raw            a sequential read of every block file with plain Python `open().read()`
  read_full      TensorStoreBlockStore.read_full of all blocks into a preallocated PE buffer's
                 slots (HostBufferPool, `buffer_destination`), with 1, 8 and 16 reads in flight; `vs raw` is its throughput
                 over the raw read of the same bytes in the same cache state
  read_layers    one layer of every block (byte-range reads), 16 in flight
  layer latency  one read_layers call for one layer of one block, called back to back
                 (median / p99 over all blocks and 8 layers), next to an `os.pread` of the
                 same byte range
Each read runs with the page cache warm and, where `os.posix_fadvise` can drop the files' pages,
cold. Throughputs are medians of `--reps` after one warm-up; GB/s is 1e9 bytes per second of
payload-plus-format bytes read from storage.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time

import numpy as np

from dualpath_jax.config import StoreConfig
from dualpath_jax.kvstore import (
    BlockFormat,
    HostBufferPool,
    TensorStoreBlockStore,
    block_keys,
    buffer_destination,
)
from dualpath_jax.kvstore.identity import key_path, model_fingerprint
from dualpath_jax.model.layout import BlockLayout, kv_bytes_per_token_per_layer
from dualpath_jax.presets import DEEPSEEK_V3_660B, QWEN25_32B

CASES = {
    # DeepSeek-V3 with FlashMLA's FP8 KV: 61 layers x 64 tokens x 656 B = 2.4 MiB per Full Block.
    "ds-fp8": (DEEPSEEK_V3_660B, "fp8_flashmla"),
    # Qwen2.5-32B with FP16 KV: 64 layers x 64 tokens x 4 KiB = 16 MiB per Full Block.
    "qwen-fp16": (QWEN25_32B, "float16"),
}
CONCURRENCY = (1, 8, 16)


def drop_cache(paths: list[str]) -> bool:
    """Asks the kernel to drop the files' cached pages; False where that is not possible."""
    if not hasattr(os, "posix_fadvise"):
        return False
    os.sync()
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return True


def raw_read(paths: list[str]) -> int:
    n = 0
    for p in paths:
        with open(p, "rb") as f:
            n += len(f.read())
    return n


def timed(fn, reps: int, before=None) -> float:
    """Median seconds of `fn()` over `reps` runs after one warm-up; `before()` runs untimed."""
    times = []
    for i in range(reps + 1):
        if before:
            before()
        t = time.perf_counter()
        fn()
        if i:
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def run_case(name: str, blocks: int, reps: int, root: str) -> list[dict]:
    model, kv_format = CASES[name]
    layout = BlockLayout(model.num_layers, 64, kv_bytes_per_token_per_layer(model, kv_format))
    fmt = BlockFormat(layout, kv_format, model_fingerprint(model))
    keys = block_keys(np.arange(blocks * 64) % 1000, 64, fmt.fingerprint)
    data = np.random.default_rng(0).integers(0, 256, (blocks, *layout.shape), dtype=np.uint8)
    rows: list[dict] = []
    total = blocks * fmt.encoded_bytes

    def row(op: str, conc: int | str, cache: str, seconds: float, nbytes: int, **extra) -> dict:
        r = {
            "case": name,
            "op": op,
            "inflight": conc,
            "cache": cache,
            "s": seconds,
            "GB/s": nbytes / seconds / 1e9,
            **extra,
        }
        rows.append(r)
        return r

    # Writes: a fresh store per repetition, fsync off and on.
    for fsync in (False, True):

        def write_once(fsync=fsync):
            d = tempfile.mkdtemp(dir=root)
            with TensorStoreBlockStore(StoreConfig(root=d, fsync=fsync), fmt) as st:
                st.write_full(keys, data).result()
            shutil.rmtree(d)

        row("write", 16, f"fsync={'on' if fsync else 'off'}", timed(write_once, reps), total)

    store_root = os.path.join(root, f"store-{name}")
    cfg = StoreConfig(root=store_root, io_concurrency=16)
    with TensorStoreBlockStore(cfg, fmt) as st:
        assert st.write_full(keys, data).result().written == blocks
    paths = [os.path.join(store_root, key_path(k)) for k in keys]
    cold_ok = drop_cache(paths[:1])
    pool = HostBufferPool(layout, blocks, "PE buffer")
    res = pool.reserve(blocks)
    dest = buffer_destination(res)
    caches = ["warm"] + (["cold"] if cold_ok else [])
    for cache in caches:
        before = (lambda: drop_cache(paths)) if cache == "cold" else None
        raw_s = timed(lambda: raw_read(paths), reps, before)
        row("raw", 1, cache, raw_s, total)
        for conc in CONCURRENCY:
            with TensorStoreBlockStore(
                StoreConfig(root=store_root, io_concurrency=conc), fmt
            ) as st:

                def read_all(st=st):
                    r = st.read_full(keys, dest).result()
                    assert r.hits == blocks, r.miss_reason

                s = timed(read_all, reps, before)
                row("read_full", conc, cache, s, total, vs_raw=raw_s / s)
        with TensorStoreBlockStore(cfg, fmt) as st:
            lay_bytes = blocks * (layout.layer_nbytes + 8)
            mid = layout.num_layers // 2

            def read_layer(st=st):
                r = st.read_layers(keys, (mid, mid + 1)).result()
                assert r.hits == blocks

            row("read_layers(1 layer)", 16, cache, timed(read_layer, reps, before), lay_bytes)
    np.testing.assert_array_equal(np.stack(res.blocks()), data)
    res.release()

    # Latency of single-layer reads of one block (warm), against os.pread of the same range.
    with TensorStoreBlockStore(cfg, fmt) as st:
        layers = np.linspace(0, layout.num_layers - 1, 8).astype(int)
        lat, raw_lat = [], []
        for k, p in zip(keys, paths):
            fd = os.open(p, os.O_RDONLY)
            try:
                for layer in layers:
                    t = time.perf_counter()
                    r = st.read_layers([k], (int(layer), int(layer) + 1)).result()
                    lat.append(time.perf_counter() - t)
                    assert r.hits == 1
                    lo, hi = fmt.layer_byte_range(int(layer), int(layer) + 1)
                    t = time.perf_counter()
                    os.pread(fd, hi - lo, lo)
                    raw_lat.append(time.perf_counter() - t)
            finally:
                os.close(fd)
        for op, xs in (("layer latency", lat), ("layer latency (os.pread)", raw_lat)):
            rows.append(
                {
                    "case": name,
                    "op": op,
                    "inflight": 1,
                    "cache": "warm",
                    "p50_ms": 1e3 * float(np.median(xs)),
                    "p99_ms": 1e3 * float(np.percentile(xs, 99)),
                    "layer_bytes": layout.layer_nbytes,
                }
            )
    shutil.rmtree(store_root)
    return rows


def print_table(rows: list[dict]) -> None:
    print(
        f"{'case':10} {'op':26} {'inflight':>8} {'cache':>10} {'GB/s':>7} {'vs raw':>7} {'p50 ms':>7} {'p99 ms':>7}"
    )
    for r in rows:
        gbs = f"{r['GB/s']:.2f}" if "GB/s" in r else ""
        vs = f"{100 * r['vs_raw']:.0f}%" if "vs_raw" in r else ""
        p50 = f"{r['p50_ms']:.3f}" if "p50_ms" in r else ""
        p99 = f"{r['p99_ms']:.3f}" if "p99_ms" in r else ""
        print(
            f"{r['case']:10} {r['op']:26} {r['inflight']!s:>8} {r['cache']:>10} {gbs:>7} {vs:>7} {p50:>7} {p99:>7}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default="ds-fp8,qwen-fp16")
    ap.add_argument("--blocks", type=int, default=96)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--root", default="", help="directory for the stores (default: a temp dir)")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    root = args.root or tempfile.mkdtemp(prefix="kvstore-bench-")
    os.makedirs(root, exist_ok=True)
    rows: list[dict] = []
    try:
        for name in args.cases.split(","):
            blocks = args.blocks if name != "qwen-fp16" else max(8, args.blocks // 4)
            rows += run_case(name, blocks, args.reps, root)
    finally:
        if not args.root:
            shutil.rmtree(root, ignore_errors=True)
    print_table(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
