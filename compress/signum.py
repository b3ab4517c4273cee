"""``signum``: send the sign of a momentum (Bernstein et al. 2018, Signum).

Per key, ``m = momentum * m + (1 - momentum) * g`` (fp32; fp64 for fp64 input) and the
wire carries ``sign(m)``: 1 bit per element plus one fp32 word, decoded as +1 / -1 like
``signsgd``, and as zeros while the momentum is zero everywhere (sign(0) = 0: a fresh
momentum fed zero gradients moves nothing; a zero element beside non-zero ones is sent as +1,
for one bit has no room for a third value). The momentum buffers are state: they are kept per key and
round-trip through ``state_dict()``. A gradient holding NaN/Inf decodes to NaN and leaves the
momentum untouched, so a step that AMP's loss scaler skips does not poison the later ones.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict

import torch

from .base import CompressorConfig, option, work_dtype
from .registry import register
from .sign import SignCompressor, finite_flag, nonfinite_sum, zero_or_one
from .transaction import replace, writable


@register("signum")
class Signum(SignCompressor):
    """Sign of a per-key momentum of the input, decoded as +1 / -1 (0 while the momentum is
    zero); keeps state per key."""

    @dataclass(frozen=True)
    class Config(CompressorConfig):
        momentum: float = option(0.9, "weight of past gradients in the momentum whose sign is sent; "
                                 "higher => smoother signs, slower to follow a change",
                                 lambda v: 0.0 <= v < 1.0, "a float in [0, 1)")

    config: Config
    # sum(|m|): 0 exactly when the momentum is zero everywhere (the gradient's finiteness is
    # checked before it enters the momentum, which then stays finite)
    stats = "abs"

    def _post_init(self) -> None:
        self._momentum: Dict[str, torch.Tensor] = {}
        self._spares: Dict[str, torch.Tensor] = {}  # the other buffer inside a transaction

    def _signal(self, flat, key):
        if flat.device.type != "cpu":
            return self._signal_on_device(flat, key)
        return self._signal_cpu(flat, key)

    def _signal_cpu(self, flat, key):
        """The momentum step of a CPU gradient: its finiteness read on the host (free there),
        the momentum left alone when it holds NaN/Inf."""
        if nonfinite_sum(flat.sum(dtype=work_dtype(flat.dtype)).item(), flat):
            return flat, True
        old = self._buffer(key, flat)
        # one pass, the bits of old.lerp_(...); inside a transaction into the other buffer
        weight = 1.0 - self.config.momentum
        buf = torch.lerp(old, flat.to(old.dtype), weight, out=writable(self._momentum, key, self._spares))
        return buf, False

    def _signal_on_device(self, flat, key):
        """The same step decided on the device: a non-finite gradient is replaced by the old
        momentum before the lerp (``lerp(m, m, w)`` is ``m``, bit for bit), so the momentum is
        left as it was, and the returned flag (a device tensor) makes the wire NaN. One pass
        more than on CPU (the select), no host read."""
        old = self._buffer(key, flat)
        nonfinite = finite_flag(flat.sum(dtype=torch.float64), flat).logical_not()
        target = torch.where(nonfinite, old, flat.to(old.dtype))
        buf = torch.lerp(old, target, 1.0 - self.config.momentum, out=writable(self._momentum, key, self._spares))
        return buf, nonfinite

    def _values(self, x, sums, bits):
        return zero_or_one(sums[0], x)

    def _buffer(self, key: str, flat: torch.Tensor) -> torch.Tensor:
        wd = work_dtype(flat.dtype)
        buf = self._momentum.get(key)
        if buf is None:
            buf = torch.zeros(flat.numel(), dtype=wd, device=flat.device)
        elif buf.numel() != flat.numel():
            raise ValueError(f"signum: key {key!r} held a momentum of {buf.numel()} elements, now "
                             f"{flat.numel()}; use a distinct key per tensor")
        elif buf.device == flat.device and buf.dtype == wd:
            return buf
        else:
            buf = buf.to(device=flat.device, dtype=wd, copy=True)
        replace(self._momentum, key, self._spares)
        self._momentum[key] = buf
        return buf

    def momentum_buffer(self, key: str | None = None) -> torch.Tensor:
        """A copy of the momentum of ``key`` (flat; a scalar zero before its first step)."""
        buf = self._momentum.get("" if key is None else str(key))
        return buf.clone() if buf is not None else torch.zeros(())

    def state_dict(self) -> Dict[str, Any]:
        sd = super().state_dict()
        sd["momentum"] = {k: v.detach().cpu().clone() for k, v in self._momentum.items()}
        return sd

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        super().load_state_dict(state)
        self._momentum = {k: v.clone() for k, v in state.get("momentum", {}).items()}
        self._spares = {}
