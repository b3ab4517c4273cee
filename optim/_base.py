"""``DistributedOptimizer``: what the compressed-momentum optimizers (1-bit Adam, 0/1 Adam,
1-bit LAMB) share.

They are data-parallel themselves: some steps need the dense mean of the gradients, the others
only this rank's gradient (its momentum is exchanged compressed instead). Without DDP the
optimizer averages the gradients itself on the steps that need it. Under DDP, DDP would
average every step; register :meth:`comm_hook` instead of DDP's own reduction and it averages
densely (DDP's bits) exactly on the steps that need it and leaves the local gradient elsewhere.

A parameter without a gradient counts as a zero gradient, so every rank steps the same
parameters; a sparse gradient is refused (``ValueError`` naming the parameter). At construction
the parameters are broadcast from the group's first rank and the ranks check that they agree
on the configuration, the learning rates and the parameters (the same ``ValueError`` on every
rank otherwise; the learning rates are left out of a checkpoint's identity only, since
schedulers change them).

A step whose gradient is not finite, or so large that Adam's second moment would overflow
(:class:`~gradcomp.optim._common.MomentRange`), on any rank is skipped on every rank: nothing
changes, ``skipped`` counts it and a ``RuntimeWarning`` says so; the next step goes on. The
verdict is already the same on every rank (the exchanged mean carries the poison), so the
optimizer's :class:`~gradcomp.training.step.StepDecision` (``opt.decision``) only settles it,
without a reduction of its own; ``skipped`` is its counter (``skipped_steps``, the older name,
reads it too).

``state_dict`` adds the error-feedback residuals and counters to torch's optimizer state, with
whose they are; ``load_state_dict`` refuses another rank's, another world size's or another
model's.
"""
from __future__ import annotations

import warnings
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from gradcomp.collectives import rank_of, world_of
from gradcomp.compress import as_codec
from gradcomp.collectives.identity import Identity, describe_params
from gradcomp.training.step import StepDecision, Stepping
from gradcomp.training.wrapper import broadcast_params

from . import _common as common
from .momentum import MomentumExchange


_SCHEDULED = ("params", "lr", "initial_lr")


class DistributedOptimizer(Stepping, torch.optim.Optimizer):
    """Base of the optimizers that exchange compressed momentum; see the module docstring."""

    #: the name used in messages and in a checkpoint's identity
    display_name = "optimizer"

    def __init__(self, params: Any, defaults: Dict[str, Any], *, compressor: Any, compressor_options: Any,
                 process_group: Any, exchanges: Sequence[str]) -> None:
        self._built = False  # torch's __init__ adds the first groups through add_param_group
        super().__init__(params, defaults)
        self.process_group = process_group
        self._params = common.trained([p for g in self.param_groups for p in g["params"]], self.display_name)
        self._group_by_id = {id(p): g for g in self.param_groups for p in g["params"]}
        self._built = True
        codec = as_codec(compressor, compressor_options, error_feedback="none", wrappers="refuse", what=self.display_name)
        self.compressor_name = codec.name
        self._codec_config = repr(codec.config)  # the options too: ranks must code alike
        # one exchange (its own residuals on both sides) per quantity that travels compressed
        self.exchanges: Dict[str, MomentumExchange] = {}
        for name in exchanges:  # one codec: its per-key state is kept apart by the keys
            self.exchanges[name] = MomentumExchange(codec, process_group, key=f"{self.display_name}/{name}")
        self._ddp = False  # comm_hook() was taken: DDP hands step() the gradients it needs
        self._dense_agreed: set = set()  # dense means checked once on every rank (common.dense_mean)
        self.steps = 0  # completed steps
        # settles every step; its counter, skipped: steps that changed nothing (a gradient not finite
        # or out of the second moment's range)
        self.decision = StepDecision(process_group, self.display_name)
        self._range = common.MomentRange()
        self._masks: Optional[List[Optional[Mask]]] = None
        if common.is_distributed(process_group):
            common.agree_config({"configuration": self._config(), "learning rates": self._learning_rates(),
                                 "parameters": describe_params(common.named(self._params))}, process_group,
                                self.display_name)
            broadcast_params(self._params, process_group)

    # ---- what a subclass says ----------------------------------------------------------------
    def wants_dense(self) -> bool:
        """Whether the coming step needs the dense mean of the gradients."""
        raise NotImplementedError

    def _state_of(self, p: torch.Tensor) -> Dict[str, Any]:
        """The state of ``p``, created at first use (with ``exp_avg`` and ``exp_avg_sq``)."""
        raise NotImplementedError

    def _dense_step(self, grads: List[torch.Tensor]) -> None:
        """A step on the dense mean ``grads``."""
        raise NotImplementedError

    def _compressed_step(self, grads: List[torch.Tensor]) -> None:
        """A step on this rank's own ``grads``."""
        raise NotImplementedError

    def _forget(self) -> None:
        """Drop what is derived from the state (after a load)."""

    def _config(self) -> str:
        """Every option that must be the same on every rank and in a resumed run."""
        # not the learning rate: schedulers change it, and a resumed run is the same run
        hyper = [{k: v for k, v in g.items() if k not in _SCHEDULED} for g in self.param_groups]
        return f"{self.display_name} {self._options()} compressor={self.compressor_name} {self._codec_config} groups={hyper}"

    def _learning_rates(self) -> str:
        """Every group's learning rate (and a scheduler's ``initial_lr``): the same on every rank
        at construction, or the replicas drift apart from the first step."""
        return str([{k: g[k] for k in ("lr", "initial_lr") if k in g} for g in self.param_groups])

    # ---- steps that change nothing ------------------------------------------------------------
    @property
    def skipped_steps(self) -> int:
        """:attr:`skipped`, by its older name (read only)."""
        return self.decision.skipped

    def _settle(self, keep: bool, what: str = "on every rank: a gradient on some rank was") -> bool:
        """Settle the step (``keep``: the same on every rank, or this rank's own where it steps
        alone): a step that changed nothing is counted and reported. True when kept."""
        if not self.decision.settle(keep):
            warnings.warn(f"{self.display_name}: step {self.steps + 1} skipped {what} not finite or too large for "
                          f"Adam's second moment (|g| beyond ~1.8e19 in fp32); nothing changed, training goes on "
                          f"({self.skipped} skipped so far: opt.skipped)", RuntimeWarning, stacklevel=4)
        return keep

    def _skip(self, what: str = "on every rank: a gradient on some rank was") -> None:
        """Count and report a step that changed nothing."""
        self._settle(False, what)

    def _out_of_range(self, grads: List[torch.Tensor], vmax: Optional[torch.Tensor] = None) -> torch.Tensor:
        """True (a 0-d bool on the device, no sync) when a gradient of ``grads`` (one per
        parameter) is not finite or would overflow its parameter's second moment."""
        return self._range.out_of_range(grads, [self._state_of(p)["exp_avg_sq"] for p in self._params],
                                        [self._group_of(p)["betas"][1] for p in self._params], vmax)

    def _fits(self, grads: List[torch.Tensor], vmax: Optional[torch.Tensor] = None) -> bool:
        """Whether the step on ``grads`` can go ahead (one host sync); counts and reports it if not."""
        return self._settle(not bool(self._out_of_range(grads, vmax)))

    def _options(self) -> str:
        raise NotImplementedError

    def _extra_state(self) -> Dict[str, Any]:
        """Counters a subclass keeps beyond torch's per-parameter state."""
        return {}

    def _load_extra_state(self, state: Mapping[str, Any]) -> None:
        pass

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        loss = common.run_closure(closure)
        common.check_dense_grads(self._params, self.display_name)  # before anything changes
        dense = self.wants_dense()
        grads = self._grads(dense)
        if dense:
            self._dense_step(grads)
        else:
            self._compressed_step(grads)
        return loss

    def masks(self) -> List[Optional[torch.Tensor]]:
        """Per parameter, the elements masked out of the exchange (a bool tensor, True where
        masked; None: none): where the variance is zero, fixed when it is frozen."""
        return [None if m is None else m.mask for m in self.masked()]

    def masked(self) -> List[Optional["Mask"]]:
        """:meth:`masks` as :class:`Mask` objects, which zero a tensor there cheaply."""
        if self._masks is None:
            self._masks = zero_masks([self._state_of(p)["exp_avg_sq"] for p in self._params])
        return self._masks

    def has_unmasked(self) -> bool:
        """Whether some element is not masked, so that a poisoned (NaN) element survives the
        masking and reaches every rank's mean (see ``_common.poison_``)."""
        return any(m is None or m.kept for p, m in zip(self._params, self.masked()) if p.numel())

    def _group_of(self, p: torch.Tensor) -> Dict[str, Any]:
        return self._group_by_id[id(p)]

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        if self._built:
            raise ValueError(f"{self.display_name}: parameters cannot be added after construction (the exchanged "
                             f"tensor and its residuals are laid out over them); pass every group at once")
        super().add_param_group(param_group)

    # ---- gradients ---------------------------------------------------------------------------
    @property
    def world(self) -> int:
        return world_of(self.process_group) if common.is_distributed(self.process_group) else 1

    @property
    def rank(self) -> int:
        return rank_of(self.process_group) if common.is_distributed(self.process_group) else 0

    def _local_grads(self) -> List[torch.Tensor]:
        """Every parameter's gradient (zeros where it has none), as it is on this rank."""
        return [p.grad.detach() if p.grad is not None else torch.zeros_like(p) for p in self._params]

    def _grads(self, dense: bool) -> List[torch.Tensor]:
        """The gradients of this step: the dense mean over ranks when ``dense`` (done by DDP's
        hook when :meth:`comm_hook` was registered), else this rank's own."""
        grads = self._local_grads()
        if not dense or self._ddp or not common.is_distributed(self.process_group):
            return grads
        for dtype, idx in _by_dtype(grads).items():
            flat = common.dense_mean(torch.cat([grads[i].reshape(-1) for i in idx]), self.process_group,
                                     key=f"{self.display_name}/dense/{dtype}", agreed=self._dense_agreed)
            for i, piece in zip(idx, flat.split([grads[i].numel() for i in idx])):
                grads[i] = piece.view_as(grads[i])
        return grads

    def comm_hook(self) -> Tuple[Any, Callable[..., Any]]:
        """``(state, hook)`` for ``ddp_model.register_comm_hook``: dense mean on the steps that
        need it (the bits of DDP's own allreduce), this rank's gradient on the others."""
        from .ddp import dense_or_local_hook

        self._ddp = True
        return self, dense_or_local_hook

    # ---- state -------------------------------------------------------------------------------
    def _identity(self) -> Identity:
        return common.identity(self.display_name, self.process_group, self._config(), self._params)

    def state_dict(self) -> Dict[str, Any]:
        """torch's optimizer state plus the residuals and counters, with whose they are."""
        sd = super().state_dict()
        sd["gradcomp"] = {"identity": self._identity().to_dict(), "steps": self.steps, "skipped": self.skipped,
                          "exchanges": {k: e.state_dict() for k, e in self.exchanges.items()},
                          "extra": self._extra_state()}
        return sd

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load :meth:`state_dict` on every rank at the same point: a state_dict of another
        rank, world size, model or configuration on any rank is refused with the same
        ``ValueError`` on every rank, and nothing is loaded."""
        ours = state_dict.get("gradcomp") if isinstance(state_dict, Mapping) else None
        problem = None if isinstance(ours, Mapping) else "it holds no gradcomp state (saved by another optimizer?)"
        saved = ours.get("identity") if isinstance(ours, Mapping) else None
        common.check_identity(problem, self._identity(), saved, self.process_group, self.display_name, self._config())
        assert isinstance(ours, Mapping)
        rest = {k: v for k, v in state_dict.items() if k != "gradcomp"}
        super().load_state_dict(rest)
        for k, e in self.exchanges.items():
            e.load_state_dict(ours["exchanges"][k])
        self.steps = int(ours["steps"])
        self.skipped = int(ours.get("skipped", 0))
        self._load_extra_state(ours["extra"])
        self._masks = None  # recomputed from the loaded variance
        self._forget()


def _by_dtype(tensors: Sequence[torch.Tensor]) -> Dict[torch.dtype, List[int]]:
    out: Dict[torch.dtype, List[int]] = {}
    for i, t in enumerate(tensors):
        out.setdefault(t.dtype, []).append(i)
    return out


# A mask over at most this share of its tensor is applied by its positions (``index_fill_``):
# a pass over the masked elements only, ~10x faster than ``masked_fill_``'s pass over the
# whole tensor at 1.4 % of 25M elements; its int64 positions then take at most half the
# bool mask's memory.
SPARSE_MASK = 1 / 16


class Mask:
    """Where a tensor is masked out of the exchange (``mask``, True there) and how to zero it
    there: ``fill_(t)`` is ``t.masked_fill_(mask, 0.0)``, the same bits, by the masked
    positions (``index``) when they are few."""

    __slots__ = ("mask", "index", "kept")

    def __init__(self, mask: torch.Tensor, index: torch.Tensor) -> None:
        self.mask = mask
        self.kept = index.numel() < mask.numel()  # some element is not masked
        self.index = index if index.numel() <= SPARSE_MASK * mask.numel() else None

    def fill_(self, t: torch.Tensor) -> torch.Tensor:
        if self.index is not None and t.is_contiguous():
            t.view(-1).index_fill_(0, self.index, 0.0)
        else:
            t.masked_fill_(self.mask, 0.0)
        return t


MaskLike = Optional[Any]  # a Mask, a bool tensor (True where masked) or None (nothing masked)


def zero_masked_(t: torch.Tensor, m: MaskLike) -> torch.Tensor:
    """``t`` with its masked elements set to +0.0, in place (``m``: see :data:`MaskLike`)."""
    if m is None:
        return t
    return m.fill_(t) if isinstance(m, Mask) else t.masked_fill_(m, 0.0)


def flat(tensors: Sequence[torch.Tensor], masks: Sequence[MaskLike]) -> torch.Tensor:
    """Every tensor in fp32, zero where its mask (see :func:`zero_masks`; a bool tensor is
    taken too) is True, as one flat tensor (new: the inputs are not written)."""
    if not tensors:
        return torch.zeros(0)
    out = torch.cat([t.float().reshape(-1) for t in tensors])
    for t, m, piece in zip(tensors, masks, out.split([t.numel() for t in tensors])):
        zero_masked_(piece.view(t.shape), m)  # a contiguous view: zeroed by its positions
    return out


def unflat_(out: Sequence[torch.Tensor], masks: Sequence[MaskLike], values: torch.Tensor) -> None:
    """Write ``values`` (as :func:`flat` laid them out) back into ``out``; masked elements
    become zero (whatever a code that cannot say zero decoded there)."""
    for t, m, piece in zip(out, masks, values.split([t.numel() for t in out])):
        t.copy_(piece.view_as(t))
        zero_masked_(t, m)


def zero_masks(tensors: Sequence[torch.Tensor]) -> List[Optional[Mask]]:
    """Per tensor: where it is zero (a :class:`Mask`), or None when nowhere; one host read per
    tensor (the positions' count), when the variance is frozen."""
    out: List[Optional[Mask]] = []
    for t in tensors:
        zero = t == 0
        index = zero.reshape(-1).nonzero().view(-1)
        out.append(Mask(zero, index) if index.numel() else None)
    return out
