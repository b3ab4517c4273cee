"""``powersgd``: rank-``r`` approximation by one warm-started power iteration (Vogels et al. 2019).

A tensor of ``ndim >= 2`` is viewed as the matrix ``M`` of shape ``(shape[0], prod(shape[1:]))``.
With ``Q`` kept per key from the previous step (at the first step drawn from the seeded stream,
identical on every rank)::

    P = M Q;  P = average over ranks;  P = orthonormalize(P)
    Q = M^T P;  Q = average over ranks;  result = P Q^T

The wire carries ``P`` and ``Q``: ``(n + m) * r`` numbers instead of ``n * m``. Tensors that
would shrink less than ``min_compression_rate`` (and 0-d, 1-D and empty ones) are sent as
they are. Factors are computed and sent in fp32 (fp64 for fp64 input). Biased; use it with
``ErrorFeedback``.

The collective layer drives the averaging through :meth:`PowerSGD.rounds`; ``compress`` is the
one-process form (the average of one rank is itself) and its payload decodes to ``P Q^T``.
A non-finite ``Q`` is not kept for the next step, so one NaN gradient (a step that AMP's loss
scaler skips) does not poison the warm start.

Finite input gives finite output at every magnitude. A factor can overflow where the matrix
does not (``P = M Q`` sums ``m`` products): when the average of ``P`` (the sum of its entries)
or of ``Q`` comes back non-finite, which every rank sees alike, that round is repeated once
with the other factor, ``Q`` or ``P``, scaled by powers of two, per column, to an l1 norm
below 2**-2 (``_scaled``), so that no product, no partial sum and no average over ranks
(``Comm.mean_`` scales by ``1/w`` before summing) can overflow; the scale is exact and taken
out of ``P`` again, and NaN/Inf input stays non-finite through the repeat.
Entries of ``P Q^T`` beyond the largest finite value of the gradient's dtype (an fp16 matrix
near 65504, say) saturate to it.

That repeat is a host decision, taken on CPU tensors only, where reading a flag costs nothing.
Off the CPU (``_factors_on_device``) the number of rounds is fixed, two, and nothing is read:
each round's other factor is scaled so beforehand, in every round; the orthonormalisation
does not see the scale, so for operands of normal magnitude the result has the bits of the
CPU form. The kept ``Q`` is then the scaled one (the next ``P``
round is blind to its scale); ``P Q^T`` is formed scaled down by a power of two where a bound
on the device says it could overflow, and clamped to the dtype's range.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, Generator, Optional, Tuple

import torch

from gradcomp.kernels.memory import empty
from gradcomp.kernels.linalg import METHODS, orthonormalize
from gradcomp.kernels.quant import may_hold, mul_pow2_on_device_, pow2

from .base import (FLOAT_DTYPES, Capabilities, Compressor, CompressorConfig, Encoded, Rounds, expect, numel_of,
                   option, seed_option, work_dtype)
from .registry import register
from .transaction import replace


@register("powersgd")
class PowerSGD(Compressor):
    """Low-rank ``P Q^T`` by a warm-started power iteration; multi-round; keeps ``Q`` per key."""

    @dataclass(frozen=True)
    class Config(CompressorConfig):
        rank: int = option(4, "rank r of the approximation P Q^T (the matrix rank, not the process rank: the same on "
                           "every process); lower => fewer bytes, larger error", lambda v: v >= 1,
                           "an int >= 1: the matrix rank r of the approximation P Q^T, not a process rank (pass "
                           "the same value on every process, never dist.get_rank())")
        min_compression_rate: float = option(
            2.0, "send a tensor dense unless n*m / ((n+m)*rank) reaches this; higher => more tensors "
            "sent exactly, more bytes", lambda v: 1.0 <= v < math.inf, "a finite float >= 1")
        orthogonalize: str = option("qr", "how P is orthonormalised: 'qr' (Householder, robust) or "
                                    "'gram_schmidt' (a loop over the rank; cheaper on GPUs for small rank)",
                                    choices=METHODS)
        seed: int = seed_option()

    config: Config
    # the factor sizes depend on the matrix shape, not only on numel (fixed_size=False); the
    # first Q is drawn from the seeded stream of each key (stochastic)
    capabilities = Capabilities(multi_round=True, fixed_size=False, stochastic=True)

    def _post_init(self) -> None:
        self._q: Dict[str, torch.Tensor] = {}

    # ---- the algorithm --------------------------------------------------------------------
    def plan(self, shape: Tuple[int, ...]) -> Optional[Tuple[int, int, int]]:
        """``(n, m, r)`` of the low-rank view of a tensor of ``shape``, or None if sent dense."""
        if len(shape) < 2:
            return None
        n, m = shape[0], math.prod(shape[1:])
        r = min(self.config.rank, n, m)
        if n * m == 0 or n * m < self.config.min_compression_rate * (n + m) * r:
            return None
        return n, m, r

    def rounds(self, tensor: torch.Tensor, key: Optional[str] = None, *,
               out: Optional[torch.Tensor] = None) -> Rounds:
        """The multi-round form (see ``Compressor.rounds``): yields ``P``, then ``Q``, or the dense
        tensor once when it is sent uncompressed. Every yielded tensor is new, so the caller may
        average it in place; the averages it sends back must keep shape and dtype. ``out``
        (see ``Compressor.rounds``) receives the result: ``P Q^T`` is then written straight
        into it, which may be ``tensor`` itself (read in full before)."""
        self._check_input(tensor)
        _check_out(out, tensor)
        skey = "" if key is None else str(key)
        plan = self.plan(tuple(tensor.shape))
        if plan is None:
            avg = yield tensor.detach().clone()
            _expect_like(avg, tensor, "the dense tensor")
            return _deliver(avg.to(tensor.dtype).reshape(tensor.shape), out)
        n, m, r = plan
        p, q, p_top, q_top = yield from self._factors(tensor.detach().reshape(n, m), skey, r)
        if out is not None and out.dtype == p.dtype:  # no new memory to fault in
            return _product(p, q, tensor.dtype, out.view(n, m), p_top, q_top).view(tensor.shape)
        # a numpy-backed buffer: no page-fault cost on CPU
        approx = _product(p, q, tensor.dtype, empty(n * m, p.dtype, p.device).view(n, m), p_top, q_top)
        return _deliver(approx.reshape(tensor.shape).to(tensor.dtype), out)

    def _factors(self, mat: torch.Tensor, key: str, r: int
                 ) -> Generator[torch.Tensor, torch.Tensor,
                                Tuple[torch.Tensor, torch.Tensor, Optional[float], Optional[float]]]:
        """One power iteration on ``mat`` with the averaging done by the caller; returns
        ``(P, Q, max |P|, max |Q|)``, the third 1 for orthonormal ``P``, the fourth read with
        Q's finiteness (``_product`` then needs no pass and no read of its own); both None from
        the device form."""
        mat = mat.to(work_dtype(mat.dtype))
        if _on_device(mat):
            return (yield from self._factors_on_device(mat, key, r))
        q = self._start(key, mat.shape[1], r, mat.device, mat.dtype)
        # = mat @ q; on CPU this form is ~2x faster (MKL at small rank), on GPUs the plain one is the norm
        p = mat @ q if mat.is_cuda else (q.T @ mat.T).T.contiguous()
        p_avg = yield p
        _expect_like(p_avg, p, "P")
        # P's finiteness stays on the device until Q's round is back, and is read with Q's: one read
        # per matrix. A non-finite P (an overflow somewhere, or NaN/Inf input) is replaced by zeros
        # for that Q round, which is then wasted: the P round is repeated with a rescaled Q.
        p_ok = torch.isfinite(p_avg.sum())
        p = orthonormalize(torch.where(p_ok, p_avg, torch.zeros_like(p_avg)), self.config.orthogonalize)
        p_top = 1.0  # orthonormal columns: no entry above 1
        q_start = q
        q = (p.T @ mat).T.contiguous()  # = mat.T @ p, but streams mat by rows: ~6x faster on CPU
        q_avg = yield q
        _expect_like(q_avg, q, "Q")
        p_finite, finite, q_top = _finite_and_absmax(q_avg, p_ok)  # the retries' decisions, _product's bound
        if not p_finite:
            p = mat @ _scaled(q_start)[0]
            p_avg = yield p
            _expect_like(p_avg, p, "P")
            p = orthonormalize(p_avg, self.config.orthogonalize)
            q = (p.T @ mat).T.contiguous()
            q_avg = yield q
            _expect_like(q_avg, q, "Q")
            _, finite, q_top = _finite_and_absmax(q_avg)
        if not finite:
            small, k = _scaled(p)
            lift = pow2(k, p.dtype)
            q = (small.T @ mat).T.contiguous()
            q_avg = yield q
            _expect_like(q_avg, q, "Q")
            p = p * lift  # P Q^T unchanged: Q came out smaller by exactly this factor
            p_top = float(lift.amax())
            _, finite, q_top = _finite_and_absmax(q_avg)
        if finite:
            replace(self._q, key)  # an open transaction may have to undo it
            self._q[key] = q_avg.detach().clone()
        return p, q_avg, p_top, q_top

    def _factors_on_device(self, mat: torch.Tensor, key: str, r: int
                           ) -> Generator[torch.Tensor, torch.Tensor, Tuple[torch.Tensor, torch.Tensor, None, None]]:
        """``_factors`` without a host read (see the module docstring): two rounds, each factor
        that multiplies ``mat`` scaled first (``_scaled``), so that neither round can overflow;
        ``Q`` is kept where its average is finite, decided by ``torch.where``. The bounds are
        None: ``_product`` then finds them on the device."""
        q_start = self._start(key, mat.shape[1], r, mat.device, mat.dtype)
        q, _ = _scaled(q_start)  # P's columns scale with Q's, and orthonormalize takes that out again
        p = mat @ q if mat.is_cuda else (q.T @ mat.T).T.contiguous()
        p_avg = yield p
        _expect_like(p_avg, p, "P")
        p = orthonormalize(p_avg, self.config.orthogonalize)
        small, k = _scaled(p)
        q = (small.T @ mat).T.contiguous()
        q_avg = yield q
        _expect_like(q_avg, q, "Q")
        p = p * pow2(k, p.dtype)  # P Q^T unchanged: Q came out smaller by exactly this factor
        replace(self._q, key)  # an open transaction may have to undo it
        self._q[key] = torch.where(torch.isfinite(q_avg).all(), q_avg, q_start)  # the scaled Q, or the old one
        return p, q_avg, None, None

    def _start(self, key: str, m: int, r: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """The warm-start ``Q`` of ``key``; zero columns (left by a zero gradient) are drawn anew,
        since a power iteration can never leave a zero column."""
        q = self._q.get(key)
        if q is None:
            return self._draw(key, m, r, device, dtype)
        if tuple(q.shape) != (m, r):
            raise ValueError(f"powersgd: key {key!r} held Q of shape {tuple(q.shape)}, now needs ({m}, {r}); "
                             f"use a distinct key per tensor")
        if q.device != device or q.dtype != dtype:
            q = q.to(device=device, dtype=dtype)
        dead = q.abs().amax(dim=0) == 0
        if may_hold(dead):  # off the CPU the fresh draw is selected on the device, nothing read
            q = torch.where(dead, self._draw(key, m, r, device, dtype), q)
        return q

    def _draw(self, key: str, m: int, r: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """Standard normal (m, r) from the stream (seed, key): Box-Muller on uniform draws."""
        u = self._uniform(2 * m * r, key, 0, device, salt="/q").to(torch.float64).view(2, m, r)
        z = torch.sqrt(-2.0 * torch.log1p(-u[0])) * torch.cos(2.0 * math.pi * u[1])
        return z.to(dtype)

    # ---- one-process compress / decompress ---------------------------------------------------
    def _compress(self, flat, shape, key, step, want_decoded):
        plan = self.plan(shape)  # the matrix view needs the original shape
        if plan is None:
            return Encoded([flat.clone()], {"dense": True})
        p, q, p_top, q_top = _local(self._factors(flat.reshape(plan[0], plan[1]), key, plan[2]))
        return Encoded([p, q], {"dense": False},
                       _product(p, q, flat.dtype, None, p_top, q_top).reshape(-1) if want_decoded else None)

    def _decompress(self, payload):
        if payload.meta["dense"]:
            return payload.tensors[0]
        p, q = payload.tensors
        return _product(p, q, payload.dtype).reshape(-1)

    def _wire_bytes(self, numel):
        """Estimate for a square matrix of ``numel`` elements in fp32 (the real size depends on
        the shape: ``(n + m) * r`` numbers, or ``numel`` when sent dense)."""
        side = math.isqrt(numel)
        if self.plan((side, side)) is None or side * side != numel:
            return 4.0 * numel
        return 4.0 * 2 * side * min(self.config.rank, side)

    @classmethod
    def _check_tensors(cls, payload):
        dense = payload.meta.get("dense")
        expect(isinstance(dense, bool), cls.name, f"meta dense={dense!r} must be a bool")
        ts = payload.tensors
        expect(len(ts) == (1 if dense else 2), cls.name, f"{len(ts)} tensors for dense={dense}")
        expect(all(t.dtype in FLOAT_DTYPES for t in ts), cls.name, "tensors must be floating point")
        numel = numel_of(payload)
        if dense:
            expect(ts[0].dim() == 1 and ts[0].numel() == numel, cls.name,
                   f"dense tensor has shape {tuple(ts[0].shape)}, expected ({numel},)")
            return
        p, q = ts
        expect(p.dim() == 2 and q.dim() == 2 and p.dtype == q.dtype, cls.name,
               "P and Q must be matrices of one dtype")
        expect(p.shape[1] == q.shape[1] >= 1, cls.name, f"P {tuple(p.shape)} and Q {tuple(q.shape)} differ in rank")
        expect(p.shape[0] * q.shape[0] == numel, cls.name,
               f"P {tuple(p.shape)} and Q {tuple(q.shape)} do not describe {numel} elements")

    # ---- state --------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        sd = super().state_dict()
        sd["q"] = {k: v.detach().cpu().clone() for k, v in self._q.items()}
        return sd

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        super().load_state_dict(state)
        self._q = {k: v.clone() for k, v in state.get("q", {}).items()}


_HEADROOM = -2  # exponent of the l1 norm a factor column gets before it multiplies the matrix


def _on_device(t: torch.Tensor) -> bool:
    """Whether ``t`` takes the forms that read nothing back (all but CPU tensors; the tests
    run them on CPU tensors too)."""
    return t.device.type != "cpu"


def _scaled(f: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(f / 2**k, k)``, ``k`` an int64 exponent per column chosen on the device so that each
    column's l1 norm is below 2**-2: then ``|M (f / 2**k)| <= max|M| / 4`` entry by entry and
    partial sum by partial sum. ``k`` comes from the column's largest entry and its length (no
    sum that could overflow), the division is done in float64 (``mul_pow2_on_device_``): exact
    wherever the result is a normal number of ``f``'s dtype. A zero or non-finite column is
    divided by ``2**k`` all the same (NaN stays NaN)."""
    _, exp = torch.frexp(f.abs().amax(dim=0))  # |entries| < 2**exp; 0 for zero and non-finite columns
    k = exp.long() + ((f.shape[0] - 1).bit_length() - _HEADROOM)  # l1 < rows * 2**exp <= 2**(k - 2)
    return mul_pow2_on_device_(f.to(torch.float64, copy=True), -k).to(f.dtype), k


def _product(p: torch.Tensor, q: torch.Tensor, dtype: torch.dtype, out: Optional[torch.Tensor] = None,
             p_top: Optional[float] = None, q_top: Optional[float] = None) -> torch.Tensor:
    """``P Q^T`` in the factors' dtype (into ``out`` if given); entries of finite factors beyond
    ``dtype``'s largest finite value saturate to it. On CPU the bound ``r max|P| max|Q|`` on the
    entries (``p_top``, ``q_top``: max |P|, max |Q| when known) rules that out without a pass
    over the result, except near that value; elsewhere ``_product_on_device`` reads nothing."""
    if _on_device(p):
        return _product_on_device(p, q, dtype, out)
    return _product_cpu(p, q, dtype, out, p_top, q_top)


def _product_on_device(p: torch.Tensor, q: torch.Tensor, dtype: torch.dtype,
                       out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``_product`` with its bound on the device: where ``r max|P| max|Q|`` may exceed a quarter
    of the factors' largest value, the factors are scaled down by powers of two first, so that
    no sum overflows, and the product scaled back (beyond the factors' range, inf), then
    clamped to ``dtype``'s range (NaN stays NaN). Elsewhere every scale is 1: the bits of the
    plain product."""
    if not p.numel() or not q.numel():
        return torch.mm(p, q.T, out=out)
    top = torch.finfo(dtype).max
    room = math.frexp(torch.finfo(p.dtype).max)[1] - 2  # a sum below 2**room cannot overflow
    p_top, q_top = p.abs().amax(), q.abs().amax()
    _, p_exp = torch.frexp(p_top)
    _, q_exp = torch.frexp(q_top)
    bits = p_exp.long() + q_exp.long() + (p.shape[1] - 1).bit_length()  # r max|P| max|Q| < 2**bits
    k = torch.where(torch.isfinite(p_top) & torch.isfinite(q_top), (bits - room).clamp(min=0), 0)
    k_p = k.clamp(max=room)  # each scale a normal number of the factors' dtype
    k_q = k - k_p
    res = torch.mm(p * pow2(-k_p, p.dtype), (q * pow2(-k_q, q.dtype)).T, out=out)
    return res.mul_(pow2(k_p, p.dtype)).mul_(pow2(k_q, p.dtype)).clamp_(-top, top)


def _product_cpu(p: torch.Tensor, q: torch.Tensor, dtype: torch.dtype, out: Optional[torch.Tensor] = None,
                 p_top: Optional[float] = None, q_top: Optional[float] = None) -> torch.Tensor:
    res = torch.mm(p, q.T, out=out)
    top = torch.finfo(dtype).max
    if not res.numel():
        return res
    bound = p.shape[1] * (_absmax(p) if p_top is None else p_top) * (_absmax(q) if q_top is None else q_top)
    if bound * (1 + 2.0 ** -10) < top:  # the rounding of a rank-r dot product stays far below 2**-10
        return res
    if bool(torch.isfinite(p).all()) and bool(torch.isfinite(q).all()):
        exact = torch.mm(p.double(), q.double().T) if p.dtype != torch.float64 else res
        res.copy_(exact.clamp(-top, top))
    return res


def _finite_and_absmax(t: torch.Tensor, also: Optional[torch.Tensor] = None) -> Tuple[bool, bool, float]:
    """``(also, finite, top)`` in one host read: the value of ``also`` (a 0-d bool device
    tensor; True when not given), whether ``t`` is finite and ``max |t|`` (NaN when it holds NaN)."""
    flag = torch.ones((), dtype=t.dtype, device=t.device) if also is None else also.to(t.dtype).reshape(())
    if not t.numel():
        return bool(flag), True, 0.0
    first, lo, hi, finite = torch.stack([flag, *torch.aminmax(t), torch.isfinite(t).all().to(t.dtype)]).tolist()
    return bool(first), bool(finite), (math.nan if math.isnan(lo) or math.isnan(hi) else max(hi, -lo))


def _absmax(t: torch.Tensor) -> float:
    """``max |t|`` in one pass (NaN when ``t`` holds NaN)."""
    lo, hi = torch.stack(torch.aminmax(t)).tolist()  # both bounds in one host read
    return math.nan if math.isnan(lo) or math.isnan(hi) else max(hi, -lo)


def _check_out(out: Optional[torch.Tensor], tensor: torch.Tensor) -> None:
    if out is not None and not (isinstance(out, torch.Tensor) and out.shape == tensor.shape
                                and out.dtype == tensor.dtype and out.is_contiguous() and out.device == tensor.device):
        raise ValueError(f"powersgd: out must be a contiguous tensor of the input's shape {tuple(tensor.shape)}, "
                         f"dtype {tensor.dtype} and device")


def _deliver(result: torch.Tensor, out: Optional[torch.Tensor]) -> torch.Tensor:
    return result if out is None else out.copy_(result)


def _local(gen: Generator[torch.Tensor, torch.Tensor, Any]) -> Any:
    """Run a rounds generator in one process, where the average of a tensor is itself."""
    try:
        sent = next(gen)
        while True:
            sent = gen.send(sent)
    except StopIteration as stop:
        return stop.value


def _expect_like(got: Any, want: torch.Tensor, what: str) -> None:
    if not isinstance(got, torch.Tensor) or got.shape != want.shape or got.dtype != want.dtype:
        desc = f"{got.dtype} {tuple(got.shape)}" if isinstance(got, torch.Tensor) else type(got).__name__
        raise ValueError(f"powersgd: the average sent back for {what} must be a {want.dtype} tensor of "
                         f"shape {tuple(want.shape)}, got {desc}")
