"""An OpenAI-compatible HTTP server over a local disaggregated cluster (or a running router).

Example:
  python launch/api_server.py --config=configs/serve.py:tiny --workdir=/tmp/dp_api --port=8000
  curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \
    -d '{"model": "tiny-qwen2", "prompt": "Hello", "max_tokens": 8, "temperature": 0}'
`--checkpoint=DIR` serves a Hugging Face checkpoint with its tokenizer; without it the config's
model serves (the tiny presets read text as bytes). Stops on SIGTERM or Ctrl-C, and stops the
cluster it started. The server listens at once; `GET /health` answers 200 once every engine
has compiled its shapes and registered (`--nowarmup`: at once, shapes compile on first use).
configs/serve.py runs every link at the host's speed; a config that emulates links (the `cpu_*`
experiments) is served with them, which the log warns of and `GET /health` lists. docs/serving.md.
"""

from __future__ import annotations

import dataclasses

import _flags  # this directory's shared flags
from absl import app, flags

from dualpath_jax.serving.run import serve, serving_config
from dualpath_jax.wire.rpc import is_loopback

_CHECKPOINT = flags.DEFINE_string(
    "checkpoint", None, "A Hugging Face checkpoint directory to serve (model, weights, tokenizer)."
)
_HOST = flags.DEFINE_string("host", "127.0.0.1", "Address to listen on (loopback by default).")
_PORT = flags.DEFINE_integer("port", 8000, "Port (0: any free port; see api_server.json).")
_API_KEY = flags.DEFINE_string("api_key", "", "Require `Authorization: Bearer KEY` on /v1.")
_NAME = flags.DEFINE_string("served_model_name", "", "The model name (default: config's).")
_ROUTER = flags.DEFINE_string(
    "router", "", "Attach to a running router at this address instead of starting a cluster."
)
_SECRETS = flags.DEFINE_string("secrets_file", "", "The cluster's secrets (with --router).")
_MAX_TOKENS = flags.DEFINE_integer(
    "default_max_tokens", 256, "Chat requests without max_tokens generate at most this many."
)
_ROUND_TIMEOUT = flags.DEFINE_float(
    "round_timeout_s", 600.0, "A round taking longer fails with 503 (and is cancelled)."
)
_SESSION_IDLE = flags.DEFINE_float(
    "session_idle_s", 1800.0, "Agent sessions unused this long are closed (blocks stay stored)."
)
_MAX_PRIORITY = flags.DEFINE_integer(
    "max_session_priority", 100, "The largest X-Session-Priority a client may ask for."
)
_MAX_TTL = flags.DEFINE_float(
    "max_session_ttl_s", 86400.0, "The largest X-Session-TTL (seconds) a client may ask for."
)
_HEADER_TIMEOUT = flags.DEFINE_float(
    "header_timeout_s", 10.0, "A request's line and headers must arrive within this (else closed)."
)
_BODY_TIMEOUT = flags.DEFINE_float(
    "body_timeout_s", 60.0, "A request's body must arrive within this after its headers (408)."
)
_KEEPALIVE = flags.DEFINE_float(
    "keepalive_timeout_s", 75.0, "An idle keep-alive connection is closed after this."
)
_WRITE_TIMEOUT = flags.DEFINE_float(
    "write_timeout_s",
    60.0,
    "A response write the client does not read within this closes the connection (and cancels"
    " its round).",
)
_MAX_CONNECTIONS = flags.DEFINE_integer(
    "max_connections", 1024, "Connections past this many are answered 503 (0: no cap)."
)
_WARMUP = flags.DEFINE_bool(
    "warmup",
    True,
    "Engines compile every shape bucket before the server reports ready (GET /health is 503"
    " until then; JAX's compilation cache in the workdir makes restarts fast). --nowarmup:"
    " shapes compile on first use.",
)


def main(argv):
    del argv
    if not is_loopback(_HOST.value) and not _API_KEY.value:
        raise app.UsageError(f"serving on {_HOST.value!r} (not loopback) needs --api_key")
    pinned = any(s.split("=", 1)[0].strip() == "cluster.decode_max_len" for s in _flags.SET.value)
    cfg = serving_config(_flags.build_config("offline"), _CHECKPOINT.value, pinned_context=pinned)
    cfg = dataclasses.replace(cfg, cluster=dataclasses.replace(cfg.cluster, warmup=_WARMUP.value))
    wd = _flags.prepare_workdir(cfg)
    serve(
        cfg,
        wd,
        checkpoint=_CHECKPOINT.value,
        host=_HOST.value,
        port=_PORT.value,
        api_key=_API_KEY.value,
        model_name=_NAME.value,
        router=_ROUTER.value,
        secrets_file=_SECRETS.value,
        default_max_tokens=_MAX_TOKENS.value,
        round_timeout_s=_ROUND_TIMEOUT.value,
        session_idle_s=_SESSION_IDLE.value,
        max_session_priority=_MAX_PRIORITY.value,
        max_session_ttl_s=_MAX_TTL.value,
        header_timeout_s=_HEADER_TIMEOUT.value,
        body_timeout_s=_BODY_TIMEOUT.value,
        keepalive_timeout_s=_KEEPALIVE.value,
        write_timeout_s=_WRITE_TIMEOUT.value,
        max_connections=_MAX_CONNECTIONS.value,
    )


if __name__ == "__main__":
    app.run(main)
