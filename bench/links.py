"""Emulated links: achieved rate and HIGH/LOW shares of the TrafficManager, in real time.

For each rate: (1) saturate one link with 4 threads of mixed classes and report the achieved rate
against the configured one; (2) saturate it with HIGH and LOW together and report HIGH's share of
the bytes (the configured 99:1 is 0.99); (3) leave HIGH idle and report LOW's rate; (4) issue
one 64 KiB HIGH request while LOW saturates the link and report its latency in link-chunk times.
Numbers come from the links' own byte counters over wall-clock intervals.

  python bench/links.py [--rates=8e6,64e6,512e6] [--seconds=1.0] [--chunk_kib=64]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import time

from dualpath_jax.config import HardwareConfig
from dualpath_jax.transfer.links import LinkId, LinkKind, TrafficClass
from dualpath_jax.transfer.traffic import LinkClosedError
from dualpath_jax.transfer.traffic import TrafficManager as TM

HIGH, LOW = TrafficClass.HIGH, TrafficClass.LOW
LINK = LinkId(LinkKind.SNIC_RX, "node0")


def manager(rate: float, chunk: int) -> TM:
    return TM(HardwareConfig(snic_bytes_per_s=rate, emulated=True), chunk_bytes=chunk)


def saturated_rate(rate: float, seconds: float, chunk: int) -> float:
    n = int(rate * seconds) // 4
    with manager(rate, chunk) as tm:
        t0 = time.monotonic()
        futs = [tm.submit([LINK], n, HIGH if i % 2 else LOW) for i in range(4)]
        concurrent.futures.wait(futs)
        return 4 * n / (time.monotonic() - t0)


def shares(rate: float, seconds: float, chunk: int) -> tuple[float, float, float]:
    """HIGH share while both saturate, LOW rate while HIGH is idle, small-HIGH latency (s)."""
    tm = manager(rate, chunk)
    high = tm.submit([LINK], int(rate * seconds), HIGH)
    low = tm.submit([LINK], 10**15, LOW)
    high.result()
    hi, lo = tm.bytes(LINK, HIGH), tm.bytes(LINK, LOW)
    t1, b1 = time.monotonic(), lo
    time.sleep(seconds / 2)
    low_rate = (tm.bytes(LINK, LOW) - b1) / (time.monotonic() - t1)
    t2 = time.monotonic()
    tm.transfer([LINK], 64 * 1024, HIGH)
    latency = time.monotonic() - t2
    tm.close()
    try:
        low.result()
    except LinkClosedError:
        pass
    return hi / (hi + lo), low_rate, latency


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rates", default="8e6,64e6,512e6")
    ap.add_argument("--seconds", type=float, default=1.0)
    ap.add_argument("--chunk_kib", type=int, default=64)
    args = ap.parse_args()
    chunk = args.chunk_kib * 1024
    print(f"emulated links, chunk {args.chunk_kib} KiB, {args.seconds:g} s per measurement")
    print(
        f"{'rate MB/s':>10} {'achieved/rate':>14} {'HIGH share':>11} {'LOW alone/rate':>15} "
        f"{'64KiB HIGH latency ms':>22} {'(chunk time ms)':>16}"
    )
    for rate in (float(x) for x in args.rates.split(",")):
        achieved = saturated_rate(rate, args.seconds, chunk)
        share, low_rate, latency = shares(rate, args.seconds, chunk)
        print(
            f"{rate / 1e6:>10.0f} {achieved / rate:>14.4f} {share:>11.4f} "
            f"{low_rate / rate:>15.4f} {latency * 1e3:>22.2f} {chunk / rate * 1e3:>16.2f}"
        )


if __name__ == "__main__":
    main()
