"""``OneBitLamb``: 1-bit LAMB (Li et al. 2021) — LAMB's layer-wise coefficients frozen after
a dense warm-up, the momentum exchanged compressed.

Warm-up (steps ``1 .. freeze_step``): LAMB on the dense mean of the gradients
(``update = m / (sqrt(v) + eps) + weight_decay * p``, trust ratio ``||p|| / ||update||``
clipped to ``[min_coeff, max_coeff]``), keeping an exponential average (``coeff_beta``) of each
layer's ratio. At the freeze the variance is frozen, a fresh copy of it starts, and every
layer's momentum gets a scale that brings all layers to one magnitude (one compressed tensor
carries them all). Then each step: the local momentum, divided by the frozen denominator (as
in ``OneBitAdam``) and scaled, is averaged compressed with error feedback on both sides and
unscaled; the fresh variance follows the gradient
reconstructed from the momentum change; the layer's coefficient is its frozen ratio times a
factor ``max(denominator_frozen / denominator_fresh)``, clipped to ``[factor_min, factor_max]``
and to ``1 +- factor_threshold`` of the previous step's factor. Zero-variance elements are
masked as in ``OneBitAdam``.

The update norms it needs are of whole tensors that every rank holds (the averaged update), so
they are right under data parallel. It is itself the data-parallel layer (it exchanges the
momentum), so it is not meant to run inside a sharded optimizer: ``shard_layout`` refuses.
A step whose gradient is not finite, or finite but too large for the second moment (it would
overflow to inf), on any rank changes nothing on any rank; ``skipped`` counts it and a
``RuntimeWarning`` reports it.
"""
from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch

from . import _common as common
from ._base import DistributedOptimizer, flat, unflat_


_EXACT = ("coeff_freeze", "last_factor")  # fp64 scalars kept exactly across a checkpoint


class OneBitLamb(DistributedOptimizer):
    """1-bit LAMB; see the module docstring. Under DDP register ``comm_hook()``."""

    display_name = "OneBitLamb"
    layerwise = False  # see shard_layout

    def __init__(self, params: Any, lr: float = 1e-3, betas: Tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, freeze_step: int = 100_000, *,
                 max_coeff: float = 10.0, min_coeff: float = 0.01, coeff_beta: float = 0.9,
                 factor_max: float = 4.0, factor_min: float = 0.5, factor_threshold: float = 0.1,
                 compressor: Any = "onebit", compressor_options: Optional[Mapping[str, Any]] = None,
                 process_group: Any = None) -> None:
        common.check_adam_options(lr, betas, eps, weight_decay)
        self.freeze_step = common.check_int("freeze_step", freeze_step, low=1)
        common.check_number("min_coeff", min_coeff, low_open=True)
        common.check_number("max_coeff", max_coeff, low=min_coeff)
        common.check_number("coeff_beta", coeff_beta, high=1.0)
        common.check_number("factor_min", factor_min, low_open=True)
        common.check_number("factor_max", factor_max, low=factor_min)
        common.check_number("factor_threshold", factor_threshold, high=1.0)
        self.coeffs = dict(max_coeff=max_coeff, min_coeff=min_coeff, coeff_beta=coeff_beta, factor_max=factor_max,
                           factor_min=factor_min, factor_threshold=factor_threshold)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        self._denoms: Optional[List[torch.Tensor]] = None
        self._vmax: Optional[torch.Tensor] = None  # max of each frozen variance (MomentRange)
        super().__init__(params, defaults, compressor=compressor, compressor_options=compressor_options,
                         process_group=process_group, exchanges=("momentum",))

    def _options(self) -> str:
        return f"freeze_step={self.freeze_step} {sorted(self.coeffs.items())}"

    def shard_layout(self, layout: Any, num_layers: int, group: Any = None) -> None:
        raise ValueError("OneBitLamb exchanges its own compressed momentum across the data-parallel ranks, so it "
                         "cannot be the inner optimizer of a sharded optimizer; use gradcomp.optim.Lamb there")

    @property
    def frozen(self) -> bool:
        return self.steps >= self.freeze_step

    def wants_dense(self) -> bool:
        return not self.frozen

    def _state_of(self, p: torch.Tensor) -> Dict[str, Any]:
        st = self.state[p]
        if not st:
            st["exp_avg"] = torch.zeros_like(p)
            st["exp_avg_sq"] = torch.zeros_like(p)
            # fp64 device scalars, never read on the host (load_state_dict keeps their dtype)
            st["coeff_freeze"] = torch.zeros((), dtype=torch.float64, device=p.device)
            st["last_factor"] = torch.ones((), dtype=torch.float64, device=p.device)
        return st

    def _clamp(self, ratio: torch.Tensor) -> torch.Tensor:
        return ratio.clamp(self.coeffs["min_coeff"], self.coeffs["max_coeff"])

    # ---- warm-up ----------------------------------------------------------------------------
    def _dense_step(self, grads: List[torch.Tensor]) -> None:
        """LAMB on the mean gradients; at the freeze, the compression stage's start."""
        if not self._fits(grads):
            return
        beta = self.coeffs["coeff_beta"]
        for p, g in zip(self._params, grads):
            group, st = self._group_of(p), self._state_of(p)
            beta1, beta2 = group["betas"]
            st["exp_avg"].lerp_(g, 1 - beta1)
            st["exp_avg_sq"].mul_(beta2).addcmul_(g, g, value=1 - beta2)
            update = st["exp_avg"] / (st["exp_avg_sq"].sqrt() + group["eps"])
            if group["weight_decay"]:
                update.add_(p, alpha=group["weight_decay"])
            # the trust ratio stays on the device: no host sync per parameter
            w, u = p.double().norm(), update.double().norm()
            ok = (w > 0) & (u > 0)
            ratio = torch.where(ok, self._clamp(w / torch.where(ok, u, 1.0)), 1.0)
            cf = st["coeff_freeze"]
            st["coeff_freeze"] = torch.where(ratio != 1.0, beta * cf + (1 - beta) * ratio, cf)
            p.add_(update.mul_((ratio * -group["lr"]).to(update.dtype)))
        self.steps += 1
        if self.frozen:
            self._start_compression()

    def _start_compression(self) -> None:
        """At the freeze: the fresh variance starts from the frozen one; each layer's scale (the
        RMS of what it sends, its momentum over the frozen denominator) sets the factor that
        brings every layer to their mean RMS. (The raw momentum's RMS, DeepSpeed's, is wrong
        here: what travels is divided by the denominator already, and a layer with a small
        momentum but an equally small variance would be blown up, diverging on a conv net with
        BatchNorm from the first compressed step.)"""
        scales = []
        for p, d in zip(self._params, self._denominators()):
            st = self._state_of(p)
            st["exp_avg_sq_fresh"] = st["exp_avg_sq"].clone()
            scales.append(float((st["exp_avg"].float() / d).double().norm()) / max(p.numel(), 1) ** 0.5)
        united = sum(scales) / max(len(scales), 1)
        for p, s in zip(self._params, scales):
            self._state_of(p)["scaling"] = united / s if s > 0 else 1.0

    # ---- compression stage ------------------------------------------------------------------
    def _denominators(self) -> List[torch.Tensor]:
        """``sqrt(v) + eps`` of the frozen variance, per parameter (fp32; kept, not saved)."""
        if self._denoms is None:
            self._denoms = [self._state_of(p)["exp_avg_sq"].float().sqrt().add_(self._group_of(p)["eps"])
                            for p in self._params]
        return self._denoms

    def _compressed_step(self, grads: List[torch.Tensor]) -> None:
        # sent divided by the frozen denominator (the update's coordinates; see OneBitAdam) and
        # scaled per layer to one magnitude: both are the same on every rank, so undone exactly
        if self._vmax is None:
            self._vmax = common.MomentRange.maxima([self._state_of(p)["exp_avg_sq"] for p in self._params])
        bad = self._out_of_range(grads, self._vmax)
        # the poison rides in lerp's weight (NaN when bad, the same bits otherwise), as in
        # OneBitAdam; its own pass only when every element is masked
        weights: Dict[float, torch.Tensor] = {}  # per beta1 of the groups, on bad's device
        local = []
        for p, g, d in zip(self._params, grads, self._denominators()):
            st = self._state_of(p)
            beta1 = self._group_of(p)["betas"][0]
            if beta1 not in weights:
                weights[beta1] = torch.where(bad, torch.nan, 1 - beta1).float()
            m = torch.lerp(st["exp_avg"].float(), g.float(), weights[beta1])
            local.append(m.div_(d).mul_(st["scaling"]))
        sent = flat(local, self.masked())
        if not self.has_unmasked():
            common.poison_(sent, bad)
        mean = self.exchanges["momentum"].finite_mean(sent)
        if mean is None:
            self._skip()
            return
        unflat_(local, self.masked(), mean)
        for p, u, d in zip(self._params, local, self._denominators()):
            self._apply(p, u.mul_(d).div_(self._state_of(p)["scaling"]))
        self.steps += 1

    def _apply(self, p: torch.Tensor, m: torch.Tensor) -> None:
        group, st, c = self._group_of(p), self._state_of(p), self.coeffs
        beta1, beta2 = group["betas"]
        fresh = (m - st["exp_avg"].float() * beta1) / (1 - beta1)  # the averaged gradient, reconstructed
        st["exp_avg_sq_fresh"].mul_(beta2).addcmul_(fresh, fresh, value=1 - beta2)
        st["exp_avg"].copy_(m)
        denom = st["exp_avg_sq"].sqrt() + group["eps"]
        prelim = st["exp_avg"] / denom
        update = prelim.add(p, alpha=group["weight_decay"]) if group["weight_decay"] else prelim
        # the factor stays on the device (fp64 scalars): no host sync per parameter
        factor = (denom / (st["exp_avg_sq_fresh"].sqrt() + group["eps"])).max().double()
        if group["weight_decay"]:
            un = update.double().norm()
            share = torch.where(un > 0, (prelim.double().norm() / torch.where(un > 0, un, 1.0)).clamp(max=1.0), 1.0)
            factor = factor * share + (1.0 - share)
        last = st["last_factor"]
        factor = factor.clamp(c["factor_min"], c["factor_max"])
        factor = torch.minimum(torch.maximum(factor, last * (1 - c["factor_threshold"])),
                               last * (1 + c["factor_threshold"]))
        st["last_factor"] = factor
        p.add_(update * (st["coeff_freeze"] * factor * -group["lr"]).to(update.dtype))

    def _forget(self) -> None:
        self._denoms = None
        self._vmax = None

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """As :class:`DistributedOptimizer`'s, with the fp64 coefficients kept in fp64 (torch's
        load casts state tensors to the parameter's dtype: the resumed run would differ)."""
        exact = {i: {k: v for k, v in st.items() if k in _EXACT}
                 for i, st in (state_dict.get("state", {}) if isinstance(state_dict, Mapping) else {}).items()}
        super().load_state_dict(state_dict)
        for i, p in enumerate(self._params):
            for k, v in exact.get(i, {}).items():  # a float from an older checkpoint becomes a tensor
                self.state[p][k] = torch.as_tensor(v, dtype=torch.float64).to(p.device, copy=True)
