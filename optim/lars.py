"""``Lars``: LARS (You et al. 2017) with the LARC clipping option, norms right under data
parallel and sharding.

Per tensor, for groups with weight decay (or all with ``always_adapt``), the gradient plus
weight decay is scaled by the trust ratio ``trust_coeff * ||p|| / (||g|| + weight_decay *
||p|| + eps)`` (1 where either norm is 0); with ``trust_clip`` (LARC) the ratio is divided by
the learning rate and clipped at 1. Then SGD with momentum (dampening, Nesterov) steps. The
rules and defaults follow timm's ``Lars``.

The norms are those of the averaged gradient (DDP, ``CompressedOptimizer``) and, under
``shard_layout``, of each whole layer (one float64 all-reduce per step; see
:mod:`gradcomp.optim.layerwise`). A step whose gradient norm is not finite changes nothing.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from . import _common as common
from .layerwise import LayerNorms, Layerwise


class Lars(Layerwise, torch.optim.Optimizer):
    """LARS / LARC; see the module docstring. Options as timm's ``Lars``."""

    def __init__(self, params: Any, lr: float = 1.0, momentum: float = 0.0, dampening: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False, trust_coeff: float = 0.001, eps: float = 1e-8,
                 trust_clip: bool = False, always_adapt: bool = False) -> None:
        common.check_number("lr", lr)
        common.check_number("momentum", momentum)
        common.check_number("dampening", dampening, high=1.0, high_open=False)
        common.check_number("weight_decay", weight_decay)
        common.check_number("trust_coeff", trust_coeff, low_open=True)
        common.check_number("eps", eps)
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("nesterov=True needs momentum > 0 and dampening=0")
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                        nesterov=bool(nesterov), trust_coeff=trust_coeff, eps=eps, trust_clip=bool(trust_clip),
                        always_adapt=bool(always_adapt))
        super().__init__(params, defaults)
        params_ = common.trained([p for g in self.param_groups for p in g["params"]], "Lars")
        self.norms_of = LayerNorms(len(params_), "Lars")

    @torch.no_grad()
    def step(self, closure: Optional[Any] = None) -> Any:
        loss = common.run_closure(closure)
        params = [p for g in self.param_groups for p in g["params"]]
        common.check_dense_grads(params, "Lars")  # before anything changes
        norms = self.norms_of.norms([params, [p.grad for p in params]])
        if not bool(torch.isfinite(norms).all()):
            return loss  # the same norms on every rank: every rank skips, nothing changed
        w, gn = norms[0], norms[1]
        i = 0
        for group in self.param_groups:
            wd, lr = group["weight_decay"], group["lr"]
            ratio = group["trust_coeff"] * w / (gn + w * wd + group["eps"])
            ratio = torch.where((w > 0) & (gn > 0), ratio, 1.0)
            if group["trust_clip"]:
                ratio = (ratio / lr).clamp(max=1.0)
            for p in group["params"]:
                if p.grad is not None:
                    self._apply(p, p.grad.detach(), i, ratio.to(torch.float32), group)
                i += 1
        return loss

    def _apply(self, p: torch.Tensor, g: torch.Tensor, i: int, ratio: torch.Tensor, group) -> None:
        """One tensor's step: trust ratio (``ratio``, per layer), weight decay, momentum."""
        if group["weight_decay"] != 0 or group["always_adapt"]:
            g = self.norms_of.scale_(i, g.add(p, alpha=group["weight_decay"]), ratio)
        if group["momentum"] != 0:
            st = self.state[p]
            buf = st.get("momentum_buffer")
            if buf is None:
                buf = st["momentum_buffer"] = torch.clone(g).detach()
            else:
                buf.mul_(group["momentum"]).add_(g, alpha=1 - group["dampening"])
            g = g.add(buf, alpha=group["momentum"]) if group["nesterov"] else buf
        p.add_(g, alpha=-group["lr"])
