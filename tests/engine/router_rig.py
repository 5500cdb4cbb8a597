"""The router rig of this directory's tests: a `Router` (or one of its parts) fed messages
in-process, with a fake clock and no engines, every message it sends recorded.

`make_router_rig` builds a router over a memory store with one prefill engine (`PE`, connection
`PE_ID`) and one decode engine (`DE`, `DE_ID`) registered; a test then plays the engines and a
client (`CLIENT`) by handing it messages (`RouterRig.handle`) and reads what it answered. The
`router_rig` and `rig` fixtures of conftest.py make one that is closed after the test. The
router's parts alone (tests/engine/test_router_parts.py) take the same `config`, `Clock`,
`Recorder` and `registration`.

A module, not conftest.py itself: test modules import these names, and `from conftest import`
finds whichever conftest came first (tests/conftest.py).
"""

from __future__ import annotations

import dataclasses

from dualpath_jax.config import ClusterConfig, ExperimentConfig, Policy, StoreConfig
from dualpath_jax.kvstore.store import open_block_store
from dualpath_jax.presets import TINY_QWEN2
from dualpath_jax.router.router import Router
from dualpath_jax.sched.scheduler import GlobalScheduler
from dualpath_jax.wire import frames, messages
from dualpath_jax.wire.rpc import RpcServer

BT = 16  # tokens per block
PE, DE = 0, 1  # the engines a rig registers ...
PE_ID, DE_ID, CLIENT = b"pe0", b"de1", b"client"  # ... their connections, and a client's

Sent = list[tuple[bytes, messages.Msg]]  # (recipient, message) of each send


class Clock:
    """A clock that stands still until a test moves `t`."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class Recorder:
    """A server that records what is sent (all an `Outbox` does with its server)."""

    def __init__(self) -> None:
        self.sent: Sent = []

    def send(self, ident: bytes, msg: messages.Msg) -> None:
        self.sent.append((ident, msg))

    def to(self, ident: bytes) -> list[messages.Msg]:
        return [m for i, m in self.sent if i == ident]


def config(**cluster) -> ExperimentConfig:
    """The tiny Qwen2 over a memory store of `BT`-token blocks, with `cluster` fields set."""
    return ExperimentConfig(
        model=TINY_QWEN2,
        store=StoreConfig(kind="memory", block_tokens=BT),
        cluster=ClusterConfig(decode_max_len=256, **cluster),
    )


def registration(engine: int, role: str, pid: int = 7, **kw) -> messages.Register:
    """The `Register` of engine `engine` (`role`), on node `engine`, at `inproc://{engine}`."""
    return messages.Register(
        role=role, engine=engine, node=engine, group=0, address=f"inproc://{engine}", pid=pid, **kw
    )


def only(sent: Sent, kind: type) -> Sent:
    """The sends of messages of type `kind`."""
    return [(ident, m) for ident, m in sent if isinstance(m, kind)]


@dataclasses.dataclass
class RouterRig:
    """A router that sends into `sent`, on `clock`. Every answer a rig returns leaves out
    session retention (`Retain`, tests/engine/test_router_retention.py)."""

    router: Router
    sent: Sent
    clock: Clock

    def sends(self, msg: messages.Msg, ident: bytes = CLIENT, role: str = frames.ENGINE) -> Sent:
        """Hands the router `msg` from connection `ident` (its frame carrying `role`'s secret);
        returns (recipient, message) of what it sent in answer."""
        self.sent.clear()
        self.router.handle(ident, msg, role)
        return [(i, m) for i, m in self.sent if not isinstance(m, messages.Retain)]

    def handle(
        self, msg: messages.Msg, ident: bytes = CLIENT, role: str = frames.ENGINE
    ) -> list[messages.Msg]:
        """`sends`, the messages alone (to whomever)."""
        return [m for _, m in self.sends(msg, ident, role)]

    def to(self, ident: bytes) -> list[messages.Msg]:
        """What the last handled message made the router send to `ident`."""
        return [m for i, m in self.sent if i == ident and not isinstance(m, messages.Retain)]

    def submit(self, session: str, request: str, gen: int = 3) -> None:
        """A client opens `session` and submits round `request` of three tokens (queued)."""
        assert self.handle(messages.OpenSession(session=session), role=frames.CLIENT) == [
            messages.Ack(ref=session)
        ]
        assert self.handle(messages.Submit(request=request, session=session, append=[1, 2, 3], gen=gen),
                           role=frames.CLIENT) == []  # fmt: skip

    def fetch(self, engine: int, slots: int = 2) -> Sent:
        """Engine `engine` (`PE` or `DE`) fetches; returns everything the router sent."""
        ident = PE_ID if engine == PE else DE_ID
        load = (
            messages.Load(hbm_capacity_tokens=10_000, slots=slots)
            if engine == DE
            else messages.Load()
        )
        self.handle(messages.Fetch(engine=engine, load=load), ident)
        return list(self.sent)

    def assign(self) -> list[messages.LoadJobMsg]:
        """DE then PE fetch: the jobs the DE got."""
        self.fetch(DE)
        sent = self.fetch(PE)
        return [j for i, m in sent if i == DE_ID and isinstance(m, messages.Work) for j in m.jobs]

    def close(self) -> None:
        self.router.server.close()
        self.router.store.close()


def make_router_rig(store_wait_s: float = 60.0, max_queue: int = 100_000, **cluster) -> RouterRig:
    """A router (`config(**cluster)`) with `PE` and `DE` registered and one liveness tick done;
    its scheduler queues at most `max_queue` rounds and holds at most a DE's slots plus its
    queue on a DE. Close it (`close`)."""
    cfg = config(**cluster)
    c = cfg.cluster
    server = RpcServer("127.0.0.1", 0)
    store = open_block_store(cfg.store, cfg.model)
    clock = Clock()
    sched = GlobalScheduler(
        Policy.DUALPATH, max_queue=max_queue, de_max_seqs=c.decode_slots + c.decode_queue
    )
    router = Router(cfg, server, store, sched, clock=clock, store_wait_s=store_wait_s)
    sent: Sent = []
    server.send = lambda ident, msg: sent.append((ident, msg))  # type: ignore[method-assign]
    rig = RouterRig(router, sent, clock)
    for engine, role, ident in ((PE, "prefill", PE_ID), (DE, "decode", DE_ID)):
        rig.handle(registration(engine, role, pid=100 + engine), ident)
    rig.router.tick(clock())
    return rig
