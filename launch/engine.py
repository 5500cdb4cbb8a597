"""One process of a multi-host cluster: the router, a prefill engine or a decode engine.

The example of docs/multihost.md (same config everywhere; a non-loopback router needs
--set cluster.secrets_file=PATH, a 0600 file from `python -m dualpath_jax.wire.credentials PATH`
copied to every host; the block store is one directory every host sees, or a gcs/s3 spec):
  python launch/engine.py --role=router --config=configs/cpu_1p1d.py:tiny --workdir=/var/lib/dualpath/router \
      --set cluster.host=10.213.0.2 --set cluster.router_port=5555 \
      --set cluster.secrets_file=/etc/dualpath/secrets.json --set store.root=/shared/dualpath/kv
  python launch/engine.py --role=prefill --engine_id=0 --node=0 --group=0 --router=tcp://10.213.0.2:5555 \
      --config=configs/cpu_1p1d.py:tiny --workdir=/var/lib/dualpath/pe --set cluster.transfer_host=10.213.0.3 ...
  python launch/engine.py --role=decode --engine_id=1 --node=1 --group=0 --router=tcp://10.213.0.2:5555 \
      --config=configs/cpu_1p1d.py:tiny --workdir=/var/lib/dualpath/de --set cluster.transfer_host=10.213.0.4 ...

An engine spanning two processes (or hosts): its mesh covers both processes' devices
(`cluster.decode_processes=2`, or `prefill_processes` for a prefill engine), one engine id, one
coordinator served by rank 0:
  python launch/engine.py --role=decode --engine_id=1 --node=1 --span_rank=0 --coordinator=10.213.0.4:7777 \
      --set cluster.decode_processes=2 --set cluster.decode_mesh=tensor=2 ...
  python launch/engine.py --role=decode --engine_id=1 --node=1 --span_rank=1 --coordinator=10.213.0.4:7777 \
      --set cluster.decode_processes=2 --set cluster.decode_mesh=tensor=2 ...

Devices: an engine runs on a mesh of `cluster.prefill_mesh` / `cluster.decode_mesh`. With
`--set cluster.platform=cpu` it gets that many CPU host devices; with `gpu` or `tpu`, `--devices`
names its GPUs or TPU chips (e.g. --devices=2,3), else it takes the first ones it sees. The
variables are set here, before JAX starts in this process (`dualpath_jax.runtimes.devices`):
  python launch/engine.py --role=prefill --engine_id=0 --node=0 --router=tcp://127.0.0.1:5555 \
      --set cluster.platform=gpu --set cluster.prefill_mesh=tensor=2 --devices=0,1 ...
"""

from __future__ import annotations

import faulthandler
import logging
import os
import pathlib
import signal
import sys

from absl import app, flags

# Nothing imported before `main` may start JAX: the engine's device variables come first.
from dualpath_jax.config import apply_overrides, to_json, validate
from dualpath_jax.configs_loader import load_config
from dualpath_jax.logs import install_rate_limit
from dualpath_jax.runtimes.devices import TPU_PORT_BASE, device_env, processes, router_env

_ROLE = flags.DEFINE_enum("role", None, ["router", "prefill", "decode"], "Which process to run.")
_CONFIG = flags.DEFINE_string(
    "config", "configs/cpu_1p1d.py", "Experiment file `configs/NAME.py[:ARG]`."
)
_SET = flags.DEFINE_multi_string("set", [], "Override `section.key=value` (repeatable).")
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (events, logs, link reports).")
_ROUTER = flags.DEFINE_string("router", "", "Router address tcp://HOST:PORT (engines).")
_ENGINE = flags.DEFINE_integer(
    "engine_id", 0, "Engine id, unique across prefill and decode engines."
)
_NODE = flags.DEFINE_integer("node", 0, "Node id, unique across the cluster.")
_GROUP = flags.DEFINE_integer("group", 0, "Engine group (its leader fetches for the group).")
_DEVICES = flags.DEFINE_list(
    "devices",
    [],
    "Engines with cluster.platform gpu or tpu: the GPU / TPU chip ids this engine uses, as many"
    " as its role's mesh spans (empty: those the environment shows).",
)
_SPAN_RANK = flags.DEFINE_integer(
    "span_rank",
    0,
    "An engine spanning cluster.prefill_processes / decode_processes processes: this process's"
    " rank (0 is the engine the router knows; the others follow it).",
)
_COORDINATOR = flags.DEFINE_string(
    "coordinator",
    "",
    "An engine spanning several processes: HOST:PORT of its jax.distributed coordinator,"
    " which rank 0 serves (the same for every process of the engine).",
)
flags.mark_flags_as_required(["role", "workdir"])


def main(argv):
    del argv
    cfg = validate(apply_overrides(load_config(_CONFIG.value), _SET.value))
    install_rate_limit()
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # kill -USR1: every thread's stack
    wd = pathlib.Path(_WORKDIR.value)
    wd.mkdir(parents=True, exist_ok=True)
    if _ROLE.value == "router":
        (wd / "config.json").write_text(to_json(cfg, indent=1))
        os.environ.update(router_env(cfg.cluster))  # no device of the engines
    elif not _ROUTER.value:
        raise app.UsageError("engines need --router=tcp://HOST:PORT")
    else:
        if _DEVICES.value and cfg.cluster.platform not in ("gpu", "tpu"):
            raise app.UsageError("--devices names GPUs or TPU chips: set cluster.platform")
        if "jax" in sys.modules:
            raise RuntimeError("JAX was imported before the engine's device variables were set")
        env = device_env(
            cfg.cluster,
            _ROLE.value,
            _DEVICES.value or None,
            os.environ,
            port=TPU_PORT_BASE + _ENGINE.value,
        )
        os.environ.update(env)  # read by JAX when it starts, in run_process
        logging.info("%s engine %d device variables: %s", _ROLE.value, _ENGINE.value, env)
    from dualpath_jax.runtimes.process import ProcessSpec, run_process

    spec = ProcessSpec(
        _ROLE.value,
        str(wd),
        _ROUTER.value,
        _ENGINE.value,
        _NODE.value,
        _GROUP.value,
        address_file=str(wd / "router.address") if _ROLE.value == "router" else "",
        span_rank=_SPAN_RANK.value,
        span_size=processes(cfg.cluster, _ROLE.value) if _ROLE.value != "router" else 1,
        coordinator=_COORDINATOR.value,
    )
    if spec.span_size > 1 and not spec.coordinator:
        raise app.UsageError(
            f"an engine of cluster.{spec.role}_processes={spec.span_size} needs --coordinator"
        )
    logging.info("starting %s with config %s", _ROLE.value, cfg.name)
    run_process(cfg, spec)


if __name__ == "__main__":
    app.run(main)
