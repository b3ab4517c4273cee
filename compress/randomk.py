"""``randomk``: send k elements chosen at random, scaled by numel/k so the result is unbiased.

Positions come from the counter stream keyed by ``(seed, key, step)``: ranks with the same
seed, key and step choose the same positions, so their value tensors can be averaged as they
are (``native``). The positions are not sent. The payload is ``[values]`` (input dtype,
unscaled) and its meta carries ``k, seed, key, step, rescale``; the receiver draws the same
positions again. That is 32 bits per kept fp32 element, half of ``topk``, and no index from
the wire is ever scattered with.

Sampling is stratified with a random rotation: the positions, rotated by a uniform shift, are
cut into k strata of floor(n/k) or ceil(n/k) consecutive positions and one position is drawn
uniformly in each. This needs k + 1 draws (random keys for all n elements and a selection
would need n), gives k distinct positions by construction, and selects every element with
probability exactly k/n: averaged over the shift, an element sits in each stratum with
probability size/n and is then chosen with probability 1/size. Unlike uniform sampling without
replacement, two elements of one stratum are never both chosen; that changes covariances, not
the per-element unbiasedness.

Non-finite input cannot be carried by a random subset, so it poisons the payload: if the
tensor holds NaN or Inf, every sent value is NaN. The rescale is computed in fp32 (fp64 for
fp64) and decoded to the tensor's dtype; a kept value whose rescaled value that dtype cannot
hold (fp16: ``|x| * numel / k >= 65520``, i.e. ``|x| > 655`` at ratio 0.01) makes decoding a
``ValueError`` (the same on every rank, which decode the same averaged values), never an inf
nor a silently clipped, biased value.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from gradcomp.kernels import rng
from gradcomp.kernels.sparse import densify

from .base import (Capabilities, Compressor, CompressorConfig, Encoded, expect, meta_int, numel_of, option,
                   seed_option, work_dtype)
from .registry import register
from .sparse import ratio_option, scatter_into
from .transaction import refuse

_MAX_K = 2**31 - 1  # keeps the stratum arithmetic below in int64


def positions(numel: int, k: int, seed: int, key: str, step: int, device: torch.device) -> torch.Tensor:
    """The k distinct int64 positions that ``randomk`` keeps for ``(seed, key, step)``."""
    if k == 0:
        return torch.empty(0, dtype=torch.int64, device=device)
    # Named from the arguments, not from a compressor's config: the receiver is default-made
    # and knows seed, key and step only from the payload. Same stream name as _uniform uses.
    u = rng.uniform(2 * (k + 1), rng.stream_key(seed, f"randomk/{key}", step), device).double()
    # Two 24-bit draws make one 48-bit uniform, fine enough for strata of up to 2**31 elements.
    w = u[:k + 1] + u[k + 1:] * 2.0**-24
    shift = torch.clamp((w[0] * numel).long(), max=numel - 1)  # kept on the device: no host read
    j = torch.arange(k + 1, device=device)
    q, r = divmod(numel, k)
    start = j * q + (j * r) // k  # floor(j * numel / k) without overflow
    size = start[1:] - start[:-1]
    offset = torch.minimum((w[1:] * size).long(), size - 1)
    return (start[:-1] + offset + shift) % numel


@register("randomk")
class RandomK(Compressor):
    """k = max(1, round(ratio * numel)) elements at shared random positions, scaled by n/k."""

    @dataclass(frozen=True)
    class Config(CompressorConfig):
        ratio: float = ratio_option(0.01)
        seed: int = seed_option()
        rescale: bool = option(True, "scale kept values by numel/k: True => unbiased; False => biased "
                               "towards zero with k/n of the variance, the better choice under error "
                               "feedback")

    config: Config

    @property
    def capabilities(self) -> Capabilities:
        # the option decides: without the rescale the result is biased towards zero
        return Capabilities(native=True, unbiased=self.config.rescale, stochastic=True)

    def _k(self, numel: int) -> int:
        return 0 if numel == 0 else max(1, round(self.config.ratio * numel))

    def _compress(self, flat, shape, key, step, want_decoded):
        c = self.config
        n = flat.numel()
        k = self._k(n)
        if k > _MAX_K:
            raise ValueError(f"randomk keeps at most {_MAX_K} elements, ratio={c.ratio} asks for {k}")
        idx = positions(n, k, c.seed, key, step, flat.device)
        values = flat[idx]
        # NaN everywhere unless all of flat is finite: on a GPU decided on the device
        if n and flat.device.type != "cpu":
            values = torch.where(torch.isfinite(flat).all(), values, math.nan)
        elif n and not _all_finite_cpu(flat):
            values.fill_(math.nan)
        meta = {"k": k, "seed": c.seed, "key": key, "step": step, "rescale": c.rescale}
        decoded = _decode(idx, values, n, c.rescale, flat.dtype) if want_decoded else None
        return Encoded([values], meta, decoded)

    def _decompress(self, payload):
        m = payload.meta
        n = numel_of(payload)
        values = payload.tensors[0]
        idx = positions(n, m["k"], m["seed"], m["key"], m["step"], values.device)
        return _decode(idx, values, n, m["rescale"], payload.dtype)

    def _decompress_into(self, payload, out, alpha, accumulate):
        m, n = payload.meta, payload.numel
        values = payload.tensors[0]
        idx = positions(n, m["k"], m["seed"], m["key"], m["step"], values.device)
        scaled = _scaled(values, n, idx.numel(), m["rescale"], payload.dtype)
        scatter_into(out, idx, scaled, payload.dtype, alpha, accumulate, checked=True)  # positions() are in range

    def _wire_bytes(self, numel):
        return 4.0 * self._k(numel)

    @classmethod
    def _check_tensors(cls, payload):
        name, m, n = cls.name, payload.meta, numel_of(payload)
        expect(set(m) == {"k", "seed", "key", "step", "rescale"}, name,
               f"meta must hold exactly k, seed, key, step, rescale; got {sorted(m)}")
        k = meta_int(payload, "k", name, 0, min(n, _MAX_K))
        expect((k == 0) == (n == 0), name, f"k={k} for {n} elements; k >= 1 unless the tensor is empty")
        meta_int(payload, "seed", name, 0, 2**63 - 1)
        meta_int(payload, "step", name, -(2**62), 2**62)
        expect(isinstance(m["key"], str), name, f"meta key must be a string, got {m['key']!r:.40}")
        expect(isinstance(m["rescale"], bool), name, f"meta rescale must be a bool, got {m['rescale']!r:.40}")
        expect(len(payload.tensors) == 1, name, f"expected 1 tensor (values), got {len(payload.tensors)}")
        values = payload.tensors[0]
        allowed = (payload.dtype, work_dtype(payload.dtype))  # error feedback sends fp32 for fp16/bf16
        expect(values.dtype in allowed, name, f"values have dtype {values.dtype}, expected one of {allowed}")
        expect(values.dim() == 1 and values.numel() == k, name,
               f"values have shape {tuple(values.shape)}, expected ({k},)")


def _all_finite_cpu(flat: torch.Tensor) -> bool:
    """Every element of the CPU tensor ``flat`` is finite: a sum first (one fast pass), confirmed
    element by element only when it is not finite (finite data can overflow it). Read on the
    host, which on CPU costs nothing; other devices decide on the device (``_compress``)."""
    return bool(torch.isfinite(flat.sum())) or bool(torch.isfinite(flat).all())


def _decode(idx: torch.Tensor, values: torch.Tensor, numel: int, rescale: bool, dtype: torch.dtype) -> torch.Tensor:
    return densify(idx, _scaled(values, numel, idx.numel(), rescale, dtype), numel, work_dtype(values.dtype),
                   checked=True)  # positions() are in range


def _scaled(values: torch.Tensor, numel: int, k: int, rescale: bool, dtype: torch.dtype) -> torch.Tensor:
    """The decoded values in the work dtype: ``values * numel / k`` with ``rescale``;
    ``ValueError`` if one is finite but beyond what the gradient's ``dtype`` holds."""
    wd = work_dtype(values.dtype)
    if not (rescale and numel):
        return values.to(wd)
    scaled = values.to(wd) * (numel / k)
    top = torch.finfo(dtype).max
    problem = (f"randomk: a kept value times numel/k = {numel / k:.4g} exceeds the largest finite {dtype} "
               f"({top:.6g}): with rescale=True |x| must stay below {top * k / numel:.4g} for this tensor; use "
               f"rescale=False, a larger ratio or a wider dtype")
    refuse(torch.logical_and(torch.isinf(scaled.to(dtype)).any(), torch.isfinite(values).all()), problem)
    return scaled
