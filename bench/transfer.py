"""Transfer benchmarks between two engine processes on one host.

  python bench/transfer.py [--sections=channel] [--reps=3] [--json=out.json]

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

    from dualpath_jax.transfer.channel import JaxTransferChannel, pack_layer_blocks

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
    from dualpath_jax.transfer.channel import JaxTransferChannel, make_uuid, unpack_layer_blocks

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


SECTIONS: dict[str, Callable[[argparse.Namespace], list[dict]]] = {"channel": channel_section}


def print_table(rows: list[dict]) -> None:
    head = f"{'section':8} {'block':>6} {'n':>3} {'method':14} {'MiB':>7} {'ms':>9} {'GiB/s':>7} {'x tcp':>6}"
    print(head)
    print("-" * len(head))
    for r in rows:
        print(
            f"{r['section']:8} {r['block']:>6} {r['blocks']:>3} {r['method']:14} "
            f"{r['total_mib']:7.1f} {r['seconds'] * 1e3:9.2f} {r['gib_per_s']:7.3f} "
            f"{r['x_tcp']:6.2f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--role", default="main", choices=["main", "peer"])
    parser.add_argument("--sections", default=",".join(SECTIONS))
    parser.add_argument("--cases", default=",".join(CASES), help="block sizes for `channel`")
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
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    main()
