"""The base of every control message (engine/messages.py has the union and the envelope)."""

from __future__ import annotations

import msgspec


class Msg(msgspec.Struct, tag=True, kw_only=True):
    """Base of every control message (tagged by class name). `RoundResult` is one too, with the
    same options but not this base: the simulator, which sends nothing, keeps it as well."""
