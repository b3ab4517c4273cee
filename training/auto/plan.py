"""``compressor="auto"``'s plan: a pure function from measurements to a choice per bucket.

Every rank runs :func:`plan` on the same MAX-reduced numbers, so every rank decides alike.
The worker exchanges buckets one after another from the moment each is submitted, so a
bucket's exchange hides behind the rest of backward and the last ones do not: the plan
minimises the step's exposed time (the last finish minus the last submission), takes a
compressed method for a bucket only when it beats dense by ``margin``, then gives each bucket,
earliest first, the most faithful candidate (the candidates' order) that keeps the exposed
time within ``tolerance`` of the step, and finally falls back to all-dense when that is
predicted no slower.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import AbstractSet, Dict, Hashable, List, Mapping, Optional, Sequence, TypeVar

from ..policy import DENSE

__all__ = ["Option", "PlanBucket", "plan"]

K = TypeVar("K", bound=Hashable)  # a bucket's key (auto's: its parameter names)


@dataclass(frozen=True)
class Option:
    """A candidate as the plan sees it: its label and whether it is light (8 or more bits per
    element: what Accordion's critical regime allows)."""

    label: str
    light: bool = True


@dataclass
class PlanBucket:
    """One bucket as the plan sees it."""

    ready_ms: float  # its submission, from the iteration's first bucket's
    costs: Mapping[str, float]  # predicted ms per candidate label (dense always among them)
    open: bool = True  # to decide now; else it keeps ``choice``
    choice: Optional[str] = None  # its current choice
    critical: bool = False  # Accordion's critical regime: light candidates only
    failed: bool = False  # a choice measured slower than predicted: only measured methods
    measured: AbstractSet[str] = field(default_factory=frozenset)  # methods whose real exchanges were timed


def plan(buckets: Mapping[K, PlanBucket], options: Sequence[Option], margin: float,
         tolerance: float) -> Dict[K, Optional[str]]:
    """The choice per bucket (``buckets`` in submission order; ``options`` most faithful
    first): see the module docstring. Buckets not open keep their choice."""
    order = list(buckets)
    pref = {o.label: i for i, o in enumerate(options)}
    light = {o.label: o.light for o in options}
    ready = [buckets[k].ready_ms for k in order]

    def exposed(choice: Sequence[Optional[str]]) -> float:
        f = 0.0
        for k, r, c in zip(order, ready, choice):
            costs = buckets[k].costs
            f = max(f, r) + costs.get(c or DENSE, costs[DENSE])
        return f - (ready[-1] if ready else 0.0)

    def allowed(k: K) -> List[str]:
        b = buckets[k]
        return [o.label for o in options if o.label in b.costs and (not b.critical or light[o.label])
                and (not b.failed or o.label in b.measured)]

    choice: List[Optional[str]] = []
    for k in order:
        b = buckets[k]
        if not b.open:
            choice.append(b.choice)
            continue
        dense = b.costs[DENSE]
        best = min(allowed(k), key=lambda c: (b.costs[c], pref[c]))
        choice.append(best if b.costs[best] <= (1 - margin) * dense else DENSE)
    best_time = exposed(choice)
    slack = tolerance * (ready[-1] - ready[0] + best_time) if ready else 0.0
    for i, k in enumerate(order):  # earliest first: they have the most backward to hide behind
        if not buckets[k].open:
            continue
        for c in sorted(allowed(k), key=pref.__getitem__):
            if pref[c] >= pref[choice[i] or DENSE]:
                break
            trial = choice[:i] + [c] + choice[i + 1:]
            if exposed(trial) <= best_time + slack:
                choice[i] = c
                break
    dense_all = [DENSE if buckets[k].open else buckets[k].choice for k in order]
    if exposed(dense_all) <= exposed(choice) * (1 + margin) and margin:
        choice = dense_all
    return {k: c for k, c in zip(order, choice)}
