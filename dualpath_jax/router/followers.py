"""Group sampling's followers, for the router's sessions part: rounds of one prompt that decode
from another round's prompt pages instead of prefilling the prompt again.

A round names the round it follows (`Submit.follows`, as `Client.submit_group` sends its
samples; under `scheduler.fork_identical` the first round of the same prompt still in flight).
Whether it follows is settled when it is admitted, not when its own store lookup answers (a
follower needs no lookup to fork): if its leader is still being admitted, it is parked until
that admission ends (`park`, `admitted`), so a group's samples fork however slowly the store
answers and in whichever order the lookups come back. It follows a leader whose first token
has not come, that follows nobody, of the same prompt (`followable`); it then waits on it
(`add`) and goes with its first token to its DE (`take`). Otherwise it runs on its own.
"""

from __future__ import annotations

from collections.abc import Callable

from dualpath_jax.router.sessions import RequestState
from dualpath_jax.wire import messages


def lookup_failed(_: Exception) -> None:
    """A follower's lookup failed: were it to run on its own, it reads nothing."""


class Followers:
    """Who follows whom: `of[leader]` the rounds waiting on `leader`'s first token, `following`
    their ids, `open_prompts` (`fork_identical`) the round each prompt's later rounds follow,
    `parked[leader]` what goes on once `leader`'s admission ended."""

    def __init__(self, fork_identical: bool):
        self.fork_identical = fork_identical
        self.of: dict[str, list[RequestState]] = {}
        self.following: set[str] = set()  # (a follower leads nobody)
        self.open_prompts: dict[int, str] = {}  # prompt hash -> request id
        self.parked: dict[str, list[Callable[[], None]]] = {}

    def named(self, msg: messages.Submit, prompt: list[int]) -> str:
        """The round `msg`'s round asks to follow ("" if none). Under `fork_identical` a round
        naming none leads the later rounds of its prompt while it is the first in flight."""
        if msg.follows:
            return msg.follows
        if not self.fork_identical:
            return ""
        h = hash(tuple(prompt))
        leader = self.open_prompts.setdefault(h, msg.request)
        return "" if leader == msg.request else leader

    def park(self, leader: str, go_on: Callable[[], None]) -> None:
        """`go_on()` once `leader`'s admission ended (`admitted`)."""
        self.parked.setdefault(leader, []).append(go_on)

    def admitted(self, request: str, in_flight: bool) -> None:
        """`request`'s admission ended, the round `in_flight` or not: the rounds parked on it go
        on; if it did not start, later rounds of its prompt do not name it."""
        if not in_flight:
            self._close_prompt(request)
        for go_on in self.parked.pop(request, []):
            go_on()

    def followable(self, leader: RequestState | None, prompt: list[int]) -> bool:
        """Whether a round of `prompt` can follow `leader` now."""
        return (
            leader is not None
            and leader.first_token < 0
            and leader.id not in self.following
            and leader.prompt == prompt
        )

    def add(self, leader: RequestState, st: RequestState) -> None:
        self.of.setdefault(leader.id, []).append(st)
        self.following.add(st.id)
        st.follows = leader.id

    def waiting(self, request: str, requests: dict[str, RequestState]) -> list[RequestState]:
        """Round `request`'s followers still in flight, waiting for its first token."""
        return [f for f in self.of.get(request, ()) if requests.get(f.id) is f]

    def take(self, st: RequestState, requests: dict[str, RequestState]) -> list[RequestState]:
        """`st` has its first token (or ended): its followers stop waiting on it (those still in
        flight are returned) and later rounds of its prompt no longer follow it."""
        live = self.waiting(st.id, requests)
        for f in self.of.pop(st.id, []):
            self.following.discard(f.id)
        self._close_prompt(st.id)
        return live

    def release(self, st: RequestState, requests: dict[str, RequestState]) -> list[RequestState]:
        """`st` ended before its first token (it follows nobody any more): its followers still
        in flight, returned, run on their own."""
        self.following.discard(st.id)
        back = self.take(st, requests)
        for f in back:
            f.follows = ""  # (it prefills its own prompt)
        return back

    def _close_prompt(self, request: str) -> None:
        if self.open_prompts:
            for h in [h for h, r in self.open_prompts.items() if r == request]:
                del self.open_prompts[h]
