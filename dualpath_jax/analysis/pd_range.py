"""The bottleneck-free P/D range of paper section 4.2 (corrected formulas, see paper/NOTES.md).

Symbols: `P`, `D` prefill / decode nodes; `g` GPUs (engines) per node; `B` one compute NIC's
bandwidth; `s*B` a node's storage NIC bandwidth; `M` a node's DRAM bandwidth. With every storage
NIC saturated and load balanced, per PE-DE GPU pair the PE read path carries
`T_p = B*s/(D*g^2)` and the DE read path `T_c = B*s/(P*g^2)`. Each link gives one bound:

- PE CNIC read   `2*B*s/g <= B`                      (a condition: `s <= g/2`)
- PE CNIC write  `(B*s/g)*(1 + D/P) <= B`            =>  `P/D >= s/(g-s)`
- DE CNIC read   `(s/g)*(P/D + 2)*B <= B`            =>  `P/D <= (g-2s)/s`
- DE CNIC write  `(2*T_p + T_c)*P*g <= B`            =>  `P/D <= (g-s)/(2s)`
- PE DRAM        `2*s*B <= M`                        (a condition)
- DE DRAM        `(3 + 2*P/D)*B*s <= M`              =>  `P/D <= (M/(B*s) - 3)/2`
"""

from __future__ import annotations

import dataclasses
import math
from fractions import Fraction


@dataclasses.dataclass(frozen=True)
class Bound:
    name: str
    kind: str  # "lower" | "upper" (on P/D) | "condition" (independent of P/D)
    value: float  # the bound on P/D; for a condition, the link's load as a fraction of capacity
    formula: str

    @property
    def ok(self) -> bool:
        return self.kind != "condition" or self.value <= 1.0 + 1e-12


@dataclasses.dataclass(frozen=True)
class PDRange:
    """`lower <= P/D <= upper`; `binding_*` name the bounds that attain them."""

    lower: float
    upper: float
    bounds: tuple[Bound, ...]
    binding_lower: tuple[str, ...]
    binding_upper: tuple[str, ...]

    @property
    def feasible(self) -> bool:
        return self.lower <= self.upper and all(b.ok for b in self.bounds)

    def contains(self, prefill_nodes: int, decode_nodes: int) -> bool:
        r = prefill_nodes / decode_nodes
        return self.feasible and self.lower - 1e-12 <= r <= self.upper + 1e-12


def as_fraction(x: float, max_den: int = 64) -> str:
    """`0.142857...` -> "1/7" (the nearest fraction with a small denominator)."""
    f = Fraction(x).limit_denominator(max_den)
    return str(f.numerator) if f.denominator == 1 else f"{f.numerator}/{f.denominator}"


def pd_range(g: int, s: float, mem_gbps: float, bs_gbps: float) -> PDRange:
    """The bottleneck-free P/D range for `g` GPUs per node, storage NIC `s` x one compute NIC,
    DRAM bandwidth `mem_gbps` and storage NIC bandwidth `bs_gbps` (= B*s) per node.

    Raises ValueError with the reason when the arguments leave no range (e.g. `s >= g/2`).
    """
    if not (isinstance(g, int) and g >= 1):
        raise ValueError(f"g (GPUs per node) must be an int >= 1, got {g!r}")
    if not (s > 0 and math.isfinite(s)):
        raise ValueError(f"s (storage NIC / compute NIC bandwidth) must be > 0, got {s!r}")
    if not (mem_gbps > 0 and bs_gbps > 0):
        raise ValueError(f"mem_gbps and bs_gbps must be > 0, got {mem_gbps!r} and {bs_gbps!r}")
    if 2 * s >= g:
        raise ValueError(
            f"s={s} >= g/2={g / 2}: the DE CNIC read bound (g-2s)/s = {(g - 2 * s) / s:.3g} leaves "
            "no positive P/D (a decode node's compute NICs cannot carry the DE read path); "
            "need s < g/2"
        )
    ratio = mem_gbps / bs_gbps
    if ratio <= 3:
        raise ValueError(
            f"M/(B*s) = {mem_gbps}/{bs_gbps} = {ratio:.3g} <= 3: DE DRAM pressure (3 + 2*P/D)*B*s "
            "exceeds M for every P/D > 0; need mem_gbps > 3 * bs_gbps"
        )
    bounds = (
        Bound("PE CNIC read", "condition", 2 * s / g, "2*s/g <= 1"),
        Bound("PE DRAM", "condition", 2 * bs_gbps / mem_gbps, "2*B*s <= M"),
        Bound("PE CNIC write", "lower", s / (g - s), "P/D >= s/(g-s)"),
        Bound("DE CNIC read", "upper", (g - 2 * s) / s, "P/D <= (g-2s)/s"),
        Bound("DE CNIC write", "upper", (g - s) / (2 * s), "P/D <= (g-s)/(2s)"),
        Bound("DE DRAM", "upper", (ratio - 3) / 2, "P/D <= (M/(B*s)-3)/2"),
    )
    lows = [b for b in bounds if b.kind == "lower"]
    ups = [b for b in bounds if b.kind == "upper"]
    lower = max(b.value for b in lows)
    upper = min(b.value for b in ups)
    return PDRange(
        lower=lower,
        upper=upper,
        bounds=bounds,
        binding_lower=tuple(b.name for b in lows if math.isclose(b.value, lower, rel_tol=1e-9)),
        binding_upper=tuple(b.name for b in ups if math.isclose(b.value, upper, rel_tol=1e-9)),
    )


def format_pd_range(r: PDRange) -> str:
    """A few lines for a terminal: the range, each bound, the binding ones."""
    lines = [
        f"bottleneck-free range: {as_fraction(r.lower)} <= P/D <= {as_fraction(r.upper)}"
        f"  ({r.lower:.4g} .. {r.upper:.4g})"
    ]
    for b in r.bounds:
        if b.kind == "condition":
            tag = "ok" if b.ok else "VIOLATED"
            lines.append(f"  {b.name:<14} {b.formula:<24} load {b.value:.3g} of capacity ({tag})")
        else:
            bind = b.name in r.binding_lower or b.name in r.binding_upper
            lines.append(
                f"  {b.name:<14} {b.formula:<24} = {as_fraction(b.value):>6} ({b.value:.4g})"
                + ("  <- binding" if bind else "")
            )
    lines.append(
        f"binding lower: {', '.join(r.binding_lower)}; binding upper: {', '.join(r.binding_upper)}"
    )
    return "\n".join(lines)
