"""Control messages of a parameters update (engine/params_update.py, engine/params.py, docs/rl.md).

Client -> router `UpdateParams`; router -> engine `LoadParams` / `CommitParams`; engine ->
router `ParamsLoaded`. They are members of the control plane's one union (engine/messages.py).
"""

from __future__ import annotations

from dualpath_jax.engine.msg_base import Msg
from dualpath_jax.transfer.params_offer import ParamsOffer


class UpdateParams(Msg):
    """Client -> router: serve new parameters as `version`: those in `path` (an orbax checkpoint
    directory every engine can read) or, without a path, those of `offer` (streamed from the
    client's process). Answered `Ack(ref="params:<version>")` once every live engine loaded and
    checked them, or `Error` (the old params stay). KV of older versions is never reused because
    the version enters the block-key fingerprint. `pause`: what the rounds in flight do meanwhile
    (`PAUSE_MODES`: "wait" lets them finish on the old params, "abort" ends them now with what
    they generated, "keep" halts their decoding, serves the new params under them, and lets them
    decode on)."""

    version: str
    path: str = ""
    offer: ParamsOffer | None = None
    pause: str = "wait"


class LoadParams(Msg):
    """Router -> engine: load and check the parameters in `path`, or pull those of `offer`
    (its process k takes copy `copy + k`), staged, not yet served."""

    version: str
    path: str = ""
    offer: ParamsOffer | None = None
    copy: int = 0


class ParamsLoaded(Msg):
    """Engine -> router: the staged load of `version` succeeded (`ok`) or why not."""

    engine: int
    version: str
    ok: bool
    message: str = ""


class CommitParams(Msg):
    """Router -> engine: serve the staged `version` (`commit`) or drop it. Sent on the same
    socket before any job of the new version, so no job ever runs on the wrong params."""

    version: str
    commit: bool
