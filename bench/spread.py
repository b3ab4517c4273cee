"""Run-to-run spread of the benchmarks' timings, and when two of them are a tie.

A median alone ranks methods that the machine's noise cannot tell apart (dense allreduce ran
21-34 ms within one loopback run). Every timed figure the reports compare carries its
**middle half**: the first to the third quartile of its calls (``statistics.quantiles``,
inclusive method: with 5 calls, the 2nd and 4th fastest). Two methods whose middle halves
overlap are a **tie**: the report says so instead of naming a winner. The same rule decides
the colour of the speed-up bars (faster than dense, slower, or within noise of it).
"""
from __future__ import annotations

import statistics
from typing import Optional, Sequence, Tuple

Span = Tuple[float, float]


def middle_half(values: Sequence[float]) -> Span:
    """``(q1, q3)`` of ``values`` (one value: that value twice)."""
    vals = [float(v) for v in values]
    if not vals:
        raise ValueError("no values to take a spread of")
    if len(vals) == 1:
        return vals[0], vals[0]
    q1, _, q3 = statistics.quantiles(vals, n=4, method="inclusive")
    return q1, q3


def overlap(a: Span, b: Span) -> bool:
    """Whether two spans share a point (a tie)."""
    return a[0] <= b[1] and b[0] <= a[1]


def versus(mine: Span, theirs: Span) -> str:
    """``"faster"`` when every time of ``mine``'s middle half is below ``theirs``, ``"slower"``
    when above, else ``"tie"`` (times: lower is faster)."""
    if mine[1] < theirs[0]:
        return "faster"
    if mine[0] > theirs[1]:
        return "slower"
    return "tie"


def ratio_span(num: Span, den: Span) -> Span:
    """The span of ``num / den`` when each may lie anywhere in its span (a speed-up's spread:
    dense's time over the method's)."""
    lo = num[0] / den[1] if den[1] > 0 else float("inf")
    hi = num[1] / den[0] if den[0] > 0 else float("inf")
    return lo, hi


def fmt_span(span: Optional[Span], spec: str = ".1f", unit: str = "") -> str:
    """``"21.0-34.0"`` (``"-"`` when there is none)."""
    if span is None:
        return "-"
    return f"{format(span[0], spec)}-{format(span[1], spec)}{unit}"
