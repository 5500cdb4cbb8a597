"""A cluster on a running Ray cluster (`RayCluster`): the router and every engine as Ray actors,
placed by the config's `ray` section, serving until SIGTERM or Ctrl-C (docs/multihost.md, "On
Ray"). Needs the `ray` extra.

  python launch/ray_cluster.py --config=configs/cpu_1p2d.py --address=auto --workdir=/tmp/dp_ray
  python launch/ray_cluster.py --config=configs/cpu_1p2d.py --address=auto --workdir=/tmp/dp_ray \
      --serve --port=8000

Prints the router's address and the file holding the cluster's secrets (mode 0600, in
--workdir: clients need its client secret); with --serve, also the OpenAI-compatible HTTP
server's address (launch/api_server.py's, attached to this router). `--address=local` starts a
Ray of this host instead (as many logical CPUs as the cluster's bundles ask for, or --num_cpus).
"""

from __future__ import annotations

import signal
import threading

import _flags  # this directory's shared flags
from absl import app, flags

_ADDRESS = flags.DEFINE_string(
    "address", "auto", "The Ray cluster: auto, ray://HOST:10001, a GCS address, or local."
)
_NUM_CPUS = flags.DEFINE_integer(
    "num_cpus", 0, "CPUs of a local Ray (--address=local); 0: as many as the cluster's bundles."
)
_SERVE = flags.DEFINE_bool("serve", False, "Also serve the OpenAI-compatible HTTP API.")
_HOST = flags.DEFINE_string("host", "127.0.0.1", "With --serve: the address to listen on.")
_PORT = flags.DEFINE_integer("port", 8000, "With --serve: the port (0: any free port).")
_API_KEY = flags.DEFINE_string("api_key", "", "With --serve: require `Authorization: Bearer KEY`.")


def main(argv):
    del argv
    from dualpath_jax.cluster import RayCluster, write_credentials
    from dualpath_jax.wire.rpc import is_loopback

    if _SERVE.value and not is_loopback(_HOST.value) and not _API_KEY.value:
        raise app.UsageError(f"serving on {_HOST.value!r} (not loopback) needs --api_key")
    cfg = _flags.build_config("offline")
    wd = _flags.prepare_workdir(cfg)
    local = _ADDRESS.value == "local" and _NUM_CPUS.value > 0
    cluster = RayCluster(
        cfg,
        wd,
        address=_ADDRESS.value,
        init_kwargs={"num_cpus": _NUM_CPUS.value} if local else None,
    )
    with cluster:
        secrets = wd / "secrets.json"
        write_credentials(secrets, cluster.credentials)
        print(f"router: {cluster.address}", flush=True)
        print(f"secrets: {secrets}", flush=True)
        for name, w in cluster.where().items():
            print(f"{name}: node {w['node_id'][:12]} ({w['ip']}) pid {w['pid']}", flush=True)
        if _SERVE.value:
            from dualpath_jax.serving.run import serve

            serve(  # prints "serving MODEL on http://HOST:PORT"; returns on SIGTERM / Ctrl-C
                cfg,
                wd,
                host=_HOST.value,
                port=_PORT.value,
                api_key=_API_KEY.value,
                router=cluster.address,
                secrets_file=str(secrets),
            )
            return
        stop = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
        stop.wait()


if __name__ == "__main__":
    app.run(main)
