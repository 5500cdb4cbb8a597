"""The loader between a prefill engine on a mesh and a decode engine, in a process with 4 CPU
devices: run by `test_mesh_loader.py` with `XLA_FLAGS=--xla_force_host_platform_device_count=4`
(the flag must be set before JAX starts). Not collected by a plain `pytest tests`.

The PE half's runner is split over the 4 devices (`tensor=4`: one KV head each, or
`data=2,tensor=2`); the DE half runs on one. Both talk over real `JaxTransferChannel`s on loopback.
"""

from __future__ import annotations

import dataclasses
from concurrent import futures

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from dualpath_jax.config import HardwareConfig, StoreConfig
from dualpath_jax.kvstore.buffers import HostBufferPool
from dualpath_jax.kvstore.identity import block_keys, model_fingerprint
from dualpath_jax.kvstore.store import open_block_store
from dualpath_jax.model import sharding
from dualpath_jax.model.cached_kv import CachedPages, LayerPages
from dualpath_jax.model.layout import BlockLayout, kv_to_full_blocks
from dualpath_jax.model.runner import ModelRunner, PrefillBatch
from dualpath_jax.model.transformer import init_model
from dualpath_jax.presets import TINY_QWEN2
from dualpath_jax.transfer.decode_load import DecodeLoad
from dualpath_jax.transfer.jax_channel import JaxTransferChannel
from dualpath_jax.transfer.loader import LoaderContext, LoadJob, Part
from dualpath_jax.transfer.prefill_load import DeviceRows, PrefillLoad, SplitRows, row_bytes_split
from dualpath_jax.transfer.row_offers import HitPieces, RowOffers, piece_uuid
from dualpath_jax.transfer.traffic import TrafficManager

pytestmark = pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 (CPU) devices")

BT = 16
CFG = dataclasses.replace(TINY_QWEN2, num_heads=8, num_kv_heads=4, head_dim=8)


MESHES = {"tensor=4": 4, "data=2,tensor=2": 2}  # mesh -> devices a KV row is split over


@pytest.fixture(scope="module")
def base():
    return ModelRunner(init_model(CFG, seed=0))


@pytest.fixture(scope="module", params=sorted(MESHES))
def runners(base, request):
    """(one-device runner, runner on the mesh) of the same parameters, and the mesh's split."""
    mesh = sharding.make_mesh(request.param)
    return base, ModelRunner(init_model(CFG, seed=0, mesh=mesh)), MESHES[request.param]


@pytest.fixture(scope="module")
def prompt_and_kv(base):
    prompt = np.random.RandomState(0).randint(0, CFG.vocab_size, 70).tolist()
    _, kv = base.prefill_monolithic(PrefillBatch.build(CFG, [prompt], [0]))
    return prompt, np.asarray(kv[:, 0, :70])


class Halves:
    """A PE half on the mesh and a DE half on one device, one store, real transfer channels;
    `offered[uuid]` records the devices of every array the PE offered."""

    def __init__(self, mesh):
        self.pulled: dict[int, list] = {}  # uuid -> the devices the PE's pulled arrays are on
        self.store = open_block_store(StoreConfig(kind="memory", block_tokens=BT), CFG)
        layout = BlockLayout.for_model(CFG, BT)
        self.pool = futures.ThreadPoolExecutor(16)
        self.traffic = TrafficManager(HardwareConfig())
        self.offered: dict[int, list] = {}

        def ctx(name, mesh):
            channel = JaxTransferChannel()
            return LoaderContext(
                CFG, layout, self.store, HostBufferPool(layout, 64, name), channel,
                self.traffic, self.pool, 20.0, mesh=mesh,
            )  # fmt: skip

        self.pe, self.de = ctx("PE buffer", mesh), ctx("DE buffer", None)
        offer = self.pe.channel.offer

        def spy(uuid, arrays):
            self.offered[uuid] = [
                tuple(a.devices()) if isinstance(a, jax.Array) else "host" for a in arrays
            ]
            offer(uuid, arrays)

        self.pe.channel.offer = spy
        pull = self.pe.channel.pull

        def spy_pull(peer, uuid, specs, timeout_s, **kw):
            out = pull(peer, uuid, specs, timeout_s, **kw)
            self.pulled[uuid] = [tuple(a.devices()) for a in out]
            return out

        self.pe.channel.pull = spy_pull

    def close(self):
        for c in (self.pe, self.de):
            c.channel.close()
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.traffic.close()
        self.store.close()


def started(halves, job, prompt):
    """Both halves of `job`'s load started, the PE's hit read and streaming, its only chunk (the
    prompt after the hit) begun: (DE half, PE half, hit blocks, the chunk's batch)."""
    de = DecodeLoad(halves.de, job).start()
    pe = PrefillLoad(halves.pe, job).start()
    h = pe.hit_blocks()
    pe.stream()
    batch = PrefillBatch.build(CFG, [prompt[h * BT :]], [h * BT])
    pe.begin_chunk(h * BT, len(prompt), True, n_pad=batch.n_pad)
    return de, pe, h, batch


@pytest.mark.parametrize("pe_blocks, de_blocks", [(4, 0), (0, 4), (1, 3)])
@pytest.mark.parametrize("program", [False, True], ids=["layerwise", "basic"])
def test_kv_between_a_mesh_and_one_device(runners, prompt_and_kv, pe_blocks, de_blocks, program):
    """The PE's hit pages are built split by KV head on its mesh (DE-read blocks pulled onto its
    transfer device are placed there too), its logits equal one device's, and each layer's new
    rows reach the DE buffer as one piece per device, offered from the device that computed
    them; the DE buffer holds the prompt's exact hit KV and the computed tail."""
    base, runner, split = runners
    prompt, kv = prompt_and_kv
    halves = Halves(runner.mesh)
    try:
        keys = block_keys(prompt, BT, model_fingerprint(CFG))
        halves.store.write_full(keys, kv_to_full_blocks(kv[:, : 4 * BT], BT)).result(10)
        job = LoadJob(
            "m1", tuple(keys), pe_blocks, de_blocks, len(prompt), "pe0", "node0", "de1", "node1",
            halves.pe.channel.address, halves.de.channel.address,
            pe_pieces=halves.pe.row_pieces,  # as the router sends it (the PE's Register)
        )  # fmt: skip
        de, pe, h, batch = started(halves, job, prompt)
        assert h == 4

        def load(i):
            hit = pe.readiness.wait(i, 20.0)
            pe.consumed()
            pages = LayerPages.assemble(
                [hit.segments()], BT, CFG.kv_width, CFG.kv_dtype, runner.pages_sharding
            )
            assert pages.pages.sharding.spec == P(None, None, None, "tensor")
            return pages

        new = len(prompt) - h * BT
        if program:  # Basic: every layer's pages first, one program
            kv_pages = CachedPages.from_layers([load(i) for i in range(CFG.num_layers)])
            res, rows = runner.prefill_program(batch, kv_pages)
            for i in range(CFG.num_layers):
                pe.send_layer(i, DeviceRows(rows[i], 0, new))
        else:
            res = runner.prefill_layerwise(
                batch, load, lambda i, rows: pe.send_layer(i, DeviceRows(rows, 0, new))
            )
        pe.flush()
        de.wait(20.0)
        full, _ = base.prefill_monolithic(PrefillBatch.build(CFG, [prompt], [0]))
        np.testing.assert_allclose(
            np.asarray(res.last_logits), np.asarray(full.last_logits), atol=2e-5, rtol=1e-5
        )
        de_kv = de.prompt_kv()
        assert de_kv[:, : 4 * BT].tobytes() == kv[:, : 4 * BT].tobytes()
        np.testing.assert_allclose(de_kv, kv, atol=2e-5)
        # the new rows of each layer: a piece per split (its KV heads), each from its device
        chunk = 1 if 0 < pe_blocks < h else 0  # split path: the PE-read hit went as piece 0
        for i in range(CFG.num_layers):
            offered = halves.offered[job.uuid(Part.PE_LAYER, chunk, i)]
            pieces = offered[-split:]
            assert len(offered) == split + (pe_blocks == 4), offered  # (+ the PE-read hit)
            assert all(len(d) == 1 for d in pieces), pieces
            assert len({d for (d,) in pieces}) == split, pieces
        # the DE-read hit of each layer: a piece per split, each pulled onto a device of its heads
        for i in range(CFG.num_layers if h > pe_blocks else 0):
            pulled = halves.pulled[job.uuid(Part.DE_LAYER, layer=i)]
            assert len(pulled) == split and all(len(d) == 1 for d in pulled), pulled
            assert len({d for (d,) in pulled}) == split, pulled
        pe.close()
        de.close()
    finally:
        halves.close()


@pytest.mark.parametrize("pe_blocks, de_blocks", [(4, 0), (0, 4)])
def test_row_pieces_offered_apart_reach_the_de(runners, prompt_and_kv, pe_blocks, de_blocks):
    """The pieces of a spanning PE (`RowOffers`): each KV-head piece of the new rows offered at
    its own uuid from where its device sits (here one process, so one address), the PE-read hit
    alone at the layer's uuid; the DE pulls them apart and holds the exact prompt KV. Hit
    layers come in pieces too (the DE's offered to each process holding them, here the one; the
    PE's own from its buffer), each on a device that holds it, joined over the mesh when the
    layer runs."""
    base, runner, split = runners
    prompt, kv = prompt_and_kv
    halves = Halves(None)  # as a spanning PE: its loads see no mesh, its offers do
    try:
        offers = RowOffers.for_mesh(CFG, runner.mesh, {0: halves.pe.channel.address})
        halves.pe.row_offers = offers
        assert offers.pieces == split and len(set(offers.homes)) == split
        keys = block_keys(prompt, BT, model_fingerprint(CFG))
        halves.store.write_full(keys, kv_to_full_blocks(kv[:, : 4 * BT], BT)).result(10)
        job = LoadJob(
            "m2", tuple(keys), pe_blocks, de_blocks, len(prompt), "pe0", "node0", "de1", "node1",
            halves.pe.channel.address, halves.de.channel.address,
            pe_piece_addresses=offers.addresses, pe_pieces=split, pe_piece_holders=offers.holders,
        )  # fmt: skip
        assert offers.holders == ((0,),) * split
        de, pe, h, batch = started(halves, job, prompt)

        def load(i):
            hit = pe.readiness.wait(i, 20.0)
            pe.consumed()
            (seg,) = hit.segments()  # the PE-read or the DE-read hit, in pieces either way
            assert isinstance(seg, HitPieces) and len(seg.arrays) == split
            assert seg.meta["kind"] == ("pe" if pe_blocks else "de")
            homes = [a.devices() for a in seg.arrays.values()]
            assert len({d for (d,) in map(tuple, homes)}) == split, homes
            segs = [offers.hit_pages(seg, CFG.kv_width, CFG.kv_dtype)]
            return LayerPages.assemble(
                [segs], BT, CFG.kv_width, CFG.kv_dtype, runner.pages_sharding
            )

        new = len(prompt) - h * BT
        runner.prefill_layerwise(
            batch,
            load,
            lambda i, rows: pe.send_layer(
                i, SplitRows(row_bytes_split(rows, 0, offers.split), new)
            ),
        )
        pe.flush()
        de.wait(20.0)
        np.testing.assert_allclose(de.prompt_kv(), kv, atol=2e-5)
        for i in range(CFG.num_layers):
            pieces = [halves.offered[piece_uuid("m2", 0, 0, i, j)] for j in range(split)]
            assert all(len(p) == 1 and len(p[0]) == 1 for p in pieces), pieces
            assert len({p[0][0] for p in pieces}) == split, pieces  # each from its own device
            hit = halves.offered.get(job.uuid(Part.PE_LAYER, 0, i))
            assert (hit is not None) == (pe_blocks > 0), hit  # the PE-read hit, alone
        pe.close()
        de.close()
    finally:
        halves.close()
