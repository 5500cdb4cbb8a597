"""The simulated cluster's block store when it has a capacity (`store.capacity_bytes > 0`).

Which leading blocks of a round's hit are still stored is decided by the block index of the real
store (`kvstore.index.BlockIndex`) on the simulated clock, so eviction, and session retention
with `store.eviction="retention"`, run the same code as on the local cluster. Each agent's
session is told what the router tells the decode engines' stores: active when a round is
submitted, idle for `store.retention_ttl_s` when it finishes, ended after its last round. The DE
persists a finished round's whole chain (blocks it recomputed because they had been evicted
included) and claims it for the session.

Keys name what a real hash chain names: a block inside a first round given as content pieces
(Mooncake and conversation traces) is named by the pieces it covers, so trajectories that share
them share its key; every other block is private to its agent. Without a capacity the simulator
keeps every block (no `SimBlockStore`), as before.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

from dualpath_jax.kvstore.index import BlockIndex
from dualpath_jax.workload.trace import cut_pieces

Pieces = tuple[tuple[int, int], ...]


class SimBlockStore:
    """A capacity-limited store of Full Blocks of `block_bytes` each, counted in `counters`
    (`store_hit_tokens`: hits found; `store_lost_tokens`: hits an unlimited store would have had
    but that were evicted; `store_evictions`: blocks evicted)."""

    def __init__(
        self,
        capacity_bytes: int,
        block_bytes: int,
        block_tokens: int,
        policy: str,
        ttl_s: float,
        clock: Callable[[], float],
        counters: dict[str, int],
    ):
        self.index = BlockIndex(capacity_bytes, policy, clock)
        self.nbytes = block_bytes
        self.bt = block_tokens
        self.ttl_s = ttl_s
        self.counters = counters
        self._keys: dict[int, list[str]] = {}  # agent -> its chain's keys so far

    def keys(self, agent: int, pieces: Pieces, n: int) -> list[str]:
        """The first `n` block keys of `agent`'s chain."""
        keys = self._keys.setdefault(agent, [])
        shared = sum(k for _, k in pieces) // self.bt
        while len(keys) < n:
            i = len(keys)
            if i < shared:
                cover = repr(cut_pieces(pieces, (i + 1) * self.bt)).encode()
                keys.append("c" + hashlib.blake2b(cover, digest_size=12).hexdigest())
            else:
                keys.append(f"a{agent}:{i}")
        return keys[:n]

    def begin(self, agent: int, session: str, pieces: Pieces, hit_tokens: int) -> int:
        """A round of `session` is submitted whose hit an unlimited store would hold is
        `hit_tokens`: returns the hit tokens still stored (touched, as the lookup does)."""
        keys = self.keys(agent, pieces, hit_tokens // self.bt)
        found = self.index.prefix(keys)
        self.index.touch(keys[:found], self.nbytes)
        self.index.retain(session, "active")
        self.counters["store_hit_tokens"] += found * self.bt
        self.counters["store_lost_tokens"] += hit_tokens - found * self.bt
        return found * self.bt

    def end(self, agent: int, session: str, pieces: Pieces, n_full: int, last: bool) -> None:
        """The round's DE persisted the `n_full` Full Blocks of its context; the session is idle
        (in a tool call) or, after its `last` round, ended."""
        keys = self.keys(agent, pieces, n_full)
        _, evicted = self.index.admit(keys, self.nbytes)
        self.index.claim(session, keys)
        self.counters["store_evictions"] += len(evicted)
        self.index.retain(session, "ended" if last else "idle", 0, self.ttl_s)
