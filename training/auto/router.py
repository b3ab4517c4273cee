"""Applying ``compressor="auto"``'s decisions to buckets: each parameter's owed residual
moves with it when its bucket changes method, so no gradient mass is lost.

What a method owes a parameter is its error feedback's to say (``ErrorFeedback.owed(name)``,
``ErrorFeedback.take(name)``: its residual and, on more than two ranks, scatter-reduce's
server residual of its chunk). On a change it is taken from the old method's codec and put
into the new one's residual, or, when the new method keeps none (dense, a 16-bit cast), held
as a carry that the bucket's next exchange adds to the gradient: a change of the iteration's
transaction, so a skipped iteration gives it back and it goes with the next gradient.
"""
from __future__ import annotations

import math
from typing import Any, Dict, Optional, Sequence

import torch

from gradcomp.compress import ErrorFeedback, transaction

from ..policy import DENSE
from .candidates import AutoPolicy

__all__ = ["Router"]


class Router:
    """Moves owed residuals between the candidates' codecs of ``policy`` and holds the carry
    for methods that keep none."""

    def __init__(self, policy: AutoPolicy) -> None:
        self.policy = policy
        self.carry: Dict[str, torch.Tensor] = {}  # owed residual to add to the next gradient (dense/cast)

    def switch(self, names: Sequence[str], metas: Sequence[torch.Tensor], iteration: int, old: Optional[str],
               new: Optional[str]) -> int:
        """Parameters ``names`` (of shapes and dtypes ``metas``) go from method ``old`` (None:
        on trial, dense) to ``new``: carry what each owes across. Returns how many moved."""
        p = self.policy
        old_c, new_c = p.by_label.get(old) if old else None, p.by_label[new or DENSE]
        moved = 0
        for name, meta in zip(names, metas):
            src = None if old_c is None or old_c.policy is None else old_c.policy.route(name, meta, iteration)
            dst = None if new_c.policy is None else new_c.policy.route(name, meta, iteration)
            if src is dst:
                continue
            owed = self.take(src, name, meta.shape)
            if owed is None:
                continue
            moved += 1
            if isinstance(dst, ErrorFeedback):
                if name in self.carry:
                    owed = owed + self.carry.pop(name).view(owed.shape)
                held = dst.residual(name)
                dst.update(name, owed + held.view(owed.shape) if held.dim() else owed, torch.zeros_like(owed))
            else:
                self.carry[name] = owed if name not in self.carry else self.carry[name] + owed
        return moved

    @staticmethod
    def take(codec: Any, name: str, shape: torch.Size) -> Optional[torch.Tensor]:
        """Remove and return what ``codec`` owes parameter ``name`` (None when nothing): its
        error feedback's residual and scatter-reduce server residual (``ErrorFeedback.take``)."""
        if not isinstance(codec, ErrorFeedback):
            return None
        owed = codec.take(name)
        return None if owed is None else owed.reshape(shape)

    def add_carry(self, items: Sequence[Any]) -> None:
        """Add the carry of each gradient of ``items`` (``(name, grad, codec)``) to it, inside
        the bucket's job: a change of the iteration's transaction."""
        for name, grad, _ in items:  # owed residual of a method left behind
            if name in self.carry:
                # a change of the iteration's transaction: a skipped iteration gives it back
                transaction.replace(self.carry, name)
                grad.add_(self.carry.pop(name).to(grad.dtype).view(grad.shape))

    def owed(self, name: str, shape: Sequence[int]) -> torch.Tensor:
        """What this rank still owes parameter ``name`` (of ``shape``), summed over every
        candidate: what each candidate's error feedback owes it (``ErrorFeedback.owed``: its
        residual and ``w`` times its scatter-reduce server residual of its chunk), and a carry
        waiting for the next gradient; changes nothing. With the averages sent, it closes the
        error-feedback invariant: over the ranks, ``sum(g) == w * sum(averages) + sum(owed)``."""
        total = torch.zeros(math.prod(shape), dtype=torch.float64)
        for codec in self.policy.codecs().values():
            part = codec.owed(name, torch.float64) if isinstance(codec, ErrorFeedback) else None
            if part is not None:
                total += part.reshape(-1).cpu()
        if name in self.carry:
            total += self.carry[name].reshape(-1).double().cpu()
        return total.view(*shape)

    def state_dict(self) -> Dict[str, torch.Tensor]:
        return {n: t.detach().cpu().clone() for n, t in self.carry.items()}

    def load_state_dict(self, carry: Dict[str, torch.Tensor]) -> None:
        self.carry = {n: t.clone() for n, t in carry.items()}

