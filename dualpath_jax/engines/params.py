"""An engine's served parameters: the model it starts with (`load_served_model`), the staging slot
an update loads into (`ParamsSlot`), and their checks. The update protocol and the version names
are `wire/params_protocol.py`."""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence

import msgspec

from dualpath_jax.config import ExperimentConfig
from dualpath_jax.transfer.params_offer import ParamsOffer
from dualpath_jax.wire import messages
from dualpath_jax.wire.params_protocol import check_params_config

log = logging.getLogger(__name__)


def load_served_model(cfg: ExperimentConfig, mesh=None):
    """The model an engine starts with: `cluster.params_path` (checked) or `init_model`, on the
    engine's `mesh` (None: one device): `init_model` makes each shard in place, `load_params`
    reads or restores each shard of a checkpoint in place."""
    from dualpath_jax.model.checkpoint import load_params
    from dualpath_jax.model.transformer import init_model

    if cfg.cluster.params_path:
        check_params_config(cfg.cluster)
        return load_params(cfg.cluster.params_path, cfg.model, mesh=mesh)
    return init_model(cfg.model, seed=cfg.seed, mesh=mesh)


class ParamsMismatch(RuntimeError):
    """A job of another params version than the engine serves: reported as kind `params`, so
    the router retries the round elsewhere and takes the engine out of rotation until it has
    loaded the served params (router/params_update.py)."""


class ParamsSlot:
    """An engine's served params version plus at most one staged update.

    `stage(LoadParams)` loads and checks new params without touching the served ones and returns
    the `ParamsLoaded` answer; `commit(CommitParams)` swaps them in (no recompile: params are jit
    arguments) or drops them. `check_job` refuses a job of another version (`ParamsMismatch`).
    """

    def __init__(
        self,
        runner,
        version: str,
        engine: int,
        mirror=None,
        *,
        channel=None,
        open_channel=None,
        load_timeout_s: float = 600.0,
        corrupt_bucket=None,
    ):
        """`mirror`: an engine spanning processes (`span.MirrorLeader`): each load and commit
        is sent to its followers first (`replay_params`). A load places each process's shards
        onto the runner's mesh, as the engine's first params were.

        A streamed update (`LoadParams.offer`, transfer/params_sync.py) is pulled over `channel`
        (the engine's KV channel) or, without one, over a channel `open_channel()` opens for
        the load (a follower of a spanning engine); every bucket within `load_timeout_s`.
        `corrupt_bucket`: a test hook applied to each pulled bucket (`engines.fault_hook`)."""
        self.runner, self.version, self.engine = runner, version, engine
        self.mirror = mirror
        self.channel, self.open_channel = channel, open_channel
        self.load_timeout_s = load_timeout_s
        self.corrupt_bucket = corrupt_bucket
        self._staged: tuple[str, object] | None = None

    def stage(self, msg: messages.LoadParams) -> messages.ParamsLoaded:
        from dualpath_jax.model.checkpoint import load_params

        self._staged = None
        source = msg.path if msg.offer is None else f"the offer of {msg.offer.address}"
        try:
            if self.mirror is not None:
                offer = "" if msg.offer is None else msgspec.json.encode(msg.offer).decode()
                self.mirror.send("_params_stage", (msg.version, msg.path, offer, msg.copy))
            if msg.offer is not None:
                model = self._pull(msg.offer, msg.copy)
            else:
                model = load_params(msg.path, self.runner.cfg, mesh=self.runner.mesh)
            check_finite(model)
        except Exception as e:  # noqa: BLE001 - any failure is reported; the old params stay
            log.warning("params %s from %s refused: %s", msg.version, source, e)
            return messages.ParamsLoaded(
                engine=self.engine,
                version=msg.version,
                ok=False,
                message=f"{type(e).__name__}: {e}",
            )
        self._staged = (msg.version, model)
        return messages.ParamsLoaded(engine=self.engine, version=msg.version, ok=True)

    def _pull(self, offer: ParamsOffer, copy: int):
        """The model of a streamed update: this process pulls copy `copy + its rank` of every
        bucket (transfer/params_sync.py), placed as the served params are."""
        import jax

        from dualpath_jax.model.checkpoint import model_from_params
        from dualpath_jax.model.sharding import _path
        from dualpath_jax.transfer.params_sync import ParamsTransferError, flat_params, pull_params

        served_tree = served_params(self.runner)
        channel, opened = self.channel, None
        if channel is None:
            if self.open_channel is None:
                raise ParamsTransferError("this engine has no transfer channel to pull params over")
            channel = opened = self.open_channel()
        try:
            flat = pull_params(
                offer,
                copy + jax.process_index(),
                channel,
                dict(flat_params(served_tree)),
                self.load_timeout_s,
                corrupt=self.corrupt_bucket or (lambda arrays: arrays),
            )
        finally:
            if opened is not None:
                opened.close()
        tree = jax.tree_util.tree_map_with_path(lambda k, _: flat[_path(k)], served_tree)
        return model_from_params(tree, self.runner.cfg)

    def commit(self, msg: messages.CommitParams) -> None:
        if self.mirror is not None:
            self.mirror.send("_params_commit", (msg.version, msg.commit))
        staged, self._staged = self._staged, None
        if not msg.commit:
            return
        if staged is None or staged[0] != msg.version:
            log.error(
                "commit of params %s without a staged load; still serving %r",
                msg.version,
                self.version,
            )
            return
        self.runner.update_params(staged[1])
        self.version = msg.version
        log.info("serving params version %r", self.version)

    def drop_staged(self) -> None:
        """Drops a staged load, if any (an engine registering again: the router asks anew)."""
        if self._staged is not None:
            self.commit(messages.CommitParams(version=self._staged[0], commit=False))

    def check_job(self, job: messages.LoadJobMsg) -> None:
        if job.params_version != self.version:
            raise ParamsMismatch(
                f"job {job.request} needs params version {job.params_version!r}; this engine serves {self.version!r}"
            )

    def handle(self, msg: messages.Msg, send) -> bool:
        """Handles LoadParams/CommitParams (True), anything else is not ours (False)."""
        if isinstance(msg, messages.LoadParams):
            send(self.stage(msg))
            return True
        if isinstance(msg, messages.CommitParams):
            self.commit(msg)
            return True
        return False


def served_params(runner) -> dict:
    """The params a `ModelRunner` serves, as a pure dict (`nnx.to_pure_dict` layout)."""
    from flax import nnx

    return {
        "embed": nnx.to_pure_dict(runner.embed_state),
        "head": nnx.to_pure_dict(runner.head_state),
        "layers": {i: nnx.to_pure_dict(s) for i, s in enumerate(runner.layer_states)},
    }


def check_finite(model) -> None:
    """Raises ValueError naming the first parameters that hold a NaN or an infinity (a diverged
    training step): an engine refuses them and keeps serving the old ones. One compiled
    reduction over every floating parameter, on the devices they live on."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from dualpath_jax.model.sharding import _path, host_value

    flat = jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(nnx.state(model)))
    named = [(_path(k), x) for k, x in flat if jnp.issubdtype(x.dtype, jnp.floating)]
    if not named:
        return
    ok = host_value(_all_finite()([x for _, x in named]))  # replicated: each process reads its own
    bad = [name for (name, _), good in zip(named, ok) if not good]
    if bad:
        raise ValueError(f"the params hold NaN or Inf values: {', '.join(bad[:4])}")


@functools.cache
def _all_finite():
    """The jitted check `xs -> [whether every value of xs[i] is finite]`: one function, so its
    program compiles once per model (one defined per call would compile at every update)."""
    import jax
    import jax.numpy as jnp

    return jax.jit(lambda xs: jnp.stack([jnp.isfinite(x).all() for x in xs]))


def replay_params(slot: ParamsSlot, method: str, args: Sequence) -> bool:
    """A follower's side of a spanning engine's params update (`ParamsSlot.mirror`): loads or
    commits as its leader does. True if `method` was one of these."""
    if method == "_params_stage":
        version, path, offer, copy = args
        offer = msgspec.json.decode(offer, type=ParamsOffer) if offer else None
        got = slot.stage(messages.LoadParams(version=version, path=path, offer=offer, copy=copy))
        if not got.ok:
            log.warning("params %s not loaded here either: %s", version, got.message)
        return True
    if method == "_params_commit":
        version, commit = args
        slot.commit(messages.CommitParams(version=version, commit=commit))
        return True
    return False
