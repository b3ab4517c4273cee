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
                 full: Optional[Tuple[torch.Tensor, Optional[torch.Tensor]]] = None) -> None:
        self._parts, self._full = parts, full  # per frontier node: (its edges, their gradients, its weights)

    @property
    def whole(self) -> bool:
        """Whether this W pass is the whole backward (the I pass computed nothing)."""
        return self._full is not None

    def run(self) -> None:
        if self._full is not None:  # no input gradient was asked for: the whole backward is the weights'
            out, grad = self._full
            torch.autograd.backward(out, grad)
        for edges, grads, weights in self._parts:
            # one call per frontier node: with every node's weights as inputs at once, a node's
            # gradient would also flow down the input's path into the deeper nodes, counted twice
            torch.autograd.backward(edges, grads, inputs=weights)
        self._parts, self._full = [], None


def input_grad(out: torch.Tensor, grad: Optional[torch.Tensor], x: Any, weights: Sequence[torch.Tensor]
               ) -> Tuple[Optional[torch.Tensor], WeightGrad]:
    """``(d out / d x, the W pass)`` for ``out`` backpropagated with ``grad`` (``None`` for a
    scalar loss). ``x`` not requiring a gradient (the first stage's inputs): no I work, the W
    pass is the whole backward."""
    if not isinstance(x, torch.Tensor) or not x.requires_grad or out.grad_fn is None:
        return None, WeightGrad([], full=(out, grad))
    target = get_gradient_edge(x).node
    by_node = {get_gradient_edge(w).node: w for w in weights if w.requires_grad}
    to_x = _reaching(out.grad_fn, target)
    frontier: List[Tuple[Any, List[torch.Tensor]]] = []  # (node, the weights its other edges lead to)
    claimed: Set[Any] = set()
    for n in to_x:
        if n is target:
            continue
        mine = _weights_below([c for c, _ in n.next_functions if c is not None and c not in to_x], by_node)
        if mine:
            if claimed & set(mine):  # a weight reached from two frontier nodes (shared weights): B at once
                return _whole(out, grad, x)
            claimed.update(mine)
            frontier.append((n, [by_node[k] for k in mine]))
    caught: Dict[Any, Tuple[Optional[torch.Tensor], ...]] = {}
    handles = [n.register_prehook(_catch(caught, n)) for n, _ in frontier]
    try:
        (dx,) = torch.autograd.grad(out, [x], grad, retain_graph=True)
    finally:
        for h in handles:
            h.remove()
    parts = []
    for n, ws in frontier:
        edges = [(GradientEdge(n, i), g) for i, g in enumerate(caught.get(n, ())) if g is not None]
        if edges:
            parts.append(([e for e, _ in edges], [g for _, g in edges], ws))
    return dx, WeightGrad(parts)


def _whole(out: torch.Tensor, grad: Optional[torch.Tensor], x: torch.Tensor
           ) -> Tuple[Optional[torch.Tensor], WeightGrad]:
    """The full backward now (the input's gradient and the weights'); nothing left for W."""
    was, x.grad = x.grad, None
    torch.autograd.backward(out, grad)
    dx, x.grad = x.grad, was
    return dx, WeightGrad([])


def _catch(caught: Dict[Any, Tuple[Optional[torch.Tensor], ...]], node: Any) -> Any:
    def hook(grad_outputs: Tuple[Optional[torch.Tensor], ...]) -> None:
        caught[node] = tuple(grad_outputs)
    return hook


def _reaching(root: Any, target: Any) -> Set[Any]:
    """The nodes of the graph below ``root`` from which ``target`` is reachable (iterative:
    graphs can be deeper than Python's recursion limit)."""
    found: Set[Any] = set()
    seen: Set[Any] = set()
    stack: List[Tuple[Any, bool]] = [(root, False)]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            if node is target or any(c in found for c, _ in node.next_functions if c is not None):
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
