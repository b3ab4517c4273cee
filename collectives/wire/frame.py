"""Frames: payloads as flat byte tensors, and the exchange of byte tensors of different sizes.

A payload travels in the project's wire format (``Payload.to_bytes``): self-describing, so
metadata that depends on the data (a scale, a count) reaches the other ranks, and validated
by ``Payload.from_bytes`` (index ranges included) before anything decodes it.

A set of payloads for one destination (or for everyone: ``allreduce_fused``'s self-describing
path) is one frame of ``n`` int64 lengths (one per tensor, 0 for an empty one), then the
payloads' wire bytes back to back (:func:`pack`, :func:`split`).
"""
from __future__ import annotations

from typing import Callable, List, Optional, Sequence

import numpy as np
import torch

from gradcomp.compress import Payload
from gradcomp.kernels.memory import copy_from_host

from .._comm import Comm


def encode(payload: Payload, device: torch.device) -> torch.Tensor:
    """The payload's wire bytes as a new 1-D uint8 tensor on ``device``."""
    buf = payload.to_tensor()
    return buf if device.type == "cpu" else buf.to(device)


def decode(buf: torch.Tensor, device: torch.device, numel: Optional[int] = None, rank: Optional[int] = None,
           max_numel: Optional[int] = None) -> Payload:
    """Inverse of :func:`encode`; ``ValueError`` if the bytes are not a valid payload, if they
    describe more than ``max_numel`` elements, or (when ``numel`` is given: what this rank
    expects, from the agreed header) another number of elements; all checked before anything
    is allocated for them."""
    limit = numel if numel is not None else max_numel
    try:
        # the received buffer (or its fresh CPU copy) is the caller's alone: the tensors may be views of it
        payload = Payload.from_bytes(buf.cpu().numpy(), copy=False,
                                     **({} if limit is None else {"max_numel": max(limit, 0)}))
    except ValueError as exc:
        if rank is None:
            raise
        raise ValueError(f"the payload from rank {rank} is invalid: {exc}") from None
    if numel is not None and payload.numel != numel:
        raise ValueError(f"the payload from rank {rank} holds {payload.numel} elements where {numel} were agreed; "
                         f"ranks run different gradcomp versions or the data was corrupted")
    return payload if device.type == "cpu" else payload.to(device)


def gather_bytes(comm: Comm, buf: torch.Tensor, sizes: Sequence[int], *, exact: bool,
                 while_sending: Optional[Callable[[], None]] = None) -> List[torch.Tensor]:
    """Every rank's byte tensor, in rank order; ``sizes[r]`` is rank r's length.

    ``exact``: point-to-point blocks of the exact sizes (for payloads whose size varies with
    the data); otherwise one all_gather of blocks padded to the largest (sizes nearly equal).
    ``while_sending``: local work run while the bytes are on the wire (see ``Comm.all_gather``).
    """
    sizes = [int(s) for s in sizes]
    if comm.size == 1:
        if while_sending is not None:
            while_sending()
        return [buf]
    if exact:
        in_splits = [0 if r == comm.rank else sizes[comm.rank] for r in range(comm.size)]
        out_splits = [0 if r == comm.rank else sizes[r] for r in range(comm.size)]
        out = comm.all_to_all(buf.repeat(comm.size - 1), in_splits, out_splits, while_sending)
        parts = list(out.split(out_splits))
        parts[comm.rank] = buf
        return parts
    padded = buf.new_zeros(max(sizes))
    padded[:buf.numel()] = buf
    rows = comm.all_gather(padded, while_sending)
    return [rows[r, :sizes[r]] for r in range(comm.size)]


# ---- a set's frame: lengths, then the payloads ----------------------------------------------
def pack(parts: Sequence[Optional[torch.Tensor]], device: torch.device, error) -> torch.Tensor:
    """``len(parts)`` int64 lengths (0 for None), then the parts' bytes; only the lengths
    (all zero) when ``error`` is set."""
    lengths = [0 if p is None or error is not None else p.numel() for p in parts]
    prefix = torch.tensor(lengths, dtype=torch.int64).view(torch.uint8).to(device)
    if error is not None:
        return prefix
    return torch.cat([prefix, *(p for p in parts if p is not None)])


def split(buf: torch.Tensor, n: int, rank: int) -> List[torch.Tensor]:
    """Rank ``rank``'s bytes cut into its ``n`` payloads, by the lengths in front of them."""
    head = 8 * n
    lengths = np.frombuffer(buf[:head].cpu().numpy().tobytes(), dtype="<i8") if buf.numel() >= head else None
    if lengths is None or (lengths < 0).any() or head + int(lengths.sum()) != buf.numel():
        raise ValueError(f"allreduce_fused: the bytes from rank {rank} do not hold {n} payloads as announced; "
                         f"ranks run different gradcomp versions or the data was corrupted")
    return list(buf[head:].split([int(x) for x in lengths]))


def int64_vector(values: Sequence[int], device: torch.device) -> torch.Tensor:
    """A small int64 tensor of host ``values`` on ``device``, built without making the host
    wait for the device where that is a GPU (pinned memory, asynchronous copy)."""
    if device.type == "cpu":
        return torch.tensor(values, dtype=torch.int64, device=device)
    return copy_from_host(torch.empty(len(values), dtype=torch.int64, device=device),
                          torch.tensor(values, dtype=torch.int64))
