"""``OneBitAdam``: 1-bit Adam (Tang et al. 2021) — dense Adam, then compressed momentum.

Steps ``1 .. freeze_step`` are ``torch.optim.Adam`` on the dense mean of the gradients: the
same functional update, the same state (``step``, ``exp_avg``, ``exp_avg_sq``), so under DDP
with :meth:`comm_hook` the parameters are the bits ``torch.optim.Adam`` gives. Then the
variance is frozen (Adam's variance is non-linear in the gradient: error feedback on the
gradient cannot correct it), and each step

    d   = sqrt(v) / sqrt(1 - beta2^freeze_step) + eps             # frozen: the same on every rank
    m_r = beta1 * m + (1 - beta1) * (g_r + weight_decay * p)     # this rank's gradient
    u   = compressed mean of m_r / d, error feedback on both sides   # MomentumExchange
    m   = u * d;   p -= lr / (1 - beta1^t) * u

(Adam's update with the frozen, bias-corrected variance). The momentum travels divided by the
frozen denominator: the same mean (``d`` is common), but every element at the scale of Adam's
update, so a 1-bit code's per-element error is bounded like the update instead of being
amplified where the variance is small. Elements whose variance is exactly
zero at the freeze never had a gradient (an embedding row never looked up): a 1-bit code
cannot say zero, and a momentum there would be divided by ``eps``, so they are masked: sent as
zero, whatever is decoded there dropped, their momentum kept at zero, the parameter where it is.

A step whose gradient is not finite, or finite but too large for Adam's second moment (it
would overflow to inf, and a frozen variance could not damp it), on any rank changes nothing on
any rank: no parameter, moment, counter or residual; ``skipped`` counts it, a
``RuntimeWarning`` reports it, and the next step goes on. (``torch.optim.Adam`` takes such a
step with ``v = inf`` and never moves those elements again.) bf16/fp16 parameters keep moments in their dtype,
as ``torch.optim.Adam`` does; the exchange and its residuals are fp32.
"""
from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch
from torch.optim.adam import adam as adam_update
from torch.optim.optimizer import _get_scalar_dtype

from gradcomp.kernels.memory import empty

from . import _common as common
from ._base import DistributedOptimizer, zero_masked_


class OneBitAdam(DistributedOptimizer):
    """Dense Adam until ``freeze_step``, then the momentum exchanged compressed (``compressor``,
    default ``onebit``; any gradcomp compressor name with ``compressor_options``) with error
    feedback on both sides. ``process_group``: the data-parallel ranks (default all). Under DDP
    register ``comm_hook()``; see :mod:`gradcomp.optim._base`."""

    display_name = "OneBitAdam"

    def __init__(self, params: Any, lr: float = 1e-3, betas: Tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, freeze_step: int = 100_000, *,
                 compressor: Any = "onebit", compressor_options: Optional[Mapping[str, Any]] = None,
                 process_group: Any = None) -> None:
        common.check_adam_options(lr, betas, eps, weight_decay)
        # longer => closer to Adam, more bytes; at least one dense step gives the variance to freeze
        self.freeze_step = common.check_int("freeze_step", freeze_step, low=1)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, amsgrad=False,
                        maximize=False, foreach=None, capturable=False, differentiable=False, fused=None,
                        decoupled_weight_decay=False)
        self._denoms: Optional[List[torch.Tensor]] = None
        self._vmax: Optional[torch.Tensor] = None  # max of each frozen variance (MomentRange)
        super().__init__(params, defaults, compressor=compressor, compressor_options=compressor_options,
                         process_group=process_group, exchanges=("momentum",))

    def _options(self) -> str:
        return f"freeze_step={self.freeze_step}"

    def wants_dense(self) -> bool:
        return self.steps < self.freeze_step

    @property
    def frozen(self) -> bool:
        """Whether the variance is frozen (the momentum travels compressed)."""
        return self.steps >= self.freeze_step

    # ---- warm-up: torch.optim.Adam -----------------------------------------------------------
    def _state_of(self, p: torch.Tensor) -> Dict[str, Any]:
        st = self.state[p]
        if not st:  # as torch.optim.Adam creates it
            st["step"] = torch.tensor(0.0, dtype=_get_scalar_dtype())
            st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return st

    def _dense_step(self, grads: List[torch.Tensor]) -> None:
        """``torch.optim.Adam``'s step on the mean gradients."""
        if not self._fits(grads):
            return  # the same mean on every rank: every rank skips
        by_param = dict(zip(map(id, self._params), grads))
        for group in self.param_groups:
            params = list(group["params"])
            states = [self._state_of(p) for p in params]
            beta1, beta2 = group["betas"]
            adam_update(
                params, [by_param[id(p)] for p in params], [s["exp_avg"] for s in states],
                [s["exp_avg_sq"] for s in states], [], [s["step"] for s in states],
                foreach=group["foreach"], capturable=False, differentiable=False, fused=group["fused"],
                grad_scale=None, found_inf=None, has_complex=False, decoupled_weight_decay=False,
                amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"],
                eps=group["eps"], maximize=False)
        self.steps += 1

    # ---- after the freeze: compressed momentum -----------------------------------------------
    def denominators(self) -> List[torch.Tensor]:
        """Per parameter, Adam's frozen denominator ``sqrt(v) / sqrt(1 - beta2^freeze_step) + eps``
        (fp32; kept, not saved: the variance it comes from does not change)."""
        if self._denoms is None:
            self._denoms = []
            for group in self.param_groups:
                bc2_sqrt = (1 - group["betas"][1] ** self.freeze_step) ** 0.5
                for p in group["params"]:
                    v = self._state_of(p)["exp_avg_sq"]
                    self._denoms.append((v.float().sqrt() / bc2_sqrt).add_(group["eps"]))
        return self._denoms

    def to_send(self, grads: List[torch.Tensor]) -> torch.Tensor:
        """What this rank sends for ``grads``: its momentum ``beta1 * m + (1 - beta1) * (g +
        weight_decay * p)`` divided by the frozen denominator (the update's coordinates, where
        every element has Adam's scale: a 1-bit code's error is then that of the update, not
        amplified by a small variance), zero where masked; one flat fp32 tensor, NaN wherever
        it is not masked when a gradient is out of range (so that every rank skips the step)."""
        masks, denoms = self.masked(), self.denominators()
        # large CPU blocks in huge pages (kernels.memory.empty): fewer page faults at first touch
        out = empty(sum(p.numel() for p in self._params), torch.float32,
                    self._params[0].device if self._params else "cpu")
        if not self._params:
            return out
        if self._vmax is None:  # the variance is frozen: its maxima are too
            self._vmax = common.MomentRange.maxima([self._state_of(p)["exp_avg_sq"] for p in self._params])
        bad = self._out_of_range(grads, self._vmax)
        # the poison rides in lerp's weight (NaN when bad, the same bits otherwise) instead of a
        # pass of its own; masked elements are zeroed after it, so only when every element is
        # masked does the poison need its own pass
        survives = self.has_unmasked()
        pieces = out.split([p.numel() for p in self._params])
        i = 0
        for group in self.param_groups:
            beta1, wd = group["betas"][0], group["weight_decay"]
            weight = torch.where(bad, torch.nan, 1 - beta1).float()  # on bad's device: nothing copied from the host
            for p in group["params"]:
                g = grads[i].float()
                if wd:
                    g = g.add(p.float(), alpha=wd)
                u = pieces[i].view(p.shape)  # written straight into the flat tensor
                torch.lerp(self._state_of(p)["exp_avg"].float(), g, weight, out=u)
                u.div_(denoms[i])
                zero_masked_(u, masks[i])  # by the masked positions when they are few
                i += 1
        if not survives:
            common.poison_(out, bad)
        return out

    def _compressed_step(self, grads: List[torch.Tensor]) -> None:
        # v is frozen and the same on every rank: the mean of m_r / d is mean(m_r) / d exactly
        mean = self.exchanges["momentum"].finite_mean(self.to_send(grads))
        if mean is None:
            self._skip()  # NaN/Inf on some rank reaches every rank; the residuals were kept as they were
            return
        masks, denoms = self.masked(), self.denominators()
        pieces = mean.split([p.numel() for p in self._params])  # ours: decoded in place
        i = 0
        for group in self.param_groups:
            beta1 = group["betas"][0]
            for p in group["params"]:
                st, u = self._state_of(p), pieces[i].view(p.shape)
                zero_masked_(u, masks[i])  # masked elements: no momentum, no move
                st["step"] += 1
                if st["exp_avg"].dtype == torch.float32:
                    torch.mul(u, denoms[i], out=st["exp_avg"])
                else:
                    st["exp_avg"].copy_(u * denoms[i])
                p.add_(u.to(p.dtype), alpha=-group["lr"] / (1 - beta1 ** float(st["step"])))
                i += 1
        self.steps += 1

    # ---- state -------------------------------------------------------------------------------
    def _forget(self) -> None:
        self._denoms = None
        self._vmax = None

    def error_state(self) -> Dict[str, torch.Tensor]:
        """This rank's residuals: ``worker`` over the whole exchanged tensor, ``server`` over the
        chunk it reduces (empty when the codec does not travel by scatter-reduce)."""
        ex = self.exchanges["momentum"]
        numel = sum(p.numel() for p in self._params)
        return {"worker": ex.worker_residual(numel),
                "server": ex.server_residual(numel, self.rank, self.world)}
