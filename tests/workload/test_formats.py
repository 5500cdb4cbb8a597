"""Mooncake traces and conversation files as trajectories: grouping, lengths, block-size rule,
arrival times, validation; the hits their shared prefixes imply, checked against the store's
content-addressed lookup over the materialized tokens and against the simulator."""

from __future__ import annotations

import dataclasses
import json
import pathlib

import numpy as np
import pytest

from dualpath_jax.config import ConfigError, WorkloadConfig, validate
from dualpath_jax.kvstore.identity import block_keys
from dualpath_jax.presets import emulated_cpu_experiment
from dualpath_jax.sched.cost import FittedCostModel
from dualpath_jax.sim import simulate
from dualpath_jax.workload.arrivals import build_trajectories, plan_agents, trace_arrivals
from dualpath_jax.workload.formats import (
    conversation_rounds,
    load_conversations,
    load_mooncake,
    message_tokens,
    parse_conversations,
    parse_mooncake,
)
from dualpath_jax.workload.sharing import PrefixIndex, common_prefix, prefix_hit, replay_hits
from dualpath_jax.workload.synthetic import load_workload
from dualpath_jax.workload.trace import (
    Round,
    TraceError,
    Trajectory,
    content_tokens,
    materialize,
    truncate,
)

DATA = pathlib.Path(__file__).parent / "data"
MOONCAKE = DATA / "mooncake_sample.jsonl"
CONVERSATIONS = DATA / "conversations_sample.json"
BT = 16  # store.block_tokens of the CPU configs
# The sample trace's blocks: 96 trace tokens x 1/4 = 24 tokens, 1.5 store blocks.
SAMPLE = dict(trace_block_tokens=96, length_scale=0.25)
CPU_COST = FittedCostModel(prefill=(0.02, 2e-5, 5e-9), decode=(0.005, 1e-4, 1e-8))


def mooncake_line(ts: float, n_in: int, n_out: int, ids: list[int]) -> str:
    return json.dumps(
        {"timestamp": ts, "input_length": n_in, "output_length": n_out, "hash_ids": ids}
    )


# ----------------------------------------------------------------------------- Mooncake


def test_mooncake_sessions_group_continuations_and_keep_first_arrivals():
    trajs, starts = load_mooncake(MOONCAKE, **SAMPLE)
    a, b, d = trajs
    # Line 1 (434 tokens: 4 whole blocks + 50 -> 4 x 24 + 12), continued by lines 3 and 5.
    assert a == Trajectory(
        "mooncake-1",
        (
            Round(108, 10, ((1, 24), (2, 24), (3, 24), (4, 24), (5, 12))),
            Round(128 - 108 - 10, 4),
            Round(154 - 128 - 4, 3),
        ),
    )
    # Line 2 shares the 3-block system prompt only: a trajectory of its own.
    assert b.id == "mooncake-2" and b.rounds == (
        Round(116, 5, ((1, 24), (2, 24), (3, 24), (10, 24), (11, 20))),
    )
    # Line 4 is 2 whole blocks (192 tokens), aligned: no partial block.
    assert d.rounds == (Round(48, 2, ((1, 24), (2, 24))),)
    assert starts == [0.0, 1000.0, 3000.0]


def test_mooncake_requests_mode_is_one_round_per_request():
    trajs, starts = load_mooncake(MOONCAKE, **SAMPLE, sessions=False)
    assert [t.id for t in trajs] == [f"mooncake-{i}" for i in range(1, 6)]
    assert all(len(t.rounds) == 1 for t in trajs)
    assert [t.rounds[0].append for t in trajs] == [108, 116, 128, 48, 154]
    assert starts == [0.0, 1000.0, 2000.0, 3000.0, 4000.0]


def test_the_sample_hits_are_what_the_hash_ids_imply():
    sessions, _ = load_mooncake(MOONCAKE, **SAMPLE)
    # A: cold; then its own context (A.3): 108 + 10 - 1 -> 7 blocks; 128 + 4 - 1 -> 8 blocks.
    # B shares blocks 1-3 = 72 tokens with A: 4 whole store blocks. D's whole aligned prompt
    # (48 tokens) is shared: one block is left to compute.
    assert replay_hits(sessions, BT) == [[0, 112, 128], [64], [32]]
    requests, _ = load_mooncake(MOONCAKE, **SAMPLE, sessions=False)
    # Request-level: line 3 shares blocks 1-4 with line 1 (96 tokens), line 5 blocks 1-4 and 6
    # with line 3 (120 tokens -> 112).
    assert replay_hits(requests, BT) == [[0], [64], [96], [32], [112]]


def test_a_prefix_other_conversations_share_does_not_group():
    # Lines 1 and 2 both end inside block 3 after the shared blocks 1-2; line 3 extends [1, 2]
    # too: [1, 2] is followed by several blocks, so nobody continues across it.
    lines = [
        mooncake_line(0, 1100, 40, [1, 2, 3]),
        mooncake_line(10, 1300, 20, [1, 2, 7]),
        mooncake_line(20, 1700, 30, [1, 2, 4, 5]),
        mooncake_line(30, 2100, 30, [1, 2, 4, 5, 6]),  # continues line 3 (after [1, 2, 4])
    ]
    trajs, starts = parse_mooncake(lines, length_scale=1 / 16)
    assert [(t.id, len(t.rounds)) for t in trajs] == [
        ("mooncake-1", 1),
        ("mooncake-2", 1),
        ("mooncake-3", 2),
    ]
    assert starts == [0.0, 0.01, 0.02]
    assert replay_hits(trajs, BT) == [[0], [64], [64, 96]]


def test_a_continuation_needs_more_input_than_the_context_it_extends():
    lines = [
        mooncake_line(0, 600, 200, [1, 2]),
        mooncake_line(5, 700, 10, [1, 9]),  # 700 < 600 + 200: a new trajectory
    ]
    trajs, _ = parse_mooncake(lines)
    assert [len(t.rounds) for t in trajs] == [1, 1]
    lines[1] = mooncake_line(5, 1100, 10, [1, 9, 8])
    (t,) = parse_mooncake(lines)[0]
    assert t.rounds[1] == Round(1100 - 800, 10)


def test_requests_are_taken_in_timestamp_order():
    lines = [mooncake_line(50, 100, 5, [4]), "", mooncake_line(20, 100, 5, [3])]
    trajs, starts = parse_mooncake(lines)
    assert [t.id for t in trajs] == ["mooncake-3", "mooncake-1"]
    assert starts == [0.0, 0.03]


@pytest.mark.parametrize(
    "block, scale, n_in, tokens, last",
    [
        (512, 1.0, 1100, 1100, 76),
        (512, 1 / 16, 1100, 69, 5),  # 32-token blocks; the 76-token tail -> 5
        (512, 1 / 16, 1024, 64, 32),  # aligned stays aligned
        (512, 1 / 512, 1100, 3, 1),  # 1-token blocks; a tail keeps at least 1 token
        (100, 0.24, 250, 60, 12),  # 24-token blocks (not a multiple of 16)
    ],
)
def test_lengths_scale_by_whole_trace_blocks(block, scale, n_in, tokens, last):
    ids = list(range(-(-n_in // block)))
    line = mooncake_line(0, n_in, 7, ids)
    ((t,), _) = parse_mooncake([line], trace_block_tokens=block, length_scale=scale)
    r = t.rounds[0]
    assert r.append == tokens and r.pieces[-1] == (ids[-1], last)
    assert r.gen == max(1, round(7 * scale))


@pytest.mark.parametrize(
    "line, message",
    [
        ("{not json", "line 2: not valid JSON"),
        ("[1]", "line 2: expected an object, got list"),
        (
            '{"timestamp": 0, "input_length": 5}',
            "line 2: missing key(s) ['output_length', 'hash_ids']",
        ),
        (mooncake_line(-1, 10, 1, [1]), "line 2: 'timestamp' must be >= 0, got -1"),
        (mooncake_line("0", 10, 1, [1]), "line 2: 'timestamp' must be a number, got '0'"),
        (mooncake_line(0, 0, 1, []), "line 2: 'input_length' must be >= 1, got 0"),
        (mooncake_line(0, 10.5, 1, [1]), "line 2: 'input_length' must be an int, got 10.5"),
        (mooncake_line(0, 10, True, [1]), "line 2: 'output_length' must be an int, got True"),
        (mooncake_line(0, 10, 1, [1, "x"]), "line 2: 'hash_ids' must be a list of ints"),
        (
            mooncake_line(0, 600, 1, [1]),
            "line 2: 1 hash_ids for input_length 600: at 512 tokens a block it needs 2",
        ),
    ],
)
def test_bad_mooncake_lines_name_the_line(line, message):
    with pytest.raises(TraceError) as e:
        parse_mooncake([mooncake_line(0, 10, 1, [1]), line])
    assert str(e.value).startswith(message), str(e.value)


def test_bad_mooncake_files_name_the_file(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text("\n\n")
    with pytest.raises(TraceError, match=r"t\.jsonl: the trace has no requests"):
        load_mooncake(path)


# ----------------------------------------------------------------------------- conversations


def test_conversations_become_trajectories():
    trajs = load_conversations(CONVERSATIONS)
    a, b, c = trajs  # chat-d has no reply: skipped
    system = a.rounds[0].pieces[0]
    assert system == b.rounds[0].pieces[0] and system[1] == 100  # 400 bytes / 4
    assert a.id == "chat-a" and [(r.append, r.gen) for r in a.rounds] == [(114, 6), (16, 3)]
    assert b.id == "chat-b" and [(r.append, r.gen) for r in b.rounds] == [(110, 10)]
    # A leading greeting is context; two replies in a row are one generation; the last
    # message has no reply and is dropped.
    assert c.id == "chat-c" and [(r.append, r.gen) for r in c.rounds] == [(6 + 7, 1 + 3)]
    assert replay_hits(trajs, BT) == [[0, 112], [96], [0]]


def test_conversation_lengths_and_ids():
    assert message_tokens("abcdefgh") == 2
    assert message_tokens("") == 1
    assert message_tokens("é" * 8, bytes_per_token=2.0) == 8  # UTF-8 bytes, not characters
    assert message_tokens("x" * 400, length_scale=0.25) == 25
    msgs = [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]
    text = "\n".join(json.dumps({"id": "same", "conversations": msgs}) for _ in range(3))
    text += "\n" + json.dumps({"conversations": msgs})  # JSONL, one without an id
    assert [t.id for t in parse_conversations(text)] == [
        "same",
        "same~1",
        "same~2",
        "conversation-3",
    ]
    # Roles are normalized: ShareGPT and OpenAI spellings give the same content.
    openai = conversation_rounds([("user", "hi"), ("assistant", "hello")])
    assert openai == conversation_rounds([("human", "hi"), ("gpt", "hello")])
    assert openai != conversation_rounds([("system", "hi"), ("gpt", "hello")])


def test_openai_content_parts_count_their_text():
    entry = {
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "abcd"}, {"type": "image"}]},
            {"role": "assistant", "content": None},
        ]
    }
    ((r,),) = [t.rounds for t in parse_conversations(json.dumps([entry]))]
    assert (r.append, r.gen) == (1, 1)


@pytest.mark.parametrize(
    "entry, message",
    [
        ("[1, 2]", "entry 1: expected an object"),
        ('{"id": "x"}', "entry 1 (id 'x'): needs 'conversations' (ShareGPT) or 'messages'"),
        ('{"id": [1], "messages": []}', "entry 1: 'id' must be a string or an int, got [1]"),
        ('{"id": 7, "messages": {}}', "entry 1 (id '7'): the messages must be a list"),
        ('{"conversations": [{"value": "a"}]}', "entry 1 (id 'conversation-1'): message 0 must"),
        (
            '{"conversations": [{"from": "", "value": "a"}]}',
            "message 0: 'from' must be a non-empty",
        ),
        (
            '{"conversations": [{"from": "human", "value": 3}]}',
            "message 0: the text must be a string",
        ),
        ('{"messages": [{"role": "user", "content": [3]}]}', "message 0: content parts must be"),
    ],
)
def test_bad_conversations_name_the_entry(entry, message):
    good = '{"conversations": [{"from": "human", "value": "a"}, {"from": "gpt", "value": "b"}]}'
    with pytest.raises(TraceError) as e:
        parse_conversations(f"[{good}, {entry}]")
    assert message in str(e.value), str(e.value)


def test_bad_conversation_files(tmp_path):
    with pytest.raises(TraceError, match=r"line 2: not valid JSON"):
        parse_conversations('[\n{"id": ]')
    with pytest.raises(TraceError, match=r"line 3: not valid JSON"):
        parse_conversations('{"messages": []}\n\n{oops')
    path = tmp_path / "c.json"
    path.write_text('[{"messages": [{"role": "user", "content": "q"}]}]')
    with pytest.raises(TraceError, match=r"c\.json: no conversation has an assistant reply"):
        load_conversations(path)


# ----------------------------------------------------------------------------- sharing


def test_equal_content_ids_give_equal_token_blocks():
    trajs, _ = load_mooncake(MOONCAKE, **SAMPLE, sessions=False)
    a, b = (materialize(t, 257, seed=3) for t in trajs[:2])
    assert a.rounds[0].append[:72] == b.rounds[0].append[:72]  # hash ids 1, 2, 3
    assert a.rounds[0].append[72:96] != b.rounds[0].append[72:96]  # 4 vs 10
    # A partial block is a prefix of the whole block of the same hash id.
    assert content_tokens(5, 12, 257, 3) == content_tokens(5, 24, 257, 3)[:12]
    assert content_tokens(5, 24, 257, 3) != content_tokens(5, 24, 257, 4)  # seeded


def test_the_prefix_index_finds_the_longest_shared_prefix():
    rng = np.random.default_rng(0)

    def pieces():  # few contents and lengths: many shared and partial prefixes
        return tuple(
            (int(rng.integers(3)), int(rng.integers(1, 4))) for _ in range(int(rng.integers(1, 5)))
        )

    index, added = PrefixIndex(), []
    for _ in range(300):
        p = pieces()
        assert index.longest(p) == max((common_prefix(p, q) for q in added), default=0)
        index.add(p)
        added.append(p)
        assert index.longest(p) == sum(n for _, n in p)


def test_common_prefix_counts_the_tokens_the_pieces_share():
    rng = np.random.default_rng(1)
    vocab = 2**20  # chance agreements are negligible
    for _ in range(200):
        a, b = (
            tuple((int(rng.integers(3)), int(rng.integers(1, 6))) for _ in range(3))
            for _ in range(2)
        )
        ta, tb = ([x for c, n in p for x in content_tokens(c, n, vocab, seed=0)] for p in (a, b))
        same = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), min(len(ta), len(tb)))
        assert common_prefix(a, b) == same


def store_replay_hits(trajs: list[Trajectory], vocab: int, seed: int) -> list[list[int]]:
    """The router's hits over a store that keeps every block: trajectories one after another,
    each round's generated tokens random (a stand-in for the model's)."""
    stored: set[str] = set()
    rng = np.random.default_rng(99)
    out = []
    for t in trajs:
        m = materialize(t, vocab, seed)
        context: list[int] = []
        hits = []
        for r in m.rounds:
            prompt = context + list(r.append)
            keys = block_keys(prompt, BT, "0" * 32)
            hit = next((i for i, k in enumerate(keys) if k not in stored), len(keys))
            if hit * BT >= len(prompt):
                hit -= 1
            hits.append(hit * BT)
            gen = rng.integers(0, vocab, r.gen).tolist()
            stored.update(block_keys(prompt + gen[:-1], BT, "0" * 32))
            context = prompt + gen
        out.append(hits)
    return out


@pytest.mark.parametrize("sessions", [True, False])
def test_replay_hits_equal_the_content_addressed_lookup(sessions):
    trajs, _ = load_mooncake(MOONCAKE, **SAMPLE, sessions=sessions)
    assert store_replay_hits(trajs, 257, seed=0) == replay_hits(trajs, BT)
    convs = load_conversations(CONVERSATIONS)
    assert store_replay_hits(convs, 257, seed=0) == replay_hits(convs, BT)


def test_truncation_cuts_the_pieces():
    t = load_mooncake(MOONCAKE, **SAMPLE, sessions=False)[0][0]
    cut = truncate(t, 60)
    assert cut.rounds[0].pieces == ((1, 24), (2, 24), (3, 2))
    assert cut.rounds[0].append == 50 and prefix_hit(50, 50, BT) == 48


# ----------------------------------------------------------------------------- configs


def cpu_config(**workload):
    cfg = emulated_cpu_experiment(1, 1, "tiny")
    w = dataclasses.replace(cfg.workload, max_len=0, max_turns=0, **workload)
    return validate(dataclasses.replace(cfg, workload=w))


def test_configs_read_every_format():
    cfg = cpu_config(trace=str(MOONCAKE), trace_format="mooncake", agents=3, **SAMPLE)
    trajs, times = load_workload(cfg.workload)
    assert [t.id for t in trajs] == ["mooncake-1", "mooncake-2", "mooncake-4"]
    assert times == [0.0, 1000.0, 3000.0]
    # Offline: every agent at t = 0; the materialized rounds share the hash ids' tokens.
    built, arrivals = build_trajectories(cfg)
    assert arrivals == [0.0] * 3
    assert built[0].rounds[0].append[:72] == built[1].rounds[0].append[:72]
    cfg = cpu_config(trace=str(CONVERSATIONS), trace_format="conversation", agents=3)
    assert [t.id for t in load_workload(cfg.workload)[0]] == ["chat-a", "chat-b", "chat-c"]
    assert load_workload(cfg.workload)[1] is None


def test_online_mooncake_arrives_at_its_timestamps():
    w = WorkloadConfig(mode="online", agents=2)
    assert trace_arrivals([0.0, 1.0, 3.0], w) == [0.0, 1.0]
    w = WorkloadConfig(mode="online", duration_s=1.5, agents=0)
    assert trace_arrivals([0.0, 1.0, 3.0], w) == [0.0, 1.0]
    # aps > 0: the trace's clock scaled to a mean rate of aps (2 gaps over 3 s -> 2 per s).
    w = WorkloadConfig(mode="online", aps=2.0, agents=3)
    assert trace_arrivals([0.0, 1.0, 3.0], w) == pytest.approx([0.0, 1 / 3, 1.0])
    cfg = cpu_config(
        trace=str(MOONCAKE), trace_format="mooncake", mode="online", aps=0.0, agents=8, **SAMPLE
    )
    trajs, arrivals = plan_agents(cfg)
    assert len(trajs) == 3 and arrivals == [0.0, 1000.0, 3000.0]  # no synthetic extra agents


def test_config_rules_for_trace_formats():
    with pytest.raises(ConfigError, match="workload.trace_format: must be one of"):
        cpu_config(trace="x", trace_format="sharegpt")
    with pytest.raises(ConfigError, match=r"workload.trace_format: needs a trace file"):
        cpu_config(trace_format="mooncake")
    with pytest.raises(ConfigError, match="workload.aps: must be > 0 in online mode"):
        cpu_config(trace="x", trace_format="conversation", mode="online")
    with pytest.raises(ConfigError, match="workload.trace_block_tokens: must be >= 1"):
        cpu_config(trace="x", trace_format="mooncake", trace_block_tokens=0)
    cpu_config(trace="x", trace_format="mooncake", mode="online")  # the trace's own times


# ----------------------------------------------------------------------------- simulator


def sim_hits(run) -> dict[str, list[int]]:
    """Each trajectory's cached tokens per round, from a simulation's results."""
    out: dict[str, list[int]] = {}
    for r in sorted(run.cluster.results, key=lambda r: (r.request, r.submit_s)):
        traj, _, turn = r.request.rpartition("/r")
        out.setdefault(traj.rsplit("/a", 1)[0], []).append((int(turn), r.cached_tokens))
    return {k: [c for _, c in sorted(v)] for k, v in out.items()}


@pytest.mark.parametrize("sessions", [True, False])
def test_the_simulator_reports_the_mooncake_hits(sessions):
    # Online at the trace's own timestamps, 1000 s apart: each trajectory ends before the next.
    cfg = cpu_config(
        trace=str(MOONCAKE),
        trace_format="mooncake",
        trace_sessions=sessions,
        mode="online",
        agents=8,
        **SAMPLE,
    )
    run = simulate(cfg, cost=CPU_COST)
    assert run.summary["errors"] == 0
    trajs, _ = plan_agents(cfg)
    assert sim_hits(run) == dict(zip([t.id for t in trajs], replay_hits(trajs, BT)))


def test_the_simulator_reports_the_conversation_hits():
    cfg = cpu_config(
        trace=str(CONVERSATIONS), trace_format="conversation", agents=3, length_scale=1.0
    )
    trajs, _ = plan_agents(cfg)
    run = simulate(cfg, cost=CPU_COST, trajectories=trajs, arrivals=[0.0, 1000.0, 2000.0])
    assert sim_hits(run) == {"chat-a": [0, 112], "chat-b": [96], "chat-c": [0]}
    # Started together, nothing is finished when the first rounds look up: no shared hits.
    together = simulate(cfg, cost=CPU_COST, trajectories=trajs)
    assert sim_hits(together)["chat-b"] == [0]
