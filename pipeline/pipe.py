"""``Pipeline``: pipeline-parallel training over compressed point-to-point links.

Each rank holds one stage of a model (or, interleaved, several chunks of it). A step splits
the batch into ``chunks`` micro-batches and runs the schedule's forward and backward passes
(:mod:`gradcomp.pipeline.schedule`); activations go forward and activation gradients back
through ``gradcomp.collectives.send`` / ``recv``, each direction through its own codec. Every
message carries its shape and size in the payload, so shapes may change from step to step
(a new sequence length) at no extra round trip.

Contracts:

- loss: the last stage computes ``loss_fn(output, target)`` per micro-batch and backpropagates
  ``loss / chunks``: gradients are those of the mean of the micro-batch losses — with the
  ``none`` codecs bit-identical to one process running the same micro-batches in order
  (``tests/pipeline/test_pipeline_schedules.py``). ``step`` returns that mean (averaged over
  replicas) on every rank;
- with ``optimizer`` (a function of the stage's parameters that returns a
  ``torch.optim.Optimizer``) the step also updates the stage; with ``replicas > 1`` the
  optimizer is wrapped in ``gradcomp.training.CompressedOptimizer`` over the stage's replicas
  (``dp_compressor``), whose exchange starts during each chunk's last backward pass and so
  overlaps the pipeline's cool-down. Without it the gradients are left in ``.grad``;
- a step whose local gradients or loss are not finite anywhere in the grid changes no state:
  parameters, optimizer state, compression state, delta caches and codec counters stay as they
  were (one small all-reduce per step decides it on every rank);
- ranks that disagree on the configuration raise the same ``ValueError`` at construction; a
  dead or silent peer is a ``CommunicationError`` within the group timeout, never a hang.
"""
from __future__ import annotations

import hashlib
import time
from typing import Any, Callable, Dict, Iterable, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint as _checkpoint

from gradcomp.collectives import recv, send
from gradcomp.collectives import group_timeout
from gradcomp.compress import Compressor, available_compressors, get_compressor
from gradcomp.compress.transaction import Transaction, all_finite
from gradcomp.training import CompressedOptimizer
from gradcomp.training import agree

from .channel import Channels
from .delta import DeltaFeedback
from .grid import Grid
from .stages import split
from .schedule import Action, build, check_shape

CHECKPOINTS = (None, "never", "except_last", "always")
Codec = Union[None, str, Compressor]


class Event(NamedTuple):
    """One interval of a step on one rank (seconds since the step began, wall clock)."""

    # "F", "B" (training passes), "E" (an eval_step forward), "send" (until the data has left),
    # "wait" (for a message)
    kind: str
    stage: int  # virtual stage
    mb: int
    start: float
    end: float


class Pipeline:
    """One rank's part of a pipeline; see the module docstring for the contracts.

    ``stages``: an ``nn.Sequential`` of the whole model with ``balance`` (layers per virtual
    stage, or ``"auto"``: :func:`gradcomp.pipeline.balance.auto_balance` with ``sample``,
    ``link_bps``), or this rank's module (a list of modules, one per chunk, for
    ``schedule="interleaved"``). ``schedule``: ``"gpipe"``, ``"1f1b"`` or ``"interleaved"``;
    ``chunks``: micro-batches per step (more: smaller bubble, smaller messages).
    ``activation_codec`` / ``grad_codec``: a compressor name or a ``Compressor`` for the
    activations sent forward and the gradients sent back (``None``: exact); ``delta=True``
    sends each sample's activation change (AQ-SGD; ``step(..., sample_ids=...)``).
    ``checkpoint``: recompute inside stages — ``"except_last"`` (every micro-batch but the last,
    as torchgpipe), ``"always"``, ``"never"``/``None``; or ``memory_budget``: bytes of saved
    activations per micro-batch, each chunk under a ``gradcomp.memory`` plan (with ``balance``
    and ``sample``). ``replicas``: pipelines side by side
    (data parallel); ``dp_compressor`` (+ ``dp_options``) averages each stage's gradients over its
    replicas. ``process_group``: the ranks of the whole grid (default: all).
    """

    def __init__(self, stages: Union[nn.Module, Sequence[nn.Module]], *, schedule: str = "1f1b", chunks: int = 4,
                 balance: Union[None, str, Sequence[int]] = None, activation_codec: Codec = None,
                 grad_codec: Codec = None, delta: bool = False, checkpoint: Optional[str] = None,
                 replicas: int = 1, dp_compressor: Any = "none", dp_options: Optional[Dict[str, Any]] = None,
                 optimizer: Optional[Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]] = None,
                 process_group: Any = None, virtual: Optional[int] = None, sample: Optional[torch.Tensor] = None,
                 link_bps: Optional[float] = None, memory_budget: Optional[float] = None) -> None:
        if checkpoint not in CHECKPOINTS:
            raise ValueError(f"checkpoint={checkpoint!r} is not allowed; use one of {CHECKPOINTS}")
        if memory_budget is not None and checkpoint not in (None, "never"):
            raise ValueError(f"memory_budget= and checkpoint={checkpoint!r} both decide what a stage recomputes; "
                             f"give one of them")
        if not isinstance(delta, bool):
            raise ValueError(f"delta={delta!r} is not allowed; it must be True or False")
        self.grid = Grid(process_group, replicas)
        p = self.grid.stages
        self.schedule, self.chunks, self.checkpoint, self.delta = schedule, chunks, checkpoint, delta
        # checked by every rank, then compared: a rank alone with a bad shape or a budget too
        # small for its stage must not leave the others waiting
        problem = ""
        try:
            self.modules, self.balance = split(stages, balance, p, self.grid.stage, schedule, virtual, sample,
                                               (activation_codec, grad_codec), link_bps, process_group, memory_budget)
            check_shape(schedule, p, chunks, len(self.modules))
        except ValueError as exc:
            self.modules, self.balance, problem = [nn.Identity()], None, str(exc)
        self.memory_budget = memory_budget
        self.v = len(self.modules)
        self.n_stages = p * self.v
        self.stage_ids = [c * p + self.grid.stage for c in range(self.v)]  # the virtual stage of each chunk
        self.local = nn.ModuleList(self.modules)
        self._act = [_codec(activation_codec, "activation_codec") for _ in range(self.v)]
        self._grad = [_codec(grad_codec, "grad_codec") for _ in range(self.v)]
        self._agree(dp_compressor, dp_options, optimizer, problem)
        if problem:
            raise ValueError(problem)
        self.grid.make_dp_groups(group_timeout(process_group if process_group is not None else dist.group.WORLD))
        # per chunk, one codec per direction and end: each keeps its own per-key counters
        self._recv_codec = [_codec(activation_codec, "activation_codec") for _ in range(self.v)]
        self._delta_out = [DeltaFeedback(c) for c in self._act] if delta else []  # what this chunk sent
        self._delta_in = [DeltaFeedback(c) for c in self._recv_codec] if delta else []  # what it received
        self._ids: List[Any] = []
        self.optimizer = self._make_optimizer(optimizer, dp_compressor, dp_options or {})
        self.actions: List[Action] = build(schedule, self.grid.stage, p, chunks, self.v)
        self._channels = Channels(f"gradcomp-pipeline-r{self.grid.rank}")
        self._failed: Optional[BaseException] = None
        self.events: List[Event] = []  # the last step's timeline on this rank, from started_at
        self.started_at = 0.0  # wall-clock time (time.time()) the last step began on this rank
        self.peak_in_flight = 0  # micro-batches whose activations were held at once, measured in the last step
        self.applied = True  # whether the last step was kept (False: something was not finite; nothing changed)

    # ---- construction helpers ------------------------------------------------------------
    def _agree(self, dp: Any, dp_options: Any, optimizer: Any, problem: str) -> None:
        """The same ``ValueError`` on every rank unless all were built alike (``problem``:
        what this rank's own checks found, compared too)."""
        if self.grid.world == 1:
            return
        config = {"stage check": problem or "passed", "schedule": self.schedule,
                  "chunks (micro-batches)": repr(self.chunks),
                  "grid (stages x replicas)": f"{self.grid.stages} x {self.grid.replicas}",
                  "model chunks per rank": repr(self.v), "activation_codec": repr(self._act[0]),
                  "grad_codec": repr(self._grad[0]), "delta": repr(self.delta), "checkpoint": repr(self.checkpoint),
                  "memory_budget": repr(self.memory_budget),
                  "dp_compressor": f"{dp!r} {sorted((dp_options or {}).items())!r}",
                  "optimizer given": repr(optimizer is not None), "balance": repr(self.balance)}
        agree(config, self.grid.group, "when the Pipeline was built")

    def _make_optimizer(self, factory: Any, dp: Any, options: Dict[str, Any]) -> Optional[torch.optim.Optimizer]:
        if factory is None:
            if self.grid.replicas > 1:
                raise ValueError("replicas > 1 needs optimizer= (a function of the stage's parameters returning a "
                                 "torch.optim.Optimizer): the stage replicas average gradients inside its step")
            return None
        if not callable(factory):
            raise ValueError(f"optimizer must be a function of the stage's parameters returning a "
                             f"torch.optim.Optimizer, got {type(factory).__name__}")
        inner = factory(self.local.parameters())
        if self.grid.replicas == 1:
            return inner
        return CompressedOptimizer(inner, dp, model=self.local, process_group=self.grid.dp_group, **options)

    # ---- the public API ------------------------------------------------------------------
    def parameters(self) -> Iterable[nn.Parameter]:
        """The parameters of this rank's stage (all its chunks)."""
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
        """One training step of ``chunks`` micro-batches; the mean micro-batch loss on every rank.

        ``inputs`` is read on the first stage, ``targets`` on the last (others may pass None);
        both are split along dim 0 into ``chunks`` equal micro-batches. ``sample_ids`` (delta
        mode; every rank passes the same): one id per sample, as the caches are keyed."""
        self._check_usable()
        mbs = self._split_inputs(inputs, targets, sample_ids, need_targets=True, need_ids=self.delta)
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)
        txn = Transaction()
        try:
            with txn.active():
                loss = self._run(mbs, loss_fn)
            loss_value, finite = self._conclude(loss, txn)
        except BaseException as exc:
            self._abandon(txn, exc)
            raise
        self.applied = finite
        if finite:
            txn.commit()
            if self.optimizer is not None:
                self.optimizer.step()
        else:
            txn.rollback()
            if self.optimizer is not None:
                self.optimizer.zero_grad(set_to_none=True)  # drains the exchange, undoing its state
        return loss_value

    @torch.no_grad()
    def eval_step(self, inputs: Optional[torch.Tensor], targets: Optional[torch.Tensor] = None,
                  loss_fn: Optional[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = None
                  ) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """Forward only (micro-batches in order, no gradients, no state change):
        ``(output, loss)``; the output (concatenated micro-batches) on the last stage, None
        elsewhere; the mean micro-batch loss on every rank when ``loss_fn`` is given."""
        self._check_usable()
        mbs = self._split_inputs(inputs, targets, None, need_targets=loss_fn is not None, need_ids=False)
        self.started_at = time.time()
        outs: List[torch.Tensor] = []
        losses: List[torch.Tensor] = []
        txn = Transaction()  # codec counters of eval messages are not training state
        try:
            with txn.active():
                order = [Action("F", c, mb) for mb in range(self.chunks) for c in range(self.v)]
                self._expect(order, delta=False)
                for _, c, mb in order:
                    y = self._forward_pass(c, mb, mbs, record=False)
                    if self._stage(c) == self.n_stages - 1:
                        outs.append(y)
                        if loss_fn is not None:
                            losses.append(loss_fn(y, mbs["targets"][mb]).detach())
                self._channels.flush()
            mean = torch.stack(losses).mean() if losses else None
            if loss_fn is not None:
                mean, _ = self._conclude(mean, txn, check_grads=False)
        except BaseException as exc:
            self._abandon(txn, exc)
            raise
        txn.rollback()
        return (torch.cat(outs) if outs else None), mean

    def state_dict(self) -> Dict[str, Any]:
        """This rank's stage: modules, optimizer (with its compression state), delta caches,
        codec counters, and an identity that :meth:`load_state_dict` checks."""
        return {"identity": self._identity(),
                "modules": [m.state_dict() for m in self.modules],
                "optimizer": None if self.optimizer is None else self.optimizer.state_dict(),
                "codecs": [c.state_dict() for c in self._act + self._grad + self._recv_codec],
                "delta": None if not self.delta else [d.state_dict() for d in self._delta_out + self._delta_in]}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; a checkpoint of another rank, grid, model or configuration
        is refused with a ``ValueError`` before anything changes."""
        if not isinstance(state, dict) or "identity" not in state:
            raise ValueError("not a Pipeline state_dict (it carries no identity)")
        mine, saved = self._identity(), state["identity"]
        for field, what in (("world", "ranks"), ("rank", "rank"), ("stage", "stage"), ("config", "configuration"),
                            ("params", "stage model (parameter names and shapes)")):
            if saved.get(field) != mine[field]:
                raise ValueError(f"the Pipeline state_dict was saved with another {what} ({saved.get(field)!r}, this "
                                 f"rank has {mine[field]!r}); every rank loads its own checkpoint of the same run")
        for m, sd in zip(self.modules, state["modules"]):
            m.load_state_dict(sd)
        if self.optimizer is not None and state["optimizer"] is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        for c, sd in zip(self._act + self._grad + self._recv_codec, state["codecs"]):
            c.load_state_dict(sd)
        if self.delta:
            for d, sd in zip(self._delta_out + self._delta_in, state["delta"]):
                d.load_state_dict(sd)

    def close(self) -> None:
        """End the channel threads (also when the pipeline is dropped)."""
        self._channels.close()

    def __del__(self) -> None:
        channels = getattr(self, "_channels", None)
        if channels is not None:
            channels.close()

    # ---- one step ------------------------------------------------------------------------
    def _stage(self, chunk: int) -> int:
        return self.stage_ids[chunk]

    def _split_inputs(self, inputs: Any, targets: Any, ids: Any, *, need_targets: bool,
                      need_ids: bool) -> Dict[str, List[Any]]:
        """The batch, split into ``chunks`` micro-batches; a clear ``ValueError`` (before any
        message) when something this rank needs is missing, or anything given is uneven. Every
        tensor given is checked, on every rank: a batch passed to all ranks fails on all alike."""
        m = self.chunks
        out: Dict[str, List[Any]] = {}
        for name, value, where in (("inputs", inputs, "the first stage" if self.is_first else None),
                                   ("targets", targets, "the last stage" if self.is_last and need_targets else None),
                                   ("sample_ids", ids, "every rank in delta mode" if need_ids else None)):
            if value is None and where is None:
                continue
            if not isinstance(value, torch.Tensor) or value.dim() < 1:
                raise ValueError(f"{name} must be a tensor with the batch along dim 0 on {where or 'any rank'}, "
                                 f"got {type(value).__name__}")
            if value.shape[0] % m or value.shape[0] == 0:
                raise ValueError(f"the batch of {value.shape[0]} {name} does not split into chunks={m} equal "
                                 f"micro-batches; use a batch size that is a multiple of {m}")
            out[name] = list(value.chunk(m))
        return out

    def _run(self, mbs: Dict[str, List[Any]], loss_fn: Callable) -> Optional[torch.Tensor]:
        self.events = []
        self.started_at = time.time()
        self._ids = mbs.get("sample_ids", [])
        saved: Dict[Tuple[int, int], Tuple[Any, torch.Tensor]] = {}
        losses: List[torch.Tensor] = []
        last_b = {c: max(a.mb for a in self.actions if a.kind == "B" and a.chunk == c) for c in range(self.v)}
        self._expect(self.actions, delta=True)
        live = peak = 0
        for a in self.actions:
            if a.kind == "F":
                x, y = self._forward_pass(a.chunk, a.mb, mbs, record=True)
                if self._stage(a.chunk) == self.n_stages - 1:
                    y = loss_fn(y, mbs["targets"][a.mb])
                    losses.append(y.detach())
                saved[(a.chunk, a.mb)] = (x, y)
                live += 1
                peak = max(peak, live)
            else:
                x, y = saved.pop((a.chunk, a.mb))
                self._backward_pass(a.chunk, a.mb, x, y, sync=a.mb == last_b[a.chunk])
                live -= 1
        self.peak_in_flight = peak
        self._channels.flush()
        return torch.stack(losses).mean() if losses else None

    def _forward_pass(self, c: int, mb: int, mbs: Dict[str, List[Any]], record: bool) -> Any:
        s = self._stage(c)
        if s == 0:
            x = mbs["inputs"][mb]
        else:
            x = self._recv(c, mb, "act")
            if x.is_floating_point() and record:
                x.requires_grad_(True)
        t = time.time()
        module = self.modules[c]
        recompute = record and (self.checkpoint == "always" or (self.checkpoint == "except_last"
                                                                 and mb < self.chunks - 1))
        y = _checkpoint(module, x, use_reentrant=False) if recompute else module(x)
        self._event("F" if record else "E", s, mb, t)
        if s < self.n_stages - 1:
            self._send(c, mb, "act", y.detach(), delta=record)
        return (x, y) if record else y

    def _backward_pass(self, c: int, mb: int, x: Any, y: torch.Tensor, sync: bool) -> None:
        s = self._stage(c)
        if s == self.n_stages - 1:
            out, grad = y / self.chunks, None
        else:
            out, grad = y, self._recv(c, mb, "grad")
        t = time.time()
        if isinstance(self.optimizer, CompressedOptimizer) and not sync:
            with self.optimizer.no_sync():
                torch.autograd.backward(out, grad)
        else:
            torch.autograd.backward(out, grad)
        self._event("B", s, mb, t)
        if s > 0:
            self._send(c, mb, "grad", x.grad)

    # ---- messages ------------------------------------------------------------------------
    def _tag(self, boundary: int, kind: str) -> int:
        """The tag of the messages across boundary ``boundary`` (between stages b and b + 1),
        one per direction: each is one receive channel, in micro-batch order."""
        return 2 * boundary + (0 if kind == "act" else 1)

    def _send(self, c: int, mb: int, kind: str, tensor: torch.Tensor, delta: bool = False) -> None:
        s = self._stage(c)
        boundary, peer = (s, s + 1) if kind == "act" else (s - 1, s - 1)
        key = f"{kind}{boundary}:{mb}"
        codec: Any = self._act[c] if kind == "act" else self._grad[c]
        if delta and self.delta:
            codec = self._delta_out[c]
            codec.expect(key, self._ids[mb])
        dst, tag = self.grid.peer(peer), self._tag(boundary, kind)

        def job() -> None:
            t = time.time()
            send(tensor, dst, codec, key=key, group=self.grid.group, tag=tag)
            self._event("send", s, mb, t)

        self._channels.post(dst, job)

    def _incoming(self, c: int, kind: str) -> Tuple[int, int, int]:
        """``(boundary, peer's global rank, tag)`` of the messages of ``kind`` into chunk ``c``."""
        s = self._stage(c)
        boundary, peer = (s - 1, s - 1) if kind == "act" else (s, s + 1)
        return boundary, self.grid.peer(peer), self._tag(boundary, kind)

    def _expect(self, actions: Sequence[Action], delta: bool) -> None:
        """Post, in schedule order, a receive for every message ``actions`` will read: the
        receive channels take them in while this rank computes."""
        for a in actions:
            s = self._stage(a.chunk)
            if (a.kind == "F" and s > 0) or (a.kind == "B" and s < self.n_stages - 1):
                kind = "act" if a.kind == "F" else "grad"
                boundary, src, tag = self._incoming(a.chunk, kind)
                key = f"{kind}{boundary}:{a.mb}"
                codec: Any = self._recv_codec[a.chunk] if kind == "act" else self._grad[a.chunk]
                if kind == "act" and delta and self.delta:
                    codec = self._delta_in[a.chunk]
                    codec.expect(key, self._ids[a.mb])

                def job(src: int = src, codec: Any = codec, key: str = key, tag: int = tag) -> torch.Tensor:
                    return recv(src, codec, key=key, group=self.grid.group, tag=tag, device=self._device())

                self._channels.expect(src, tag, job)

    def _recv(self, c: int, mb: int, kind: str) -> torch.Tensor:
        _, src, tag = self._incoming(c, kind)
        t = time.time()
        out = self._channels.take(src, tag)
        self._event("wait", self._stage(c), mb, t)
        return out

    def _device(self) -> torch.device:
        p = next(self.local.parameters(), None)
        return p.device if p is not None else torch.device("cpu")

    def _event(self, kind: str, stage: int, mb: int, t: float) -> None:
        self.events.append(Event(kind, stage, mb, t - self.started_at, time.time() - self.started_at))

    # ---- the end of a step ---------------------------------------------------------------
    def _conclude(self, loss: Optional[torch.Tensor], txn: Transaction,
                  check_grads: bool = True) -> Tuple[torch.Tensor, bool]:
        """One all-reduce over the grid: the loss (from the last stages, averaged over
        replicas) and whether every rank's loss and local gradients are finite."""
        ok = txn.finite
        if loss is not None:
            ok = ok and bool(torch.isfinite(loss))
        if check_grads:
            ok = ok and all_finite([p.grad for p in self.local.parameters() if p.grad is not None])
        row = torch.tensor([0.0 if loss is None else float(loss), 0.0 if ok else 1.0], dtype=torch.float64)
        if self.grid.world > 1:
            try:
                dist.all_reduce(row, group=self.grid.group)
            except RuntimeError as exc:
                from gradcomp.collectives import CommunicationError

                raise CommunicationError(f"Pipeline: the end-of-step all-reduce failed on rank {self.grid.rank}: a "
                                         f"peer died or did not answer within the group timeout ({exc})") from exc
        dtype = loss.dtype if loss is not None else torch.float32
        return torch.tensor(row[0].item() / self.grid.replicas, dtype=dtype), row[1].item() == 0.0

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

    def _identity(self) -> Dict[str, Any]:
        params = [(n, tuple(p.shape)) for n, p in self.local.named_parameters()]
        config = repr((self.schedule, self.chunks, self.grid.stages, self.grid.replicas, self.v, repr(self._act[0]),
                       repr(self._grad[0]), self.delta, self.checkpoint))
        return {"world": self.grid.world, "rank": self.grid.rank, "stage": self.grid.stage,
                "config": hashlib.blake2b(config.encode(), digest_size=8).hexdigest(),
                "params": hashlib.blake2b(repr(params).encode(), digest_size=8).hexdigest()}


def _codec(spec: Codec, what: str) -> Compressor:
    """A fresh compressor for one channel: its per-key counters are that channel's alone."""
    if spec is None:
        return get_compressor("none")
    if isinstance(spec, str):
        if spec not in available_compressors():
            raise ValueError(f"{what}={spec!r} is not a compressor; allowed: None, a Compressor, or one of "
                             f"{', '.join(available_compressors())}")
        return get_compressor(spec)
    if isinstance(spec, Compressor):
        return spec
    raise ValueError(f"{what} must be None, a compressor name or a Compressor, got {type(spec).__name__}")
