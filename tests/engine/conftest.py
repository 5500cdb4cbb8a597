"""Fixtures of the router tests: routers driven in-process (router_rig.py), closed after each
test. A module with a `rig` of its own (another router setup) overrides the one here."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from router_rig import RouterRig, make_router_rig


@pytest.fixture()
def router_rig() -> Iterator[Callable[..., RouterRig]]:
    """`router_rig(store_wait_s=60.0, max_queue=100_000, **cluster)` -> a `RouterRig` with a PE and a DE
    registered (`make_router_rig`); every rig it made is closed after the test."""
    made: list[RouterRig] = []

    def make(**kw) -> RouterRig:
        made.append(make_router_rig(**kw))
        return made[-1]

    yield make
    for rig in made:
        rig.close()


@pytest.fixture()
def rig(router_rig) -> RouterRig:
    """A router with a PE and a DE registered that tries a round at most twice."""
    return router_rig(max_attempts=2)
