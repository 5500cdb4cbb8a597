"""The cluster's two secrets: one for engines (and the admin), one for clients.

They live in a JSON file `{"engine": "...", "client": "..."}` readable by its owner only (mode
0600), named by `cluster.secrets_file`; processes read it, so no secret is ever on a command line
or in `config.json`. `LocalCluster` writes a fresh file into its workdir when none is configured;
for a multi-host cluster make one and copy it to every host:

    python -m dualpath_jax.wire.credentials /path/to/secrets.json

Clients get the client secret only (`Credentials.client`): it opens sessions and submits rounds
but can neither register an engine nor shut the router down.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import secrets
import stat
import sys

from dualpath_jax.config import ConfigError


@dataclasses.dataclass(frozen=True)
class Credentials:
    engine: str = ""
    client: str = ""

    def __post_init__(self) -> None:
        if self.engine and self.engine == self.client:
            raise ConfigError("the engine and client secrets must differ")

    @property
    def tokens(self) -> dict[str, str]:
        """role -> secret, for the router's server (empty when no secrets are configured)."""
        return {r: s for r, s in (("engine", self.engine), ("client", self.client)) if s}

    def __repr__(self) -> str:  # never print a secret
        return f"Credentials(engine={'***' if self.engine else ''!r}, client={'***' if self.client else ''!r})"


def new_credentials() -> Credentials:
    return Credentials(engine=secrets.token_hex(24), client=secrets.token_hex(24))


def write_credentials(path: str | os.PathLike, creds: Credentials | None = None) -> Credentials:
    """Writes `creds` (default: fresh ones) to `path` with mode 0600, atomically."""
    creds = creds or new_credentials()
    path = pathlib.Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"engine": creds.engine, "client": creds.client}, f)
    os.replace(tmp, path)
    return creds


def read_credentials(path: str | os.PathLike) -> Credentials:
    """The secrets of `path`; refuses a file that others than its owner can read."""
    p = pathlib.Path(path)
    try:
        mode = p.stat().st_mode
        data = json.loads(p.read_text())
    except OSError as e:
        raise ConfigError(f"cluster.secrets_file {str(p)!r}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"cluster.secrets_file {str(p)!r}: not JSON ({e})") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(
            f"cluster.secrets_file {str(p)!r} is readable by others (mode {stat.S_IMODE(mode):o}); "
            "chmod 600 it"
        )
    if not isinstance(data, dict) or set(data) != {"engine", "client"}:
        raise ConfigError(f"cluster.secrets_file {str(p)!r}: expected keys 'engine' and 'client'")
    if not all(isinstance(v, str) and len(v) >= 16 for v in data.values()):
        raise ConfigError(
            f"cluster.secrets_file {str(p)!r}: each secret must be a string of >= 16 characters"
        )
    return Credentials(engine=data["engine"], client=data["client"])


def credentials_for(secrets_file: str) -> Credentials:
    """The configured credentials, or none (loopback-only clusters) for an empty path."""
    return read_credentials(secrets_file) if secrets_file else Credentials()


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python -m dualpath_jax.wire.credentials PATH")
    write_credentials(sys.argv[1])
    print(f"wrote fresh engine and client secrets to {sys.argv[1]} (mode 0600)")
