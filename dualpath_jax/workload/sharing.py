"""Prefixes shared between trajectories: content pieces, an index over them, the hits they imply.

A first round whose append is given as content pieces (`Round.pieces`, `(content id, tokens)`)
has tokens that depend only on its pieces (`trace.content_tokens`), so two first rounds share a
token prefix exactly as far as their pieces agree: every leading piece that is equal, plus, at the
first piece that differs, `min` of the two lengths when both are the same content (a shorter piece
of a content is a prefix of a longer one). Past that point the tokens are different contents'
(agreeing only by chance, about `1 / vocab_size` per token).

The store finds hits by content (`kvstore.identity`: a block key names its whole token prefix), so
a round may hit blocks another trajectory persisted. The hits a replay gets, in tokens:

- a later round of a trajectory hits what its own earlier rounds persisted (appendix A.3, every
  Full Block of the previous prompt and generation but the last generated token: `context_hit`);
- a first round hits the longest prefix it shares with the first round of a trajectory that
  finished before it was submitted, rounded down to whole store blocks (`prefix_hit`);
- both keep at least one token to compute (a hit covering the whole prompt loses a block).

`PrefixIndex` holds the first rounds seen so far; the simulator (`sim.agents`) keeps one to give
first rounds these hits, and `replay_hits` computes every round's hit for trajectories replayed
one after another (what a test compares with the cluster's `RoundResult.cached_tokens`).

Not counted (documented limits): a later round can also hit another trajectory's blocks past
its first round only if both trajectories begin with the same whole first append, so that the
model (greedy) generates the same tokens for both.
"""

from __future__ import annotations

from collections.abc import Sequence

from dualpath_jax.workload.trace import Trajectory

Piece = tuple[int, int]  # (content id, tokens)


def common_prefix(a: Sequence[Piece], b: Sequence[Piece]) -> int:
    """Tokens two piece sequences share from their start."""
    n = 0
    for (ca, na), (cb, nb) in zip(a, b):
        if ca != cb:
            break
        n += min(na, nb)
        if na != nb:
            break
    return n


class PrefixIndex:
    """The piece sequences added so far, as a trie: `longest(pieces)` is the most tokens `pieces`
    shares with any of them (`common_prefix`), in time linear in `len(pieces)`."""

    def __init__(self) -> None:
        self._child: dict[tuple[int, int, int], int] = {}  # (node, content, tokens) -> node
        self._longest: dict[tuple[int, int], int] = {}  # (node, content) -> longest piece added

    def add(self, pieces: Sequence[Piece]) -> None:
        node = 0
        for content, n in pieces:
            key = (node, content)
            if self._longest.get(key, 0) < n:
                self._longest[key] = n
            child = self._child.get((node, content, n))
            if child is None:
                child = self._child[(node, content, n)] = len(self._child) + 1
            node = child

    def longest(self, pieces: Sequence[Piece]) -> int:
        node, shared = 0, 0
        for content, n in pieces:
            m = self._longest.get((node, content), 0)
            child = self._child.get((node, content, n))
            if child is None:
                return shared + min(n, m)
            shared += n
            node = child
        return shared


def prefix_hit(shared: int, prompt: int, block_tokens: int) -> int:
    """Cached tokens of a `prompt`-token prompt whose first `shared` tokens are stored: whole
    store blocks only, less one block when they would cover the whole prompt."""
    blocks = min(shared, prompt) // block_tokens
    if blocks * block_tokens >= prompt:
        blocks -= 1
    return max(0, blocks) * block_tokens


def context_hit(prev_prompt: int, prev_gen: int, prompt: int, block_tokens: int) -> int:
    """Cached tokens of a later round: the Full Blocks its trajectory's previous round persisted
    (prompt + generation but the last generated token, whose KV is never computed)."""
    return prefix_hit(prev_prompt + prev_gen - 1, prompt, block_tokens)


def replay_hits(trajectories: Sequence[Trajectory], block_tokens: int) -> list[list[int]]:
    """Cached tokens of every round when the trajectories run one after another, in order (each
    finishes before the next starts), against a store that keeps every block."""
    index = PrefixIndex()
    out = []
    for t in trajectories:
        hits = []
        prev_prompt = prev_gen = context = 0
        for i, r in enumerate(t.rounds):
            prompt = context + r.append_len
            if i == 0:
                shared = index.longest(r.pieces) if r.pieces else 0
                hits.append(prefix_hit(shared, prompt, block_tokens))
            else:
                hits.append(context_hit(prev_prompt, prev_gen, prompt, block_tokens))
            prev_prompt, prev_gen = prompt, r.gen
            context = prompt + r.gen
        if t.rounds and t.rounds[0].pieces:
            index.add(t.rounds[0].pieces)
        out.append(hits)
    return out
