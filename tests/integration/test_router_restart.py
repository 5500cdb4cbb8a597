"""The router process killed and started again over running engines (`LocalCluster.restart(
"router")`): the engines register with the new one, a client reconnects by itself (the round
the old router had taken fails with kind `connection`, not a hang), the params an update made
are still served, and a session opened again is served the reference tokens, its earlier
rounds' KV hit in the store. Engine processes: the full tier."""

from __future__ import annotations

import time

import pytest
from test_cluster import RESULT_TIMEOUT_S, cluster_config, make_trajectories

from dualpath_jax.model.transformer import init_model
from dualpath_jax.presets import TINY_QWEN2
from dualpath_jax.rollout import RolloutError, Session

TRAJ = make_trajectories("restart", n=1, rounds=3, seed=21, gen=(6, 9))[0]


@pytest.mark.multiprocess
def test_a_restarted_router_is_rejoined_by_engines_and_clients(
    tmp_path, start_cluster, reference_tokens
):
    expected = reference_tokens(TRAJ)
    rounds = TRAJ[1]
    # The engines wait this long for a silent router before they stop themselves.
    cfg = cluster_config("dualpath", heartbeat_timeout_s=30.0)
    with start_cluster(cfg, tmp_path) as cluster:
        client = cluster.client()
        # the same weights under a new version: the restarted router must serve it too (and
        # so key its blocks as the old one did)
        version = client.update_params(init_model(TINY_QWEN2, seed=0), "v-restart")
        s = Session(client, "before")
        assert s.step(*rounds[0], timeout_s=RESULT_TIMEOUT_S) == expected[0]
        old = client.stats()
        assert old["params_version"] == version

        # a long round in flight when the router dies
        in_flight = client.submit("before", [5] * 20, 400)
        time.sleep(0.5)
        cluster.kill("router")
        cluster.restart("router")
        with pytest.raises(RolloutError) as err:
            in_flight.result(RESULT_TIMEOUT_S)  # lost with the old router: fails, never hangs
        assert err.value.kind == "connection"

        new = client.stats()  # the same client, reconnected
        assert new["epoch"] != old["epoch"] and client.router_restarts >= 1
        assert new["params_version"] == version  # what the engines serve, not the config's
        assert sorted(e["alive"] for e in new["engines"].values()) == [True, True]
        assert new["counters"].get("rejoin_orders", 0) >= 1

        # the old session is gone; opened again with its context, its stored KV is hit
        again = Session(client, "before")
        context = [*rounds[0][0], *expected[0], *rounds[1][0]]
        res = again.step_async(context, rounds[1][1]).result(RESULT_TIMEOUT_S)
        assert list(res.tokens) == expected[1] and res.cached_tokens > 0
        assert again.step(*rounds[2], timeout_s=RESULT_TIMEOUT_S) == expected[2]
