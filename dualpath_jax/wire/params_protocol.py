"""Served parameters: which params an engine starts with, and how an update reaches every engine.

Transport: an update travels as an orbax checkpoint directory that every engine reads (the
client writes it, `UpdateParams` names it). Parameters can be far larger than a control frame
(64 MiB), every engine of a multi-host cluster can read a shared directory (a mounted file
system), orbax restores each array with the engine's
own dtype and sharding, and the directory stays behind as a record of exactly what was served
(a restarted engine or a later run can start from it with `cluster.params_path`).

Protocol (router side `router.params_update.ParamsCoordinator`, engine side
`engines.params.ParamsSlot`):
1. `UpdateParams(version, path)` arrives; rounds submitted from now on are held at the router.
2. Drain: every round submitted before it (queued or running) finishes with the old params.
3. `LoadParams` to every live engine; each loads and checks the tree into a staging slot and
   answers `ParamsLoaded(ok, message)` (the old params keep serving meanwhile).
4. All ok: `CommitParams(commit=True)`, the router's `params_version` (and so the block-key
   fingerprint) becomes `version`, the client gets `Ack`. Any failure: `CommitParams(commit=False)`
   everywhere, the client gets `Error` with the engines' messages, nothing changes.
5. Held rounds are submitted: their keys use the new fingerprint, so no KV computed with older
   params is ever read.
"""

from __future__ import annotations

import os
import re

from dualpath_jax.config import ClusterConfig, ConfigError

# The router's record of the params it serves, in the workdir (what a restarted one serves).
SERVED_FILE = "served_params.json"

_VERSION_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:+-]{0,127}")


def check_version(version: str) -> str:
    """Returns `version` if it is a usable params version name (also a safe directory name)."""
    if not isinstance(version, str) or not _VERSION_RE.fullmatch(version) or ".." in version:
        raise ValueError(
            f"params version {version!r} must be 1-128 characters of letters, digits and ._:+- "
            "(starting with a letter or digit)"
        )
    return version


def initial_params_version(cluster: ClusterConfig) -> str:
    """The version a cluster serves when it starts: `params_version`, else derived from
    `params_path` (so KV of `init_model` weights is never reused for a checkpoint), else ""."""
    if cluster.params_version:
        return cluster.params_version
    if cluster.params_path:
        return "path:" + os.path.abspath(cluster.params_path)
    return ""


def check_params_config(cluster: ClusterConfig) -> None:
    """Raises ConfigError when `cluster.params_path` cannot be served (checked before starting
    processes, so the user sees the reason rather than a dead engine)."""
    path = cluster.params_path
    if not path:
        return
    if not os.path.isdir(path):
        raise ConfigError(f"cluster.params_path={path!r} is not a directory")
    if not (
        os.path.isdir(os.path.join(path, "params"))
        or os.path.isfile(os.path.join(path, "config.json"))
    ):
        raise ConfigError(
            f"cluster.params_path={path!r} holds neither an orbax checkpoint (params/) nor a "
            "Hugging Face model (config.json); write one with model.checkpoint.save_params_tree"
        )
