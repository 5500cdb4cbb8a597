"""Compiled programs kept on disk under a key known before tracing: a warm start loads them.

JAX's persistent compilation cache skips the backend compile of a program it has seen, but not
its tracing and lowering: the cache's key is a hash of the lowered module. For a prefill engine
that warms hundreds of shapes (engines/warmup.py) tracing and lowering are most of a restart:
on a 2-core host ~0.1 s per program against ~0.02 s to load its executable.

A `StoredProgram` wraps a jitted function. Called with the store enabled (`enable`), it keys
the call by what decides the program (the function, its static arguments' `repr`, the tree of
the others and each leaf's shape, dtype, weak type and sharding, the abstract mesh) and by what
decides how it compiles (`fingerprint`: the source of the package's model layers, the jax,
jaxlib and flax versions, `XLA_FLAGS` and the JAX options that change lowering, the devices);
it runs the executable loaded for that key, or else lowers and compiles one (XLA compiles it: an executable loaded
from JAX's persistent cache does not survive a second serialization on XLA:CPU) and writes it
for the next process (programs of one device; those over a mesh are compiled each start).
Disabled, or in a job over several processes (an engine spanning processes), a call is the
jitted function's call.

Static arguments must have a `repr` that names everything the program depends on (a flax
`GraphDef`, a frozen dataclass of static fields), and the function must depend on nothing else
that can change without those layers' source changing (no module state read at trace time).
Entries are written atomically (a temporary file, then a rename), so processes share a store;
an entry that does not load (truncated, from another jaxlib) is compiled again and rewritten.
The treedefs of an entry are pickled: a store is as trusted as the code that reads it.
"""

from __future__ import annotations

import functools
import hashlib
import io
import logging
import os
import pathlib
import pickle
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax._src.lib import xla_client as xc

log = logging.getLogger(__name__)

# JAX options that change what a function lowers to (the rest change where or how it runs).
_LOWERING_OPTIONS = (
    "jax_enable_x64",
    "jax_default_matmul_precision",
    "jax_default_prng_impl",
    "jax_threefry_partitionable",
    "jax_numpy_rank_promotion",
    "jax_numpy_dtype_promotion",
    "jax_use_shardy_partitioner",
)

_MAX_FAST_KEYS = 8192  # per program; past it the fast keys start again
_MAX_PROGRAMS = 4096  # executables per program held in memory; past it they load again
_lock = threading.Lock()
_compile_lock = threading.Lock()  # one compile at a time with JAX's cache off
_directory: pathlib.Path | None = None


def enable(directory: str | os.PathLike) -> pathlib.Path:
    """Keeps this process's `StoredProgram` executables under `directory` (made if missing) and
    loads those already there. Returns the directory."""
    global _directory
    path = pathlib.Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    with _lock:
        _directory = path
    return path


def disable() -> None:
    """Stored programs run as their jitted functions again (executables loaded stay loaded)."""
    global _directory
    with _lock:
        _directory = None


def directory() -> pathlib.Path | None:
    """Where executables are kept, None when the store is off."""
    return _directory


# Where a model program's code can come from: the package's lowest layers (tests/test_layers.py
# keeps `model` and `kernels` from importing anything above them). An edit elsewhere (engines,
# router, runtimes) keeps the stored programs.
_PROGRAM_SOURCES = ("*.py", "config/*.py", "presets/*.py", "kernels/*.py", "model/*.py")


@functools.cache
def _source_digest() -> str:
    digest = hashlib.sha256()
    root = pathlib.Path(__file__).resolve().parent
    for path in sorted(p for pattern in _PROGRAM_SOURCES for p in root.glob(pattern)):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def fingerprint() -> str:
    """What decides how a program compiles, beside the program itself: the source of the
    package's model layers (`_PROGRAM_SOURCES`), the library versions, XLA's compile options as
    `XLA_FLAGS` set them, JAX's lowering options and the devices."""
    import flax
    import jaxlib

    parts = [
        _source_digest(),
        jax.__version__,
        jaxlib.__version__,
        flax.__version__,
        # XLA's options as this process's flags (XLA_FLAGS) set them
        hashlib.sha256(xc.CompileOptions().SerializeAsString()).hexdigest(),
        *(f"{name}={getattr(jax.config, name, None)}" for name in _LOWERING_OPTIONS),
        jax.default_backend(),
        str(jax.process_count()),
        *sorted({f"{d.platform}:{d.device_kind}" for d in jax.devices()}),
    ]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def _leaf_key(x: Any) -> tuple:
    if isinstance(x, jax.Array):
        return (x.shape, x.dtype, x.weak_type, x.sharding)
    if isinstance(x, np.ndarray | np.generic):
        return (x.shape, x.dtype, False, None)
    return ((), type(x).__name__, True, None)  # a Python scalar: weakly typed


class StoredProgram:
    """`jitted` (a `jax.jit` function with static arguments `static_argnums`) whose executables
    the store keeps; see the module docstring. `compiled(*args)` is the executable for these
    arguments (loaded, or compiled and written); calling runs it."""

    def __init__(self, jitted: Callable, static_argnums: Sequence[int] = ()):
        self.jitted = jitted
        self.static = tuple(sorted(static_argnums))
        functools.update_wrapper(self, jitted)
        fn = getattr(jitted, "__wrapped__", jitted)
        self.name = f"{fn.__module__}.{fn.__qualname__}"
        self._loaded: dict[tuple, Any] = {}  # `_fast_key` -> executable
        self._by_key: dict[tuple, Any] = {}  # the full key -> executable
        self._alive: dict[int, Any] = {}  # the static arguments `_loaded`'s ids refer to
        self._watched: set[int] = set()  # ids of params `_loaded` holds
        self._lock = threading.Lock()

    def __getattr__(self, name: str):  # the jitted function's own (`lower`, `trace`, ...)
        return getattr(self.jitted, name)

    def _split(self, args: tuple) -> tuple[tuple, tuple]:
        statics = tuple(args[i] for i in self.static)
        dynamic = tuple(a for i, a in enumerate(args) if i not in self.static)
        return statics, dynamic

    def compiled(self, *args):
        """The executable for `args` (static ones included): from memory, the store, or a
        compile through the jitted function that the store then keeps."""
        if _directory is None or jax.process_count() > 1:  # JAX's own caches keep it
            return self.jitted.lower(*args).compile()
        fast = self._fast_key(args)
        exe = self._loaded.get(fast)
        if exe is not None:
            return exe
        statics, dynamic = self._split(args)
        leaves, tree = jax.tree.flatten(dynamic)
        key = (statics, tree, tuple(map(_leaf_key, leaves)), jax.sharding.get_abstract_mesh())
        with self._lock:
            exe = self._by_key.get(key)
            if exe is None:
                exe = self._by_key[key] = self._load_or_compile(_directory, args, key)
            if len(self._by_key) >= _MAX_PROGRAMS:  # as many shapes as a warm-up reaches, twice
                self._by_key.clear()
                self._alive.clear()
                self._loaded = {}
            if len(self._loaded) >= _MAX_FAST_KEYS:
                self._loaded = {}
            self._loaded[fast] = exe
            # An id in a fast key must not outlive its object: static arguments are kept
            # alive (GraphDefs, small); params are not (an update replaces them), and when
            # params die the fast keys go (the next calls take the full key once).
            for i, a in enumerate(args):
                if i in self.static:
                    self._alive[id(a)] = a
                elif isinstance(a, nnx.State) and id(a) not in self._watched:
                    self._watched.add(id(a))
                    weakref.finalize(a, self._forget, id(a))
        return exe

    def _forget(self, ident: int) -> None:
        self._watched.discard(ident)
        self._loaded = {}  # rebound, not cleared: no lock (a collection may run anywhere)

    def _fast_key(self, args: tuple) -> tuple:
        """A key of `args` cheap enough for every call: static arguments and params (`State`)
        by identity (the runner passes the same GraphDefs and params each call), arrays by
        shape, dtype, weak type and sharding, other pytrees by their tree and leaves."""
        parts: list[Any] = [jax.sharding.get_abstract_mesh()]
        for i, a in enumerate(args):
            if isinstance(a, jax.Array | np.ndarray):
                parts.append(_leaf_key(a))
            elif i in self.static or isinstance(a, nnx.State):
                parts.append(id(a))
            elif a is None or isinstance(a, bool | int | float):
                parts.append(type(a))
            else:
                leaves, tree = jax.tree.flatten(a)
                parts.append((tree, *map(_leaf_key, leaves)))
        return tuple(parts)

    def __call__(self, *args):
        if _directory is None or jax.process_count() > 1:  # a job over processes: JAX's path
            return self.jitted(*args)
        return self.compiled(*args)(*self._split(args)[1])

    def _disk_key(self, key: tuple) -> str:
        statics, tree, leaves, mesh = key
        text = "\n".join(
            [fingerprint(), self.name, repr(statics), str(tree), repr(leaves), repr(mesh)]
        )
        return hashlib.sha256(text.encode()).hexdigest()

    def _load_or_compile(self, store: pathlib.Path | None, args: tuple, key: tuple):
        if store is None:
            return self.jitted.lower(*args).compile()
        from jax.experimental import serialize_executable

        path = store / f"{self.name.rsplit('.', 1)[-1].lstrip('_')}-{self._disk_key(key)}.exe"
        try:
            payload, in_tree, out_tree = pickle.loads(path.read_bytes())
            exe = _load(payload, in_tree, out_tree)
            if len(exe._executable._unloaded_executable.device_list) == 1:
                return exe
        except FileNotFoundError:
            pass
        except Exception as e:  # noqa: BLE001 - a bad entry is compiled again and replaced
            log.warning("program store: %s did not load (%s); compiling it again", path.name, e)
        exe, fresh = _compile_fresh(self.jitted.lower(*args))
        if not fresh or len(exe._executable._unloaded_executable.device_list) != 1:
            return exe  # (a program over several devices is not kept: loaded onto which?)
        try:
            data = pickle.dumps(serialize_executable.serialize(exe))
            tmp = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
            tmp.write_bytes(data)
            tmp.replace(path)
        except Exception as e:  # noqa: BLE001 - a store that cannot write still serves
            log.warning("program store: could not keep %s: %s", path.name, e)
        return exe


def _compile_fresh(lowered) -> tuple[Any, bool]:
    """(`lowered` compiled, whether by XLA here): not loaded from JAX's persistent cache,
    whose executables XLA:CPU serializes again without their kernels (the copy then fails to
    run: "Function ... not found"). JAX keeps whether its cache is in use in a module global
    (`compilation_cache._cache_used`); it is off for this compile (a compile of another thread
    meanwhile skips the cache too, which costs it time, not correctness). Without that global
    (another JAX), the program compiles as usual and is not kept."""
    from jax._src import compilation_cache as cache

    lock = getattr(cache, "_cache_initialized_mutex", None)
    if lock is None or not hasattr(cache, "_cache_used"):
        return lowered.compile(), False
    cache.is_cache_used(jax.devices()[0].client)  # initializes the global once
    with _compile_lock:
        with lock:
            used, cache._cache_used = cache._cache_used, False
        try:
            return lowered.compile(), True
        finally:
            with lock:
                cache._cache_used = used


class _Unpickler(pickle.Unpickler):
    """`jax.experimental.serialize_executable`'s unpickler, the executable deserialized with
    this process's compile options (`XLA_FLAGS` among them) as JAX's compilation cache
    deserializes its entries, onto this process's devices."""

    def __init__(self, file, backend):
        super().__init__(file)
        self.backend = backend
        self.devices = {d.id: d for d in backend.devices()}
        self.device_list = xc.DeviceList(tuple(backend.devices()))

    def persistent_load(self, pid):
        if pid[0] == "exec":
            return self.backend.deserialize_executable(
                pid[1], self.device_list, xc.CompileOptions()
            )
        if pid[0] == "device":
            return self.devices[pid[1]]
        if pid[0] == "client":
            return self.backend
        raise pickle.UnpicklingError(pid)


def _load(payload: bytes, in_tree, out_tree):
    backend = jax.devices()[0].client
    unloaded, args_info_flat, no_kwargs = _Unpickler(io.BytesIO(payload), backend).load()
    args_info = in_tree.unflatten(args_info_flat)
    return jax.stages.Compiled(unloaded.load(), [], args_info, out_tree, no_kwargs=no_kwargs)


def stored(static_argnums: int | Sequence[int] = ()) -> Callable[[Callable], StoredProgram]:
    """Decorator: `@stored(static_argnums=0)` over a function jits it (with those static
    arguments) and wraps it in a `StoredProgram`."""
    statics = (static_argnums,) if isinstance(static_argnums, int) else tuple(static_argnums)

    def wrap(fn: Callable) -> StoredProgram:
        return StoredProgram(jax.jit(fn, static_argnums=statics), statics)

    return wrap
