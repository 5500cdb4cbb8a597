"""Helpers shared by the prefill and decode engines."""

from __future__ import annotations

from dualpath_jax.engine import messages as M
from dualpath_jax.kvstore.store import StoreError
from dualpath_jax.transfer.channel import TransferError
from dualpath_jax.transfer.loader import LoadJob
from dualpath_jax.transfer.readiness import LoadCancelled, LoadTimeout


def job_from_msg(m: M.LoadJobMsg) -> LoadJob:
    return LoadJob(
        request_id=m.request,
        keys=tuple(m.keys),
        pe_blocks=m.pe_blocks,
        de_blocks=m.de_blocks,
        prompt_tokens=len(m.prompt),
        pe_engine=f"pe{m.pe_engine}",
        pe_node=f"node{m.pe_node}",
        de_engine=f"de{m.de_engine}",
        de_node=f"node{m.de_node}",
        pe_address=m.pe_address,
        de_address=m.de_address,
        oracle=m.oracle,
        attempt=m.attempt,
    )


def failure_kind(exc: BaseException) -> str:
    """How the router should treat a failure: `transfer` (a peer vanished or stalled: retry),
    `store` (the block store failed: report), or `error`."""
    if isinstance(exc, TransferError | LoadTimeout | LoadCancelled | TimeoutError):
        return "transfer"
    if isinstance(exc, StoreError):
        return "store"
    return "error"
