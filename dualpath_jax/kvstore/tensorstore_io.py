"""The tensorstore side of `TensorStoreBlockStore` (store.py): the kvstore spec of a `StoreConfig`,
the file store root's check, and batched I/O in a bounded window (`windowed`: at most
`StoreConfig.io_concurrency` in flight, each waited for at most `StoreConfig.timeout_s`)."""

from __future__ import annotations

import collections
import json
import os
import tempfile
from collections.abc import Callable
from concurrent import futures
from typing import Any

import tensorstore as ts

from dualpath_jax.config import ConfigError, StoreConfig
from dualpath_jax.kvstore.api import StoreError, StoreUnavailable

# tensorstore's encoding of "no value": a write with this `if_equal` only creates a missing key.
IF_ABSENT = b"\x02"


def run_now(fn: Callable[..., Any], *args: Any) -> futures.Future[Any]:
    """Runs `fn` here and returns its outcome as a completed future."""
    fut: futures.Future[Any] = futures.Future()
    try:
        fut.set_result(fn(*args))
    except Exception as e:
        fut.set_exception(e)
    return fut


class Joined:
    """Several tensorstore reads awaited as one (a layer range and its checksums)."""

    def __init__(self, *futs: ts.Future):
        self.futs = futs

    def result(self, timeout: float | None = None) -> tuple[Any, ...]:
        out = []
        for f in self.futs:
            try:
                out.append(f.result(timeout=timeout))
            except TimeoutError:
                raise
            except Exception as e:  # keep waiting on the rest: none is left running
                out.append(e)
        return tuple(out)


def kvstore_spec(cfg: StoreConfig) -> dict[str, Any] | str:
    """The tensorstore kvstore spec of a StoreConfig (file root resolved to an absolute path)."""
    if cfg.kind == "file":
        if not cfg.root:
            raise StoreUnavailable("StoreConfig.root is empty: set the directory of the file store")
        return {
            "driver": "file",
            "path": os.path.abspath(cfg.root) + "/",
            "context": {
                "file_io_sync": bool(cfg.fsync),
                "file_io_concurrency": {"limit": max(1, cfg.io_concurrency)},
            },
        }
    if cfg.kind == "memory":
        return {"driver": "memory"}
    if cfg.kind == "spec":
        try:
            spec = json.loads(cfg.spec_json)
        except json.JSONDecodeError as e:
            raise ConfigError(f"store.spec_json is not JSON: {e}") from None
        if not isinstance(spec, dict | str):
            raise ConfigError("store.spec_json must be a kvstore spec object or URL")
        return spec
    raise ConfigError(f"store.kind {cfg.kind!r} is not one of file, memory, spec")


def check_root(root: str) -> None:
    """Creates the file store root and proves it writable, or raises StoreUnavailable."""
    try:
        os.makedirs(root, exist_ok=True)
    except OSError as e:
        raise StoreUnavailable(f"store root {root!r} cannot be created: {e}") from None
    if not os.path.isdir(root):
        raise StoreUnavailable(f"store root {root!r} is not a directory")
    try:
        with tempfile.TemporaryFile(dir=root, prefix=".probe-") as f:
            f.write(b"\x00")
            f.flush()
    except OSError as e:
        raise StoreUnavailable(f"store root {root!r} is not writable: {e}") from None


def wait(fut: ts.Future, what: str, timeout_s: float) -> Any:
    """`fut`'s result; StoreError naming `what` when it takes longer than `timeout_s`."""
    try:
        return fut.result(timeout=timeout_s)
    except TimeoutError:
        raise StoreError(f"{what}: no answer within {timeout_s} s") from None


def windowed(
    keys: list[str],
    issue: Callable[[int, str], Any],
    handle: Callable[[int, str, Any], bool],
    *,
    window: int,
    timeout_s: float,
) -> None:
    """Issues `issue(i, key)` (a tensorstore or concurrent future) with at most `window` in
    flight and feeds results in key order to `handle(i, key, result_or_exception)`; stops
    issuing once `handle` returns False. A result not there within `timeout_s` is a StoreError."""
    inflight: collections.deque[tuple[int, str, ts.Future]] = collections.deque()
    nxt = 0
    try:
        while nxt < len(keys) or inflight:
            while nxt < len(keys) and len(inflight) < window:
                inflight.append((nxt, keys[nxt], issue(nxt, keys[nxt])))
                nxt += 1
            i, key, fut = inflight.popleft()
            try:
                res: Any = wait(fut, f"block {key}", timeout_s)
            except StoreError:
                raise
            except Exception as e:  # tensorstore raises ValueError with a status code
                res = e
            if not handle(i, key, res):
                break
    finally:
        # Let the rest finish rather than cancel them: a cancelled file read can leak its
        # slot of tensorstore's file_io_concurrency limit, and later reads then never start.
        for _, _, fut in inflight:
            try:
                fut.result(timeout=timeout_s)
            except Exception:
                pass
