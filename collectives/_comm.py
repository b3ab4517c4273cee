"""A process group seen from one rank: thin wrappers over ``torch.distributed`` that count
bytes, time the communication and turn a backend failure into one clear error.

Byte convention (per rank, counted from the tensors handed to the backend):

- ``all_reduce`` of ``n`` bytes: ``2 (w-1)/w * n`` sent and as much received — what a ring
  allreduce moves, whatever algorithm the backend picks;
- ``all_gather`` of ``n`` bytes per rank: ``(w-1) * n`` sent and received (each rank's block
  reaches the ``w-1`` others; padding included);
- ``all_to_all``: the blocks addressed to other ranks are sent, those from other ranks are
  received (the block a rank keeps for itself is not counted);
- ``send``/``recv``: the tensor's bytes.

With one process (no process group, or a group of one) nothing is sent and nothing counted.
"""
from __future__ import annotations

import os
from datetime import timedelta
from typing import Callable, List, Optional, Sequence, TypeVar

import torch
import torch.distributed as dist

from ._telemetry import Record

T = TypeVar("T")


class CommunicationError(RuntimeError):
    """A collective failed in the backend: a peer died, timed out or called something else."""


def initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def resolve(group) -> Optional[object]:
    """The process group object for ``group`` (``None`` means the default group), or None
    when no process group is initialised (see :func:`check_alone`)."""
    if not initialized():
        if group is not None:
            raise ValueError("a process group was given but torch.distributed is not initialised; "
                             "call init_process_group first or pass group=None")
        check_alone()
        return None
    return dist.group.WORLD if group is None else group


def check_alone() -> None:
    """Without a process group, refuse to run when a launcher set ``WORLD_SIZE`` above 1: the
    local round trip would leave every rank silently training on its own gradients."""
    world = os.environ.get("WORLD_SIZE", "").strip()
    if world.isdigit() and int(world) > 1:
        raise ValueError(f"WORLD_SIZE={world} says this process is one of {world}, but torch.distributed is not "
                         f"initialised; call init_process_group first, or unset WORLD_SIZE to run alone")


def world_of(group) -> int:
    """World size of ``group`` (None: the default group); 1 without a process group (see
    :func:`check_alone`)."""
    if not initialized():
        if group is not None:
            raise ValueError("a process group was given but torch.distributed is not initialised; "
                             "call init_process_group first or pass process_group=None")
        check_alone()
        return 1
    return dist.get_world_size(group)


def rank_of(group) -> int:
    """This process's rank in ``group`` (None: the default group); 0 without a process group."""
    return dist.get_rank(group) if initialized() else 0


def group_timeout(group) -> Optional[timedelta]:
    """The timeout a group was created with (None when the backend does not say)."""
    try:
        device = torch.device("cuda") if dist.get_backend(group) == "nccl" else torch.device("cpu")
        return group._get_backend(device).options._timeout
    except Exception:  # private API: absent on some backends and versions
        return None


class Comm:
    """``group`` from this rank: rank, size, device for control tensors, counted operations."""

    def __init__(self, group, record: Record, op: str) -> None:
        self.record = record
        self.op = op
        self.group = resolve(group)
        if self.group is None:
            self.rank, self.size = 0, 1
            self.device = torch.device("cpu")
            return
        if self.group == dist.GroupMember.NON_GROUP_MEMBER or dist.get_rank(self.group) < 0:
            raise ValueError(f"{op}: this rank (global rank {dist.get_rank()}) is not a member of the group it was given")
        self.rank = dist.get_rank(self.group)
        self.size = dist.get_world_size(self.group)
        nccl = dist.get_backend(self.group) == "nccl"
        self.device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")

    def global_rank(self, r: int) -> int:
        return r if self.group is None else dist.get_global_rank(self.group, r)

    # ---- counted operations ----------------------------------------------------------------
    # Tensors on another device than the backend's (CUDA tensors under gloo) are staged
    # through it: gloo's CUDA support differs between operations.
    def _wire(self, t: torch.Tensor) -> torch.Tensor:
        return t.contiguous() if t.device.type == self.device.type else t.to(self.device)

    def all_reduce_(self, t: torch.Tensor, *, count: bool = True) -> torch.Tensor:
        """Sum ``t`` over the group, in place."""
        if self.size > 1:
            buf = self._wire(t)
            self._run("all_reduce", lambda: dist.all_reduce(buf, group=self.group))
            if buf is not t:
                t.copy_(buf)
            if count:
                moved = _nbytes(t) * 2 * (self.size - 1) // self.size
                self.record.bytes_sent += moved
                self.record.bytes_recv += moved
        return t

    def reduce_(self, t: torch.Tensor, dst: int) -> torch.Tensor:
        """Sum ``t`` over the group onto rank ``dst`` (in place there; elsewhere ``t`` is only sent)."""
        if self.size > 1:
            buf = self._wire(t)
            self._run(f"reduce onto rank {dst}", lambda: dist.reduce(buf, group=self.group, group_dst=dst))
            if self.rank == dst:
                if buf is not t:
                    t.copy_(buf)
                self.record.bytes_recv += _nbytes(t) * (self.size - 1)
            else:
                self.record.bytes_sent += _nbytes(t)
        return t

    def broadcast_(self, t: torch.Tensor, src: int) -> torch.Tensor:
        """Rank ``src``'s ``t`` into ``t`` on every rank, in place."""
        if self.size > 1:
            buf = self._wire(t)
            self._run(f"broadcast from rank {src}", lambda: dist.broadcast(buf, group=self.group, group_src=src))
            if self.rank == src:
                self.record.bytes_sent += _nbytes(t) * (self.size - 1)
            else:
                if buf is not t:
                    t.copy_(buf)
                self.record.bytes_recv += _nbytes(t)
        return t

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """``(w, *t.shape)``: every rank's ``t`` in rank order (same shape on every rank)."""
        if self.size == 1:
            return t.unsqueeze(0).clone()
        src = self._wire(t)
        out = src.new_empty((self.size, *t.shape))
        self._run("all_gather", lambda: dist.all_gather(list(out.unbind(0)), src, group=self.group))
        moved = _nbytes(t) * (self.size - 1)
        self.record.bytes_sent += moved
        self.record.bytes_recv += moved
        return out.to(t.device)

    def all_to_all(self, inp: torch.Tensor, in_splits: Sequence[int], out_splits: Sequence[int]) -> torch.Tensor:
        """Block ``j`` of the 1-D ``inp`` goes to rank ``j``; the result holds, in rank order,
        the blocks every rank addressed to this one."""
        if self.size == 1:
            return inp.clone()
        src = self._wire(inp)
        out = src.new_empty(int(sum(out_splits)))
        self._run("all_to_all", lambda: dist.all_to_all_single(
            out, src, [int(s) for s in out_splits], [int(s) for s in in_splits], group=self.group))
        item = inp.element_size()
        self.record.bytes_sent += item * (int(sum(in_splits)) - int(in_splits[self.rank]))
        self.record.bytes_recv += item * (int(sum(out_splits)) - int(out_splits[self.rank]))
        return out.to(inp.device)

    def send(self, t: torch.Tensor, dst: int, tag: int = 0) -> None:
        buf = self._wire(t)
        self._run(f"send to rank {dst}", lambda: dist.send(buf, dst, group=self.group, tag=tag))
        self.record.bytes_sent += _nbytes(t)

    def recv(self, t: torch.Tensor, src: int, tag: int = 0) -> torch.Tensor:
        buf = self._wire(t)
        self._run(f"recv from rank {src}", lambda: dist.recv(buf, src, group=self.group, tag=tag))
        if buf is not t:
            t.copy_(buf)
        self.record.bytes_recv += _nbytes(t)
        return t

    def mean_(self, t: torch.Tensor, *, count: bool = True) -> torch.Tensor:
        """Average ``t`` over the group in place, by gradcomp's one rule: scaled by ``1 / w``
        before the sum, rounded as PyTorch rounds it — ``div_`` for 16-bit tensors (its
        fp16/bf16 hooks; a sum can overflow 16 bits where the mean does not) and a
        multiplication by ``1/w`` otherwise (DDP's reducer). So ``allreduce(t, "none")``, the
        ``none`` hook and plain DDP give the same bits, for any world size."""
        if self.size > 1 and t.numel():
            scale_(t, self.size)
            self.all_reduce_(t, count=count)
        return t

    def exchange(self, values: List[int]) -> torch.Tensor:
        """All-gather a small int64 vector: ``(w, len(values))`` on the CPU."""
        row = torch.tensor(values, dtype=torch.int64, device=self.device)
        return self.all_gather(row).cpu()

    # ---- errors ----------------------------------------------------------------------------
    def _run(self, what: str, fn: Callable[[], T]) -> T:
        with self.record.timing("comm"):
            try:
                return fn()
            except RuntimeError as exc:
                raise CommunicationError(self._explain(what, exc)) from exc

    def _explain(self, what: str, exc: BaseException) -> str:
        timeout = group_timeout(self.group)
        within = f"within the group timeout of {timeout.total_seconds():g} s" if timeout else "in time"
        said = " ".join(str(exc).split())[:300]
        return (f"{self.op}: {what} failed on rank {self.rank} of a group of {self.size}: a peer died, "
                f"did not answer {within}, or called a different collective (backend: {said})")


def scale_(t: torch.Tensor, world: int) -> torch.Tensor:
    """``t / world`` in place, rounded as PyTorch rounds it (see :meth:`Comm.mean_`)."""
    return t.div_(world) if t.dtype in (torch.float16, torch.bfloat16) else t.mul_(1.0 / world)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
