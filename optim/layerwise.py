"""``LayerNorms``: per-layer norms that are right when the tensors are shards.

LAMB and LARS scale each layer's update by a trust ratio ``||w|| / ||update||``. On a whole
tensor (one process, or data parallel where every rank holds the averaged gradient) a layer
is a tensor. Under sharding (``gradcomp.memory.ShardedOptimizer``) a rank holds slices of
several layers, and a local norm is wrong; the sharded optimizer then calls
``shard_layout(layout, num_layers, group)`` on the inner optimizer (its class attribute
``layerwise = True`` says it needs this):

- ``layout[i]``: for the ``i``-th tensor of the inner optimizer (in ``param_groups`` order),
  the ``(layer, start, stop)`` slices of that flat shard that belong to parameter ``layer``;
- every step the squared norms of the local slices are summed per layer into ONE float64
  tensor of shape ``(k, num_layers)``, all-reduced (SUM, dense) over ``group``; the square
  roots are the whole layers' norms on every rank. A rank without a slice of a layer adds 0.

fp64 partial sums make the result independent of how the layer is split, up to fp64 rounding.
Everything stays on the tensors' device (the all-reduced tensor too, as NCCL requires): no host
copy and no host sync here; the optimizers read the norms' finiteness once per step.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from gradcomp.collectives.worker import submit

Slices = List[Tuple[int, int, int]]


class LayerNorms:
    """Norms per layer of ``count`` tensors: each its own layer until :meth:`set_layout`."""

    def __init__(self, count: int, what: str) -> None:
        self.count = count
        self.what = what
        self.layout: Optional[List[Slices]] = None
        self.num_layers = count
        self.group = None

    def set_layout(self, layout: Sequence[Sequence[Tuple[int, int, int]]], num_layers: int, group,
                   numels: Sequence[int]) -> None:
        """Take the sharding contract's layout (see the module docstring), checked against the
        shard tensors' sizes ``numels``."""
        if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
            raise ValueError(f"{self.what}.shard_layout: num_layers={num_layers!r} must be an int >= 1")
        if len(layout) != self.count:
            raise ValueError(f"{self.what}.shard_layout: layout has {len(layout)} entries, the optimizer holds "
                             f"{self.count} tensors (one entry per tensor, in param_groups order)")
        checked: List[Slices] = []
        for i, (slices, numel) in enumerate(zip(layout, numels)):
            row: Slices = []
            for entry in slices:
                layer, start, stop = (int(v) for v in entry)
                if not (0 <= layer < num_layers and 0 <= start <= stop <= numel):
                    raise ValueError(f"{self.what}.shard_layout: slice {tuple(entry)} of tensor {i} is out of range "
                                     f"(layers 0..{num_layers - 1}, elements 0..{numel})")
                row.append((layer, start, stop))
            checked.append(row)
        self.layout, self.num_layers, self.group = checked, num_layers, group

    def norms(self, rows: Sequence[Sequence[Optional[torch.Tensor]]]) -> torch.Tensor:
        """``(k, num_layers)`` float64 norms on the tensors' device: row ``c`` of ``rows[c][i]``
        (tensor ``i``'s quantity ``c``, or None for nothing) per layer. One all-reduce under a layout."""
        present = [t for tensors in rows for t in tensors if t is not None]
        device = present[0].device if present else torch.device("cpu")
        # per (quantity, layer), the sum of its slices' squares, in slice order (deterministic,
        # unlike an index_add on a GPU); device scalars only: nothing is copied to the host
        sums: Dict[int, torch.Tensor] = {}
        for c, tensors in enumerate(rows):
            for i, t in enumerate(tensors):
                if t is None:
                    continue
                flat = t.detach().reshape(-1).double()
                slices = [(i, 0, flat.numel())] if self.layout is None else self.layout[i]
                for layer, start, stop in slices:
                    piece = flat[start:stop]
                    at = c * self.num_layers + layer
                    sq = torch.dot(piece, piece)
                    sums[at] = sq if at not in sums else sums[at] + sq
        zero = torch.zeros((), dtype=torch.float64, device=device)
        table = torch.stack([sums.get(at, zero) for at in range(len(rows) * self.num_layers)])
        table = table.view(len(rows), self.num_layers)
        if self.layout is not None and dist.is_available() and dist.is_initialized():
            # after gradcomp's jobs in flight, never beside them (one thread per communicator)
            submit(lambda twin: dist.all_reduce(table, group=twin(self.group)), (self.group,), False,
                   device=table.device)
        return table.sqrt()

    def scale_(self, i: int, t: torch.Tensor, per_layer: torch.Tensor) -> torch.Tensor:
        """Multiply tensor ``i``'s ``t`` (flat-indexable like the shard) by its layer's factor
        from ``per_layer`` (``num_layers`` values), in place."""
        if self.layout is None:
            return t.mul_(per_layer[i].to(t.dtype))
        flat = t.view(-1)
        for layer, start, stop in self.layout[i]:
            flat[start:stop].mul_(per_layer[layer].to(t.dtype))
        return t


class Layerwise:
    """Mixin of the optimizers that need per-layer norms (``layerwise = True``)."""

    layerwise = True
    norms_of: LayerNorms

    def shard_layout(self, layout: Sequence[Sequence[Tuple[int, int, int]]], num_layers: int, group=None) -> None:
        """Called by a sharded optimizer after it built this one on its shards: see
        :mod:`gradcomp.optim.layerwise`."""
        params = [p for g in self.param_groups for p in g["params"]]  # type: ignore[attr-defined]
        self._check_sharding()
        self.norms_of.set_layout(layout, num_layers, group, [p.numel() for p in params])

    def _check_sharding(self) -> None:
        """Refuse sharding when an option needs more than the one collective per step."""
