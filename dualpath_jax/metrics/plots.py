"""Figures of a policy comparison, in the style of the paper's Figures 7, 12 and 13."""

from __future__ import annotations

import pathlib

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from dualpath_jax.metrics.summary import read_link_reports  # noqa: E402


def snic_series(
    workdir: pathlib.Path, window_s: float = 1.0
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per storage NIC (read side): window start times (s from the run's first byte) and MB/s."""
    raw = {}
    for r in read_link_reports(workdir):
        for name, pts in r.get("windows", {}).items():
            if name.startswith("snic_rx:") and pts:
                raw[f"{name.split(':', 1)[1]} ({'PE' if r['role'] == 'prefill' else 'DE'})"] = pts
    if not raw:
        return {}
    t0 = min(p[0][0] for p in raw.values())
    out = {}
    for name, pts in raw.items():
        t = np.array([p[0] for p in pts]) - t0
        b = np.array([p[1] for p in pts])
        k = np.floor(t / window_s).astype(int)
        sums = np.bincount(k, weights=b)
        out[name] = (np.arange(len(sums)) * window_s, sums / window_s / 1e6)
    return out


def plot_comparison(
    result: dict, workdir: str | pathlib.Path, path: str | pathlib.Path
) -> pathlib.Path:
    """JCT per policy, the TTFT breakdown, and storage-NIC traffic over time (round robin vs the
    DualPath scheduler when both ran) in one PNG."""
    workdir = pathlib.Path(workdir)
    s = result["summaries"]
    pols = list(s)
    timeline = [p for p in ("dualpath_rr", "dualpath", "basic") if p in s][:2]
    fig, axes = plt.subplots(1, 2 + len(timeline), figsize=(5 * (2 + len(timeline)), 4))
    ax = axes[0]
    jct = [s[p]["jct_s"] for p in pols]
    bars = ax.bar(
        pols,
        jct,
        color=["#999" if p == "basic" else "#2a7" if p == "oracle" else "#36c" for p in pols],
    )
    base = s.get("basic", {}).get("jct_s")
    for b, v in zip(bars, jct):
        ax.text(
            b.get_x() + b.get_width() / 2,
            v,
            f"{v:.0f}s" + (f"\n{base / v:.2f}x" if base else ""),
            ha="center",
            va="bottom",
            fontsize=8,
        )
    ax.set_ylim(0, max(jct) * 1.2)
    ax.set_ylabel("JCT (s)")
    ax.set_title(
        f"JCT, {result.get('config', '')}" + (" (emulated links)" if result.get("emulated") else "")
    )
    ax.tick_params(axis="x", rotation=30)
    ax = axes[1]
    bottom = np.zeros(len(pols))
    for part, color in (("queueing", "#bbb"), ("kv_read", "#e94"), ("prefill", "#36c")):
        vals = np.array([s[p]["ttft_breakdown_s"][part]["mean"] for p in pols])
        ax.bar(pols, vals, bottom=bottom, label=part, color=color)
        bottom += vals
    ax.set_ylabel("mean seconds")
    ax.set_title("TTFT breakdown")
    ax.legend(fontsize=8)
    ax.tick_params(axis="x", rotation=30)
    for ax, p in zip(axes[2:], timeline):
        for name, (t, mbps) in sorted(snic_series(workdir / p).items()):
            ax.plot(t, mbps, label=name)
        ax.set_title(f"storage NIC reads, {p} (max/avg {s[p]['snic_max_over_avg']:.2f})")
        ax.set_xlabel("time (s)")
        ax.set_ylabel("MB/s")
        ax.legend(fontsize=7)
    fig.tight_layout()
    path = pathlib.Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
