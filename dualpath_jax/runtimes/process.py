"""Building and running one cluster process (router, prefill or decode) from an ExperimentConfig.

`launch/engine.py` and `LocalCluster` both call `run_process`; everything a process needs arrives
as arguments (no environment reads). The router writes its control address to `address_file`
once it is listening, which is how a local launcher finds it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pathlib
import signal
import threading
import time

from dualpath_jax.config import ExperimentConfig
from dualpath_jax.engines.core import EngineId
from dualpath_jax.runtimes.build import Transport, build_engine, build_router
from dualpath_jax.runtimes.malloc import tune
from dualpath_jax.wire.credentials import credentials_for

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ProcessSpec:
    """Which process to run. Engine ids are unique across roles; nodes too."""

    role: str  # router | prefill | decode
    workdir: str
    router_address: str = ""  # engines: tcp://host:port of the router
    engine: int = 0
    node: int = 0
    group: int = 0
    address_file: str = ""  # router: where to write the address it listens on
    parent_pid: int = 0  # if set: stop when this process is no longer our parent (it died)
    # An engine spanning several processes (`engines.span`): this one's rank, how many, and the
    # group's jax.distributed coordinator (host:port, served by rank 0).
    span_rank: int = 0
    span_size: int = 1
    coordinator: str = ""
    resume: bool = False  # router: restarted over running engines (serve what they serve)


def _install_sigterm(stop: threading.Event) -> None:
    def handler(signum, frame):  # noqa: ARG001
        stop.set()
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)


def _watch_parent(parent_pid: int, poll_s: float = 0.5) -> None:
    """Stops this process (as SIGTERM does) once `parent_pid` is no longer its parent: a
    `LocalCluster` whose owner was killed must not leave engines behind."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(poll_s)
        log.warning("parent process %d is gone: stopping", parent_pid)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def run_router(cfg: ExperimentConfig, spec: ProcessSpec) -> None:
    with build_router(cfg, spec.workdir, resume=spec.resume) as built:
        if spec.address_file:
            tmp = spec.address_file + ".tmp"
            pathlib.Path(tmp).write_text(built.address)
            os.replace(tmp, spec.address_file)
        built.serve()


def run_engine(cfg: ExperimentConfig, spec: ProcessSpec) -> None:
    """An engine process: the engine `build_engine` assembles over this process's devices, a
    ZeroMQ control socket and a `jax.experimental.transfer` channel. A process of an engine
    spanning several (`spec.span_size`) joins its `jax.distributed` group first; its followers
    replay the leader's device work and nothing else."""
    import jax

    from dualpath_jax.engines.span import MirrorLeader, Span, init_distributed
    from dualpath_jax.engines.warmup import enable_compilation_cache

    c = cfg.cluster
    enable_compilation_cache(cfg, spec.workdir)  # a restart compiles nothing it compiled before
    span = Span(spec.span_rank, spec.span_size, spec.coordinator)
    if span.spans:  # before anything else starts JAX: this engine's own process group
        init_distributed(
            span, c.platform, bind_host=c.transfer_host, timeout_s=c.heartbeat_timeout_s * 4
        )
        if not span.leader:
            return _follow(cfg, spec, span)
    who = EngineId(spec.role, spec.engine, spec.node, spec.group)
    log.info("%s: %d device(s) visible", who.name, len(jax.local_devices()))
    transport = Transport(
        router_address=spec.router_address,
        token=credentials_for(c.secrets_file).engine,
        channel=_transfer_channel,
        # an engine spanning processes meshes over all of their devices
        devices=jax.devices() if span.spans else None,
        on_router_lost=lambda: os.kill(os.getpid(), signal.SIGTERM),
        span=(
            (lambda: MirrorLeader(span, c.host, timeout_s=c.heartbeat_timeout_s * 4))
            if span.spans
            else None
        ),
        spans_processes=span.spans,
    )
    with build_engine(cfg, who, spec.workdir, transport) as built:
        built.run()


def _transfer_channel(bind: str):
    from dualpath_jax.transfer.jax_channel import JaxTransferChannel

    return JaxTransferChannel(bind=bind, transport_addresses=[bind])


def _follow(cfg: ExperimentConfig, spec: ProcessSpec, span) -> None:
    """A follower of an engine spanning processes: replays the leader's device work."""
    import jax

    from dualpath_jax.engines.calibrate import prefill_cost
    from dualpath_jax.engines.params import ParamsSlot, load_served_model
    from dualpath_jax.engines.prefill_forward import PrefillReplay
    from dualpath_jax.engines.span import DecoderReplay, announce, follow
    from dualpath_jax.model import sharding
    from dualpath_jax.model.runner import ModelRunner
    from dualpath_jax.runtimes.devices import role_mesh
    from dualpath_jax.transfer.row_offers import KV_ADDRESS_KEY
    from dualpath_jax.wire.rpc import host_port

    mesh = sharding.make_mesh(role_mesh(cfg.cluster, spec.role), jax.devices())
    runner = ModelRunner(load_served_model(cfg, mesh))
    log.info("%s engine %d: process %d of %d follows", spec.role, spec.engine, span.rank, span.size)
    timeout_s = cfg.cluster.heartbeat_timeout_s
    # A streamed params update: this process pulls its own copy over a channel of its own.
    params = ParamsSlot(
        runner,
        "",
        -1,
        open_channel=lambda: _transfer_channel(host_port(cfg.cluster.transfer_host, 0)),
        load_timeout_s=cfg.cluster.params_load_timeout_s,
    )
    if spec.role != "prefill":
        follow(DecoderReplay(runner, _follower_decoder, params), timeout_s=timeout_s)
        return
    # A KV channel of its own: the DE pulls the pieces of the new rows this process computes.
    channel = _transfer_channel(host_port(cfg.cluster.transfer_host, 0))
    try:
        announce(KV_ADDRESS_KEY.format(rank=span.rank), channel.address)
        prefill_cost(cfg, runner)  # the leader's calibration forwards, in step with it
        replay = PrefillReplay(cfg, runner, channel, params)
        follow(replay, timeout_s=timeout_s)
        log.info(
            "offered %d KV row pieces to decode engines, pulled the pieces of %d hit layers",
            replay.offered,
            replay.pulled,
        )
    finally:
        channel.close()


def _follower_decoder(runner, *, slots, max_len, min_bucket, page_size, num_pages):
    """A follower's `Decoder`, shaped as its leader's (`MirroredDecoder` sends the shape)."""
    from dualpath_jax.model.decode import Decoder

    return Decoder(runner, slots, max_len, min_bucket, page_size=page_size, num_pages=num_pages)


def run_process(cfg: ExperimentConfig, spec: ProcessSpec) -> None:
    stop = threading.Event()
    _install_sigterm(stop)
    if spec.parent_pid:
        _watch_parent(spec.parent_pid)
    # before JAX and the store start their threads: they share the capped arenas
    trimmer = tune(cfg.cluster.malloc_arena_max, cfg.cluster.malloc_trim_s)
    try:
        if spec.role == "router":
            run_router(cfg, spec)
        elif spec.role in ("prefill", "decode"):
            run_engine(cfg, spec)
        else:
            raise ValueError(f"unknown role {spec.role!r}; expected router, prefill or decode")
    except KeyboardInterrupt:
        log.info("%s stopped by signal", spec.role)
    finally:
        if trimmer is not None:
            trimmer.stop()
