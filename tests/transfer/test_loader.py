"""The dual-path loader delivers byte-identical KV on every path, and charges each link exactly."""

from __future__ import annotations

import dataclasses
from concurrent import futures

import jax.numpy as jnp
import numpy as np
import pytest

from dualpath_jax.config import HardwareConfig, StoreConfig
from dualpath_jax.copies import COPIES
from dualpath_jax.kvstore.buffers import HostBufferPool
from dualpath_jax.kvstore.identity import block_keys, key_path, model_fingerprint
from dualpath_jax.kvstore.store import open_block_store
from dualpath_jax.model.cached_kv import DevicePages, LayerPages
from dualpath_jax.model.layout import BlockLayout, kv_to_full_blocks
from dualpath_jax.model.runner import ModelRunner, PrefillBatch
from dualpath_jax.model.transformer import init_model
from dualpath_jax.presets import TINY_QWEN2
from dualpath_jax.transfer import links, paths
from dualpath_jax.transfer.decode_load import DecodeLoad
from dualpath_jax.transfer.inprocess_channel import InProcessChannel, InProcessFabric
from dualpath_jax.transfer.loader import LoaderContext, LoadJob
from dualpath_jax.transfer.prefill_load import DeviceRows, PrefillLoad
from dualpath_jax.transfer.traffic import TrafficManager

BT = 16
CFG = TINY_QWEN2


@pytest.fixture(scope="module")
def runner():
    return ModelRunner(init_model(CFG, seed=0))


@pytest.fixture(scope="module")
def prompt_and_kv(runner):
    """A 70-token prompt (4 full blocks + 6) and its reference KV rows [L, 70, W]."""
    prompt = np.random.RandomState(0).randint(0, CFG.vocab_size, 70).tolist()
    _, kv = runner.prefill_monolithic(PrefillBatch.build(CFG, [prompt], [0]))
    return prompt, np.asarray(kv[:, 0, :70])


class Cluster:
    """A PE and a DE half in one process: one store, two buffers, two channels, one
    TrafficManager (each half charges only its own links)."""

    def __init__(self, hw: HardwareConfig, store_root=None, memory="pinned_host"):
        self.store = open_block_store(StoreConfig(kind="memory", block_tokens=BT), CFG)
        layout = BlockLayout.for_model(CFG, BT)
        self.fabric = InProcessFabric()
        self.traffic = TrafficManager(hw)
        self.pool = futures.ThreadPoolExecutor(16)

        def ctx(name, owners):
            return LoaderContext(
                CFG,
                layout,
                self.store,
                HostBufferPool(layout, 64, name, memory=memory),
                InProcessChannel(self.fabric, name),
                self.traffic,
                self.pool,
                20.0,
                frozenset(owners),
            )

        self.pe = ctx("pe0", {"pe0", "node0"})
        self.de = ctx("de1", {"de1", "node1"})

    def job(
        self, request: str, keys, pe_blocks: int, de_blocks: int, prompt_tokens: int, **kw
    ) -> LoadJob:
        """Request `request`'s load from PE pe0 (node0) to DE de1 (node1), at their channels
        (`de_address` overrides the DE's); `kw`: more `LoadJob` fields."""
        kw.setdefault("de_address", self.de.channel.address)
        return LoadJob(
            request, tuple(keys), pe_blocks, de_blocks, prompt_tokens, "pe0", "node0", "de1",
            "node1", self.pe.channel.address, **kw,
        )  # fmt: skip

    def close(self):
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.traffic.close()
        self.store.close()


def run_request(
    cluster, runner, prompt, keys, pe_blocks, de_blocks, *, oracle=False, chunks=None, lead=0
):
    """Runs both halves of one request; returns (effective hit blocks, the PE's per-layer hit
    rows, the DE buffer's prompt KV [L, T, W]). `lead`: leading hit blocks the PE recomputes
    (a forward of their own first) before the new tokens after the loaded blocks."""
    job = cluster.job("r1", keys, pe_blocks, de_blocks, len(prompt), oracle=oracle, lead=lead)
    de = DecodeLoad(cluster.de, job).start()
    pe = PrefillLoad(cluster.pe, job).start()
    h = pe.hit_blocks()
    pe.stream()
    lead_tokens = lead * BT if h else 0
    cached = lead_tokens + h * BT
    hit_rows = {}
    lead_rows: dict[int, list] = {}
    done_rows: dict[int, list] = {}
    ranges = [(0, [lead_tokens])] if lead_tokens else []
    ranges.append((cached, chunks or [len(prompt) - cached]))
    for r, (t, sizes) in enumerate(ranges):
        for k, size in enumerate(sizes):
            last = r == len(ranges) - 1 and k == len(sizes) - 1
            in_lead = t < lead_tokens
            batch = PrefillBatch.build(CFG, [prompt[t : t + size]], [t])
            pe.begin_chunk(t, t + size, last)

            def load(i, batch=batch, in_lead=in_lead):
                if in_lead:
                    parts = lead_rows.get(i, [])
                else:
                    if i not in hit_rows:
                        hit = pe.readiness.wait(i, 20.0)
                        hit_rows[i] = hit.to_numpy() if hit is not None else None
                        pe.consumed()
                    parts = [*lead_rows.get(i, []), hit_rows[i], *done_rows.get(i, [])]
                parts = [x for x in parts if x is not None]
                rows = np.zeros((1, batch.c_pad, CFG.kv_width), np.float32)
                if parts:
                    cat = np.concatenate(parts)
                    rows[0, : cat.shape[0]] = cat
                return rows

            def emit(i, rows, size=size, last=last, in_lead=in_lead):
                new = np.asarray(rows[0, :size])
                if not last:
                    (lead_rows if in_lead else done_rows).setdefault(i, []).append(new)
                pe.send_layer(i, new)

            runner.prefill_layerwise(batch, load if batch.c_pad else None, emit)
            t += size
    pe.flush()
    de.wait(20.0)
    kv = de.prompt_kv()
    pe.close()
    de.close()
    return h, hit_rows, kv


@pytest.fixture(params=["pinned_host", "pageable"])
def stored(prompt_and_kv, request):
    """Both halves with the request's first 4 blocks in the store; the host buffers in pinned
    host memory (the default) or pageable numpy."""
    prompt, kv = prompt_and_kv
    cluster = Cluster(HardwareConfig(), memory=request.param)
    keys = block_keys(prompt, BT, model_fingerprint(CFG))  # 4 full blocks
    blocks = kv_to_full_blocks(kv[:, : 4 * BT], BT)
    cluster.store.write_full(keys, blocks).result(10)
    yield cluster, prompt, kv, keys
    cluster.close()


@pytest.mark.parametrize(
    "pe_blocks, de_blocks, path", [(4, 0, "pe"), (0, 4, "de"), (1, 3, "split")]
)
def test_every_path_delivers_identical_kv(stored, runner, pe_blocks, de_blocks, path):
    cluster, prompt, kv, keys = stored
    h, hit_rows, de_kv = run_request(cluster, runner, prompt, keys, pe_blocks, de_blocks)
    assert h == 4
    for i in range(CFG.num_layers):  # the prefill side got exactly the stored hit KV
        assert hit_rows[i].tobytes() == kv[i, : 4 * BT].tobytes()
    assert de_kv[:, : 4 * BT].tobytes() == kv[:, : 4 * BT].tobytes()  # DE: hit bytes exact
    np.testing.assert_allclose(de_kv, kv, atol=2e-5)  # and the computed tail matches
    # Per-link accounting equals the bytes docs/architecture.md assigns to this path.
    per_token = BlockLayout.for_model(CFG, BT).bytes_per_token_per_layer * CFG.num_layers
    want = paths.expected_link_bytes(
        path,
        4 * BT * per_token,
        (len(prompt) - 4 * BT) * per_token,
        pe="pe0",
        de="de1",
        pe_node="node0",
        de_node="node1",
        de_hit_bytes=de_blocks * BT * per_token,
        decode=False,
    )
    got = {lid.name: cluster.traffic.bytes(lid) for lid in cluster.traffic.links()}
    assert {k: v for k, v in got.items() if v} == want


def test_paths_agree_with_each_other_bitwise(stored, runner):
    cluster, prompt, kv, keys = stored
    outs = [
        run_request(cluster, runner, prompt, keys, p, d)[2] for p, d in ((4, 0), (0, 4), (2, 2))
    ]
    assert outs[0].tobytes() == outs[1].tobytes() == outs[2].tobytes()


def test_chunked_prefill_through_the_loader(stored, runner):
    cluster, prompt, kv, keys = stored
    _, _, whole = run_request(cluster, runner, prompt, keys, 4, 0)
    _, _, chunked = run_request(cluster, runner, prompt, keys, 0, 4, chunks=[2, 3, 1])
    np.testing.assert_allclose(chunked, whole, atol=2e-5)


@pytest.mark.parametrize("lead, pe_blocks, de_blocks", [(1, 3, 0), (2, 0, 2), (1, 1, 2), (3, 1, 0)])
def test_a_recomputed_lead_joins_the_loaded_blocks(stored, runner, lead, pe_blocks, de_blocks):
    """The PE computes the first `lead` hit blocks, reads the rest on either side, and the DE
    ends with the same prompt KV as loading it all: the hit bytes that were read are exact, the
    recomputed lead equals the stored KV to float tolerance, and so does the tail."""
    cluster, prompt, kv, keys = stored
    h, hit_rows, de_kv = run_request(cluster, runner, prompt, keys, pe_blocks, de_blocks, lead=lead)
    assert h == pe_blocks + de_blocks
    a, b = lead * BT, (lead + h) * BT
    for i in range(CFG.num_layers):  # the PE read only the blocks after the lead
        assert hit_rows[i].tobytes() == kv[i, a:b].tobytes()
    assert de_kv[:, a:b].tobytes() == kv[:, a:b].tobytes()
    np.testing.assert_allclose(de_kv, kv, atol=2e-5)
    _, _, loaded = run_request(cluster, runner, prompt, keys, 4, 0)
    np.testing.assert_allclose(de_kv, loaded, atol=2e-5)
    # only the blocks after the lead crossed a storage NIC
    per_block = BlockLayout.for_model(CFG, BT).nbytes
    snic = {
        x.owner: cluster.traffic.bytes(x)
        for x in cluster.traffic.links()
        if x.kind is links.LinkKind.SNIC_RX
    }
    assert snic.get("node0", 0) == (pe_blocks + 4) * per_block  # + the all-loaded run's 4
    assert snic.get("node1", 0) == de_blocks * per_block


def test_a_lead_whose_reads_all_miss_computes_the_whole_prompt(stored, runner):
    cluster, prompt, kv, keys = stored
    cluster.store.delete(keys[1:2]).result(10)  # the first block after the lead is gone
    h, _, de_kv = run_request(cluster, runner, prompt, keys, 3, 0, lead=1)
    assert h == 0
    np.testing.assert_allclose(de_kv, kv, atol=2e-5)


def test_oracle_moves_bytes_but_charges_nothing(stored, runner):
    cluster, prompt, kv, keys = stored
    _, _, de_kv = run_request(cluster, runner, prompt, keys, 4, 0, oracle=True)
    np.testing.assert_allclose(de_kv, kv, atol=2e-5)
    assert all(cluster.traffic.bytes(lid) == 0 for lid in cluster.traffic.links())


@pytest.mark.parametrize(
    "corrupt, pe_blocks, de_blocks, want_hit",
    [(1, 4, 0, 1), (2, 0, 4, 2), (0, 1, 3, 0), (3, 1, 3, 3)],
)
def test_bad_block_becomes_a_shorter_hit(stored, runner, corrupt, pe_blocks, de_blocks, want_hit):
    """A corrupt block ends the hit there; the rest is recomputed and the DE's KV is still right."""
    cluster, prompt, kv, keys = stored
    bad = kv_to_full_blocks(kv[:, : 4 * BT], BT)[corrupt].copy()
    cluster.store.delete([keys[corrupt]]).result(10)
    # Write garbage under the key through the raw kvstore so that its checksum fails.
    from dualpath_jax.kvstore.codec import encode_block

    data = bytearray(encode_block(cluster.store.fmt, keys[corrupt], bad))
    data[-5] ^= 0xFF
    cluster.store._kv.write(key_path(keys[corrupt]), bytes(data)).result()  # noqa: SLF001
    h, _, de_kv = run_request(cluster, runner, prompt, keys, pe_blocks, de_blocks)
    assert h == want_hit
    np.testing.assert_allclose(de_kv, kv, atol=2e-5)
    assert cluster.store.stats().checksum_failures >= 1


def test_errors_reach_the_waiter(stored):
    cluster, prompt, kv, keys = stored
    job = cluster.job("r9", keys, 0, 4, len(prompt), de_address="nowhere")
    ctx = dataclasses.replace(cluster.pe, timeout_s=0.5)
    pe = PrefillLoad(ctx, job).start()
    with pytest.raises(Exception):  # noqa: B017 - the channel's typed error (unknown peer)
        pe.hit_blocks()
    pe.stream()
    with pytest.raises(Exception):  # noqa: B017
        pe.readiness.wait(0, 5.0)
    pe.close()


def test_emulated_rates_slow_the_store_read(prompt_and_kv, runner):
    """With an emulated storage NIC the read takes at least bytes / rate (the link's own clock)."""
    prompt, kv = prompt_and_kv
    per_block = BlockLayout.for_model(CFG, BT).nbytes
    hw = HardwareConfig(snic_bytes_per_s=per_block * 20, emulated=True)  # 4 blocks ~ 0.2 s
    cluster = Cluster(hw)
    try:
        keys = block_keys(prompt, BT, model_fingerprint(CFG))
        cluster.store.write_full(keys, kv_to_full_blocks(kv[:, : 4 * BT], BT)).result(10)
        h, _, _ = run_request(cluster, runner, prompt, keys, 4, 0)
        assert h == 4
        snic = links.LinkId(links.LinkKind.SNIC_RX, "node0")
        assert cluster.traffic.bytes(snic) == 4 * per_block
    finally:
        cluster.close()


@pytest.mark.parametrize("pe_blocks, de_blocks", [(0, 4), (1, 3), (4, 0)])
def test_de_read_blocks_reach_the_forward_without_a_host_copy(stored, runner, pe_blocks, de_blocks):
    """The PE's forward over a hit read (partly) by the DE, or all by the PE (Basic: its blocks
    then travel to the DE with the new rows), its pages assembled as the prefill engine
    assembles them (`HitLayer.segments` -> `LayerPages.assemble`) and its new rows sent from the
    device (`DeviceRows`): the logits equal the recomputed prompt's, the DE buffer holds the
    right prompt KV, nothing is copied to the PE's host memory (not the DE-read blocks, not the
    new rows), and each layer costs one host-to-device copy of pages (a pinned buffer's for
    the forward serves the send as well)."""
    cluster, prompt, kv, keys = stored
    job = cluster.job("r2", keys, pe_blocks, de_blocks, len(prompt))
    de = DecodeLoad(cluster.de, job).start()
    pe = PrefillLoad(cluster.pe, job).start()
    h = pe.hit_blocks()
    assert h == 4
    COPIES.reset()
    pe.stream()
    batch = PrefillBatch.build(CFG, [prompt[h * BT :]], [h * BT])
    pe.begin_chunk(h * BT, len(prompt), True, n_pad=batch.n_pad)

    pinned = cluster.pe.buffer.pinned is not None

    def load(i):
        hit = pe.readiness.wait(i, 20.0)
        pe.consumed()
        assert (hit.device.blocks if hit.device is not None else 0) == de_blocks
        assert hit.tokens == h * BT
        # A pinned PE buffer's blocks reach the device inside a program; pageable: host rows.
        assert (hit.pe_device is not None) == (pinned and pe_blocks > 0)
        return LayerPages.assemble([hit.segments()], BT, CFG.kv_width, CFG.kv_dtype)

    new = len(prompt) - h * BT  # the new rows go to the DE from the device, padded
    res = runner.prefill_layerwise(
        batch, load, lambda i, rows: pe.send_layer(i, DeviceRows(rows, 0, new))
    )
    pe.flush()
    de.wait(20.0)
    # (The DE half runs in this process too: its copies into the DE buffer are its own.)
    assert COPIES.copies("d2h") == COPIES.copies("d2h", "de_buffer"), COPIES.snapshot()
    # One host-to-device copy of pages per layer for the PE-read blocks (in a program out of the
    # pinned buffer, or the assembled host pages out of a pageable one); none without them.
    page_copies = COPIES.copies("h2d", "prefill_pages") + COPIES.copies("h2d", "pe_buffer_pages")
    assert page_copies == (CFG.num_layers if pe_blocks else 0), COPIES.snapshot()
    if pinned:
        assert COPIES.copies("h2d", "pe_prefix_send") == 0, COPIES.snapshot()
    full, _ = runner.prefill_monolithic(PrefillBatch.build(CFG, [prompt], [0]))
    np.testing.assert_allclose(
        np.asarray(res.last_logits), np.asarray(full.last_logits), atol=2e-5, rtol=1e-5
    )
    de_kv = de.prompt_kv()
    assert de_kv[:, : 4 * BT].tobytes() == kv[:, : 4 * BT].tobytes()
    np.testing.assert_allclose(de_kv, kv, atol=2e-5)
    pe.close()
    de.close()


@pytest.mark.parametrize("pad_to_table", [False, True])
def test_assembled_pages_equal_host_packed_pages(pad_to_table):
    """`LayerPages.assemble` with a device segment in the middle of a request's rows (and two
    later host segments that do not start on a page) reads back as `from_rows` of the same rows;
    with `pad_to_table` both have as many pages as the table could name."""
    rs = np.random.RandomState(2)
    w = CFG.kv_width
    a, d, c1, c2 = (rs.randn(n, w).astype(np.float32) for n in (2 * BT, 3 * BT, 5, 9))
    other = rs.randn(BT + 3, w).astype(np.float32)
    dev = np.zeros((4, BT, w), np.float32)  # padded to 4 pages, 3 real
    dev[:3] = d.reshape(3, BT, w)
    segs = [[a, DevicePages(jnp.asarray(dev), 3), c1, c2], [other]]
    got = LayerPages.assemble(segs, BT, w, np.float32, pad_to_table=pad_to_table)
    want = LayerPages.from_rows(
        [np.concatenate([a, d, c1, c2]), other], BT, w, np.float32, pad_to_table=pad_to_table
    )
    if pad_to_table:  # a table [2, 8]: 2 * 8 + 2 pages, rounded up
        assert got.table.shape == want.table.shape == (2, 8)
        assert got.pages.shape[0] == want.pages.shape[0] == 32

    def rows(lp, b, n):
        pages, table = np.asarray(lp.pages), np.asarray(lp.table)
        return np.concatenate([pages[p, 0] for p in table[b] if p])[:n]

    for b, n in ((0, 5 * BT + 14), (1, BT + 3)):
        np.testing.assert_array_equal(rows(got, b, n), rows(want, b, n))


def test_assembled_pages_take_earlier_chunks_rows_from_the_device():
    """Earlier chunks' rows kept on the device (`DeviceRowRun`, a forward's layer output
    `[B, N_pad, W]`) at any alignment, after host rows and device pages and between host rows,
    read back as `from_rows` of the same rows; with no host rows nothing is copied to the
    device but the page table."""
    from dualpath_jax.copies import COPIES
    from dualpath_jax.model.cached_kv import DeviceRowRun

    rs = np.random.RandomState(3)
    w = CFG.kv_width
    a, c1, c2, h2 = (rs.randn(n, w).astype(np.float32) for n in (BT + 5, 7, 2 * BT + 1, 4))
    d = rs.randn(2 * BT, w).astype(np.float32)
    out = rs.randn(2, 40, w).astype(np.float32)  # a batch's layer output: 2 requests, 40 rows
    out_dev = jnp.asarray(out)
    dev = DevicePages(jnp.asarray(d.reshape(2, BT, w)), 2)
    segs = [
        [a, DeviceRowRun(out_dev, 1, 11), h2, DeviceRowRun(out_dev, 0, 30)],
        [dev, DeviceRowRun(out_dev, 0, 7), c1],
        [c2],
    ]
    got = LayerPages.assemble(segs, BT, w, np.float32)
    want_rows = [
        np.concatenate([a, out[1, :11], h2, out[0, :30]]),
        np.concatenate([d, out[0, :7], c1]),
        c2,
    ]
    want = LayerPages.from_rows(want_rows, BT, w, np.float32)

    def rows(lp, b, n):
        pages, table = np.asarray(lp.pages), np.asarray(lp.table)
        return np.concatenate([pages[p, 0] for p in table[b] if p])[:n]

    for b, r in enumerate(want_rows):
        np.testing.assert_array_equal(rows(got, b, len(r)), rows(want, b, len(r)))
    COPIES.reset()
    only_device = LayerPages.assemble([[dev, DeviceRowRun(out_dev, 1, 9)]], BT, w, np.float32)
    np.testing.assert_array_equal(rows(only_device, 0, 2 * BT + 9), np.concatenate([d, out[1, :9]]))
    assert COPIES.copies("h2d") == COPIES.copies("h2d", "prefill_table") == 1
