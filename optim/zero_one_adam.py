"""``ZeroOneAdam``: 0/1 Adam (Lu et al. 2022) — adaptive variance freezing and local steps.

Two phases, with the paper's policy (and DeepSpeed's knobs):

1. Steps ``1 .. var_freeze_step``. The variance is updated only at steps ``t`` with
   ``t % var_interval == 0``; those steps use the dense mean of the gradients. After every
   ``var_update_scaler`` (kappa) variance updates the interval doubles, so dense steps thin out
   exponentially. Every other step averages the gradient compressed (divided by the current
   denominator, the update's coordinates, as in ``OneBitAdam``), with error feedback on both
   sides, and updates the momentum only. The update is Adam's with the bias corrections
   of the momentum steps and the variance updates made so far.
2. After ``var_freeze_step`` the variance is frozen and ranks take local steps: each updates its
   momentum with its own gradient and moves its parameters; every ``local_interval`` steps the
   ranks synchronise: the moves since the last common point (in the update's coordinates
   already) are averaged compressed with error feedback on both sides, every replica takes the
   mean move from that point, and the momentum becomes the mean move over the step sizes,
   times the frozen denominator. The interval doubles every ``local_step_scaler`` steps, up to
   ``local_step_clipper`` (H). :meth:`ZeroOneAdam.synchronize` brings the replicas together at
   any step (call it before evaluating or saving at the end of training).

The two compressed quantities (gradient in phase 1, accumulated moves in phase 2) keep their
own residuals. Replicas are identical after every synchronising step. A gradient that is not
finite, or finite but too large for the second moment (it would overflow to inf, and then
``0 * inf`` is NaN), is skipped and counted (``skipped``, with a ``RuntimeWarning``): a
dense or compressed step with such a gradient on any rank changes nothing on any rank; a local
step with one moves nothing on that rank (the counters advance on every rank, so all reach the
next synchronisation together).
"""
from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch

from . import _common as common
from ._base import DistributedOptimizer, flat, unflat_


class ZeroOneAdam(DistributedOptimizer):
    """0/1 Adam; see the module docstring. Under DDP register ``comm_hook()``."""

    display_name = "ZeroOneAdam"

    def __init__(self, params: Any, lr: float = 1e-3, betas: Tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, var_freeze_step: int = 100_000,
                 var_update_scaler: int = 16, local_step_scaler: int = 32678, local_step_clipper: int = 16, *,
                 compressor: Any = "onebit", compressor_options: Optional[Mapping[str, Any]] = None,
                 process_group: Any = None) -> None:
        common.check_adam_options(lr, betas, eps, weight_decay)
        # later => more variance updates (dense steps), fewer local steps
        self.var_freeze_step = common.check_int("var_freeze_step", var_freeze_step, low=1)
        # larger => more dense steps before the variance interval doubles
        self.var_update_scaler = common.check_int("var_update_scaler", var_update_scaler, low=1)
        # larger => the local-step interval grows more slowly
        self.local_step_scaler = common.check_int("local_step_scaler", local_step_scaler, low=1)
        # the longest run of local steps (H): larger => fewer bytes, replicas apart longer
        self.local_step_clipper = common.check_int("local_step_clipper", local_step_clipper, low=1)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        self.policy: Dict[str, int] = {"var_interval": 1, "var_counter": 0, "var_updates": 0,
                                       "local_interval": 1, "local_counter": 0}
        self.lrs = 0.0  # the sum of the learning rates since the last synchronisation
        self._denoms: Optional[List[torch.Tensor]] = None
        self._vmax: Optional[torch.Tensor] = None  # max of each variance, kept with the denominators
        super().__init__(params, defaults, compressor=compressor, compressor_options=compressor_options,
                         process_group=process_group, exchanges=("grad", "sync"))

    def _options(self) -> str:
        return (f"var_freeze_step={self.var_freeze_step} var_update_scaler={self.var_update_scaler} "
                f"local_step_scaler={self.local_step_scaler} local_step_clipper={self.local_step_clipper}")

    @property
    def frozen(self) -> bool:
        """Whether the variance is frozen (phase 2: local steps)."""
        return self.steps >= self.var_freeze_step

    def wants_dense(self) -> bool:
        return not self.frozen and (self.steps + 1) % self.policy["var_interval"] == 0

    def syncs(self) -> bool:
        """Whether the coming step (phase 2) synchronises the replicas."""
        return self.frozen and (self.steps + 1) % self.policy["local_interval"] == 0

    def _state_of(self, p: torch.Tensor) -> Dict[str, Any]:
        st = self.state[p]
        if not st:
            st["exp_avg"] = torch.zeros_like(p)
            st["exp_avg_sq"] = torch.zeros_like(p)
        return st

    def _compressed_step(self, grads: List[torch.Tensor]) -> None:
        if self.frozen:
            self._local_step(grads)
        else:
            self._momentum_step(grads)

    # ---- phase 1 -----------------------------------------------------------------------------
    def _with_decay(self, grads: List[torch.Tensor]) -> List[torch.Tensor]:
        """``g + weight_decay * p`` per parameter in fp32 (Adam's L2 decay)."""
        out = []
        for p, g in zip(self._params, grads):
            wd = self._group_of(p)["weight_decay"]
            out.append(g.float().add(p.float(), alpha=wd) if wd else g.float())
        return out

    def _dense_step(self, grads: List[torch.Tensor]) -> None:
        """A variance update on the mean gradients (phase 1)."""
        decayed = self._with_decay(grads)
        if not self._fits(decayed):
            return
        for p, g in zip(self._params, decayed):
            st = self._state_of(p)
            beta1, beta2 = self._group_of(p)["betas"]
            st["exp_avg_sq"].mul_(beta2).addcmul_(g, g, value=1 - beta2)
            st["exp_avg"].lerp_(g.to(p.dtype), 1 - beta1)
        self.policy["var_updates"] += 1
        self._forget()
        self._adam_update()

    def _momentum_step(self, grads: List[torch.Tensor]) -> None:
        # sent in the update's coordinates (divided by the current denominator, the same on every
        # rank; see OneBitAdam); where no variance exists yet no gradient was ever seen: nothing
        # is sent there, and a 1-bit code's value there is dropped
        g = self._with_decay(grads)
        denoms = [d.float() for d in self.denominators()]
        seen = [self._state_of(p)["exp_avg_sq"] != 0 for p in self._params]
        whole = [None] * len(g)  # a fixed size: the residuals keep their shape while the mask grows
        sent = flat([gi.div(d).mul_(s) for gi, d, s in zip(g, denoms, seen)], whole)
        mean = self.exchanges["grad"].finite_mean(common.poison_(sent, self._out_of_range(g, self._maxima())))
        if mean is None:
            self._skip()
            return
        unflat_(g, whole, mean)
        for p, gi, d, s in zip(self._params, g, denoms, seen):
            gi.mul_(d).mul_(s)
            self._state_of(p)["exp_avg"].lerp_(gi.to(p.dtype), 1 - self._group_of(p)["betas"][0])
        self._adam_update()

    def denominators(self) -> List[torch.Tensor]:
        """Per parameter, ``sqrt(v) / sqrt(1 - beta2^n) + eps`` with ``n`` the variance updates
        so far (kept until the next one; not saved)."""
        if self._denoms is None:
            n = max(self.policy["var_updates"], 1)
            self._denoms = []
            for p in self._params:
                group = self._group_of(p)
                bc2_sqrt = (1 - group["betas"][1] ** n) ** 0.5
                self._denoms.append((self._state_of(p)["exp_avg_sq"].sqrt() / bc2_sqrt).add_(group["eps"]))
        return self._denoms

    def _maxima(self) -> torch.Tensor:
        if self._vmax is None:  # the variance changes only at a variance update
            self._vmax = common.MomentRange.maxima([self._state_of(p)["exp_avg_sq"] for p in self._params])
        return self._vmax

    def _forget(self) -> None:
        self._denoms = None
        self._vmax = None

    def _adam_update(self) -> None:
        t = self.steps + 1
        for p, d in zip(self._params, self.denominators()):
            p.addcdiv_(self._state_of(p)["exp_avg"], d, value=-self._step_size(self._group_of(p)))
        self.steps += 1
        self._advance_variance_policy(t)

    def _advance_variance_policy(self, t: int) -> None:
        pol = self.policy
        if t % pol["var_interval"] == 0:
            pol["var_counter"] += 1
            if pol["var_counter"] == self.var_update_scaler:
                pol["var_counter"], pol["var_interval"] = 0, pol["var_interval"] * 2

    # ---- phase 2 -----------------------------------------------------------------------------
    def _local_step(self, grads: List[torch.Tensor]) -> None:
        decayed = self._with_decay(grads)
        if bool(self._out_of_range(decayed, self._maxima())):  # this rank's own gradient: it alone skips
            self._skip("on this rank: its gradient was")
        else:
            for p, g, d in zip(self._params, decayed, self.denominators()):
                group = self._group_of(p)
                st = self._state_of(p)
                if "anchor" not in st:  # the last point every replica shared
                    st["anchor"] = p.detach().clone()
                st["exp_avg"].lerp_(g.to(p.dtype), 1 - group["betas"][0])
                p.addcdiv_(st["exp_avg"], d, value=-self._step_size(group))
        self.lrs += self._step_size(self.param_groups[0])  # on every rank: the same sum everywhere
        if self.syncs():
            self._sync_replicas()
        self.steps += 1
        pol = self.policy
        pol["local_counter"] += 1
        if pol["local_counter"] == self.local_step_scaler:
            pol["local_counter"] = 0
            pol["local_interval"] = min(self.local_step_clipper, pol["local_interval"] * 2)

    def _step_size(self, group: Dict[str, Any]) -> float:
        return group["lr"] / (1 - group["betas"][0] ** (self.steps + 1))

    @torch.no_grad()
    def synchronize(self) -> None:
        """Bring the replicas together now (phase 2, when they took local steps since the last
        synchronisation): call it on every rank before evaluating or saving at the end of
        training. Costs one compressed exchange; nothing to do otherwise."""
        if self.frozen and self.lrs > 0:
            self._sync_replicas()

    def _sync_replicas(self) -> None:
        """Average the moves since the last common point compressed (they are in the update's
        coordinates already); every replica takes the mean move from that point, so all hold
        the same bits again, and the momentum becomes the mean move over the step sizes."""
        masks = self.masked()
        moves = []
        for p in self._params:
            st = self._state_of(p)
            if "anchor" not in st:
                st["anchor"] = p.detach().clone()
            moves.append(p.float() - st["anchor"].float())
        mean = self.exchanges["sync"].finite_mean(flat(moves, masks))
        if mean is None:
            return  # the replicas keep their local moves until the next synchronisation
        unflat_(moves, masks, mean)
        lrs = self.lrs if self.lrs > 0 else 1.0
        for p, mv, d in zip(self._params, moves, self.denominators()):
            st = self._state_of(p)
            p.copy_(st["anchor"].float() + mv)
            st["anchor"].copy_(p)
            st["exp_avg"].copy_(mv.mul_(d).div_(-lrs))
        self.lrs = 0.0

    # ---- state -------------------------------------------------------------------------------
    def _extra_state(self) -> Dict[str, Any]:
        return {"policy": dict(self.policy), "lrs": self.lrs}

    def _load_extra_state(self, state: Mapping[str, Any]) -> None:
        self.policy = {k: int(v) for k, v in state["policy"].items()}
        self.lrs = float(state["lrs"])
