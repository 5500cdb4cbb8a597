"""What an engine's fetches carry of its link counters (`engines.common.LinkReports`): while
busy, their snapshot at most once every `LINKS_EVERY_S`, nothing in between, which the router
takes as "unchanged" (it keeps the last snapshot it got); while idle, every change at once."""

from __future__ import annotations

import json

from router_rig import DE, DE_ID

from dualpath_jax.engines.common import LINKS_EVERY_S, LinkReports
from dualpath_jax.wire import messages


class _Traffic:
    def __init__(self) -> None:
        self.snapshots = 0

    def snapshot(self) -> dict:
        self.snapshots += 1
        return {"links": {"h2d:de1": {"bytes": self.snapshots}}}


def test_a_snapshot_at_most_every_interval():
    traffic = _Traffic()
    reports = LinkReports(every_s=1.0)
    assert json.loads(reports.due(traffic, 10.0)) == {"links": {"h2d:de1": {"bytes": 1}}}
    assert [reports.due(traffic, t) for t in (10.005, 10.5, 10.999)] == ["", "", ""]
    assert json.loads(reports.due(traffic, 11.0))["links"]["h2d:de1"]["bytes"] == 2
    assert traffic.snapshots == 2  # none taken for the fetches in between
    assert LinkReports().due(None, 0.0) == "" and LINKS_EVERY_S == 1.0


class _Counters:
    def __init__(self) -> None:
        self.bytes = 0

    def snapshot(self) -> dict:
        return {"links": {"snic_tx:node0": {"bytes": self.bytes}}}


def test_an_idle_engine_reports_each_change_at_once():
    traffic = _Counters()
    reports = LinkReports(every_s=1.0)
    assert reports.due(traffic, 10.0, busy=True)  # the first fetch's
    traffic.bytes = 4096  # a round's blocks persisted
    assert reports.due(traffic, 10.1, busy=True) == ""  # busy: waits for its interval
    assert json.loads(reports.due(traffic, 10.2, busy=False))["links"]["snic_tx:node0"] == {
        "bytes": 4096
    }  # idle: the run's last bytes reach the router's stats now
    assert reports.due(traffic, 10.3, busy=False) == ""  # nothing new
    traffic.bytes = 8192
    assert json.loads(reports.due(traffic, 10.31, busy=False))["links"]["snic_tx:node0"] == {
        "bytes": 8192
    }


def test_the_router_keeps_the_last_links_a_fetch_carried(rig):
    load = messages.Load(hbm_capacity_tokens=10_000, slots=2)
    rig.handle(messages.Fetch(engine=DE, load=load, links='{"links": {"h2d:de1": {}}}'), DE_ID)
    rig.handle(messages.Fetch(engine=DE, load=load, links=""), DE_ID)
    assert rig.router.stats()["engines"][str(DE)]["links"] == {"links": {"h2d:de1": {}}}
