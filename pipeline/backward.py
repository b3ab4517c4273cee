"""A stage's backward in two passes: the input's gradient first (I), the weights' later (W).

Zero-bubble schedules (Qi et al., ICLR 2024) send the input's gradient to the stage before as
soon as it is known and run the weights' part in what would be a bubble. :func:`input_grad`
runs autograd from the stage's output to its input only: every node on a path to the input
runs with the outputs towards the weights masked off (autograd skips what no requested input
needs, e.g. a ``Linear``'s weight product). The nodes of that path where an edge leaves for a
weight ("the frontier") record the gradient that reached them. :class:`WeightGrad` then runs
autograd from those nodes, with those gradients, to the weights only: the frontier nodes run
again for their weight outputs and the weight branches run once. Every gradient is computed
by the same operations on the same operands as one full backward, and accumulated into
``.grad`` by the same ``AccumulateGrad``: I + W equals B bit for bit (tested), with
recompute (a checkpointed region is recomputed once per pass) and with ``memory_budget`` plans.

Cost: the frontier nodes run twice (once per pass, each for its own outputs), and the graph
and its saved tensors are kept from I until W.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge


class WeightGrad:
    """The W pass of one micro-batch on one stage: :meth:`run` accumulates the weights'
    gradients into ``.grad`` (once), then drops the graph."""

    __slots__ = ("_parts", "_full")

    def __init__(self, parts: List[Tuple[List[GradientEdge], List[torch.Tensor], List[torch.Tensor]]],
                 full: Optional[Tuple[List[torch.Tensor], Optional[List[torch.Tensor]]]] = None) -> None:
        self._parts, self._full = parts, full  # per frontier node: (its edges, their gradients, its weights)

    @property
    def whole(self) -> bool:
        """Whether this W pass is the whole backward (the I pass computed nothing)."""
        return self._full is not None

    def run(self) -> None:
        if self._full is not None:  # no input gradient was asked for: the whole backward is the weights'
            outs, grads = self._full
            if outs:
                torch.autograd.backward(outs, grads)
        for edges, grads, weights in self._parts:
            # one call per frontier node: with every node's weights as inputs at once, a node's
            # gradient would also flow down the input's path into the deeper nodes, counted twice
            torch.autograd.backward(edges, grads, inputs=weights)
        self._parts, self._full = [], None


def input_grad(outs: Sequence[torch.Tensor], grads: Optional[Sequence[torch.Tensor]], xs: Sequence[torch.Tensor],
               weights: Sequence[torch.Tensor]) -> Tuple[List[Optional[torch.Tensor]], WeightGrad]:
    """``(d outs / d x for each of xs, the W pass)`` for ``outs`` backpropagated with ``grads``
    (``None`` for a scalar loss); a gradient is None where no output depends on that input.
    No ``xs`` (the first stage's inputs need no gradient): no I work, the W pass is the whole
    backward."""
    outs, grads = list(outs), None if grads is None else list(grads)
    if not xs or not outs:
        return [None] * len(xs), WeightGrad([], full=(outs, grads))
    targets = {get_gradient_edge(x).node for x in xs}
    by_node = {get_gradient_edge(w).node: w for w in weights if w.requires_grad}
    to_x = _reaching([o.grad_fn for o in outs if o.grad_fn is not None], targets)
    if any(o.grad_fn not in to_x for o in outs):  # an output no input reaches has no frontier: B at once
        return _whole(outs, grads, xs)
    frontier: List[Tuple[Any, List[torch.Tensor]]] = []  # (node, the weights its other edges lead to)
    claimed: Set[Any] = set()
    for n in to_x:
        if n in targets:
            continue
        mine = _weights_below([c for c, _ in n.next_functions if c is not None and c not in to_x], by_node)
        if mine:
            if claimed & set(mine):  # a weight reached from two frontier nodes (shared weights): B at once
                return _whole(outs, grads, xs)
            claimed.update(mine)
            frontier.append((n, [by_node[k] for k in mine]))
    caught: Dict[Any, Tuple[Optional[torch.Tensor], ...]] = {}
    handles = [n.register_prehook(_catch(caught, n)) for n, _ in frontier]
    try:
        dxs: List[Optional[torch.Tensor]] = list(torch.autograd.grad(outs, list(xs), grads, retain_graph=True,
                                                                     allow_unused=True))
    finally:
        for h in handles:
            h.remove()
    parts = []
    for n, ws in frontier:
        edges = [(GradientEdge(n, i), g) for i, g in enumerate(caught.get(n, ())) if g is not None]
        if edges:
            parts.append(([e for e, _ in edges], [g for _, g in edges], ws))
    return dxs, WeightGrad(parts)


def _whole(outs: List[torch.Tensor], grads: Optional[List[torch.Tensor]], xs: Sequence[torch.Tensor]
           ) -> Tuple[List[Optional[torch.Tensor]], WeightGrad]:
    """The full backward now (the inputs' gradients and the weights'); nothing left for W."""
    was = [x.grad for x in xs]
    for x in xs:
        x.grad = None
    torch.autograd.backward(outs, grads)
    dxs: List[Optional[torch.Tensor]] = [x.grad for x in xs]
    for x, g in zip(xs, was):
        x.grad = g
    return dxs, WeightGrad([])


def _catch(caught: Dict[Any, Tuple[Optional[torch.Tensor], ...]], node: Any) -> Any:
    def hook(grad_outputs: Tuple[Optional[torch.Tensor], ...]) -> None:
        caught[node] = tuple(grad_outputs)
    return hook


def _reaching(roots: List[Any], targets: Set[Any]) -> Set[Any]:
    """The nodes of the graph below ``roots`` from which one of ``targets`` is reachable
    (iterative: graphs can be deeper than Python's recursion limit)."""
    found: Set[Any] = set()
    seen: Set[Any] = set()
    stack: List[Tuple[Any, bool]] = [(root, False) for root in roots]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            if node in targets or any(c in found for c, _ in node.next_functions if c is not None):
                found.add(node)
            continue
        if node in seen:
            continue
        seen.add(node)
        stack.append((node, True))
        stack.extend((c, False) for c, _ in node.next_functions if c is not None and c not in seen)
    return found


def _weights_below(roots: List[Any], by_node: Dict[Any, torch.Tensor]) -> List[Any]:
    """The weights' gradient nodes reachable from ``roots`` (in the order first met)."""
    out: List[Any] = []
    seen: Set[Any] = set()
    stack = list(roots)
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if node in by_node:
            out.append(node)
        stack.extend(c for c, _ in node.next_functions if c is not None and c not in seen)
    return out
