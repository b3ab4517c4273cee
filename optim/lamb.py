"""``Lamb``: LAMB (You et al. 2019, "BERT in 76 minutes"), with norms right under data
parallel and sharding.

Per tensor, the Adam direction ``update = m_hat / (sqrt(v_hat) + eps) + weight_decay * p`` is
scaled by the layer's trust ratio ``||p|| / ||update||`` (1 where either norm is 0; at most 1
with ``trust_clip``, LAMBC), then ``p -= lr * ratio * update``. The rules and defaults follow
timm's ``Lamb`` (NVIDIA's FusedLAMB variant: ``grad_averaging``, ``bias_correction``, trust
ratio only for groups with weight decay unless ``always_adapt``) except ``max_grad_norm``,
which is off by default here: a global gradient norm under sharding needs a collective of
its own before the update, so clip before ``step()`` instead (``torch.nn.utils.clip_grad_norm_``).

The norms are taken of what the step applies — the averaged gradient under DDP or
``CompressedOptimizer`` (the decompressed mean), and under ``shard_layout`` summed over the
shards of each layer in one float64 all-reduce (:mod:`gradcomp.optim.layerwise`). A step whose
update is not finite changes nothing: the moments are computed aside and kept only after the
norms (the same on every rank) are finite.
"""
from __future__ import annotations

from typing import Any, List, Optional, Tuple

import torch

from . import _common as common
from .layerwise import LayerNorms, Layerwise


class Lamb(Layerwise, torch.optim.Optimizer):
    """LAMB; see the module docstring. Options as timm's ``Lamb``."""

    def __init__(self, params: Any, lr: float = 1e-3, bias_correction: bool = True,
                 betas: Tuple[float, float] = (0.9, 0.999), eps: float = 1e-6, weight_decay: float = 0.01,
                 grad_averaging: bool = True, max_grad_norm: Optional[float] = None, trust_clip: bool = False,
                 always_adapt: bool = False) -> None:
        common.check_adam_options(lr, betas, eps, weight_decay)
        if max_grad_norm is not None:
            common.check_number("max_grad_norm", max_grad_norm, low_open=True)
        defaults = dict(lr=lr, bias_correction=bool(bias_correction), betas=tuple(betas), eps=eps,
                        weight_decay=weight_decay, grad_averaging=bool(grad_averaging), trust_clip=bool(trust_clip),
                        always_adapt=bool(always_adapt))
        super().__init__(params, defaults)
        self.max_grad_norm = max_grad_norm
        params_ = common.trained([p for g in self.param_groups for p in g["params"]], "Lamb")
        self.norms_of = LayerNorms(len(params_), "Lamb")

    def _check_sharding(self) -> None:
        if self.max_grad_norm is not None:
            raise ValueError("Lamb(max_grad_norm=...) needs the global gradient norm before the update, a second "
                             "collective per step that sharding does not have; pass max_grad_norm=None and clip "
                             "the gradients before step()")

    def _clip(self, grads: List[Optional[torch.Tensor]]) -> List[Optional[torch.Tensor]]:
        if self.max_grad_norm is None:
            return grads
        present = [g for g in grads if g is not None]
        if not present:
            return grads
        total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in present]))
        factor = (total / self.max_grad_norm).clamp_(min=1.0)
        return [None if g is None else g / factor for g in grads]

    @torch.no_grad()
    def step(self, closure: Optional[Any] = None) -> Any:
        loss = common.run_closure(closure)
        params = [p for g in self.param_groups for p in g["params"]]
        common.check_dense_grads(params, "Lamb")  # before anything changes
        grads = self._clip([p.grad for p in params])
        moments: List[Optional[Tuple[torch.Tensor, torch.Tensor]]] = []
        updates: List[Optional[torch.Tensor]] = []
        i = 0
        for group in self.param_groups:
            for p in group["params"]:
                g = grads[i]
                i += 1
                if g is None:
                    moments.append(None)
                    updates.append(None)
                    continue
                m, v, u = self._direction(p, g, group)
                moments.append((m, v))
                updates.append(u)
        norms = self.norms_of.norms([params, updates])
        if not bool(torch.isfinite(norms).all()):
            return loss  # the same norms on every rank: every rank skips, nothing changed
        w, u = norms[0], norms[1]
        ratio = torch.where((w > 0) & (u > 0), w / torch.where(u > 0, u, 1.0), 1.0)
        i = 0
        for group in self.param_groups:
            adapt = group["weight_decay"] != 0 or group["always_adapt"]
            layer_ratio = ratio.clamp(max=1.0) if group["trust_clip"] else ratio
            for p in group["params"]:
                upd, mv = updates[i], moments[i]
                if upd is not None and mv is not None:
                    if adapt:
                        self.norms_of.scale_(i, upd, layer_ratio.to(torch.float32))
                    p.add_(upd, alpha=-group["lr"])
                    st = self.state[p]
                    st["exp_avg"], st["exp_avg_sq"] = mv
                    st["step"] = st.get("step", 0) + 1
                i += 1
        return loss

    def _direction(self, p: torch.Tensor, g: torch.Tensor, group) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(exp_avg, exp_avg_sq, update)`` of this step, new tensors (the state is untouched)."""
        st = self.state[p]
        beta1, beta2 = group["betas"]
        m = st["exp_avg"] if "exp_avg" in st else torch.zeros_like(p)
        v = st["exp_avg_sq"] if "exp_avg_sq" in st else torch.zeros_like(p)
        step = st.get("step", 0) + 1
        bc1, bc2 = (1 - beta1 ** step, 1 - beta2 ** step) if group["bias_correction"] else (1.0, 1.0)
        if group["grad_averaging"]:
            m = torch.lerp(m, g, 1 - beta1)
        else:
            m = m.mul(beta1).add_(g)
        v = v.mul(beta2).addcmul_(g, g, value=1 - beta2)
        denom = (v.sqrt() / (bc2 ** 0.5)).add_(group["eps"])
        update = (m / bc1).div_(denom)
        if group["weight_decay"] != 0:
            update.add_(p, alpha=group["weight_decay"])
        return m, v, update
