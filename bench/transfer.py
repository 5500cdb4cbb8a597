"""Transfer benchmarks between two engine processes on one host.

  python bench/transfer.py [--sections=channel,overlap] [--reps=3] [--json=out.json]
  python bench/transfer.py --sections=overlap --reps=5 --overlap-layers=3,12

Section `channel`: KVChannel (JaxTransferChannel on jax.experimental.transfer) throughput for
64 MiB and 64 KiB Layer Blocks `[1, T, B]` uint8 moved from a peer process to this one, next to
the same bytes over a raw loopback TCP socket and through a shared-memory segment
(multiprocessing.shared_memory: the peer copies in, this process copies out), all in one run.
It also compares ways to move a request's N Layer Blocks with the channel:
  kv:each-seq    N pulls of one array, one after another
  kv:each-async  N pulls of one array, all in flight at once (pull_async)
  kv:list        one pull of a list of N arrays
  kv:contig      the N blocks are already one contiguous `[N, T, B]` array (a Full Block): one
                 pull, kept packed here
  kv:packed      the peer packs the N blocks into one `[N, T, B]` array (`pack_layer_blocks`),
                 one pull, then `unpack_layer_blocks` here
`tcp` receives into one reused buffer, `tcp-fresh` into a new buffer per block (as a pull does).
Every timing runs from sending the peer its command to having all bytes here (the peer's send
side is inside it), median of `--reps` after one warm-up; `x tcp` is time / raw-TCP time.

Section `overlap`: how much of the per-layer KV load the layerwise prefill hides (paper 5.1). The
tiny Qwen2 model (and the same model with `--overlap-layers` layers) prefills `--overlap-new` new
tokens on top of `--overlap-cached` cached ones (random KV stored as Full Blocks in a memory store;
the values do not matter for timing), all in one process:
  compute     `prefill_layerwise` with every layer's KV already in host memory (no load)
  load        the real PE read path alone: a `PrefillLoad` (pe_blocks = all, de_blocks = 0; its
              store reads are done before the clock starts) streams the layers into its
              `LayerReadiness` through an emulated H2D link (`TrafficManager`,
              `HardwareConfig.h2d_bytes_per_s = R`), the consumer taking each layer at once
  serial:meas the whole load, then the compute (the Basic baseline), measured
  overlapped  `stream()` while the prefill loop runs: `load_layer(i)` waits for layer i only and
              calls `consumed()`, so layer i+1 loads while layer i computes (lookahead 2)
and, derived from the medians: serial = load + compute, ideal = max(load, compute), and pipeline =
max(first + compute, load + compute / L), the bound for layer-granular streaming: nothing overlaps
the first layer's load (`first`, measured in `load`) nor the last layer's compute (estimated as
compute / L), so with load = compute the best efficiency is about (L - 1) / L. R is calibrated
first so that the load takes as long as the compute (R = KV bytes / median compute time).
`eff` = (serial - overlapped) / (serial - ideal) from the medians, 1.0 being perfect overlap;
`eff/rep` is the median of the same ratio taken within each rep (compute, load and overlapped
timed back to back), which is steadier where the machine is shared; `eff pipe` uses the pipeline
bound instead of ideal. Every mode is timed once per rep, interleaved in alternating order (the
compute of a shared CPU varies a lot; the load, paced by the link, barely does), median of
`--reps` after one warm-up; the JSON rows keep every sample.

Sections are entries of `SECTIONS` (name -> function(args) -> rows); add one there.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from multiprocessing import resource_tracker, shared_memory

import numpy as np

# block name -> (T, B, blocks per round): 64 MiB blocks and a request's worth of 64 KiB blocks.
CASES = {
    "64MiB": (4096, 16384, 4),
    "1MiB": (256, 4096, 64),
    "64KiB": (64, 1024, 64),
}
KV_METHODS = ("kv:each-seq", "kv:each-async", "kv:list", "kv:contig", "kv:packed")


# --- peer process ----------------------------------------------------------------------------


def run_peer() -> None:
    """The sending engine: reads commands on stdin, answers `OK` on stdout."""
    import jax

    from dualpath_jax.transfer.channel import pack_layer_blocks
    from dualpath_jax.transfer.jax_channel import JaxTransferChannel

    channel = JaxTransferChannel(offer_ttl_s=600.0)
    listener = socket.create_server(("127.0.0.1", 0))
    print(f"READY {channel.address} {listener.getsockname()[1]}", flush=True)
    tcp, _ = listener.accept()
    tcp.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    host_blocks: dict[str, list[np.ndarray]] = {}
    dev_blocks: dict[str, list[jax.Array]] = {}
    contig: dict[str, jax.Array] = {}  # the same blocks already contiguous, like a Full Block
    for line in sys.stdin:
        cmd, *args = line.split()
        if cmd == "exit":
            break
        if cmd == "prep":
            name, t, b, n = args[0], *map(int, args[1:])
            rng = np.random.default_rng(0)
            host_blocks[name] = [rng.integers(0, 256, (1, t, b), np.uint8) for _ in range(n)]
            dev_blocks[name] = [jax.device_put(x) for x in host_blocks[name]]
            contig[name] = jax.device_put(np.concatenate(host_blocks[name]))
            jax.block_until_ready((dev_blocks[name], contig[name]))
        elif cmd == "tcp":
            for x in host_blocks[args[0]]:
                tcp.sendall(memoryview(x).cast("B"))
        elif cmd == "shm":
            shm = shared_memory.SharedMemory(name=args[1])
            resource_tracker.unregister(shm._name, "shared_memory")  # the receiver owns it
            dst = np.ndarray((shm.size,), np.uint8, buffer=shm.buf)
            off = 0
            for x in host_blocks[args[0]]:
                dst[off : off + x.nbytes] = x.reshape(-1)
                off += x.nbytes
            del dst
            shm.close()
        elif cmd == "offer_each":
            base = int(args[1])
            for i, x in enumerate(dev_blocks[args[0]]):
                channel.offer(base + i, [x])
        elif cmd == "offer_list":
            channel.offer(int(args[1]), dev_blocks[args[0]])
        elif cmd == "offer_contig":
            channel.offer(int(args[1]), [contig[args[0]]])
        elif cmd == "offer_packed":
            channel.offer(int(args[1]), [pack_layer_blocks(dev_blocks[args[0]])])
        print("OK", flush=True)
    channel.close()


class Peer:
    """The peer process, its KVChannel address and its raw TCP connection."""

    def __init__(self):
        env = dict(os.environ, JAX_PLATFORMS="cpu")
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--role=peer"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        line = self.proc.stdout.readline().split()
        if not line or line[0] != "READY":
            self.close()
            raise RuntimeError(f"peer failed to start: {line}")
        self.address, port = line[1], int(line[2])
        self.tcp = socket.create_connection(("127.0.0.1", port))
        self.tcp.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)

    def send(self, cmd: str) -> None:
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()

    def ack(self) -> None:
        reply = self.proc.stdout.readline().strip()
        if reply != "OK":
            raise RuntimeError(f"peer: {reply!r}")

    def call(self, cmd: str) -> None:
        self.send(cmd)
        self.ack()

    def close(self) -> None:
        try:
            if self.proc.poll() is None:
                self.send("exit")
                self.proc.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            pass
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()


# --- section: channel ------------------------------------------------------------------------


def channel_section(args: argparse.Namespace) -> list[dict]:
    from dualpath_jax.transfer.channel import make_uuid, unpack_layer_blocks
    from dualpath_jax.transfer.jax_channel import JaxTransferChannel

    rows = []
    peer = Peer()
    receiver = JaxTransferChannel(pull_workers=16)
    rounds = iter(range(1 << 30))
    try:
        for case in args.cases.split(","):
            t, b, n = CASES[case]
            block = t * b
            total = block * n
            peer.call(f"prep {case} {t} {b} {n}")
            spec = ((1, t, b), np.uint8)
            tcp_buf = bytearray(total)
            shm = shared_memory.SharedMemory(create=True, size=total)
            out = np.empty(total, np.uint8)

            def raw_tcp():
                peer.send(f"tcp {case}")
                view, got = memoryview(tcp_buf), 0
                while got < total:
                    got += peer.tcp.recv_into(view[got:])
                peer.ack()

            def shm_copy():
                peer.call(f"shm {case} {shm.name}")
                np.copyto(out, np.ndarray((total,), np.uint8, buffer=shm.buf))

            def kv(method: str) -> Callable[[], None]:
                def run():
                    r = next(rounds)
                    base = make_uuid("bench", r) % (1 << 62) + 1  # base + i stays 63-bit
                    uuids = [base + i for i in range(n)]
                    if method == "kv:each-seq":
                        peer.send(f"offer_each {case} {uuids[0]}")
                        got = [
                            receiver.pull(peer.address, uuids[i], [spec], 60)[0] for i in range(n)
                        ]
                    elif method == "kv:each-async":
                        peer.send(f"offer_each {case} {uuids[0]}")
                        futs = [
                            receiver.pull_async(peer.address, uuids[i], [spec], 60)
                            for i in range(n)
                        ]
                        got = [f.result()[0] for f in futs]
                    elif method == "kv:list":
                        peer.send(f"offer_list {case} {uuids[0]}")
                        got = receiver.pull(peer.address, uuids[0], [spec] * n, 60)
                    elif method == "kv:contig":
                        peer.send(f"offer_contig {case} {uuids[0]}")
                        got = receiver.pull(peer.address, uuids[0], [((n, t, b), np.uint8)], 60)
                        got = [got[0][:1]] * n  # stays [N, T, B]: no unpack
                    else:
                        peer.send(f"offer_packed {case} {uuids[0]}")
                        (packed,) = receiver.pull(
                            peer.address, uuids[0], [((n, t, b), np.uint8)], 60
                        )
                        got = unpack_layer_blocks(packed, n)
                    assert len(got) == n and got[0].shape == (1, t, b)
                    peer.ack()

                return run

            def raw_tcp_fresh():  # like a pull: a new destination buffer each block
                peer.send(f"tcp {case}")
                for _ in range(n):
                    view, got = memoryview(np.empty(block, np.uint8)), 0
                    while got < block:
                        got += peer.tcp.recv_into(view[got:])
                peer.ack()

            methods: dict[str, Callable[[], None]] = {
                "tcp": raw_tcp,
                "tcp-fresh": raw_tcp_fresh,
                "shm": shm_copy,
            }
            kv_methods = KV_METHODS if case != "64MiB" else KV_METHODS[:3]
            methods.update({m: kv(m) for m in kv_methods})
            times = {}
            for name, fn in methods.items():
                fn()  # warm-up (connections, compiles)
                samples = []
                for _ in range(args.reps):
                    t0 = time.perf_counter()
                    fn()
                    samples.append(time.perf_counter() - t0)
                times[name] = statistics.median(samples)
            shm.close()
            shm.unlink()
            for name, sec in times.items():
                rows.append(
                    {
                        "section": "channel",
                        "block": case,
                        "blocks": n,
                        "method": name,
                        "total_mib": total / 2**20,
                        "seconds": sec,
                        "gib_per_s": total / 2**30 / sec,
                        "x_tcp": sec / times["tcp"],
                    }
                )
    finally:
        receiver.close()
        peer.close()
    return rows


# --- section: overlap ------------------------------------------------------------------------


def overlap_section(args: argparse.Namespace) -> list[dict]:
    rows = []
    for n_layers in map(int, args.overlap_layers.split(",")):
        rows += overlap_case(n_layers, args.overlap_cached, args.overlap_new, args.reps)
    return rows


def overlap_case(n_layers: int, cached: int, new: int, reps: int) -> list[dict]:
    import dataclasses
    from concurrent import futures

    import jax

    from dualpath_jax.config import HardwareConfig, StoreConfig
    from dualpath_jax.kvstore.buffers import HostBufferPool
    from dualpath_jax.kvstore.identity import block_keys, model_fingerprint
    from dualpath_jax.kvstore.store import open_block_store
    from dualpath_jax.model.layout import BlockLayout, kv_to_full_blocks
    from dualpath_jax.model.runner import ModelRunner, PrefillBatch
    from dualpath_jax.model.transformer import init_model
    from dualpath_jax.presets import TINY_QWEN2
    from dualpath_jax.transfer import links
    from dualpath_jax.transfer.inprocess_channel import InProcessChannel, InProcessFabric
    from dualpath_jax.transfer.loader import LoaderContext, LoadJob
    from dualpath_jax.transfer.prefill_load import PrefillLoad
    from dualpath_jax.transfer.traffic import TrafficManager

    cfg = dataclasses.replace(TINY_QWEN2, num_layers=n_layers)
    store_cfg = StoreConfig(kind="memory")
    bt = store_cfg.block_tokens
    if cached <= 0 or cached % bt:
        raise ValueError(f"--overlap-cached must be a positive multiple of {bt}, got {cached}")
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, cfg.vocab_size, cached + new).tolist()
    kv = rng.standard_normal((n_layers, cached, cfg.kv_width)).astype(np.float32)  # [L, C, W]
    keys = tuple(block_keys(prompt, bt, model_fingerprint(cfg))[: cached // bt])
    layout = BlockLayout.for_model(cfg, bt)
    total_bytes = len(keys) * layout.nbytes
    store = open_block_store(store_cfg, cfg)
    store.write_full(list(keys), kv_to_full_blocks(kv, bt)).result(60)

    runner = ModelRunner(init_model(cfg, 0))
    batch = PrefillBatch.build(cfg, [prompt[cached:]], [cached])

    def as_rows(x: np.ndarray) -> np.ndarray:  # [C, W] -> [1, c_pad, W]
        if batch.c_pad == cached:
            return x.reshape(1, cached, cfg.kv_width)
        out = np.zeros((1, batch.c_pad, cfg.kv_width), x.dtype)
        out[0, :cached] = x
        return out

    host_kv = [as_rows(kv[i]) for i in range(n_layers)]

    def compute(load_layer) -> float:
        t0 = time.perf_counter()
        jax.block_until_ready(runner.prefill_layerwise(batch, load_layer).last_logits)
        return time.perf_counter() - t0

    def compute_alone() -> float:
        return compute(lambda i: host_kv[i])

    compute_alone()  # warm-up (compiles)
    rate = total_bytes / statistics.median(compute_alone() for _ in range(max(reps, 5)))

    pool = futures.ThreadPoolExecutor(4)
    traffic = TrafficManager(HardwareConfig(h2d_bytes_per_s=rate, emulated=True))
    channel = InProcessChannel(InProcessFabric(), "pe0")
    ctx = LoaderContext(
        cfg, layout, store, HostBufferPool(layout, len(keys), "pe0"), channel, traffic, pool
    )
    loads = iter(range(1 << 30))

    def pe_load() -> PrefillLoad:
        """A PE read path load of the whole hit with its store reads done (not timed)."""
        job = LoadJob(
            request_id=f"overlap{next(loads)}",
            keys=keys,
            pe_blocks=len(keys),
            de_blocks=0,
            prompt_tokens=cached + new,
            pe_engine="pe0",
            pe_node="node0",
            de_engine="de1",
            de_node="node1",
            pe_address=channel.address,
            de_address="",  # de_blocks = 0: the PE half never talks to a DE half here
        )
        load = PrefillLoad(ctx, job, lookahead=2).start()
        if load.hit_blocks() != len(keys):
            raise RuntimeError(f"store returned {load.hit_blocks()} of {len(keys)} blocks")
        return load

    first_layer: list[float] = []  # load alone: when layer 0 is ready

    def load_alone() -> float:
        load = pe_load()
        t0 = time.perf_counter()
        load.stream()
        for i in range(n_layers):
            load.readiness.wait(i, 60.0)
            load.consumed()
            if i == 0:
                first_layer.append(time.perf_counter() - t0)
        dt = time.perf_counter() - t0
        load.close()
        return dt

    def serial() -> float:
        load = pe_load()
        t0 = time.perf_counter()
        load.stream()
        got = []
        for i in range(n_layers):
            got.append(as_rows(load.readiness.wait(i, 60.0)))
            load.consumed()
        compute(lambda i: got[i])
        dt = time.perf_counter() - t0
        load.close()
        return dt

    def overlapped() -> float:
        load = pe_load()

        def load_layer(i: int) -> np.ndarray:
            rows = load.readiness.wait(i, 60.0)
            load.consumed()
            return as_rows(rows)

        t0 = time.perf_counter()
        load.stream()
        compute(load_layer)
        dt = time.perf_counter() - t0
        load.close()
        return dt

    modes = {
        "compute": compute_alone,
        "load": load_alone,
        "serial:meas": serial,
        "overlapped": overlapped,
    }
    try:
        for fn in modes.values():
            fn()  # warm-up
        samples: dict[str, list[float]] = {m: [] for m in modes}
        for k in range(reps):  # interleaved, alternating order, so slow phases hit every mode
            for m, fn in list(modes.items())[:: 1 if k % 2 == 0 else -1]:
                samples[m].append(fn())
        h2d = links.LinkId(links.LinkKind.H2D, "pe0")
        if traffic.bytes(h2d) != 3 * (reps + 1) * total_bytes:  # load, serial, overlapped
            raise RuntimeError(f"H2D link charged {traffic.bytes(h2d)} bytes")
    finally:
        traffic.close()
        pool.shutdown(wait=False, cancel_futures=True)
        store.close()

    t = {m: statistics.median(v) for m, v in samples.items()}
    t["serial"] = t["compute"] + t["load"]
    t["ideal"] = max(t["compute"], t["load"])
    first = statistics.median(first_layer[-reps:])
    t["pipeline"] = max(first + t["compute"], t["load"] + t["compute"] / n_layers)
    saved = t["serial"] - t["overlapped"]
    per_rep = statistics.median(
        (c + ld - o) / min(c, ld)  # (serial - overlapped) / (serial - ideal) of one rep
        for c, ld, o in zip(samples["compute"], samples["load"], samples["overlapped"])
    )
    order = ("compute", "load", "serial", "serial:meas", "ideal", "pipeline", "overlapped")
    return [
        {
            "section": "overlap",
            "layers": n_layers,
            "cached": cached,
            "new": new,
            "mode": m,
            "kv_mib": total_bytes / 2**20,
            "h2d_mib_per_s": rate / 2**20,
            "seconds": t[m],
            "samples": samples.get(m),  # None for the derived modes
            "efficiency": saved / (t["serial"] - t["ideal"]) if m == "overlapped" else None,
            "rep_efficiency": per_rep if m == "overlapped" else None,
            "pipeline_efficiency": saved / (t["serial"] - t["pipeline"])
            if m == "overlapped"
            else None,
        }
        for m in order
    ]


SECTIONS: dict[str, Callable[[argparse.Namespace], list[dict]]] = {
    "channel": channel_section,
    "overlap": overlap_section,
}


def print_channel_table(rows: list[dict]) -> None:
    head = f"{'section':8} {'block':>6} {'n':>3} {'method':14} {'MiB':>7} {'ms':>9} {'GiB/s':>7} {'x tcp':>6}"
    print(head)
    print("-" * len(head))
    for r in rows:
        print(
            f"{r['section']:8} {r['block']:>6} {r['blocks']:>3} {r['method']:14} "
            f"{r['total_mib']:7.1f} {r['seconds'] * 1e3:9.2f} {r['gib_per_s']:7.3f} "
            f"{r['x_tcp']:6.2f}"
        )


def print_overlap_table(rows: list[dict]) -> None:
    head = f"{'section':8} {'L':>3} {'tokens':>10} {'mode':12} {'KV MiB':>7} {'ms':>9} {'eff':>5} {'eff/rep':>7} {'eff pipe':>8}"
    print(head)
    print("-" * len(head))
    for r in rows:
        eff = "" if r["efficiency"] is None else f"{r['efficiency']:5.2f}"
        per_rep = "" if r["rep_efficiency"] is None else f"{r['rep_efficiency']:7.2f}"
        pipe = "" if r["pipeline_efficiency"] is None else f"{r['pipeline_efficiency']:8.2f}"
        tokens = f"{r['cached']}+{r['new']}"
        print(
            f"{r['section']:8} {r['layers']:>3} {tokens:>10} {r['mode']:12} {r['kv_mib']:7.2f} "
            f"{r['seconds'] * 1e3:9.2f} {eff:>5} {per_rep:>7} {pipe:>8}"
        )
    rates = sorted({(r["layers"], r["h2d_mib_per_s"]) for r in rows})
    print("emulated H2D rate: " + ", ".join(f"L={n}: {x:.1f} MiB/s" for n, x in rates))


TABLES: dict[str, Callable[[list[dict]], None]] = {
    "channel": print_channel_table,
    "overlap": print_overlap_table,
}


def print_table(rows: list[dict]) -> None:
    for i, section in enumerate(dict.fromkeys(r["section"] for r in rows)):
        if i:
            print()
        TABLES[section]([r for r in rows if r["section"] == section])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--role", default="main", choices=["main", "peer"])
    parser.add_argument("--sections", default=",".join(SECTIONS))
    parser.add_argument("--cases", default=",".join(CASES), help="block sizes for `channel`")
    parser.add_argument("--overlap-layers", default="3,12", help="model depths for `overlap`")
    parser.add_argument(
        "--overlap-cached", type=int, default=2048, help="cached tokens (`overlap`)"
    )
    parser.add_argument("--overlap-new", type=int, default=256, help="new tokens (`overlap`)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--json", default="", help="optional path for the rows as JSON")
    args = parser.parse_args()
    if args.role == "peer":
        run_peer()
        return
    rows = []
    for name in args.sections.split(","):
        rows += SECTIONS[name](args)
    print_table(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
