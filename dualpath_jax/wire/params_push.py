"""The client's side of a streamed params update (`Client.update_params(via="transfer")`):
offer the params over the transfer layer for as long as the router's update runs
(transfer/params_sync.py), then drop the offers."""

from __future__ import annotations

import time
from typing import Any

from dualpath_jax.wire import messages


def tree_nbytes(params: Any) -> int:
    """The bytes of a params tree (a `Transformer`, its state or a nested dict)."""
    import jax

    from dualpath_jax.model.checkpoint import params_state

    return sum(int(x.nbytes) for x in jax.tree.leaves(params_state(params)))


def open_params_channel(client: Any):
    """A transfer channel to offer params from: the client's `params_channel()` if it has one,
    else a transfer server of its own on the client's `transfer_host`."""
    if client._params_channel is not None:  # noqa: SLF001 - the client's own setting
        return client._params_channel()  # noqa: SLF001
    from dualpath_jax.transfer.jax_channel import JaxTransferChannel
    from dualpath_jax.wire.rpc import host_port

    bind = host_port(client.transfer_host, 0)
    return JaxTransferChannel(bind=bind, transport_addresses=[bind], offer_ttl_s=None)


def stream_params(
    client: Any,
    params: Any,
    version: str,
    bucket_bytes: int | None,
    timeout_s: float,
    pause: str = "wait",
) -> str:
    """`update_params(via="transfer")`: offers the params (one copy per engine process the
    router counts in rotation, plus one for an engine joining meanwhile) for as long as the
    update runs, then drops the offers. Records the timings in `client.last_params_update`."""
    from dualpath_jax.transfer.params_sync import DEFAULT_BUCKET_BYTES, offer_params

    t0 = time.monotonic()
    copies = int(client.stats(timeout_s).get("params_pullers", 1)) + 1
    handle = offer_params(
        params,
        open_params_channel(client),
        copies,
        bucket_bytes=bucket_bytes or DEFAULT_BUCKET_BYTES,
    )
    with handle:
        msg = messages.UpdateParams(version=version, offer=handle.offer, pause=pause)
        client._check(client._call(msg, f"params:{version}").result(timeout_s))  # noqa: SLF001
    client.last_params_update = {
        "via": "transfer",
        "bytes": handle.offer.nbytes,
        "buckets": len(handle.offer.buckets),
        "prepare_s": handle.offer_s,
        "total_s": time.monotonic() - t0,
    }
    return version
