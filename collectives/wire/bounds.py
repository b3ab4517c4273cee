"""Bounded payloads: variable-size payloads exchanged at an agreed capacity, as fixed-size ones."""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

from .layouts import Item, Layout, SizedLayout, Shape, signature


def exact_sizes(specs: list) -> bool:
    """Whether payload sizes may differ between ranks (so they travel point to point)."""
    return not all(s.base.fixed_size for s in specs)


# ---- bounded payloads: variable sizes at an agreed capacity ----------------------------------
# A sized exchange shows every rank every rank's sizes. Where every variable-size payload of the
# set comes from a compressor that can bound its payloads (``Compressor.bounded_sizes``) under
# error feedback (which keeps whatever does not fit), the ranks derive from those sizes, alike,
# a capacity per payload (:func:`capacity`) and a fixed :class:`Layout` of payloads that size.
# The next ``REAGREE`` exchanges of the set compress to exactly that size
# (``compress.sparse.payload_bounds``) and travel as fixed-size payloads: no size vector, no
# host read. Then one sized exchange again measures the sizes and sets new capacities. Every
# rank counts the set's exchanges alike, so all take the same path each time.
REAGREE = 32  # bounded exchanges between two sized ones
SPARE = 0.5  # capacity above the largest size seen: this fraction of it ...
SPARE_MIN = 64  # ... and at least this many elements (never more than the tensor has)


def capacity(count: int, numel: int) -> int:
    """The capacity of a payload whose largest size at the last sized exchange was ``count``
    elements (of a tensor of ``numel``)."""
    return min(numel, count + max(int(count * SPARE), SPARE_MIN))


def bounded_set(specs: list) -> bool:
    """Whether a set's variable-size payloads may all be bounded: each from a compressor with
    ``bounded_sizes``, under error feedback."""
    return all(s.base.fixed_size or (s.base.bounded_sizes and s.feedback is not None) for s in specs)


class Bounds:
    """The agreed layout of a set of variable-size payloads (``sized``: a :class:`SizedLayout`,
    or the algorithm's structure of them) and, once a sized exchange has set them, the
    capacities per compressor key and the fixed layout(s) of payloads that size."""

    def __init__(self, sized: Any, bounded: bool) -> None:
        self.sized, self.bounded = sized, bounded
        self.caps: Optional[Dict[str, int]] = None
        self.fixed: Any = None
        self.left = 0  # bounded exchanges before the next sized one

    def local_caps(self) -> Optional[Dict[str, int]]:
        """The capacities the next exchange's local phase compresses to, or None (sized)."""
        return self.caps if self.left > 0 else None

    def begin(self) -> bool:
        """Whether this exchange is a bounded one (counted): what :meth:`local_caps` said."""
        if self.left > 0:
            self.left -= 1
            return True
        return False

    def set(self, caps: Optional[Dict[str, int]], fixed: Any) -> None:
        """After a sized exchange of a ``bounded`` set: the next ``REAGREE`` are bounded (None:
        the next stays sized)."""
        if caps is not None:
            self.caps, self.fixed, self.left = caps, fixed, REAGREE


def local_bounds(layouts: Optional[dict], algorithm: str, size: int, items: List[Item], specs: list
                 ) -> Optional[Dict[str, int]]:
    """The capacities for a set's local phase (:func:`payload_bounds`), or None."""
    if layouts is None or not exact_sizes(specs):
        return None
    entry = layouts.get(signature(algorithm, size, items, specs))
    return entry.local_caps() if isinstance(entry, Bounds) else None


def bounded_layout(layout: SizedLayout, rows: Sequence[Sequence[int]], bound: Sequence[bool]
                   ) -> Optional[Tuple[List[Optional[int]], Layout]]:
    """From every rank's announced leading dimensions (``rows``, one per rank, ``layout.count``
    each): a capacity per tensor (None for one not ``bound``) and the :class:`Layout` of
    payloads of those sizes (the others at their announced sizes). None when a tensor that is
    not bound announced different sizes on different ranks (it stays sized)."""
    caps: List[Optional[int]] = []
    shapes: List[Any] = []
    at = 0
    for s, n, b in zip(layout.structures, layout.counts, bound):
        if s is None:
            caps.append(None)
            shapes.append(None)
            continue
        dims = [list(row[at:at + n]) for row in rows]
        at += n
        if b and n and all(t == 0 for t in s.ties):  # one count: every leading dimension tied to the first
            c = capacity(max(d[0] for d in dims), s.numel)
            caps.append(c)
            shapes.append(Shape(s, [c] * n))
        elif all(d == dims[0] for d in dims):
            caps.append(None)
            shapes.append(Shape(s, dims[0]))
        else:
            return None
    return caps, Layout(shapes)
