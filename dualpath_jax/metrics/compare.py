"""The side-by-side policy comparison's table (`experiment.compare` runs the policies).

Used by `bench/compare_policies.py` and `make demo`.
"""

from __future__ import annotations

# The paper's ablation order (Fig. 12 right) and its JCT reductions vs Basic (DS 660B, 64K).
ABLATION = ("basic", "layerwise", "dualpath_rr", "dualpath")
PAPER_ABLATION_PCT = {"layerwise": 17.21, "dualpath_rr": 38.19, "dualpath": 45.62}


def table(result: dict) -> str:
    """The comparison table: JCT and ratios, bytes per read path, storage-NIC Max/Avg, TTFT
    breakdown (mean seconds)."""
    s = result["summaries"]
    base = s.get("basic", {}).get("jct_s")
    oracle = s.get("oracle", {}).get("jct_s")
    head = (
        f"{'policy':<12}{'JCT s':>8}{'Basic/x':>9}{'x/Oracle':>9}{'PE-path MB':>12}{'DE-path MB':>12}"
        f"{'SNIC max/avg':>13}{'TTFT p50':>9}{'queue':>7}{'read':>7}{'prefill':>8}{'recomp':>7}"
    )
    lines = [head, "-" * len(head)]
    for p, x in s.items():
        b = x["ttft_breakdown_s"]
        lines.append(
            f"{p:<12}{x['jct_s']:8.1f}"
            f"{(base / x['jct_s'] if base else float('nan')):9.2f}"
            f"{(x['jct_s'] / oracle if oracle else float('nan')):9.2f}"
            f"{x['bytes_read_pe_path'] / 1e6:12.1f}{x['bytes_read_de_path'] / 1e6:12.1f}"
            f"{x['snic_max_over_avg']:13.2f}{x['ttft_s']['p50']:9.3f}"
            f"{b['queueing']['mean']:7.3f}{b['kv_read']['mean']:7.3f}{b['prefill']['mean']:8.3f}"
            f"{x['recomputed_blocks']:7d}"
        )
    if base and all(p in s for p in ABLATION):
        steps = ", ".join(
            f"+{p}: {100 * (1 - s[p]['jct_s'] / base):.1f}% (paper {PAPER_ABLATION_PCT[p]}%)"
            for p in ABLATION[1:]
        )
        lines.append(f"ablation, JCT reduction vs basic: {steps}")
    lines.append(
        "tokens identical across policies: "
        + ("yes" if result["tokens_identical"] else f"NO ({len(result['mismatches'])} mismatches)")
    )
    if result.get("emulated"):
        lines.append("links are emulated (token buckets on one CPU host), see configs/")
    return "\n".join(lines)
