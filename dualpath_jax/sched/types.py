"""Value objects of the scheduler: requests, engine loads, cluster snapshots and assignments.

Everything here is frozen. The router and the simulator build these from their own state (load
reports, queues) and pass them to the pure scheduling cores in `inter.py` and `intra.py`, which
return new values instead of mutating anything.

Identifiers: engine ids and node ids are plain ints, unique across both roles (a PE and a DE never
share an id, and neither do a prefill node and a decode node). Token counts are ints.

The values made per request or per fetch (`Request`, `EngineLoad`, `Assignment`, `FetchResult`)
spell out their `__init__` (`init=False`, fields set with `object.__setattr__`, as the generated
one does): the compiled core (`dualpath_jax.native`) compiles a written `__init__` but runs a
generated one as interpreted code, about 20 times slower per object, and the simulator makes
millions (generated ones cost a compiled simulation 25-30% more CPU: docs/results.md, "Simulator
speed"). Fields, order, defaults, equality, hashing and `dataclasses.replace` are unchanged.
"""

from __future__ import annotations

import dataclasses
import enum
import math


class ReadPath(enum.StrEnum):
    """Where a request's hit KV is read from storage (paper Fig. 4)."""

    PE = "pe"  # storage -> PE buffer (storage link of the PE node)
    DE = "de"  # storage -> DE buffer (storage link of the DE node), then DE buffer -> PE per layer
    SPLIT = "split"  # the hit blocks are divided between both sides (beyond the paper)
    NONE = "none"  # nothing is read: no hit, or the Oracle policy


@dataclasses.dataclass(frozen=True, slots=True, init=False)
class Request:
    """One round of one trajectory, as the scheduler sees it.

    Lifecycle: created by the router when a client submits round `turn` of `trajectory`; queued;
    assigned a (PE, DE, read path); prefilled; decoded; finished. The prompt is
    `A_1 G_1 ... A_turn` (appendix A.3); `cached_tokens` of it have KV in storage (the hit, a
    prefix) and the rest, `new_tokens`, is computed by the PE. Exactly `gen_tokens` are generated.

    `tokens` (the paper's `len(r)` / `tokens(r)`) is the prompt length: it is what `tok_e` counts.
    `hbm_tokens` is what a DE must hold once decoding ends (prompt + generated tokens).
    """

    id: str
    trajectory: str
    turn: int
    prompt_tokens: int
    cached_tokens: int
    gen_tokens: int

    def __init__(
        self,
        id: str,
        trajectory: str,
        turn: int,
        prompt_tokens: int,
        cached_tokens: int,
        gen_tokens: int,
    ) -> None:
        object.__setattr__(self, "id", id)
        object.__setattr__(self, "trajectory", trajectory)
        object.__setattr__(self, "turn", turn)
        object.__setattr__(self, "prompt_tokens", prompt_tokens)
        object.__setattr__(self, "cached_tokens", cached_tokens)
        object.__setattr__(self, "gen_tokens", gen_tokens)
        if self.prompt_tokens < 1:
            raise ValueError(
                f"request {self.id}: prompt_tokens must be >= 1, got {self.prompt_tokens}"
            )
        if not 0 <= self.cached_tokens <= self.prompt_tokens:
            raise ValueError(
                f"request {self.id}: cached_tokens {self.cached_tokens} outside [0, {self.prompt_tokens}]"
            )
        if self.gen_tokens < 1:
            raise ValueError(f"request {self.id}: gen_tokens must be >= 1, got {self.gen_tokens}")

    @property
    def new_tokens(self) -> int:
        """Prompt tokens whose KV the PE computes (the miss)."""
        return self.prompt_tokens - self.cached_tokens

    @property
    def tokens(self) -> int:
        """The paper's len(r): the prompt length, what `tok_e` and Z count."""
        return self.prompt_tokens

    @property
    def hbm_tokens(self) -> int:
        """KV tokens a DE must have room for: prompt plus every generated token."""
        return self.prompt_tokens + self.gen_tokens

    def cached_blocks(self, block_tokens: int) -> int:
        """Storage blocks holding the hit KV (the last one may be partial)."""
        return -(-self.cached_tokens // block_tokens)


@dataclasses.dataclass(frozen=True, slots=True, init=False)
class EngineLoad:
    """One engine's load report (paper 6.1), sent by its group leader when the group fetches.

    `seq_e`: unfinished requests assigned to the engine; `tok_e`: their total tokens; `read_q`:
    the storage read queue of the engine's node in tokens (every engine of a node reports the same
    value); `free_hbm_tokens`: KV tokens the engine can still admit (DEs; unused for PEs).
    """

    engine: int
    node: int
    group: int
    seq_e: int = 0
    tok_e: int = 0
    read_q: int = 0
    free_hbm_tokens: int = 0

    def __init__(
        self,
        engine: int,
        node: int,
        group: int,
        seq_e: int = 0,
        tok_e: int = 0,
        read_q: int = 0,
        free_hbm_tokens: int = 0,
    ) -> None:
        object.__setattr__(self, "engine", engine)
        object.__setattr__(self, "node", node)
        object.__setattr__(self, "group", group)
        object.__setattr__(self, "seq_e", seq_e)
        object.__setattr__(self, "tok_e", tok_e)
        object.__setattr__(self, "read_q", read_q)
        object.__setattr__(self, "free_hbm_tokens", free_hbm_tokens)


@dataclasses.dataclass(frozen=True, slots=True)
class ClusterView:
    """A frozen snapshot of every engine's last report plus the scheduler constants.

    `alpha`: short read-queue threshold (tokens); `beta`: overload threshold on `tok_e` (tokens);
    `z_factor`: the 1.05 of Z; `pe_read_rate` / `de_read_rate`: tokens per second one prefill /
    decode node reads from storage (only their ratio matters; used by the split read path).
    """

    pe: tuple[EngineLoad, ...] = ()
    de: tuple[EngineLoad, ...] = ()
    alpha: float = math.inf
    beta: float = math.inf
    z_factor: float = 1.05
    pe_read_rate: float = 1.0
    de_read_rate: float = 1.0

    def group(self, role: str, group: int) -> tuple[EngineLoad, ...]:
        """The loads of one PE or DE group, in snapshot order."""
        loads = self.pe if role == "pe" else self.de
        return tuple(x for x in loads if x.group == group)

    def node_read_q(self) -> dict[int, int]:
        """Read queue of every node seen in the snapshot."""
        return {x.node: x.read_q for x in (*self.pe, *self.de)}


@dataclasses.dataclass(frozen=True, slots=True, init=False)
class Assignment:
    """The scheduler's decision for one request: its PE, its DE and how its hit KV is read.

    The hit's first `recompute_blocks` blocks are recomputed by the PE (load or recompute; all of
    them for a wholly recomputed hit, whose path is NONE and which reads nothing); the rest are
    read: `recompute_blocks + pe_read_blocks + de_read_blocks` == the request's cached blocks,
    except for the Oracle policy (nothing is read or recomputed). The PE reads its blocks first
    in prefix order: after the recomputed lead, `pe_read_blocks` via the PE node, then
    `de_read_blocks` via the DE node. Of the blocks of its one read side (`path` PE or DE),
    the first `held_blocks` are already in that node's memory (a tool-gap prefetch,
    `sched.prefetch`): not read again.
    """

    request: Request
    pe: int
    de: int
    path: ReadPath
    pe_read_blocks: int = 0
    de_read_blocks: int = 0
    recompute_blocks: int = 0
    held_blocks: int = 0

    def __init__(
        self,
        request: Request,
        pe: int,
        de: int,
        path: ReadPath,
        pe_read_blocks: int = 0,
        de_read_blocks: int = 0,
        recompute_blocks: int = 0,
        held_blocks: int = 0,
    ) -> None:
        object.__setattr__(self, "request", request)
        object.__setattr__(self, "pe", pe)
        object.__setattr__(self, "de", de)
        object.__setattr__(self, "path", path)
        object.__setattr__(self, "pe_read_blocks", pe_read_blocks)
        object.__setattr__(self, "de_read_blocks", de_read_blocks)
        object.__setattr__(self, "recompute_blocks", recompute_blocks)
        object.__setattr__(self, "held_blocks", held_blocks)


@dataclasses.dataclass(frozen=True, slots=True, init=False)
class FetchResult:
    """What one group fetch decided.

    `assigned`: `(request, engine id)` in assignment order; it is always the first `taken`
    requests of the queue, in queue order (FIFO). `loads`: the group's loads after the fetch, in
    the order they were given, with `seq_e`/`tok_e` (and for DEs `free_hbm_tokens`) updated.
    `cursor`: the round-robin position for the next fetch (round-robin policies only).
    `z`: the DE high-token threshold Z used by a DE phase-2 fetch (0 otherwise).
    """

    assigned: tuple[tuple[Request, int], ...]
    loads: tuple[EngineLoad, ...]
    cursor: int = 0
    z: float = 0.0

    def __init__(
        self,
        assigned: tuple[tuple[Request, int], ...],
        loads: tuple[EngineLoad, ...],
        cursor: int = 0,
        z: float = 0.0,
    ) -> None:
        object.__setattr__(self, "assigned", assigned)
        object.__setattr__(self, "loads", loads)
        object.__setattr__(self, "cursor", cursor)
        object.__setattr__(self, "z", z)

    @property
    def taken(self) -> int:
        return len(self.assigned)
