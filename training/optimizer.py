"""``CompressedOptimizer``: data-parallel training with compressed gradients, no DDP needed.

It wraps any ``torch.optim.Optimizer``. At construction it broadcasts the parameters from
rank 0, so every replica starts equal. Parameters are grouped into buckets (in reverse order,
the order backward usually produces their gradients); a gradient-accumulated hook counts the
gradients of each bucket and, as soon as a bucket is complete, starts its exchange on the
ordered worker, so communication overlaps the rest of backward. ``step()`` waits for every
bucket, writes the averaged gradients into ``.grad`` and calls the inner ``step()``: every
replica applies the same bits.

Buckets are launched strictly in order, and any not complete by ``step()`` are launched
there, so the collectives run in the same order on every rank whatever the timing. A
parameter without a gradient on this rank is sent as zeros; how many ranks had each gradient
is summed after the last bucket, in its job (one small all-reduce of an int32 per parameter;
no extra host read: it is read with the step's finiteness). A parameter that no rank had a
gradient for keeps ``.grad = None``, so the inner optimizer leaves it exactly as it would
without gradcomp (no weight decay, no momentum step), and its error feedback keeps what it
owed. One that some ranks have is averaged with the others' zeros, as DDP does with
``find_unused_parameters``. A ``step()`` without a backward pass moves nothing. A model with
no parameter that requires a gradient is refused. For gradient accumulation run the extra
backward passes under ``with opt.no_sync():``. With a loss scaler, call ``opt.synchronize()``
before ``scaler.step(opt)`` so that the overflow check sees the averaged gradients. An
iteration whose means are not finite (or whose exchange failed) is undone by the runtime's step
decision (:class:`~gradcomp.training.step.StepDecision`, ``opt.decision``) and counted in
``opt.skipped``.
"""
from __future__ import annotations

from typing import Any, Callable, ContextManager, Dict, List, Mapping, Optional

import torch

from gradcomp.collectives import plan_buckets
from gradcomp.collectives.identity import names_of
from gradcomp.kernels.memory import copy_from_host

from .wrapper import Wrapper, broadcast_params
from .buckets import BucketLauncher
from .auto import make_runtime
from .engine import build_on_every_rank, refuse_frozen
from .step import Stepping


class CompressedOptimizer(Stepping, Wrapper):
    """Averages gradients over ranks, compressed, then steps the wrapped optimizer.

    ``compressor``: a registered name (options as keywords), a ``Compressor``, an
    error-feedback wrapper, or ``"auto"`` (see :mod:`gradcomp.training.auto`); policy keywords as for :func:`ddp_comm_hook` (``start_iter``,
    ``min_compression_rate``, ``min_numel``, ``compress_1d``, ``layers``, ``error_feedback``,
    ``ef_options``). ``model`` names the parameters (else ``param{i}`` by position);
    ``bucket_mb`` caps a bucket; ``process_group`` defaults to every rank; ``local_size``
    (ranks per node) averages densely inside a node and compresses only across nodes, as for
    :func:`ddp_comm_hook`. ``param_groups``,
    ``state``, ``zero_grad``, ``add_param_group`` and LR schedulers act on the inner optimizer.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, compressor: Any = "none", *,
                 model: Optional[torch.nn.Module] = None, process_group=None, bucket_mb: float = 25.0,
                 broadcast: bool = True, local_size: Optional[int] = None, **options: Any) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ValueError(f"CompressedOptimizer wraps a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if isinstance(optimizer, CompressedOptimizer):
            raise ValueError("the optimizer is already a CompressedOptimizer; wrap the inner optimizer once")
        if isinstance(bucket_mb, bool) or not isinstance(bucket_mb, (int, float)) or not bucket_mb > 0:
            raise ValueError(f"bucket_mb={bucket_mb!r} is not allowed; it must be a number > 0")
        self.optimizer = optimizer
        super().__init__()
        trained = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
        self.compression = build_on_every_rank(lambda: make_runtime(compressor, options, process_group, local_size),
                                               process_group, trained)
        self.decision = self.compression.decision  # the runtime's: it ends every iteration
        self.bucket_mb = float(bucket_mb)
        self._model = model
        self._params: List[torch.Tensor] = []
        self._names: List[str] = []
        self._index: Dict[int, int] = {}
        self._launcher = BucketLauncher()
        self._synced = False
        self._absent: Dict[int, str] = {}  # this iteration's parameters sent as zeros (no gradient here)
        self._register([p for g in optimizer.param_groups for p in g["params"]], broadcast)
        refuse_frozen(self._params, "CompressedOptimizer")  # after the agreement: on every rank alike

    # ---- the wrapped optimizer ------------------------------------------------------------
    def __repr__(self) -> str:
        return f"CompressedOptimizer({self.optimizer!r}, {self.compression.policy.describe()})"

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._drain()
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        self._drain()
        self.optimizer.add_param_group(param_group)
        self._register(list(self.optimizer.param_groups[-1]["params"]), broadcast=True)

    def state_dict(self) -> Dict[str, Any]:
        """The inner optimizer's state dict plus ``"gradcomp"``: error feedback and codec state."""
        self._drain()
        sd = self.optimizer.state_dict()
        sd["gradcomp"] = self.compression.state_dict()
        return sd

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        self._drain()
        sd = dict(state_dict)
        # first, on every rank alike: a checkpoint of another rank or model, or one without
        # gradcomp's state on any rank, is refused before anything loads
        self.compression.load_state_dict(sd.pop("gradcomp", None), "CompressedOptimizer.load_state_dict")
        self.optimizer.load_state_dict(sd)

    # ---- communication --------------------------------------------------------------------
    def no_sync(self) -> ContextManager[None]:
        """Backward passes inside only accumulate gradients; the next one outside exchanges them."""
        return self._launcher.no_sync()

    def synchronize(self) -> None:
        """Finish the exchange of this iteration: every ``.grad`` becomes the average over ranks.

        ``step()`` calls it unless it was already called since the last backward pass.
        """
        self._launcher.launch_rest(self._launch)  # buckets whose gradients are not all there
        results, error = self._launcher.wait()
        self._launcher.reset()
        absent, self._absent = self._absent, {}
        if error is not None:  # nothing of this iteration is kept: a retry starts from the same state
            self.compression.end_iteration(keep=False)
            raise error
        *results, last = results
        *last, counts = last  # the last bucket's means, then how many ranks had each gradient
        # parameters no rank had a gradient for: decided at the iteration's one host read, below
        unused = self.compression.unused_everywhere(counts, absent)
        # a non-finite mean (the step a loss scaler skips) undoes the iteration's state changes
        self.compression.end_iteration()
        for bucket, values in zip(self._launcher.buckets, [*results, last]):
            for i, avg in zip(bucket, values):
                if i in unused:  # its gradient stays None: the inner optimizer leaves it as it would
                    continue
                p = self._params[i]
                if p.grad is None:
                    p.grad = avg.clone() if avg._base is not None else avg
                elif avg.data_ptr() != p.grad.data_ptr():
                    p.grad.copy_(avg)
        self._synced = True

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """Run ``closure`` (once) if given, average the gradients, step the inner optimizer."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not self._synced:
            self.synchronize()
        self._synced = False
        self.optimizer.step()
        return loss

    # ---- internals ------------------------------------------------------------------------
    def _register(self, params: List[torch.Tensor], broadcast: bool) -> None:
        new = [p for p in params if p.requires_grad and id(p) not in self._index]
        names = names_of(self._params + new, self._model)
        # every rank checks the configuration and parameters first: a rank with another model
        # or options gets this error, not a failed broadcast
        named = list(zip(names, self._params + new))
        if self.compression.started:
            self.compression.check(named, "when a parameter group was added")
        else:
            self.compression.start(named)
        if broadcast:
            broadcast_params(new, self.compression.group)
        for p in new:
            self._index[id(p)] = len(self._params)
            self._params.append(p)
        self._launcher.watch(new, self._grad_ready)
        self._names = names
        self.compression.names = list(self._names)
        order = list(range(len(self._params)))[::-1]  # backward produces the last parameters first
        planned = plan_buckets([(self._names[i], self._params[i]) for i in order], self.bucket_mb)
        self._launcher.plan([[order[j] for j in b] for b in planned], dict(enumerate(self._names)))

    def _grad_ready(self, param: torch.Tensor) -> None:
        if self._launcher.paused:
            return
        self._synced = False
        self._launcher.ready(self._index[id(param)], self._launch)

    def _launch(self, b: int) -> Any:
        buckets = self._launcher.buckets
        members = buckets[b]
        grads = []
        for i in members:
            grad = self._params[i].grad
            if grad is None:  # sent as zeros; left None when no rank has it (synchronize)
                self._absent[i] = self._names[i]
                grad = torch.zeros_like(self._params[i])
            grads.append(grad)
        tally = None
        if b == len(buckets) - 1:  # every bucket is launched: which gradients this rank has travels with the last
            tally = copy_from_host(torch.empty(len(self._params), dtype=torch.int32, device=grads[-1].device),
                                   torch.tensor([i not in self._absent for i in range(len(self._params))],
                                                dtype=torch.int32))
        # the last bucket has nothing left to overlap with: it runs on this thread
        return self.compression.submit([self._names[i] for i in members], grads, inline=tally is not None,
                                       tally=tally)

    def _drain(self) -> None:
        """Wait for exchanges in flight; their results are dropped, so their state changes are
        undone (the gradients they averaged never reach the parameters)."""
        self._absent = {}
        if self._launcher.drain():
            self.compression.end_iteration(keep=False)
