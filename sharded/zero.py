"""``ShardedOptimizer``: sharded data parallel (ZeRO stage 1/2) on gradcomp's collectives.

Every rank keeps the full parameters (for forward and backward) but only its *shard* of the
optimizer: each parameter group's trainable parameters are laid end to end into one flat
vector, cut into balanced contiguous shards (``sharded/layout.py``), and rank ``r`` holds,
per group, one flat tensor of its shard — the **master copy** of those elements, in fp32
(fp64 for fp64 parameters) — and the inner optimizer's state for it alone. One step:

1. backward: as each bucket's gradients are complete, its exchange starts on gradcomp's
   worker thread (overlapping the rest of backward, as ``CompressedOptimizer`` does): a
   **reduce-scatter** — each rank receives the mean over ranks of its part of the bucket,
   dense (gradcomp's one rounding rule) or compressed with error feedback on the sender
   (``collectives/shards.py``). With ``stage=2`` the bucket's ``.grad`` tensors are freed as it
   leaves; with ``stage=1`` they stay;
2. ``step()``: every rank checks its reduced shard; one flag all-reduce (the optimizer's
   :class:`~gradcomp.training.step.StepDecision`, ``opt.decision``) lets every rank skip a
   non-finite step together (nothing changes: error feedback undone, no inner step; counted in
   ``skipped``) or raise together when one rank's exchange failed. Otherwise the inner optimizer — any
   ``torch.optim`` class, built on the shard tensors with the groups' hyper-parameters — steps
   the master shard;
3. an **all-gather** of the master shards writes the parameters of every rank: exact (fp32),
   or compressed (``weight_compressor="bf16"``/``"int8"``, ZeRO++'s qwZ) with error feedback on
   the weights: the owner sends ``Q(master + e)`` and keeps ``e`` (its residual), and every rank,
   the owner too, sets the parameters to the decoded bits — replicas stay identical, and the
   master copy stays exact (it is moved only by the optimizer). ``step()`` waits for it (one
   all-gather per parameter group). With ``prefetch=True`` each group's gather is cut into
   balanced pieces (one per bucket: piece ``c`` is the ``c``-th equal part of every rank's
   shard), queued on the worker in the order the forward pass needs them, and ``step()``
   returns at once: the next forward pass waits for each piece just before a module of
   ``model`` reads its parameters, so the gathers overlap that forward pass (FSDP's forward
   prefetch).

``state_bits=8`` stores the inner optimizer's moment tensors in 8 bits between steps
(:class:`~gradcomp.sharded.LowBitState`; the small-tensor rule is decided on the whole
group, not on the shard). Optimizer classes with ``layerwise = True`` are told which slices of
their shard belong to which parameter (``inner.shard_layout(layout, num_layers, group)``).

Prefetch. Between ``step()`` and the forward pre-hook that waits for a piece, that piece's
parameters are being written: read parameters outside ``model``'s forward pass (a metric, an
EMA, your own collective) only after ``synchronize()``. ``model.state_dict()``, this
optimizer's ``step``, ``state_dict`` and ``load_state_dict`` wait by themselves. A module waits
for the parameters it owns (``named_parameters(recurse=False)``), as an FSDP unit does: a
forward that reads another module's parameter before that module runs (a tied weight used
functionally) needs ``synchronize()`` or ``prefetch=False``.

Checkpoints: ``state_dict()`` is this rank's shard (loaded by the same rank of the same world
size); ``consolidated_state_dict(to=0)`` gathers a whole checkpoint on one rank, which
``load_state_dict`` accepts at any world size (resharding). See docs/sharding.md.
"""
from __future__ import annotations

import weakref
from typing import Any, Callable, ContextManager, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import torch

from gradcomp.collectives import rank_of, world_of
from gradcomp.collectives import worker
from gradcomp.collectives.shards import all_gather, reduce_scatter
from gradcomp.compress import ErrorFeedback, as_codec
from gradcomp.compress.transaction import Transaction, nonfinite
from gradcomp.training.buckets import BucketLauncher
from gradcomp.training.step import StepDecision, Stepping
from gradcomp.training.wrapper import Wrapper, broadcast_params
from gradcomp.collectives.identity import agree, describe_params, fingerprint, names_of

from . import checkpoint
from .layout import (Bucket, GatherPiece, GroupLayout, bucket_key, flat_of, gather_pieces, group_buckets,
                      group_layout, layer_slices, weight_key)
from .lowbit import _COMPENSATIONS, BITS, MIN_NUMEL, LowBitState, bits_problem

__all__ = ["ShardedOptimizer"]

_STAGES = (1, 2)
# the agreement field naming frozen parameters: a parameter frozen on one rank only changes the
# group's layout, so it is compared before the groups and named (not just counted)
_FROZEN = "parameters with requires_grad=False"
_STATE_BITS = (32, *BITS)  # 32: the inner optimizer's own state


def _feedback(compressor: Any, options: Mapping[str, Any], what: str) -> Optional[ErrorFeedback]:
    """``None`` for dense, else the compressor with (residual) error feedback."""
    if compressor is None or (isinstance(compressor, str) and compressor == "none"):
        return None
    if isinstance(compressor, str) and compressor == "auto":
        raise ValueError(f"ShardedOptimizer: {what}='auto' is not offered here yet (auto chooses per bucket for "
                         f"ddp_comm_hook and CompressedOptimizer); name a compressor, e.g. {what}='int8'")
    return as_codec(compressor, options, error_feedback="ef", what=what)


def _groups(params: Any) -> List[Dict[str, Any]]:
    groups = list(params) if not isinstance(params, torch.Tensor) else [params]
    if not groups:
        raise ValueError("ShardedOptimizer got an empty parameter list")
    if not isinstance(groups[0], dict):
        groups = [{"params": groups}]
    out = []
    for g in groups:
        if not isinstance(g, dict) or "params" not in g:
            raise ValueError("parameter groups must all be dicts with 'params' (or pass tensors only)")
        ps = g["params"]
        ps = [ps] if isinstance(ps, torch.Tensor) else list(ps)
        if any(not isinstance(p, torch.Tensor) for p in ps):
            raise ValueError("ShardedOptimizer: every parameter must be a torch.Tensor")
        out.append({**g, "params": ps})
    return out


class ShardedOptimizer(Stepping, Wrapper):
    """Sharded data parallel with ``optimizer_class`` stepping this rank's shard (see the module
    docstring).

    ``compressor``: gradients' reduce-scatter — None (dense) or a compressor name/object (its
    options in ``compressor_options``), always with error feedback. ``weight_compressor``: the
    parameters' all-gather — None (exact) or e.g. ``"bf16"``, ``"int8"``, with error feedback on
    the weights. ``state_bits``: 32 or 8. ``stage``: 1 keeps the full gradients after the
    reduce-scatter, 2 frees them. ``bucket_mb`` caps a bucket; ``model`` names the parameters in
    checkpoints (else ``param{i}``); ``prefetch=True`` (needs ``model``) lets the parameters'
    all-gather run into the next forward pass (see the module docstring); ``process_group``
    defaults to every rank. The remaining
    keywords are the inner optimizer's defaults (``lr=...``). ``state_compensation``: how
    8-bit state compensates its rounding (:class:`~gradcomp.sharded.LowBitState`). ``param_groups`` and ``state`` are
    the inner optimizer's (its tensors are the shards), so LR schedulers work as usual.
    """

    def __init__(self, params: Iterable[Any], optimizer_class: type, *, compressor: Any = None,
                 weight_compressor: Any = None, state_bits: int = 32, process_group: Any = None, stage: int = 2,
                 bucket_mb: float = 25.0, model: Optional[torch.nn.Module] = None,
                 compressor_options: Optional[Mapping[str, Any]] = None,
                 weight_options: Optional[Mapping[str, Any]] = None, state_compensation: str = "stochastic",
                 prefetch: bool = False, **defaults: Any) -> None:
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
            raise ValueError(f"optimizer_class must be a torch.optim.Optimizer subclass (e.g. torch.optim.AdamW), "
                             f"got {optimizer_class!r}")
        problem = bits_problem("state_bits", state_bits, _STATE_BITS)
        if problem is not None:
            raise ValueError(problem)
        if state_compensation not in _COMPENSATIONS:
            raise ValueError(f"state_compensation={state_compensation!r} is not allowed; allowed: "
                             f"{', '.join(_COMPENSATIONS)}")
        if stage not in _STAGES:
            raise ValueError(f"stage={stage!r} is not allowed; allowed: 1 (keep gradients), 2 (free them)")
        if isinstance(bucket_mb, bool) or not isinstance(bucket_mb, (int, float)) or not bucket_mb > 0:
            raise ValueError(f"bucket_mb={bucket_mb!r} is not allowed; it must be a number > 0")
        if not isinstance(prefetch, bool):
            raise ValueError(f"prefetch={prefetch!r} is not allowed; it must be True or False")
        if prefetch and model is None:
            raise ValueError("prefetch=True needs model=: the forward pre-hooks of its modules wait for the "
                             "gathers of the parameters each reads")
        if callable(getattr(optimizer_class, "comm_hook", None)):
            # the same on every rank (the class is the same everywhere: ranks that disagree on
            # it are not each other's peers in any ShardedOptimizer)
            raise ValueError(f"{optimizer_class.__name__} exchanges its own momentum across the data-parallel "
                             f"ranks (it keeps a full replica on each), so it cannot step one shard: use it "
                             f"without ShardedOptimizer, or shard a plain optimizer (torch.optim.Adam, "
                             f"gradcomp.optim.Lamb)")
        super().__init__()
        self.group = process_group
        self.world, self.rank = world_of(process_group), rank_of(process_group)
        self.stage, self.state_bits, self.bucket_mb = stage, state_bits, float(bucket_mb)
        self.state_compensation = state_compensation
        self.grad_feedback = _feedback(compressor, compressor_options or {}, "compressor")
        self.weight_feedback = _feedback(weight_compressor, weight_options or {}, "weight_compressor")
        self.optimizer_class = optimizer_class
        # the step decision (its skipped counter: steps skipped together because a reduced gradient
        # or the last weight gather was not finite)
        self.decision = StepDecision(process_group, "ShardedOptimizer")
        groups = _groups(params)
        self._all = [p for g in groups for p in g["params"]]  # layer numbers: positions here, frozen included
        self.names = names_of(self._all, model)
        self._trainable = [[p for p in g["params"] if p.requires_grad] for g in groups]
        position = {id(p): i for i, p in enumerate(self._all)}
        if len(position) != len(self._all):
            raise ValueError("a parameter appears more than once in the parameters given to ShardedOptimizer")
        self._layers = [[position[id(p)] for p in ps] for ps in self._trainable]
        self._check_dtypes()
        hyper = [{k: v for k, v in g.items() if k != "params"} for g in groups]
        self.layouts: List[GroupLayout] = [group_layout([p.numel() for p in ps], self.world) for ps in self._trainable]
        self._buckets: List[Bucket] = [b for g, (lay, ps) in enumerate(zip(self.layouts, self._trainable))
                                       for b in group_buckets(lay, g, ps, self.bucket_mb)]
        self._config = self._describe(hyper, defaults)
        if self.world > 1:
            # the bucket layout too: ranks cutting buckets differently would exchange pieces of
            # other sizes (a hang, an abort or a silent mismatch)
            agree({**self._config, "buckets": self._bucket_text()}, process_group,
                  "when the ShardedOptimizer was built")
            broadcast_params([p for ps in self._trainable for p in ps], self.group)
        self.masters = [self._master_of(g) for g in range(len(groups))]
        self.optimizer = self._build_inner(hyper, defaults)
        self._index = {id(p): (g, i) for g, ps in enumerate(self._trainable) for i, p in enumerate(ps)}
        self._worker = worker.worker_for((process_group,)) if self.world > 1 else None
        self._launcher = BucketLauncher()  # members: (group, position in the group's trainable parameters)
        self._launcher.plan([[(b.group, i) for i in b.members] for b in self._buckets],
                            {(g, i): self.names[self._layers[g][i]] for (g, i) in self._index.values()})
        self._launcher.watch([p for ps in self._trainable for p in ps], self._grad_ready)
        # every rank's buckets and pieces are the same: after its first exchange, each bucket's
        # payloads travel on their agreed layout (no size exchange, no parsing)
        self._layouts: Dict[Any, Any] = {}
        self._gathered: Optional[Transaction] = None  # the last weight all-gather, decided at the next step
        self.prefetch = prefetch
        # the weights' all-gathers: one per group, or with prefetch as many balanced pieces per group
        # as it has buckets, in the order the forward pass needs them (see _gather_order)
        self._pieces: List[GatherPiece] = self._gather_order(
            [gp for g, lay in enumerate(self.layouts) if self._trainable[g]
             for gp in gather_pieces(lay, g, sum(b.group == g for b in self._buckets) if prefetch else 1)
             if any(a < z for a, z in gp.slices)])
        # per piece, fixed from here on: where its gathered vector goes and this rank's error-feedback key
        self._places_of = [self._places(gp) for gp in self._pieces]
        self._keys = [weight_key(gp.group, self._slice_of(gp)) for gp in self._pieces]
        self._pending: Dict[int, torch.futures.Future] = {}  # piece -> its all-gather, in flight
        self._hooks = self._hook(model) if prefetch and model is not None else []  # prefetch needs model (checked)
        self._reset()

    # ---- construction -----------------------------------------------------------------------
    def _check_dtypes(self) -> None:
        for g, ps in enumerate(self._trainable):
            kinds = {(p.dtype, p.device) for p in ps}
            if len(kinds) > 1:
                raise ValueError(f"parameter group {g} mixes dtypes/devices {sorted(map(str, kinds))}; a group is "
                                 f"one flat vector: put parameters of each dtype and device in their own group")
            if any(not p.is_floating_point() for p in ps):
                raise ValueError(f"parameter group {g} has a non-floating trainable parameter")

    def _describe(self, hyper: List[Dict[str, Any]], defaults: Mapping[str, Any]) -> Dict[str, str]:
        """What every rank must agree on (printable), field by field."""
        frozen = [n for n, p in zip(self.names, self._all) if not p.requires_grad]
        groups = " | ".join(str(len(ps)) for ps in self._trainable)
        return {"optimizer": f"{self.optimizer_class.__module__}.{self.optimizer_class.__qualname__}",
                "optimizer options": repr(sorted(defaults.items())),
                "parameters": describe_params(list(zip(self.names, self._all))),
                _FROZEN: repr(frozen),
                "parameter groups": f"{groups} {sorted(repr(sorted(h.items())) for h in hyper)}",
                "compressor": repr(self.grad_feedback), "weight compressor": repr(self.weight_feedback),
                "state bits": f"{self.state_bits} {self.state_compensation if self.state_bits < 32 else ''}",
                "stage": str(self.stage)}

    def _bucket_text(self) -> str:
        return f"bucket_mb={self.bucket_mb:g}: " + " ".join(f"{b.group}:{b.start}-{b.stop}" for b in self._buckets)

    def _master_dtype(self, g: int) -> torch.dtype:
        ps = self._trainable[g]
        return torch.float64 if ps and ps[0].dtype == torch.float64 else torch.float32

    def _device(self, g: int) -> torch.device:
        ps = self._trainable[g]
        return ps[0].device if ps else torch.device("cpu")

    def _master_of(self, g: int) -> torch.Tensor:
        lo, hi = self.layouts[g].shard(self.rank)
        flat = flat_of(self._trainable[g], self._master_dtype(g)).to(self._device(g))
        return flat[lo:hi].clone()

    def _build_inner(self, hyper: List[Dict[str, Any]], defaults: Mapping[str, Any]) -> torch.optim.Optimizer:
        try:
            inner = self.optimizer_class([{**h, "params": [m]} for h, m in zip(hyper, self.masters)], **defaults)
        except TypeError as exc:
            raise ValueError(f"{self.optimizer_class.__name__} refused the options {sorted(defaults)}: {exc}") from None
        if getattr(self.optimizer_class, "layerwise", False):
            layout = [layer_slices(lay, self.rank, layers) for lay, layers in zip(self.layouts, self._layers)]
            inner.shard_layout(layout, len(self._all), self.group)  # type: ignore[attr-defined]
        if self.state_bits < 32:
            whole = {id(m): lay.numel for m, lay in zip(self.masters, self.layouts)}
            # a block starts at each parameter: one block never mixes two parameters' moments
            # (measured: the many-small-tensors model lost 0.3 pp with mixed blocks, none without)
            starts = {id(m): [off - lay.shard(self.rank)[0] for off in lay.offsets]
                      for m, lay in zip(self.masters, self.layouts)}
            inner = LowBitState(inner, bits=self.state_bits, compensation=self.state_compensation,
                                quantize=lambda t: whole.get(id(t), t.numel()) >= MIN_NUMEL,
                                breaks=lambda t: starts.get(id(t), ()))
        return inner

    # ---- the wrapped optimizer --------------------------------------------------------------
    def __repr__(self) -> str:
        return (f"ShardedOptimizer({self.optimizer_class.__name__}, rank {self.rank} of {self.world}, "
                f"compressor={self.grad_feedback!r}, weight_compressor={self.weight_feedback!r}, "
                f"state_bits={self.state_bits}, stage={self.stage})")

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        raise ValueError("ShardedOptimizer cannot add parameter groups after construction (the shards are laid "
                         "out once); pass every group to the constructor")

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._drain()
        for ps in self._trainable:
            for p in ps:
                if set_to_none:
                    p.grad = None
                elif p.grad is not None:
                    p.grad.detach_().zero_()

    def no_sync(self) -> ContextManager[None]:
        """Backward passes inside only accumulate gradients (keep ``stage=1`` semantics for them:
        nothing is freed); the next one outside exchanges them."""
        return self._launcher.no_sync()

    # ---- one step ---------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """Run ``closure`` (once) if given; finish the reduce-scatter; step the shard; gather the
        parameters. A step with a non-finite reduced gradient on any rank changes nothing."""
        loss = None
        self.synchronize()
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        pieces = self._reduced()
        if pieces is None:  # skipped on every rank
            return loss
        grads = self._shard_grads(pieces)
        for m, g in zip(self.masters, grads):
            m.grad = g
        try:
            self.optimizer.step()
        finally:
            for m in self.masters:
                m.grad = None
        self._gather()
        return loss

    def _reduced(self) -> Optional[List[Optional[torch.Tensor]]]:
        """Every bucket's piece of this rank's shard, once every rank knows that none failed
        and all are finite; None when some are not (the iteration is undone and skipped)."""
        self._launcher.launch_rest(self._launch)
        pieces, error = self._launcher.wait()
        txn = self._txn
        if error is not None and not isinstance(error, ValueError):
            # the group failed under the exchange (a peer silent past the timeout, a broken
            # link): it cannot carry the flags either, and asking would wait a second timeout
            self._reset()
            txn.rollback()
            raise error
        # both flags reduced over the ranks on the device and read once: the step's one host read.
        # A failure is this rank's error, or a flag of its transaction (a refused input, an
        # invalid received payload), which every rank then learns of through the reduction.
        witness = nonfinite([p for p in pieces if p is not None] if error is None else [], self.masters[0].device)
        local = txn.flagged() if error is None else None
        failure = error is not None if local is None else local
        # the last step's weight all-gather (its error feedback's state, the payloads it received) is
        # decided here too, with the same read: its flags and finiteness join the reduction
        gathered, self._gathered = self._gathered, None
        device = self.masters[0].device
        g_flag = None if gathered is None else gathered.flagged()
        g_bad = False if gathered is None else gathered.nonfinite(device)
        verdict = self.decision.reduce({"failed": failure, "nonfinite": witness if error is None else True,
                                        "gather failed": False if g_flag is None else g_flag,
                                        "gather nonfinite": g_bad})
        failed, g_failed = verdict["failed"], verdict["gather failed"]
        problems = txn.problems if failed and local is not None else []  # read only when something failed
        g_problems = gathered.problems if gathered is not None and g_failed and g_flag is not None else []
        self._reset()
        if gathered is not None:
            gathered.rollback() if g_failed or verdict["gather nonfinite"] else gathered.commit()
        if failed or g_failed:  # undone and raised on every rank (not a skipped step)
            txn.rollback()
            if error is not None:
                raise error
            if problems or g_problems:
                said = "; ".join(problems + [f"the last step's weight all-gather: {p}" for p in g_problems])
                raise ValueError(f"ShardedOptimizer: {said}; this step changed nothing")
            raise ValueError("ShardedOptimizer: the gradient exchange or the last weight all-gather failed on "
                             "another rank (the error is raised there); this step changed nothing")
        # not finite on some rank: undone and skipped on every rank (the decision counts it)
        return pieces if self.decision.settle(verdict.clean, txn) else None

    def _shard_grads(self, pieces: List[Optional[torch.Tensor]]) -> List[torch.Tensor]:
        grads = [torch.zeros_like(m) for m in self.masters]
        for b, piece in zip(self._buckets, pieces):
            lo, hi = self.layouts[b.group].shard(self.rank)
            a, z = max(lo, b.start), min(hi, b.stop)
            if piece is not None and a < z:
                grads[b.group][a - lo:z - lo] = piece.to(grads[b.group].dtype)
        return grads

    def _gather(self) -> None:
        """Every rank's master shards into every rank's parameters (compressed when asked), one
        all-gather per piece (:attr:`_pieces`), queued on the worker in that order; waited for
        here, or with ``prefetch`` by the next forward pass (:meth:`_hook`). Compressed, the gathers' state
        changes (error feedback) and the flags of the payloads they received form a transaction
        of their own, decided at the next step's one read (:meth:`_reduced`), not by a read of
        its own."""
        if self.prefetch and self._ran is not None:
            self._attribute()
        txn = Transaction()
        self._gathered = txn
        try:
            with txn.active():
                for k in range(len(self._pieces)):
                    self._pending[k] = self._launch_gather(k, txn)
        except BaseException:
            self._settle_gather(list(self._pending), failed=True)
            raise
        if not self.prefetch:
            self.synchronize()

    def _launch_gather(self, k: int, txn: Transaction) -> torch.futures.Future:
        piece = self._pieces[k]
        g = piece.group
        lay, m = self.layouts[g], self.masters[g]
        a, z = piece.slices[self.rank]
        params = self._trainable[g]
        dense = self.weight_feedback is None
        splits = [stop - start for start, stop in piece.slices]
        places, feedback, key = self._places_of[k], self.weight_feedback, self._keys[k]
        group, layouts = self.group, self._layouts

        def job(group_for: Callable[[Any], Any]) -> None:
            with txn.active():
                mine = m[a:z].to(params[0].dtype) if dense else m[a:z]
                full = all_gather(mine, splits, compressor=feedback, key=key, group=group_for(group), layouts=layouts)
                for i, at, src, n in places:
                    p = params[i]
                    if at == 0 and n == p.numel():
                        p.data.copy_(full[src:src + n].view_as(p))
                    elif p.data.is_contiguous():
                        p.data.view(-1)[at:at + n].copy_(full[src:src + n])
                    else:  # part of a parameter in another memory format (channels_last)
                        flat = p.data.reshape(-1).clone()
                        flat[at:at + n] = full[src:src + n]
                        p.data.copy_(flat.view_as(p))

        if self._worker is None:
            return worker.completed(job, twin=lambda g: g, device=m.device)
        # without prefetch the caller waits at once: run on its thread once the queue is empty (no hand-off)
        return self._worker.submit(job, device=m.device, inline=not self.prefetch)

    def synchronize(self) -> None:
        """Wait for the parameters' all-gathers still in flight (``prefetch=True``); on CUDA the
        current stream is then ordered after them. Raises what a gather raised (its state
        changes undone), after waiting for the rest."""
        if self._pending:
            self._settle_gather(list(self._pending))

    def _settle_gather(self, ks: Sequence[int], failed: bool = False) -> None:
        """Wait for the gathers of pieces ``ks``; when one raised (or ``failed``), wait for every
        other one too, undo the gathers' transaction and raise the first error."""
        error: Optional[BaseException] = None
        for k in ks:
            fut = self._pending.pop(k, None)
            if fut is None:
                continue
            try:
                fut.wait()
            except BaseException as exc:  # noqa: B902 - re-raised below, after the rest
                error = error or exc
        if error is None and not failed:
            return
        for fut in list(self._pending.values()):
            try:
                fut.wait()
            except BaseException:  # noqa: B902 - the first error is the one raised
                pass
        self._pending.clear()
        gathered, self._gathered = self._gathered, None
        if gathered is not None:
            gathered.rollback()
        if error is not None:
            raise error

    def _slice_of(self, piece: GatherPiece) -> Optional[Tuple[int, int]]:
        """This rank's slice of ``piece`` as its error-feedback key names it: None when the piece
        is the group's whole shard (the key of a gather not cut into pieces)."""
        whole = sum(gp.group == piece.group for gp in self._pieces) == 1
        return None if whole else piece.slices[self.rank]

    def _places(self, piece: GatherPiece) -> List[Tuple[int, int, int, int]]:
        """Where the gathered vector of ``piece`` goes: ``(parameter, its first element written,
        first element read, count)`` for every overlap of a rank's slice with a parameter of the
        group."""
        lay = self.layouts[piece.group]
        out, src = [], 0
        for r, (a, z) in enumerate(piece.slices):
            lo = lay.bounds[r]
            start, stop = lo + a, lo + z  # the slice in the group's vector
            for i, (off, n) in enumerate(zip(lay.offsets, lay.numels)):
                s, e = max(start, off), min(stop, off + n)
                if s < e:
                    out.append((i, s - off, src + s - start, e - s))
            src += z - a
        return out

    def _gather_order(self, pieces: List[GatherPiece]) -> List[GatherPiece]:
        """``pieces`` in the order a forward pass needs them: by the position, among the
        parameters given, of the first parameter each writes (the same on every rank, which
        issue the gathers in this order); a group's pieces stay in their order."""
        def first(gp: GatherPiece) -> int:
            places = [i for i, *_ in self._places(gp)]
            return min(self._layers[gp.group][i] for i in places) if places else len(self._all)
        return sorted(pieces, key=first)  # stable: a group's pieces keep their order

    def _hook(self, model: torch.nn.Module) -> List[Any]:
        """Forward pre-hooks on ``model``'s modules that wait for the pieces holding the parameters
        each uses, and a state_dict pre-hook that waits for all; held by a weak reference, so
        the hooks do not keep this optimizer alive. Which module uses which parameters is
        learnt from the first forward pass (:meth:`_attribute`)."""
        pieces_of: Dict[int, set] = {}  # parameter -> the pieces that write it
        for k, (gp, places) in enumerate(zip(self._pieces, self._places_of)):
            for i, *_ in places:
                pieces_of.setdefault(id(self._trainable[gp.group][i]), set()).add(k)
        # every trainable parameter is one of model's (names_of checked it): a module owns it
        self._modules = [id(m) for m in model.modules()]
        self._parent = {id(child): id(m) for m in model.modules() for child in m.children()}
        self._direct = {id(m): set().union(*(pieces_of.get(id(p), set()) for p in m.parameters(recurse=False)))
                        for m in model.modules()}
        self._root = id(model)
        self._ran: Optional[set] = set()  # modules whose forward ran, until the first gather
        self._waits: Dict[int, Tuple[int, ...]] = {}
        ref = weakref.ref(self)
        handles = []
        for module in model.modules():
            def before(_module: Any, _args: Any, mid: int = id(module)) -> None:
                opt = ref()
                if opt is None:
                    return
                if opt._ran is not None:
                    opt._ran.add(mid)
                elif opt._pending:
                    ks = opt._waits.get(mid)
                    if ks:
                        opt._settle_gather(ks)

            handles.append(module.register_forward_pre_hook(before))

        def before_state_dict(*_: Any) -> None:
            opt = ref()
            if opt is not None:
                opt.synchronize()

        handles.append(model.register_state_dict_pre_hook(before_state_dict))
        return handles

    def _attribute(self) -> None:
        """Which pieces each module's pre-hook waits for, from the forward passes seen before the
        first gather: its own parameters' pieces when its forward ran; otherwise (a module
        whose parameters its parent reads, as ``nn.MultiheadAttention`` reads its ``out_proj``)
        its parameters are waited for by the nearest module above it whose forward ran, the
        model itself at the latest."""
        ran, self._ran = self._ran or set(), None
        waits: Dict[int, set] = {}
        for mid in self._modules:
            ks = self._direct[mid]
            if not ks:
                continue
            at = mid
            while at not in ran and at != self._root:
                at = self._parent.get(at, self._root)
            waits.setdefault(at, set()).update(ks)
        self._waits = {mid: tuple(sorted(ks)) for mid, ks in waits.items()}

    # ---- the backward hooks -----------------------------------------------------------------
    def _reset(self) -> None:
        """A new iteration: no bucket launched, a fresh transaction for the exchanges' state."""
        self._launcher.reset()
        self._txn = Transaction()

    def _grad_ready(self, param: torch.Tensor) -> None:
        self._launcher.ready(self._index[id(param)], self._launch)

    def _launch(self, k: int) -> torch.futures.Future:
        b = self._buckets[k]
        params = [self._trainable[b.group][i] for i in b.members]
        flat = flat_of([p.grad if p.grad is not None else torch.zeros_like(p) for p in params], params[0].dtype)
        if flat.device != params[0].device:
            flat = flat.to(params[0].device)
        if self.stage == 2:
            for p in params:
                p.grad = None
        splits = self.layouts[b.group].splits(b.start, b.stop)
        key, comp, group, txn = bucket_key(b.group, k), self.grad_feedback, self.group, self._txn
        layouts = self._layouts

        def job(group_for: Callable[[Any], Any]) -> torch.Tensor:
            if flat.is_cuda:  # made on the caller's stream, read (and freed) on this one
                flat.record_stream(torch.cuda.current_stream(flat.device))
            with txn.active():
                return reduce_scatter(flat, splits, compressor=comp, key=key, group=group_for(group),
                                      layouts=layouts)

        if self._worker is None:
            return worker.completed(job, twin=lambda g: None)
        return self._worker.submit(job, device=flat.device, inline=k == len(self._buckets) - 1)

    def _drain(self) -> None:
        """Wait for exchanges in flight and undo them (their gradients never reach the shard)."""
        if self._launcher.drain():
            self._txn.rollback()
            self._reset()

    # ---- checkpoints ------------------------------------------------------------------------
    def identity(self) -> Dict[str, Any]:
        """Whose optimizer this is: rank, world size, parameter names and shapes, and a
        fingerprint of the configuration."""
        cfg = {k: v for k, v in self._config.items() if k not in ("parameters", _FROZEN)}  # "trainable" has those
        return {"rank": self.rank, "world": self.world, "names": list(self.names),
                "shapes": [list(p.shape) for p in self._all],
                "trainable": [bool(p.requires_grad) for p in self._all],
                "config": fingerprint(repr(sorted(cfg.items())))}

    def _checkpoint_view(self) -> checkpoint.ShardView:
        return checkpoint.ShardView(self.rank, self.world, self.group, self.layouts,
                                    [(b.group, b.start, b.stop) for b in self._buckets], self.masters,
                                    self.optimizer, self.grad_feedback, self.weight_feedback, self.identity(),
                                    self.skipped, [(gp.group, self._slice_of(gp)) for gp in self._pieces
                                                   if gp.slices[self.rank][0] < gp.slices[self.rank][1]])

    def state_dict(self) -> Dict[str, Any]:
        """This rank's shard: inner optimizer state, master shards, error feedback."""
        self.synchronize()
        self._drain()
        return checkpoint.shard_state(self._checkpoint_view())

    def consolidated_state_dict(self, to: int = 0) -> Optional[Dict[str, Any]]:
        """The whole optimizer, gathered on rank ``to`` (None on the others; every rank must
        call it): loads at any world size."""
        self.synchronize()
        self._drain()
        return checkpoint.consolidated(self._checkpoint_view(), to)

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load this rank's ``state_dict()`` or a ``consolidated_state_dict()`` of any world
        size; every rank raises the same error when any rank's checkpoint does not fit."""
        self.synchronize()
        self._drain()
        self._layouts.clear()  # the next exchanges are checked again
        if self._gathered is not None:  # the last gather's undo would restore what the checkpoint replaces
            self._gathered.commit()
            self._gathered = None
        self.skipped = checkpoint.load(self._checkpoint_view(), state_dict)
