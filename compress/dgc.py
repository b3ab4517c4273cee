"""``dgc``: Deep Gradient Compression (Lin et al. 2018) — sampled-threshold top-k and
:class:`DGCMomentum`, DGC's momentum correction with local clipping.

Selection follows DGC: estimate the threshold from a random sample of ``sample_ratio`` of the
elements (positions from the counter stream of ``(seed, key, step)``), keep what exceeds it,
and if that is more than k take the top-k of those. DGC sends fewer than k when too few pass;
here the threshold is lowered instead, so exactly k are sent and the payload has a fixed size.
The set sent is therefore the exact top-k (ties to the lowest index) — the same as ``topk``,
whose payload format this shares; the sample only decides how fast it is found.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, Optional

import torch

from gradcomp.kernels.select import topk_abs_indices

from .base import Capabilities, Compressor, option, seed_option
from .error_feedback import _Feedback
from .transaction import replace
from .payload import Payload
from .registry import register
from .sparse import ratio_option
from .topk import TopK

_MIN_SAMPLE = 1024  # below this a quantile estimate is too noisy to save a retry


@register("dgc")
class DGC(TopK):
    """Top-k with DGC's sampled threshold; default ratio 0.001 (99.9% sparsity, as in the paper)."""

    @dataclass(frozen=True)
    class Config(TopK.Config):
        ratio: float = ratio_option(0.001)
        sample_ratio: float = option(0.01, "fraction of elements sampled for the threshold; larger => "
                                     "costs more, but fewer threshold retries",
                                     lambda v: 0.0 < v <= 1.0, "a float in (0, 1]")
        seed: int = seed_option()

    config: Config
    # draws its sample (stochastic), though the set it sends does not depend on it
    capabilities = Capabilities(stochastic=True)

    def _select(self, flat, k, key, step):
        n = flat.numel()
        s = min(n, max(_MIN_SAMPLE, math.ceil(self.config.sample_ratio * n)))
        # float32 draws have 24 bits: above 2**24 elements the sample sits on a coarse grid,
        # which is harmless for a quantile estimate.
        pos = (self._uniform(s, key, step, flat.device).double() * n).long().clamp_(max=max(n - 1, 0))
        return topk_abs_indices(flat, k, sample=flat[pos].abs())


class DGCMomentum(_Feedback):
    """DGC's error feedback with momentum correction, momentum factor masking and clipping.

    Per key it keeps a velocity ``u`` and an accumulation ``v`` (fp32; fp64 for fp64)::

        g = clip(g);  u = momentum * u + g;  v = v + u;  payload = compress(v)
        v = v - decompress(payload);  u[sent] = 0          (sent: decoded element != 0)

    so ``v_old + u_new == decompress(payload) + v_new`` at every step (``u_new`` before
    masking). For a sparsifier ``v`` becomes 0 where sent, as in DGC (up to the rounding to a
    16-bit input dtype); for any other compressor ``v`` keeps the compression error. Masking
    stops stale momentum from being sent again. The momentum lives here, so the optimizer
    should run without momentum. ``clip_norm`` clips each key's gradient norm before it is
    accumulated (DGC clips locally at the global threshold times N**-0.5 for N ranks; pass
    that value). Non-finite gradients skip the clip and propagate.
    """

    kind = "dgc"

    def __init__(self, compressor: Compressor | str, *, momentum: float = 0.9,
                 clip_norm: Optional[float] = None, masking: bool = True) -> None:
        super().__init__(compressor)
        if self.compressor.multi_round:
            raise ValueError(f"DGCMomentum needs a single-round compressor, {self.compressor.name} is multi-round")
        if isinstance(momentum, bool) or not isinstance(momentum, (int, float)) or not 0.0 <= momentum < 1.0:
            raise ValueError(f"DGCMomentum: momentum={momentum!r} is not allowed; it must be a float in [0, 1)")
        if clip_norm is not None and (isinstance(clip_norm, bool) or not isinstance(clip_norm, (int, float))
                                      or not (0.0 < clip_norm < math.inf)):
            raise ValueError(f"DGCMomentum: clip_norm={clip_norm!r} is not allowed; it must be None or a finite float > 0")
        if not isinstance(masking, bool):
            raise ValueError(f"DGCMomentum: masking={masking!r} is not allowed; it must be a bool")
        self.momentum = float(momentum)
        self.clip_norm = None if clip_norm is None else float(clip_norm)
        self.masking = masking
        self._velocity: Dict[str, torch.Tensor] = {}
        self._pending: Dict[str, torch.Tensor] = {}  # u_new between accumulate and update

    def __repr__(self) -> str:
        return (f"DGCMomentum({self.compressor!r}, momentum={self.momentum}, "
                f"clip_norm={self.clip_norm}, masking={self.masking})")

    def residual(self, key: Optional[str] = None) -> torch.Tensor:
        """The accumulation ``v`` of ``key`` (a scalar zero before its first step)."""
        buf = self._state.get("" if key is None else str(key))
        return buf.clone() if buf is not None else torch.zeros(())

    def velocity(self, key: Optional[str] = None) -> torch.Tensor:
        """The velocity ``u`` of ``key`` after masking (a scalar zero before its first step)."""
        buf = self._velocity.get("" if key is None else str(key))
        return buf.clone() if buf is not None else torch.zeros(())

    def accumulate(self, tensor: torch.Tensor, key: Optional[str]) -> torch.Tensor:
        """``v + u_new`` (a new tensor), where ``u_new = momentum * u + clip(tensor)``."""
        self.compressor._check_input(tensor)
        skey = "" if key is None else str(key)
        v = self._slot(skey, tensor)
        u = self._velocity.get(skey)
        if u is None or u.shape != v.shape or u.dtype != v.dtype or u.device != v.device:
            u = torch.zeros_like(v) if u is None or u.numel() != v.numel() else u.reshape(v.shape).to(v)
        g = tensor.detach().to(v.dtype)
        if self.clip_norm is not None:
            norm = float(torch.linalg.vector_norm(g))
            if self.clip_norm < norm < math.inf:
                g = g * (self.clip_norm / norm)
        u_new = torch.add(g, u, alpha=self.momentum)
        self._pending[skey] = u_new
        return v + u_new

    def update(self, key: Optional[str], acc: torch.Tensor, sent: torch.Tensor) -> None:
        """``v = acc - sent``; clear the velocity where ``sent`` is non-zero (masking)."""
        skey = "" if key is None else str(key)
        u = self._pending.pop(skey, None)
        if u is None:
            raise ValueError(f"DGCMomentum: update of key {skey!r} without a preceding accumulate")
        v = self._slot(skey, acc)
        sent = sent.reshape(acc.shape)
        torch.sub(acc, sent.to(v.dtype), out=self._writable(skey))
        if self.masking:
            u.masked_fill_(sent != 0, 0.0)
        replace(self._velocity, skey)
        self._velocity[skey] = u

    def _compress_step(self, tensor: torch.Tensor, key: Optional[str], step: Optional[int]) -> Payload:
        """Compress ``v + momentum * u + clip(tensor)``; updates ``u`` and ``v`` of ``key``."""
        acc = self.accumulate(tensor, key)
        payload, decoded = self._send(acc, tensor.dtype, key, step)
        self.update(key, acc, decoded)
        return payload

    def state_dict(self) -> Dict[str, Any]:
        sd = super().state_dict()
        sd["config"] = {"momentum": self.momentum, "clip_norm": self.clip_norm, "masking": self.masking}
        sd["velocity"] = {k: v.detach().cpu().clone() for k, v in self._velocity.items()}
        return sd

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        config = {"momentum": self.momentum, "clip_norm": self.clip_norm, "masking": self.masking}
        if state.get("config") != config:
            raise ValueError(f"DGCMomentum: state_dict config {state.get('config')} differs from {config}")
        super().load_state_dict(state)
        self._velocity = {k: v.clone() for k, v in state.get("velocity", {}).items()}
        self._pending = {}
