"""Running the HTTP server: on a LocalCluster it starts, or on a router that runs already.

`serving_config(cfg, checkpoint)` points a config at a Hugging Face checkpoint (its model and
its weights); `server_config(cfg, name)` is the HTTP server's config of serving it (context,
vocabulary, the links it emulates); `serve(cfg, workdir, ...)` blocks until SIGTERM or SIGINT,
then stops the server and the cluster it started. Once serving it writes
`workdir/api_server.json` (`url`, `pid`, `model`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import pathlib
import signal
import threading
import time
from typing import TYPE_CHECKING

from dualpath_jax.config import ExperimentConfig

if TYPE_CHECKING:
    from dualpath_jax.serving.server import ServerConfig

log = logging.getLogger(__name__)


HOST_KV_FRACTION = 0.25  # of this host's memory, shared by its DEs' KV pools (CPU platform)


def serving_config(
    cfg: ExperimentConfig, checkpoint: str | None, *, pinned_context: bool = False
) -> ExperimentConfig:
    """`cfg` serving `checkpoint` (a Hugging Face directory): its model config and weights, and
    decode slots as long as its context (`max_position_embeddings`) where memory allows
    (`context_limit`). `pinned_context`: the user set `cluster.decode_max_len`; it is kept (up
    to the checkpoint's context)."""
    if not checkpoint:
        return cfg
    from dualpath_jax.model.checkpoint import config_from_hf

    path = pathlib.Path(checkpoint).absolute()
    model = config_from_hf(json.loads((path / "config.json").read_text()))
    cfg = dataclasses.replace(cfg, model=model)
    if pinned_context:
        context = min(cfg.cluster.decode_max_len, model.max_seq_len)
    else:
        context, _ = context_limit(cfg)
    cluster = dataclasses.replace(cfg.cluster, params_path=str(path), decode_max_len=context)
    return dataclasses.replace(cfg, cluster=cluster)


def _host_platform() -> str:
    """The platform engines with `cluster.platform=""` will find, without starting a JAX
    backend here (on a GPU that would take the device's memory): `JAX_PLATFORMS` if it names
    one, else "gpu" or "tpu" where their jaxlib plugin is installed, else "cpu"."""
    import importlib.util

    import jax  # reads JAX_PLATFORMS into its config at import; starts no backend

    named = (jax.config.jax_platforms or "").split(",")[0].strip()
    if named:
        return {"cuda": "gpu", "rocm": "gpu"}.get(named, named)
    if any(importlib.util.find_spec(m) for m in ("jax_cuda12_plugin", "jax_cuda13_plugin")):
        return "gpu"
    return "tpu" if importlib.util.find_spec("libtpu") else "cpu"


def context_limit(cfg: ExperimentConfig, host_bytes: int | None = None) -> tuple[int, str]:
    """The longest context `cfg`'s cluster can serve, and what sets it: the model's
    `max_seq_len`, or the KV memory of the decode slots, every slot full at that length:
    `cluster.decode_kv_bytes` if given, on CPU a quarter of the host's memory (`host_bytes`,
    default this host's) shared by the DEs; on GPU and TPU the DEs size their pools from the
    device memory themselves, so the model's context stands."""
    from dualpath_jax.model.layout import BlockLayout

    c, bt = cfg.cluster, cfg.store.block_tokens
    budget, where = c.decode_kv_bytes, "cluster.decode_kv_bytes"
    if not budget and (c.platform or _host_platform()) == "cpu":
        if host_bytes is None:
            host_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        des = c.decode_nodes * cfg.hardware.engines_per_node
        budget = int(host_bytes * HOST_KV_FRACTION) // max(des, 1)
        where = f"{HOST_KV_FRACTION:.0%} of host memory over {des} decode engine(s)"
    model_max = cfg.model.max_seq_len
    if not budget:
        return model_max, "the model's max_seq_len"
    per_token = BlockLayout.for_model(cfg.model, bt).nbytes // bt
    fits = budget // (c.decode_slots * per_token) // bt * bt
    if fits >= model_max:
        return model_max, "the model's max_seq_len"
    if fits < bt:
        raise ValueError(
            f"{c.decode_slots} decode slots of {per_token} bytes of KV per token do not fit"
            f" {budget} bytes ({where}): lower cluster.decode_slots or raise the budget"
        )
    return fits, f"the KV memory of {c.decode_slots} decode slots ({where})"


def server_config(cfg: ExperimentConfig, name: str, **server: str | float | int) -> ServerConfig:
    """The `ServerConfig` of serving `cfg` as model `name`: its context (`cluster.decode_max_len`
    up to the model's `max_seq_len`), vocabulary and emulated links (`transfer.links.
    emulated_links`, which the server logs and `GET /health` reports), then the `server` fields
    given (`api_key`, the limits of `serve`)."""
    from dualpath_jax.serving.server import ServerConfig
    from dualpath_jax.transfer.links import emulated_links

    return ServerConfig(
        model=name,
        max_context=min(cfg.model.max_seq_len, cfg.cluster.decode_max_len),
        vocab_size=cfg.model.vocab_size,
        emulated_links=emulated_links(cfg.hardware),
        **server,
    )


def serve(
    cfg: ExperimentConfig,
    workdir: str | os.PathLike,
    *,
    checkpoint: str | None = None,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str = "",
    model_name: str = "",
    router: str = "",
    secrets_file: str = "",
    **server: float | int,
) -> None:
    """Serves the OpenAI API for `cfg` until SIGTERM/SIGINT. `router` (with `secrets_file`)
    attaches to a running router instead of starting a LocalCluster in `workdir`. `server`:
    more `ServerConfig` fields (`round_timeout_s`, `session_idle_s`, `default_max_tokens`, the
    connection limits `header_timeout_s`, `body_timeout_s`, `keepalive_timeout_s`,
    `write_timeout_s`, `max_connections`)."""
    from dualpath_jax.runtimes.local import LocalCluster
    from dualpath_jax.serving.server import ApiServer
    from dualpath_jax.serving.tokenizer import load_tokenizer
    from dualpath_jax.wire.client import Client
    from dualpath_jax.wire.credentials import read_credentials

    workdir = pathlib.Path(workdir)
    tokenizer = load_tokenizer(checkpoint, cfg.model.vocab_size)
    name = model_name or (pathlib.Path(checkpoint).name if checkpoint else cfg.model.name)
    context = min(cfg.model.max_seq_len, cfg.cluster.decode_max_len)
    if cfg.cluster.decode_max_len < cfg.model.max_seq_len:
        bound, what = context_limit(cfg)
        why = f"that is {what}" if checkpoint and bound == context else "set by the config"
        log.info(
            "context: %d tokens, set by cluster.decode_max_len (a decode slot's tokens; %s); the"
            " model allows %d (--set cluster.decode_max_len=N to choose, memory permitting)",
            context, why, cfg.model.max_seq_len,
        )  # fmt: skip
    else:
        log.info("context: %d tokens, the model's max_seq_len", context)
    server_cfg = server_config(cfg, name, api_key=api_key, **server)
    if router:
        creds = read_credentials(secrets_file) if secrets_file else None
        client = Client(router, creds.client if creds else "")
        _run(ApiServer(client, tokenizer, server_cfg), host, port, workdir, name)
        client.close()
        return
    # The server listens at once and reports ready (`GET /health` 200; requests before get 503)
    # when every engine has registered: with `cluster.warmup`, once each has compiled its shapes.
    cluster = LocalCluster(cfg, workdir)
    try:
        cluster.start(wait=False)
        client = cluster.client()
        ready = threading.Event()
        _run(
            ApiServer(client, tokenizer, server_cfg, ready=ready.is_set),
            host,
            port,
            workdir,
            name,
            warm=lambda: (cluster.wait_ready(), ready.set()),
        )
        client.close()
    finally:
        cluster.stop()


def _run(server, host: str, port: int, workdir: pathlib.Path, name: str, warm=None) -> None:
    """Serves until SIGTERM/SIGINT. `warm`: blocks until the cluster is ready (run beside the
    server; if it raises, the server stops and the error propagates)."""
    failed: list[BaseException] = []

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        bound = await server.start(host, port)
        shown = f"[{host}]" if ":" in host else host
        url = f"http://{shown}:{bound}"
        info = {"url": url, "pid": os.getpid(), "model": name}
        (workdir / "api_server.json").write_text(json.dumps(info))
        log.info("serving %s on %s", name, url)
        print(f"serving {name} on {url}", flush=True)
        if warm is not None:
            t0 = time.monotonic()

            def warming() -> None:
                try:
                    warm()
                    log.info("ready: every engine registered %.1f s after listening",
                             time.monotonic() - t0)  # fmt: skip
                    print("ready", flush=True)
                except BaseException as e:  # noqa: BLE001 - stop serving, then raise it
                    failed.append(e)
                    loop.call_soon_threadsafe(stop.set)

            threading.Thread(target=warming, name="wait-ready", daemon=True).start()
        await stop.wait()
        await server.stop()

    asyncio.run(main())
    if failed:
        raise failed[0]
