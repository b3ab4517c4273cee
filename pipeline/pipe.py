"""``Pipeline``: pipeline-parallel training over compressed point-to-point links.

Each rank holds one stage of a model (interleaved: several virtual stages of it). A step splits
the batch into ``microbatches`` and runs the schedule's passes
(:mod:`gradcomp.pipeline.schedule`); activations go forward and their gradients back, each
direction through its own boundary compressor (``activation_codec``, ``grad_codec``), all from
the calling thread in one order every rank derives from the schedule
(:mod:`gradcomp.pipeline.transport`). Every message carries its shape.

Invariants (the reasons, and what each costs, in docs/pipeline.md):

- the gradients are those of the mean micro-batch loss (the last stage backpropagates
  ``loss / microbatches``); with the ``none`` compressors bit-identical to one process running
  the same micro-batches in order; ``step`` returns that mean (averaged over replicas) on
  every rank;
- a step whose loss or local gradients are not finite anywhere in the grid changes no state: the
  pipeline's :class:`~gradcomp.training.step.StepDecision` (``pipe.decision``) reduces the
  loss and the flags over the grid in one all-reduce, read once, and every rank keeps or undoes
  the step together (``pipe.skipped`` counts the undone ones);
- a batch, a configuration or a stage that any rank finds wrong raises the same ``ValueError``
  on every rank, before any message; a dead or silent peer is a ``CommunicationError`` within
  the group timeout, never a hang.
"""
from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Dict, Iterable, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint as _checkpoint

from gradcomp.collectives import CommunicationError, backend_for, check_device_set, group_timeout, worker
from gradcomp.compress import Compressor, as_codec, get_compressor
from gradcomp.compress.transaction import Transaction
from gradcomp.training import CompressedOptimizer
from gradcomp.training.step import StepDecision, Stepping
from gradcomp.collectives.identity import Identity, agree, describe_params, fingerprint, refuse_on_every_rank
from gradcomp.collectives.wire.message import h63

from .delta import DeltaFeedback
from .grid import Grid
from .stages import StagesOverBudget, over_budget_message, split
from .backward import WeightGrad, input_grad
from .schedule import PASSES, Action, build, check_plan, check_shape, produced, received
from .transport import Message, Parts, Transport, message_order

CHECKPOINTS = (None, "never", "except_last", "always")
_MISSING, _NOT_A_BATCH, _UNEVEN, _OTHER_SIZE = 1, 2, 3, 4  # what a rank found wrong with its batch
BoundarySpec = Union[None, str, Compressor]  # what activation_codec= / grad_codec= accept


class Event(NamedTuple):
    """One interval of a step on one rank (seconds since the step began, wall clock)."""

    # "F", "B", "I", "W" (training passes: schedule.PASSES), "E" (an eval_step forward), "send"
    # (compressing and posting a message), "wait" (for a message)
    kind: str
    stage: int  # the stage (virtual stage id, 0 .. p * v - 1)
    mb: int
    start: float
    end: float


class _Step:
    """One training step's state between its passes on this rank."""

    __slots__ = ("mbs", "loss_fn", "losses", "saved", "weights")

    def __init__(self, mbs: Dict[str, List[Any]], loss_fn: Callable) -> None:
        self.mbs, self.loss_fn = mbs, loss_fn
        self.losses: List[torch.Tensor] = []
        self.saved: Dict[Tuple[int, int], Tuple[Any, torch.Tensor]] = {}  # (vstage, mb) -> forward's (input, output)
        self.weights: Dict[Tuple[int, int], WeightGrad] = {}  # (vstage, mb) -> its W pass, after its I


RESTORABLE_BYTES = 4 << 20  # a stage's buffers kept every step for a rerun (raw steps, the early first forward)


class _Refused(ValueError):
    """A batch some rank found wrong, raised on every rank before any message of the step."""


class _Agreement:
    """One step's batch agreement: this rank's row, all-gathered at once, waited for and
    judged by :meth:`settle` (the same verdict on every rank)."""

    def __init__(self, pipe: "Pipeline", row: List[int], need_ids: bool, training: bool, sig: int) -> None:
        self.pipe, self.need_ids, self.training, self.sig = pipe, need_ids, training, sig
        self.good_here = row[0] == 0
        self.work, self.rows_t = pipe._gather_rows(row, async_op=True)
        self.raw: Optional[bool] = None

    def settle(self) -> bool:
        """Whether the step travels raw; :class:`_Refused` (a ``ValueError``) where any rank's
        batch is wrong. Waits once."""
        if self.raw is not None:
            return self.raw
        pipe = self.pipe
        try:
            self.work.wait()
        except RuntimeError as exc:
            raise CommunicationError(f"Pipeline: the batch agreement failed on rank {pipe.grid.rank}: a peer died "
                                     f"or did not answer within the group timeout ({exc})") from exc
        rows = torch.stack(self.rows_t).tolist()
        problem = _batch_verdict(rows, pipe.microbatches, pipe.grid.stages, pipe.grid.replicas, self.need_ids)
        if problem:
            raise _Refused(problem)
        self.raw = all(r[5] for r in rows)
        if self.training and not self.raw:
            pipe._input_sig = self.sig  # the framed step about to run learns the layouts of these shapes
        return self.raw


class Pipeline(Stepping):
    """One rank's part of a pipeline; the keywords and the contracts are in docs/pipeline.md.

    ``stages``: an ``nn.Sequential`` of the whole model cut by ``balance`` (layers per stage,
    or ``"auto"``), or this rank's module (a list, one per virtual stage, for
    ``schedule="interleaved"``). A stage's output reaches the next stage as its one argument, as
    in an ``nn.Sequential``: a tensor, or a tuple or list of tensors (None allowed; tensors that
    are not floating point cross exactly), which the stage may change in place.
    ``microbatches`` (``chunks`` is the same keyword): micro-batches per step.
    ``activation_codec`` / ``grad_codec``: the boundary compressors (a name, a
    ``Compressor``, ``None``: exact). ``checkpoint`` or ``memory_budget`` (bytes of saved
    activations per micro-batch): recompute inside stages. ``replicas`` with ``dp_compressor``:
    data parallelism over stage replicas. ``device``: only for a stage without parameters or
    buffers. ``optimizer``: a function of the stage's parameters (a stage without any gets no
    optimizer). ``check_messages``: frame and check every boundary message, also where the
    channels' layouts are agreed (a debug mode; by default such steps send tensors raw).
    """

    def __init__(self, stages: Union[nn.Module, Sequence[nn.Module]], *, schedule: str = "1f1b",
                 microbatches: Optional[int] = None, balance: Union[None, str, Sequence[int]] = None,
                 activation_codec: BoundarySpec = None, grad_codec: BoundarySpec = None, delta: bool = False,
                 checkpoint: Optional[str] = None, replicas: int = 1, dp_compressor: Any = "none",
                 dp_options: Optional[Dict[str, Any]] = None,
                 optimizer: Optional[Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]] = None,
                 process_group: Any = None, virtual: Optional[int] = None, sample: Optional[torch.Tensor] = None,
                 link_bps: Optional[float] = None, memory_budget: Optional[float] = None,
                 device: Union[None, str, torch.device] = None, chunks: Optional[int] = None,
                 check_messages: bool = False) -> None:
        microbatches = _microbatches(microbatches, chunks)
        # False: a step whose channels' layouts every rank knows sends its messages raw (the
        # transport's module docstring); True: every message framed and checked (a debug mode)
        self.check_messages = bool(check_messages)
        self._raw_ok = not self.check_messages and not delta  # cleared for good by a layout that moved
        self._input_sig = 0  # this rank's inputs' shapes and dtypes in the last framed training step
        self.raw_steps = 0  # training steps whose messages travelled raw (a rerun framed not counted)
        self.reruns = 0  # raw steps undone and run again framed because a payload left its layout
        self._gate: Optional[_Agreement] = None  # the step's batch agreement, while its first forward runs
        _check_options(checkpoint, memory_budget, delta)
        self.grid = Grid(process_group, replicas)
        p = self.grid.stages
        self.schedule, self.microbatches, self.checkpoint, self.delta = schedule, microbatches, checkpoint, delta
        self.memory_budget = memory_budget
        # Checked by every rank, then compared: a rank alone with a bad shape, a budget too
        # small for its stage or a bad compressor must not leave the others waiting.
        problem, needed = self._cut(stages, balance, virtual, sample, (activation_codec, grad_codec), link_bps,
                                    process_group)
        self.virtual_stages = len(self.modules)  # this rank's virtual stages (model chunks)
        self.n_stages = p * self.virtual_stages
        self.stage_ids = [c * p + self.grid.stage for c in range(self.virtual_stages)]  # each one's stage
        self.local = nn.ModuleList(self.modules)
        placed = self._place(device, activation_codec, grad_codec)  # always: it sets the device and compressors
        # the user's optimizer is built here, before any message: a factory that raises on one
        # rank's parameters raises the same ValueError on every rank
        inner, made = self._inner_optimizer(optimizer)
        problem = problem or placed or made
        self._refuse_construction(problem, needed)
        self._agree(dp_compressor, dp_options, optimizer)
        self.grid.make_dp_groups(group_timeout(process_group if process_group is not None else dist.group.WORLD))
        self._delta_out = [DeltaFeedback(c) for c in self._act_send] if delta else []  # what each sent
        self._delta_in = [DeltaFeedback(c) for c in self._act_recv] if delta else []  # what each received
        self._ids: List[Any] = []
        self.optimizer = self._wrap_optimizer(optimizer, inner, dp_compressor, dp_options or {})
        # every rank's actions are known to every rank: the message order follows from them (the
        # plans are checked against the pass table alike everywhere, so every rank raises alike)
        plans = [build(schedule, r, p, microbatches, self.virtual_stages) for r in range(p)]
        check_plan(plans, p, microbatches)
        self.actions: List[Action] = plans[self.grid.stage]
        self._order = message_order(plans, p)
        self._eval_order = message_order([[Action("F", c, mb) for mb in range(microbatches)
                                           for c in range(self.virtual_stages)] for _ in range(p)], p)
        self._transport = Transport(self.grid.group, self.grid.peer, self.stage_ids, self.device)
        self._failed: Optional[BaseException] = None
        self.events: List[Event] = []  # the last step's timeline on this rank, from started_at
        self.started_at = 0.0  # wall-clock time (time.time()) the last step began on this rank
        self.peak_in_flight = 0  # micro-batches whose activations were held at once, measured in the last step
        self.applied = True  # whether the last step was kept (False: something was not finite; nothing changed)
        self.decision = StepDecision(self.grid.group, "Pipeline")  # the end of a step over the grid

    # ---- construction helpers ------------------------------------------------------------
    def _cut(self, stages: Any, balance: Any, virtual: Optional[int], sample: Optional[torch.Tensor],
             compressors: Tuple[Any, Any], link_bps: Optional[float], group: Any) -> Tuple[str, Dict[int, int]]:
        """This rank's modules and the balance; what was wrong ("" if nothing) and, for a budget
        too small, each stage's need."""
        p = self.grid.stages
        try:
            self.modules, self.balance = split(stages, balance, p, self.grid.stage, self.schedule, virtual, sample,
                                               compressors, link_bps, group, self.memory_budget)
            check_shape(self.schedule, p, self.microbatches, len(self.modules))
            return "", {}
        except StagesOverBudget as exc:
            self.modules, self.balance = [nn.Identity()], None
            return str(exc), exc.needed
        except ValueError as exc:
            self.modules, self.balance = [nn.Identity()], None
            return str(exc), {}

    def _place(self, device: Any, activation_codec: BoundarySpec, grad_codec: BoundarySpec) -> str:
        """The stage's device and its boundary compressors: per virtual stage, one per direction
        and end, each with its own per-key counters. What was wrong, or ""."""
        n = self.virtual_stages
        try:
            self.device = self._stage_device(device)
            self._act_send = [_boundary_compressor(activation_codec, "activation_codec") for _ in range(n)]
            self._act_recv = [_boundary_compressor(activation_codec, "activation_codec") for _ in range(n)]
            self._grad = [_boundary_compressor(grad_codec, "grad_codec") for _ in range(n)]
            return ""
        except ValueError as exc:
            self.device = torch.device("cpu")
            self._act_send = self._act_recv = self._grad = [get_compressor("none")]
            return str(exc)

    def _refuse_construction(self, problem: str, needed: Dict[int, int]) -> None:
        """The same ``ValueError`` on every rank when any rank's own checks found a
        ``problem`` (one small all-gather of objects, after the gradcomp jobs in flight)."""
        group = self.grid.group
        check_device_set(group, None, "Pipeline")  # NCCL's object collectives need set_device
        found: List[Any] = [None] * self.grid.world
        worker.submit(lambda twin: dist.all_gather_object(found, (problem, needed), group=twin(group)), (group,),
                      False, device=_object_device(group))
        message = _construction_verdict(found, self.memory_budget)
        if message:
            raise ValueError(message)

    def _agree(self, dp: Any, dp_options: Any, optimizer: Any) -> None:
        """The same ``ValueError`` on every rank unless all were built alike."""
        config = {"schedule": self.schedule, "microbatches": repr(self.microbatches),
                  "grid (stages x replicas)": f"{self.grid.stages} x {self.grid.replicas}",
                  "virtual stages per rank": repr(self.virtual_stages), "activation_codec": repr(self._act_send[0]),
                  "grad_codec": repr(self._grad[0]), "delta": repr(self.delta), "checkpoint": repr(self.checkpoint),
                  "memory_budget": repr(self.memory_budget),
                  "dp_compressor": f"{dp!r} {sorted((dp_options or {}).items())!r}",
                  "optimizer given": repr(optimizer is not None), "balance": repr(self.balance)}
        agree(config, self.grid.group, "when the Pipeline was built")

    def _stage_device(self, device: Any) -> torch.device:
        """The stage's device: its parameters' (or buffers'), else ``device``; the CPU only on a
        CPU backend (NCCL takes no CPU tensor)."""
        tensors = [t for t in list(self.local.parameters()) + list(self.local.buffers())]
        if tensors:
            found = tensors[0].device
            if device is not None and torch.device(device) != found:
                raise ValueError(f"device={device!r} but this rank's stage is on {found}; give the stage's device "
                                 f"or none")
            return found
        if device is not None:
            return torch.device(device)
        group = self.grid.group if self.grid.group is not None else dist.group.WORLD
        backend = str(dist.get_backend(group)) if self.grid.world > 1 else "gloo"
        if "nccl" in backend:
            raise ValueError("this rank's stage holds no parameter or buffer, so its device is unknown: pass "
                             "device= (e.g. torch.device('cuda', local_rank)) to Pipeline")
        return torch.device("cpu")

    def _inner_optimizer(self, factory: Any) -> Tuple[Optional[torch.optim.Optimizer], str]:
        """``(the user's optimizer of this rank's parameters, what was wrong or "")``. A stage
        without parameters gets none: it has nothing to update (and torch refuses an
        optimizer of no parameters)."""
        if factory is None:
            return None, ""
        if not callable(factory):
            return None, (f"optimizer must be a function of the stage's parameters returning a "
                          f"torch.optim.Optimizer, got {type(factory).__name__}")
        params = list(self.local.parameters())
        if not params:
            return None, ""
        try:
            return factory(params), ""
        except Exception as exc:  # the user's factory: any error is this rank's construction problem
            return None, f"optimizer= raised on this rank's stage parameters: {type(exc).__name__}: {exc}"

    def _wrap_optimizer(self, factory: Any, inner: Optional[torch.optim.Optimizer], dp: Any,
                        options: Dict[str, Any]) -> Optional[torch.optim.Optimizer]:
        if factory is None and self.grid.replicas > 1:
            raise ValueError("replicas > 1 needs optimizer= (a function of the stage's parameters returning a "
                             "torch.optim.Optimizer): the stage replicas average gradients inside its step")
        if inner is None or self.grid.replicas == 1:
            return inner
        return CompressedOptimizer(inner, dp, model=self.local, process_group=self.grid.dp_group, **options)

    # ---- the public API ------------------------------------------------------------------
    def parameters(self) -> Iterable[nn.Parameter]:
        """The parameters of this rank's stage (all its virtual stages)."""
        return self.local.parameters()

    @property
    def is_first(self) -> bool:
        return self.grid.stage == 0

    @property
    def is_last(self) -> bool:
        """Whether this rank holds the last stage (it computes the loss)."""
        return self.grid.stage == self.grid.stages - 1

    def delta_cache_bytes(self) -> int:
        """Bytes of this rank's delta-mode caches (both directions), measured from the tensors."""
        return sum(c.nbytes for c in self._delta_out + self._delta_in)

    def step(self, inputs: Optional[torch.Tensor], targets: Optional[torch.Tensor],
             loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], *,
             sample_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """One training step of ``microbatches`` micro-batches; the mean micro-batch loss on every rank.

        ``inputs`` is read on the first stage, ``targets`` on the last (others may pass None);
        both are split along dim 0 into ``microbatches`` equal parts. ``sample_ids`` (delta
        mode; every rank passes the same): one id per sample, as the caches are keyed."""
        self._check_usable()
        mbs, agreement = self._split_inputs(inputs, targets, sample_ids, need_targets=True, need_ids=self.delta,
                                            training=True, wait=False)
        # The first stage's first forward needs no message: it runs while the agreement travels,
        # when what it changes outside the step's transaction (random state, buffers) can be put
        # back should a rank refuse the batch (the agreement is settled before the first message).
        early = agreement.good_here and self.is_first and self._restorable()
        raw = False if early else agreement.settle()
        kept = self._keep_for_rerun() if early or raw else None
        while True:
            if self.optimizer is not None:
                self.optimizer.zero_grad(set_to_none=True)
            txn = Transaction()
            self._gate = agreement if early else None
            try:
                with txn.active():
                    loss = self._run(mbs, loss_fn, raw)
                loss_value, finite, moved = self._conclude(loss, txn)
            except _Refused:  # a rank refused the batch before any message: nothing happened
                txn.rollback()
                assert kept is not None
                self._restore_for_rerun(kept)
                if self.optimizer is not None:
                    self.optimizer.zero_grad(set_to_none=True)
                raise
            except BaseException as exc:
                self._abandon(txn, exc)
                raise
            finally:
                self._gate = None
            if early:
                raw, early = agreement.raw, False
            if not moved:
                break
            # a payload left its channel's layout (a shape that depends on the data): every rank
            # undoes the step, drops its layouts and runs the step again, framed; no more raw steps
            txn.rollback()
            assert kept is not None
            self._restore_for_rerun(kept)
            self._raw_ok, raw = False, False
            self._transport.forget()
            self.reruns += 1
        self.raw_steps += raw
        self.applied = finite
        if self.decision.settle(finite, txn):
            if self.optimizer is not None:
                # with replicas, the data-parallel exchange starts here: see _accumulating
                self.optimizer.step()
        else:
            if self.optimizer is not None:
                self.optimizer.zero_grad(set_to_none=True)
        return loss_value

    def _restorable(self) -> bool:
        """Whether this stage's buffers are small enough to be kept for a rerun every step."""
        return sum(b.numel() * b.element_size() for b in self.local.buffers()) <= RESTORABLE_BYTES

    def _keep_for_rerun(self) -> Tuple[Any, List[Tuple[torch.Tensor, torch.Tensor]]]:
        """What a raw step's passes change outside its transaction, kept in case it is run again
        framed: the random number generators' states (dropout) and the stage's buffers (batch
        norm's statistics)."""
        rng = (torch.get_rng_state(),
               torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None)
        return rng, [(b, b.detach().clone()) for b in self.local.buffers()]

    def _restore_for_rerun(self, kept: Tuple[Any, List[Tuple[torch.Tensor, torch.Tensor]]]) -> None:
        (cpu, dev), buffers = kept
        torch.set_rng_state(cpu)
        if dev is not None:
            torch.cuda.set_rng_state(dev, self.device)
        with torch.no_grad():
            for b, before in buffers:
                b.copy_(before)

    @torch.no_grad()
    def eval_step(self, inputs: Optional[torch.Tensor], targets: Optional[torch.Tensor] = None,
                  loss_fn: Optional[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = None
                  ) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """Forward only (micro-batches in order, no gradients, no state change):
        ``(output, loss)``; the output (concatenated micro-batches) on the last stage, None
        elsewhere; the mean micro-batch loss on every rank when ``loss_fn`` is given."""
        self._check_usable()
        mbs, _ = self._split_inputs(inputs, targets, None, need_targets=loss_fn is not None, need_ids=False)
        self.started_at = time.time()
        outs: List[Any] = []
        losses: List[torch.Tensor] = []
        txn = Transaction()  # codec counters of eval messages are not training state
        try:
            with txn.active():
                self._transport.begin(self._eval_order)
                for mb in range(self.microbatches):
                    for c in range(self.virtual_stages):
                        y = self._forward_pass(c, mb, mbs, record=False)
                        if self._stage(c) == self.n_stages - 1:
                            outs.append(y)
                            if loss_fn is not None:
                                losses.append(loss_fn(y, mbs["targets"][mb]).detach())
                self._transport.finish()
            mean = torch.stack(losses).mean() if losses else None
            if loss_fn is not None:
                mean, _, _ = self._conclude(mean, txn, check_grads=False)
        except BaseException as exc:
            self._abandon(txn, exc)
            raise
        txn.rollback()
        return (_joined(outs) if outs else None), mean

    def state_dict(self) -> Dict[str, Any]:
        """This rank's stage: modules, optimizer (with its compression state), delta caches,
        boundary compressors' counters, and an identity that :meth:`load_state_dict` checks."""
        return {"identity": self._identity().to_dict(),
                "modules": [m.state_dict() for m in self.modules],
                "optimizer": None if self.optimizer is None else self.optimizer.state_dict(),
                "codecs": [c.state_dict() for c in self._act_send + self._grad + self._act_recv],
                "delta": None if not self.delta else [d.state_dict() for d in self._delta_out + self._delta_in]}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (every rank of the grid, at the same point); a checkpoint
        of another rank, grid, model or configuration on any rank is refused with the same
        ``ValueError`` on every rank, before anything changes."""
        problem = ("it is not a Pipeline state_dict (it carries no identity)"
                   if not isinstance(state, dict) or "identity" not in state else
                   self._identity().mismatch(state["identity"], fixes={
                       "params": "load it into the stage model it was saved with (parameter names, shapes, dtypes)",
                       "config": "every rank loads its own checkpoint of the same run, built with the same options",
                       "stage": "every rank loads its own checkpoint of the same run"}))
        refuse_on_every_rank(problem, self.grid.group, "Pipeline.load_state_dict", device=self.device)
        for m, sd in zip(self.modules, state["modules"]):
            m.load_state_dict(sd)
        if self.optimizer is not None and state["optimizer"] is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        for c, sd in zip(self._act_send + self._grad + self._act_recv, state["codecs"]):
            c.load_state_dict(sd)
        if self.delta:
            for d, sd in zip(self._delta_out + self._delta_in, state["delta"]):
                d.load_state_dict(sd)

    def close(self) -> None:
        """Drop the last step's message buffers (the pipeline owns no thread)."""
        if self._transport.broken is None:
            self._transport.begin([])

    @property
    def sent_bytes(self) -> int:
        """Bytes of payload this rank sent in the last step (the compressed tensors)."""
        return self._transport.payload_bytes

    @property
    def wire_bytes(self) -> int:
        """Bytes this rank put on the wire in the last step: payloads, their framing, padding."""
        return self._transport.sent_bytes

    # ---- one step ------------------------------------------------------------------------
    def _stage(self, vstage: int) -> int:
        return self.stage_ids[vstage]

    def _split_inputs(self, inputs: Any, targets: Any, ids: Any, *, need_targets: bool, need_ids: bool,
                      training: bool = False, wait: bool = True) -> Tuple[Dict[str, List[Any]], Any]:
        """The batch split into ``microbatches``, and its agreement (one all-gather of a small
        row): once every rank found its own part good, else the same ``ValueError`` on every
        rank, before any message, so no rank runs ahead into its peers' next step. Also whether
        a training step travels raw: every rank's row says it knows its channels' layouts and its
        inputs are shaped as in the step they were learned in (the same decision on every rank).
        ``wait``: settled here (returns whether raw), else the :class:`_Agreement` in flight."""
        row, out = self._check_batch((("inputs", inputs, self.is_first),
                                      ("targets", targets, self.is_last and need_targets),
                                      ("sample_ids", ids, need_ids)))
        if need_ids and "sample_ids" in out and not row[0]:
            row[4] = _ids_hash(ids)
        sig = _shapes_sig(out.get("inputs", ()))
        row.append(int(training and self._raw_ok and sig == self._input_sig and self._restorable()
                       and self._transport.ready(self._order)))
        agreement = _Agreement(self, row, need_ids, training, sig)
        return out, (agreement.settle() if wait else agreement)

    def _check_batch(self, given: Sequence[Tuple[str, Any, bool]]) -> Tuple[List[int], Dict[str, List[Any]]]:
        """This rank's row (problem, which tensor, its length, the batch it reads, its sample
        ids' hash) and the tensors it needs, split."""
        m = self.microbatches
        out: Dict[str, List[Any]] = {}
        row = [0, 0, 0, 0, 0]
        for i, (name, value, needed) in enumerate(given):
            if row[0] or (value is None and not needed):
                continue
            n = value.shape[0] if isinstance(value, torch.Tensor) and value.dim() >= 1 else 0
            if value is None:
                row[:3] = [_MISSING, i, 0]
            elif not isinstance(value, torch.Tensor) or value.dim() < 1:
                row[:3] = [_NOT_A_BATCH, i, 0]
            elif n % m or n == 0:
                row[:3] = [_UNEVEN, i, n]
            elif needed and row[3] and row[3] != n:
                row[:3] = [_OTHER_SIZE, i, n]
            else:
                row[3] = row[3] if not needed else n
                out[name] = list(value.chunk(m))
        return row, out

    def _gather_rows(self, row: List[int], async_op: bool = False) -> Any:
        """Every rank's row, gathered on the stage's device and read once (``async_op``: the
        work and the gathered tensors, for :class:`_Agreement` to wait and read)."""
        mine = torch.tensor(row, dtype=torch.int64, device=self.device)
        rows_t = [torch.empty_like(mine) for _ in range(self.grid.world)]
        try:
            work = dist.all_gather(rows_t, mine, group=self.grid.group, async_op=async_op)
        except RuntimeError as exc:
            raise CommunicationError(f"Pipeline: the batch agreement failed on rank {self.grid.rank}: a peer died "
                                     f"or did not answer within the group timeout ({exc})") from exc
        return (work, rows_t) if async_op else torch.stack(rows_t).tolist()

    def _run(self, mbs: Dict[str, List[Any]], loss_fn: Callable, raw: bool) -> Optional[torch.Tensor]:
        self.events = []
        self.started_at = time.time()
        self._ids = mbs.get("sample_ids", [])
        step = _Step(mbs, loss_fn)
        if self._gate is None:
            self._transport.begin(self._order, raw=raw, learn=self._raw_ok)
        live = peak = 0
        for a in self.actions:
            kind = PASSES[a.kind]
            if self._transport.mismatched:  # this raw step is void here: only its messages go on
                self._pass_void(a.kind, a.vstage, a.mb)
            else:
                getattr(self, "_pass_" + kind.run)(a.vstage, a.mb, step)
            live += kind.holds
            peak = max(peak, live)
        self.peak_in_flight = peak
        self._open_gate()
        self._transport.finish()
        return torch.stack(step.losses).mean() if step.losses else None

    # ---- the passes (schedule.PASSES' "run" names them) ----------------------------------
    def _pass_forward(self, c: int, mb: int, step: "_Step") -> None:
        x, y = self._forward_pass(c, mb, step.mbs, record=True)
        if self._stage(c) == self.n_stages - 1:
            y = step.loss_fn(y, step.mbs["targets"][mb])
            step.losses.append(y.detach())
        step.saved[(c, mb)] = (x, y)

    def _pass_backward(self, c: int, mb: int, step: "_Step") -> None:
        x, y = step.saved.pop((c, mb))
        outs, grads, t = self._backward_inputs(c, mb, y)
        with self._accumulating():
            if outs:  # nothing when no output needs a gradient (a first stage without parameters)
                torch.autograd.backward(outs, grads)
        self._event("B", self._stage(c), mb, t)
        if self._stage(c) > 0:
            self._send(c, mb, "grad", _input_grads(x, lambda leaf: leaf.grad))

    def _pass_input(self, c: int, mb: int, step: "_Step") -> None:
        """The input's gradient only (sent at once); the weights' part waits for the W pass."""
        x, y = step.saved.pop((c, mb))
        outs, grads, t = self._backward_inputs(c, mb, y)
        leaves = _leaves(x)
        with self._accumulating():
            dxs, step.weights[(c, mb)] = input_grad(outs, grads, leaves, list(self.modules[c].parameters()))
        self._event("I", self._stage(c), mb, t)
        if self._stage(c) > 0:
            got = {id(leaf): dx for leaf, dx in zip(leaves, dxs)}
            self._send(c, mb, "grad", _input_grads(x, lambda leaf: got[id(leaf)]))

    def _pass_void(self, kind: str, c: int, mb: int) -> None:
        """A pass of a raw step that a payload of this rank has made void (it runs again
        framed): its messages, received and sent as zeros of the agreed sizes, and no compute
        (what arrives may no longer fit what this rank's stage made)."""
        s = self._stage(c)
        got = received(kind, s, mb, self.n_stages)
        if got is not None:
            self._recv(c, mb, got[0])
        sent = produced(kind, s, mb, self.n_stages)
        if sent is not None:
            self._transport.send_void(Message(*sent))

    def _pass_weight(self, c: int, mb: int, step: "_Step") -> None:
        t = time.time()
        w = step.weights.pop((c, mb))
        # a torch checkpoint recomputes its region again in this pass when the I pass did already
        # (autograd keys its recomputation by backward call): BatchNorm's statistics must move
        # once, as under B
        again = self._recomputes(mb) and not w.whole
        kept = [(b, b.clone()) for b in self.modules[c].buffers()] if again else []
        with self._accumulating():
            w.run()
        for b, before in kept:
            # through .data: the restore must not move the buffer's version counter, which the
            # graphs of micro-batches not recomputed (checkpoint="except_last") saved with it;
            # BatchNorm's own update of its running statistics does not move it either
            b.data.copy_(before)
        self._event("W", self._stage(c), mb, t)

    def _backward_inputs(self, c: int, mb: int, y: Any
                         ) -> Tuple[List[torch.Tensor], Optional[List[torch.Tensor]], float]:
        """``(what to backpropagate, their gradients, when the pass began)``: the last stage's
        loss over the micro-batches, or the output's values that need a gradient and their
        gradients from the next stage (none where it sent none)."""
        if self._stage(c) == self.n_stages - 1:
            return [y / self.microbatches], None, time.time()
        grad = self._recv(c, mb, "grad")
        ys = [y] if isinstance(y, torch.Tensor) else list(y)
        gs = [grad] if isinstance(grad, torch.Tensor) else list(grad.values)
        if len(ys) != len(gs):
            raise ValueError(f"pipeline: stage {self._stage(c)}'s output (micro-batch {mb}) has {len(ys)} values, the "
                             f"gradient the next stage sent back {len(gs)}")
        pairs = [(o, g) for o, g in zip(ys, gs) if g is not None and isinstance(o, torch.Tensor) and o.requires_grad]
        return [o for o, _ in pairs], [g for _, g in pairs], time.time()

    def _accumulating(self) -> Any:
        """Where a pass accumulates gradients. With replicas every pass only accumulates; the
        data-parallel exchange starts in step(), after the end-of-step all-reduce, so after this
        rank's last B or W. Started at the last W it would overlap the cool-down, but its worker
        would drive the replica group from another thread while this one still issues the
        step's point-to-point operations, in an order that differs between replicas (each
        reaches its last backward at another point of its messages), and NCCL gives no progress
        guarantee between communicators whose operations ranks issue in different orders.
        Every rank enters that all-reduce only after all its messages are done, and reads its
        result before step(): so no exchange runs beside a message of the step, and the next
        step's first message follows step(), which waits for the exchange."""
        if isinstance(self.optimizer, CompressedOptimizer):
            return self.optimizer.no_sync()
        return contextlib.nullcontext()

    def _recomputes(self, mb: int) -> bool:
        return self.checkpoint == "always" or (self.checkpoint == "except_last" and mb < self.microbatches - 1)

    def _forward_pass(self, c: int, mb: int, mbs: Dict[str, List[Any]], record: bool) -> Any:
        """One forward: ``(the stage's input leaves, its output)`` when ``record`` (training),
        else the output. The stage gets its input as in one process: not the leaves whose
        gradients are sent back but an alias of each made by an autograd node, which it may
        change in place (a first ``ReLU(inplace=True)``); a recomputed stage gets a copy inside
        the checkpointed region, so that its recomputation starts from the input it was given."""
        s = self._stage(c)
        if s == 0:
            x = inp = mbs["inputs"][mb]
        else:
            x, inp = _stage_input(self._recv(c, mb, "act", delta=record), record)
        t = time.time()
        module = self.modules[c]
        if record and self._recomputes(mb):
            y = _checkpoint(_on_a_copy(module), x, use_reentrant=False)
        else:
            y = module(inp)
        self._event("F" if record else "E", s, mb, t)
        if s < self.n_stages - 1:
            self._send(c, mb, "act", _outgoing(y, s), delta=record)
        return (x, y) if record else y

    # ---- messages ------------------------------------------------------------------------
    def _message(self, c: int, mb: int, kind: str, outgoing: bool) -> Message:
        """The message of ``kind`` that virtual stage ``c`` sends (``outgoing``) or receives for ``mb``."""
        s = self._stage(c)
        forward = kind == "act"
        return Message(kind, s if forward == outgoing else s - 1, mb)

    def _open_gate(self) -> None:
        """Before this step's first message: the batch agreement settled (a refusal raises
        :class:`_Refused`) and the transport begun, raw or framed as it decided."""
        if self._gate is not None:
            agreement, self._gate = self._gate, None
            raw = agreement.settle()
            self._transport.begin(self._order, raw=raw, learn=self._raw_ok)

    def _send(self, c: int, mb: int, kind: str, value: Union[torch.Tensor, Parts], delta: bool = False) -> None:
        self._open_gate()
        msg = self._message(c, mb, kind, True)
        compressor: Any = self._act_send[c] if kind == "act" else self._grad[c]
        if delta and self.delta:
            compressor = self._delta_out[c]
            compressor.expect(msg.key, self._ids[mb])
        t = time.time()
        self._transport.send(msg, value, compressor)
        self._event("send", self._stage(c), mb, t)

    def _recv(self, c: int, mb: int, kind: str, delta: bool = False) -> Union[torch.Tensor, Parts]:
        self._open_gate()
        msg = self._message(c, mb, kind, False)
        compressor: Any = self._act_recv[c] if kind == "act" else self._grad[c]
        if kind == "act" and delta and self.delta:
            compressor = self._delta_in[c]
            compressor.expect(msg.key, self._ids[mb])
        t = time.time()
        out = self._transport.take(msg, compressor)
        self._event("wait", self._stage(c), mb, t)
        return out

    def _event(self, kind: str, stage: int, mb: int, t: float) -> None:
        self.events.append(Event(kind, stage, mb, t - self.started_at, time.time() - self.started_at))

    # ---- the end of a step ---------------------------------------------------------------
    def _conclude(self, loss: Optional[torch.Tensor], txn: Transaction,
                  check_grads: bool = True) -> Tuple[torch.Tensor, bool, bool]:
        """The step decision's one all-reduce over the grid, on the stage's device, read once on
        the host: the loss (from the last stages, averaged over replicas), whether every rank's
        loss and local gradients are finite (the largest magnitude of each gradient: NaN and inf
        propagate, no overflow of a sum) and whether a payload of a raw step left its layout on
        any rank."""
        dev = self.device
        bad = torch.full((), 0.0 if txn.finite else 1.0, dtype=torch.float64, device=dev)
        value = torch.zeros((), dtype=torch.float64, device=dev)
        if loss is not None:
            value = loss.detach().reshape(()).double()  # the loss is on the stage's device
            bad = bad + (~torch.isfinite(value)).double()
        if check_grads:
            grads = [p.grad.detach() for p in self.local.parameters() if p.grad is not None and p.grad.numel()]
            if grads:
                peak = torch.stack([g.abs().amax().to(torch.float64) for g in grads]).amax()
                bad = bad + (~torch.isfinite(peak)).double()
        try:  # the step's one read of its outcome
            verdict = self.decision.reduce({"nonfinite": bad, "moved": self._transport.mismatched}, {"loss": value},
                                           device=dev)
        except CommunicationError as exc:
            raise CommunicationError(f"Pipeline: the end-of-step all-reduce failed on rank {self.grid.rank}: a "
                                     f"peer died or did not answer within the group timeout ({exc})") from exc
        dtype = loss.dtype if loss is not None else torch.float32
        return (torch.tensor(verdict.sums["loss"] / self.grid.replicas, dtype=dtype), not verdict["nonfinite"],
                verdict["moved"])

    def _abandon(self, txn: Transaction, exc: BaseException) -> None:
        """A step that raised after its first message: undo its state. Its messages are lost
        halfway, so the ranks are out of step: the pipeline refuses further steps."""
        txn.rollback()
        if self.optimizer is not None:
            try:
                self.optimizer.zero_grad(set_to_none=True)
            except Exception:  # the exchange failed too; its state is undone all the same
                pass
        self._failed = exc

    def _check_usable(self) -> None:
        if self._failed is not None:
            raise RuntimeError(f"this Pipeline failed in an earlier step ({type(self._failed).__name__}: "
                               f"{self._failed}); its messages were lost halfway and its ranks are out of step: "
                               f"build a new one (and a new process group if a rank died)")

    def _identity(self) -> Identity:
        config = repr((self.schedule, self.microbatches, self.grid.stages, self.grid.replicas, self.virtual_stages,
                       repr(self._act_send[0]),
                       repr(self._grad[0]), self.delta, self.checkpoint))
        return Identity(owner="Pipeline", rank=self.grid.rank, world=self.grid.world, config=fingerprint(config),
                        params=fingerprint(describe_params(list(self.local.named_parameters()))),
                        fields={"stage": str(self.grid.stage)})


def _microbatches(microbatches: Optional[int], chunks: Optional[int]) -> int:
    """``microbatches=``, or ``chunks=`` (the same keyword under torchgpipe's name); 4 by default."""
    if microbatches is not None and chunks is not None:
        raise ValueError(f"microbatches={microbatches!r} and chunks={chunks!r} name the same thing (micro-batches per "
                         f"step); give one of them")
    if microbatches is None:
        return 4 if chunks is None else chunks
    return microbatches


def _check_options(checkpoint: Any, memory_budget: Any, delta: Any) -> None:
    """The options every rank checks alike, before any collective."""
    if checkpoint not in CHECKPOINTS:
        raise ValueError(f"checkpoint={checkpoint!r} is not allowed; use one of {CHECKPOINTS}")
    if memory_budget is not None and checkpoint not in (None, "never"):
        raise ValueError(f"memory_budget= and checkpoint={checkpoint!r} both decide what a stage recomputes; "
                         f"give one of them")
    if not isinstance(delta, bool):
        raise ValueError(f"delta={delta!r} is not allowed; it must be True or False")


def _object_device(group: Any) -> torch.device:
    """Where object collectives on ``group`` put their tensors (NCCL: the current CUDA device)."""
    if backend_for(group, "cuda") == "nccl" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _construction_verdict(found: Sequence[Tuple[str, Dict[int, int]]], budget: Optional[float]) -> str:
    """One text for every rank from each rank's ``(problem, stage -> least budget)`` ("" when
    none has a problem). A budget too small is said as such, with the least that fits all the
    stages; a problem every rank found is said as it is, one found by some ranks names the first."""
    problems = [(r, text) for r, (text, _) in enumerate(found) if text]
    if not problems:
        return ""
    needed = {s: (r, n) for r, (_, per_stage) in enumerate(found) for s, n in per_stage.items()}
    if needed and budget is not None and all(found[r][1] for r, _ in problems):
        return over_budget_message(budget, needed)
    if len(problems) == len(found) and len({text for _, text in problems}) == 1:
        return problems[0][1]
    r, text = problems[0]
    return f"Pipeline: rank {r}: {text}"


def _batch_verdict(rows: List[List[int]], m: int, p: int, replicas: int, need_ids: bool) -> str:
    """The same text on every rank from every rank's batch row ("" when the batch is good
    everywhere): the first rank's own problem, else sizes or ids that differ in a pipeline."""
    names = ("inputs", "targets", "sample_ids")
    where = ("the first stage", "the last stage", "every rank in delta mode")
    tail = "; the step was refused on every rank, nothing sent or changed"
    for r, (problem, i, n, size, *_) in enumerate(rows):
        if problem == _MISSING:
            return f"rank {r}: {names[i]} is missing: {where[i]} needs a tensor with the batch along dim 0{tail}"
        if problem == _NOT_A_BATCH:
            return f"rank {r}: {names[i]} must be a tensor with the batch along dim 0{tail}"
        if problem == _UNEVEN:
            return (f"rank {r}: the batch of {n} {names[i]} does not split into microbatches={m} equal parts; "
                    f"use a batch size that is a multiple of {m}{tail}")
        if problem == _OTHER_SIZE:
            return f"rank {r}: {names[i]} has {n} rows where the rest of its batch has {size}{tail}"
    for replica in range(replicas):
        ranks = range(replica * p, (replica + 1) * p)
        sizes = {r: rows[r][3] for r in ranks if rows[r][3]}
        if len(set(sizes.values())) > 1:
            return (f"the stages of one pipeline were given batches of different sizes ({sizes}: group rank -> "
                    f"samples){tail}")
        if need_ids and len({rows[r][4] for r in ranks}) > 1:
            return (f"delta mode: sample_ids differ between the stages of one pipeline (group ranks "
                    f"{list(ranks)}); every stage must pass the same ids, in the same order, or the two ends of "
                    f"a boundary would cache different samples{tail}")
    return ""


def _shapes_sig(tensors: Sequence[Any]) -> int:
    """A non-negative 63-bit hash of the micro-batches' shapes and dtypes (0 for none)."""
    return h63(repr([(tuple(t.shape), t.dtype) for t in tensors])) if tensors else 0


def _ids_hash(ids: torch.Tensor) -> int:
    """A non-negative 63-bit hash of the sample ids (a host copy: delta mode only)."""
    flat = ids.detach().reshape(-1).to("cpu", torch.int64)
    return int.from_bytes(bytes.fromhex(fingerprint(flat.numpy().tobytes())), "little") >> 1


class _StageInput(torch.autograd.Function):
    """A received value as its stage's input: an alias of the leaf whose gradient is sent back,
    made by this node (so not a view of the leaf: the stage may change it in place, as it may
    change its input in one process); the gradient passes through unchanged."""

    @staticmethod
    def forward(ctx: Any, leaf: torch.Tensor) -> torch.Tensor:
        return leaf.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


def _stage_input(got: Union[torch.Tensor, Parts], record: bool) -> Tuple[Any, Any]:
    """``(the leaves, the stage's input)`` of a received value, in the form it was sent (a
    tensor, a tuple or a list). Training (``record``): a floating-point tensor, or a value the
    sending stage's output required a gradient for, becomes a leaf that requires one, and the
    stage gets an alias of it (:class:`_StageInput`); other values are given as they are."""
    if isinstance(got, torch.Tensor):
        if record and got.is_floating_point():
            leaf = got.requires_grad_(True)
            return leaf, _StageInput.apply(leaf)
        return got, got
    leaves = tuple(v.requires_grad_(True) if record and g and v is not None else v for v, g in zip(got.values, got.grad))
    given = tuple(_StageInput.apply(v) if v is not None and v.requires_grad else v for v in leaves)
    return _form(got.form, leaves), _form(got.form, given)


def _form(form: str, values: Tuple[Any, ...]) -> Any:
    return values[0] if form == "tensor" else list(values) if form == "list" else values


def _leaves(x: Any) -> List[torch.Tensor]:
    """The stage input's tensors that require a gradient (what the I pass differentiates for)."""
    values = [x] if isinstance(x, torch.Tensor) else list(x) if isinstance(x, (tuple, list)) else []
    return [v for v in values if isinstance(v, torch.Tensor) and v.requires_grad]


def _input_grads(x: Any, grad_of: Callable[[torch.Tensor], Optional[torch.Tensor]]) -> Union[torch.Tensor, Parts]:
    """The gradient message of a stage input ``x``: a tensor's gradient, or :class:`Parts` of
    one per value, None for a value that needs none or got none (the stage before then
    backpropagates nothing through it, as in one process)."""
    if isinstance(x, torch.Tensor):
        grad = grad_of(x) if x.requires_grad else None
        return grad if grad is not None else Parts("tensor", (None,), (False,))
    values = tuple(grad_of(v) if isinstance(v, torch.Tensor) and v.requires_grad else None for v in x)
    return Parts("tuple", values, (False,) * len(values))


def _outgoing(y: Any, stage: int) -> Union[torch.Tensor, Parts]:
    """A stage output as its message carries it: a tensor, or a tuple or list of tensors (None
    allowed) as :class:`Parts`, with whether each required a gradient."""
    if isinstance(y, torch.Tensor):
        return y.detach()
    if isinstance(y, (tuple, list)) and all(v is None or isinstance(v, torch.Tensor) for v in y):
        return Parts("list" if isinstance(y, list) else "tuple",
                     tuple(None if v is None else v.detach() for v in y),
                     tuple(v is not None and v.requires_grad for v in y))
    raise ValueError(f"pipeline: stage {stage} returned {type(y).__name__}: a stage's output crosses a boundary as a "
                     f"tensor, or a tuple or list of tensors (None allowed)")


def _on_a_copy(module: nn.Module) -> Callable[[Any], Any]:
    """``module`` run on a copy of its input's tensors (for a checkpointed region: an in-place
    change of the input is then not seen by the recomputation, nor by the caller)."""
    def run(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return module(x.clone())
        copied = tuple(v.clone() if isinstance(v, torch.Tensor) else v for v in x)
        return module(list(copied) if isinstance(x, list) else copied)
    return run


def _joined(outs: List[Any]) -> Any:
    """The last stage's outputs of every micro-batch, joined along dim 0 (a tuple or list of
    tensors value by value)."""
    if isinstance(outs[0], torch.Tensor):
        return torch.cat(outs)
    joined = [None if v[0] is None else torch.cat(list(v)) for v in zip(*outs)]
    return joined if isinstance(outs[0], list) else tuple(joined)


def _boundary_compressor(spec: BoundarySpec, what: str) -> Compressor:
    """A fresh compressor for one channel (its per-key counters are that channel's alone), or
    the instance given; no error feedback (delta mode is the pipeline's own)."""
    return as_codec("none" if spec is None else spec, error_feedback="none", wrappers="refuse", what=what)
