"""What the optimizers of ``gradcomp.optim`` share: option checks, the process group, the
dense mean, agreement between ranks, and whose a checkpoint is.

Every check raises ``ValueError`` naming the option and what is allowed, before any state
exists. The dense mean is ``gradcomp.collectives.allreduce(t, "none")``: the bits of plain DDP
(scaled by ``1/w`` before the sum) and counted in gradcomp's telemetry like every other byte.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from gradcomp.collectives import allreduce, exchange_bucket, rank_of, world_of
from gradcomp.collectives.identity import Identity, agree, describe_params, fingerprint, refuse_on_every_rank
from gradcomp.collectives.worker import submit


# ---- option checks ---------------------------------------------------------------------------
def check_number(name: str, value: Any, *, low: float = 0.0, low_open: bool = False,
                 high: Optional[float] = None, high_open: bool = True) -> float:
    """``value`` as a float, or ``ValueError`` naming ``name`` and the allowed interval."""
    lo, hi = "(" if low_open else "[", ")" if high_open or high is None else "]"
    allowed = f"{lo}{low:g}, {'inf' if high is None else f'{high:g}'}{hi}"
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(float(value)):
        raise ValueError(f"{name}={value!r} is not allowed; it must be a finite number in {allowed}")
    v = float(value)
    if v < low or (low_open and v == low) or (high is not None and (v > high or (high_open and v == high))):
        raise ValueError(f"{name}={value!r} is not allowed; it must be in {allowed}")
    return v


def check_int(name: str, value: Any, low: int = 0) -> int:
    """``value`` as an int ``>= low``, or ``ValueError`` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name}={value!r} is not allowed; it must be an int >= {low}")
    return int(value)


def check_betas(betas: Any) -> Tuple[float, float]:
    """``(beta1, beta2)``, each in ``[0, 1)``."""
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"betas={betas!r} is not allowed; it must be a pair (beta1, beta2), each in [0, 1)")
    return (check_number("betas[0]", betas[0], high=1.0), check_number("betas[1]", betas[1], high=1.0))


def check_adam_options(lr: Any, betas: Any, eps: Any, weight_decay: Any) -> None:
    """The options every Adam-like optimizer here takes."""
    check_number("lr", lr)
    check_betas(betas)
    check_number("eps", eps)
    check_number("weight_decay", weight_decay)


def check_dense_grads(params: Sequence[torch.Tensor], what: str) -> None:
    """``ValueError`` naming the first parameter whose gradient is sparse (``nn.Embedding(sparse=True)``),
    before anything changes: these optimizers keep dense moments and exchange dense tensors."""
    for i, p in enumerate(params):
        g = p.grad
        if g is not None and g.layout != torch.strided:
            raise ValueError(f"{what}: parameter {i} (shape {tuple(p.shape)}) has a sparse gradient ({g.layout}); "
                             f"{what} needs dense gradients: build that module with sparse=False (e.g. "
                             f"nn.Embedding(..., sparse=False)), or give its parameters to torch.optim.SparseAdam")


def trained(params: Sequence[torch.Tensor], what: str) -> List[torch.Tensor]:
    """The parameters (every group's, in order), refusing sparse, complex and non-float ones."""
    for p in params:
        if not p.is_floating_point() or p.is_complex():
            raise ValueError(f"{what}: parameters must be real floating point tensors, got {p.dtype}")
        if p.is_sparse:
            raise ValueError(f"{what}: sparse parameters are not supported")
    return list(params)


# ---- the process group -----------------------------------------------------------------------
def is_distributed(group) -> bool:
    """Whether ``group`` spans more than this process (a process group is started)."""
    return dist.is_available() and dist.is_initialized() and world_of(group) > 1


def dense_mean(flat: torch.Tensor, group, key: str = "dense", agreed: Optional[set] = None) -> torch.Tensor:
    """The mean of ``flat`` over ``group``, dense (DDP's bits, counted in telemetry); ``flat``
    itself with one process.

    ``agreed``: a set the caller keeps across steps. The first call of a key, size and dtype is
    a checked ``allreduce`` (its header makes every rank agree on the call) and is then noted
    there; later ones average ``flat`` in place as DDP's reducer does, one all-reduce with no
    header and nothing read back (the caller's step reads its finiteness once, as it must to
    decide the step). Without it every call is checked."""
    if not is_distributed(group):
        return flat
    sig = (key, flat.numel(), flat.dtype, flat.device)
    if agreed is None or sig not in agreed:
        out = allreduce(flat, "none", key=key, group=group)
        if agreed is not None:
            agreed.add(sig)
        return out
    world = world_of(group)
    return submit(lambda twin: exchange_bucket([(key, flat, None)], twin(group), world, buffer=flat, label=key,
                                               observe=False)[0], (group,), False, device=flat.device, inputs=[flat])


def agree_config(config: Mapping[str, str], group, what: str) -> None:
    """Raise the same ``ValueError`` on every rank unless every rank passed the same
    ``config`` (the training runtime's agreement check)."""
    if not is_distributed(group):
        return
    agree(config, group, f"when {what} started")


def named(params: Sequence[torch.Tensor]) -> List[Tuple[str, torch.Tensor]]:
    """``params`` named by position (``param0``, ...): these optimizers are given no model."""
    return [(f"param{i}", p) for i, p in enumerate(params)]


# ---- whose a checkpoint is -------------------------------------------------------------------
def identity(what: str, group, config: str, params: Sequence[torch.Tensor]) -> Identity:
    """Rank, world size, configuration and parameters: a checkpoint belongs to one rank of one
    job (``what``: the optimizer's class name)."""
    on = dist.is_available() and dist.is_initialized()
    return Identity(owner=what, rank=rank_of(group) if on else 0, world=world_of(group) if on else 1,
                    config=fingerprint(config), params=fingerprint(describe_params(named(params))))


def check_identity(problem: Optional[str], mine: Identity, saved: Any, group, what: str, config: str) -> None:
    """The same ``ValueError`` on every rank of ``group`` (this process alone without one)
    unless every rank's ``saved`` identity is its ``mine`` and it has no other ``problem``;
    ``config``: this run's configuration, named in the fix."""
    if not problem:
        problem = mine.mismatch(saved, fixes={
            "world": "error-feedback residuals belong to one world size: resume on as many ranks as it was saved on",
            # the fix is a format string ({rank}, {world}): the configuration's own braces are text
            "config": f"resume with the same options (this run's: {_literal(config)})"})
    refuse_on_every_rank(problem, group if is_distributed(group) else None, f"{what}.load_state_dict")


def _literal(text: str) -> str:
    """``text`` inside a ``str.format`` template, as it is."""
    return text.replace("{", "{{").replace("}", "}}")


def run_closure(closure: Optional[Callable[[], Any]]) -> Any:
    """The loss of ``closure`` (None without one), computed with gradients on."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


class MomentRange:
    """Whether a step's gradients fit Adam's second moment, decided on the device.

    ``beta2 * v + (1 - beta2) * g * g`` overflows for a finite but huge gradient (about 1.8e19 in
    fp32); ``v`` is then inf, ``sqrt(v)`` is inf and ``0 * inf`` is NaN downstream. A step whose
    gradient is not finite or would take the second moment out of its dtype's range is skipped
    instead. Decided per tensor from two read-only max-norms (of ``g`` and of ``v``) in fp64:
    ``max|g|^2`` must fit the compute dtype and ``beta2 * max v + (1 - beta2) * max|g|^2`` the
    moment's dtype (an upper bound of every element's new value: never lets an overflow through).
    No host sync: the result is a bool tensor on the gradients' device. Cost: one read-only pass
    over the gradients (and over the variance where it changed), less than one of the step's
    elementwise ops (25M fp32 elements, one CPU core: ~40 ms against ~75 ms for a ``lerp``)."""

    def __init__(self) -> None:
        self._consts: Dict[Any, Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def _constants(self, device: torch.device, beta2s: Sequence[float], sqs: Sequence[torch.Tensor]):
        key = (device, tuple(beta2s), tuple(v.dtype for v in sqs))
        if key not in self._consts:  # made once: a host-to-device copy each step would sync the stream
            beta2 = torch.tensor(list(beta2s), dtype=torch.float64)
            limit = torch.tensor([torch.finfo(v.dtype).max for v in sqs], dtype=torch.float64)
            # the square is taken in fp32 for fp32 and 16-bit tensors (their compute dtype), fp64 for fp64
            square = torch.tensor([torch.finfo(torch.float64 if v.dtype == torch.float64 else torch.float32).max
                                   for v in sqs], dtype=torch.float64)
            self._consts[key] = (beta2.to(device), limit.to(device), square.to(device))
        return self._consts[key]

    @staticmethod
    def maxima(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """Per tensor, ``max |t|`` in fp64 (NaN where an element is NaN; 0 for an empty tensor)."""
        dev = tensors[0].device
        out = []
        for t in tensors:
            if not t.numel():
                out.append(torch.zeros((), dtype=torch.float64, device=dev))
                continue
            low, high = torch.aminmax(t.detach())  # one read pass (4x faster on CPU than an inf-norm)
            out.append(torch.maximum(high, -low).double())
        return torch.stack(out)

    def out_of_range(self, grads: Sequence[torch.Tensor], sqs: Sequence[torch.Tensor], beta2s: Sequence[float],
                     vmax: Optional[torch.Tensor] = None) -> torch.Tensor:
        """A bool scalar on the gradients' device: True when some gradient is not finite or would
        overflow its second moment ``sqs[i]`` (``vmax``: their :meth:`maxima`, when known)."""
        if not grads:
            return torch.zeros((), dtype=torch.bool)
        g = self.maxima(grads)
        v = self.maxima(sqs) if vmax is None else vmax
        beta2, limit, square = self._constants(g.device, beta2s, sqs)
        g2 = g * g
        fits = torch.isfinite(g) & (g2 <= square) & (beta2 * v + (1 - beta2) * g2 <= limit)
        return ~fits.all()


def poison_(flat: torch.Tensor, bad: torch.Tensor) -> torch.Tensor:
    """``flat`` filled with NaN where the 0-d bool ``bad`` is True (in place, no host sync): a
    rank's unusable contribution makes the exchanged mean non-finite on every rank, so every rank
    skips the step together, whatever the codec keeps of it."""
    return flat.masked_fill_(bad, float("nan"))


def all_finite(tensors: Sequence[Optional[torch.Tensor]]) -> bool:
    """Whether every tensor is finite (one sync)."""
    from gradcomp.compress.transaction import all_finite as finite

    return finite([t for t in tensors if t is not None])
