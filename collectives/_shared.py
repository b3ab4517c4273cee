"""What exchanges shared by many tensors have in common (``allreduce_fused``).

Wire format of one rank's bytes for one destination (or for everyone): ``n`` int64 lengths
(one per tensor, 0 for an empty one), then the payloads' wire bytes back to back. The header
is one row for the set as a whole: the layout (shapes and dtypes) and the keys and
compressors are compared by hash, so a mismatch raises ``ValueError`` on every rank, as for a
single allreduce. An algorithm that can share its exchanges among many tensors implements
``Algorithm.exchange_many`` with these.
"""
from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

import numpy as np
import torch

from ._header import IDX, build, check_same_call, h64, verify

Item = Tuple[str, torch.Tensor, Any]  # (key, tensor, compressor)


def pack(parts: Sequence[Optional[torch.Tensor]], device: torch.device, error) -> torch.Tensor:
    """``len(parts)`` int64 lengths (0 for None), then the parts' bytes; only the lengths
    (all zero) when ``error`` is set."""
    lengths = [0 if p is None or error is not None else p.numel() for p in parts]
    prefix = torch.tensor(lengths, dtype=torch.int64).view(torch.uint8).to(device)
    if error is not None:
        return prefix
    return torch.cat([prefix, *(p for p in parts if p is not None)])


def device_of(items: List[Item]) -> torch.device:
    """Where the set's bytes travel: the first tensor's device (CPU for a set of no tensors)."""
    return next((t.device for _, t, _ in items if isinstance(t, torch.Tensor)), torch.device("cpu"))


def exact_sizes(specs: list) -> bool:
    """Whether payload sizes may differ between ranks (so they travel point to point)."""
    return not all(s.base.fixed_size for s in specs)


def layout(items: List[Item]) -> str:
    return repr([(tuple(t.shape), str(t.dtype)) if isinstance(t, torch.Tensor) else type(t).__name__
                 for _, t, _ in items])


def header(world: int, algorithm: str, items: List[Item], specs: list, error, sizes: List[int]) -> List[int]:
    numel = sum(t.numel() for _, t, _ in items if isinstance(t, torch.Tensor))
    row = build(world, op="allreduce", algorithm=algorithm, tensor=torch.empty(numel, device="meta"),
                compressor="|".join(s.desc for s in specs), key="\n".join(k for k, _, _ in items),
                error=error is not None, sizes=sizes)
    row[IDX["shape"]] = h64(layout(items))  # every tensor's shape and dtype, in order
    row[IDX["ndim"]] = len(items)
    return row


def verify_many(table: torch.Tensor, items: List[Item], specs: list, error) -> None:
    def same(name: str) -> bool:
        return len(set(table[:, IDX[name]].tolist())) == 1

    check_same_call(table, op="allreduce")  # a rank in allreduce instead: say so, not "different tensors"
    if not (same("shape") and same("ndim") and same("numel")):
        per_rank = ", ".join(f"rank {r}: {row[IDX['ndim']]} tensors of {row[IDX['numel']]} elements"
                             for r, row in enumerate(table.tolist()))
        raise ValueError(f"allreduce_fused: ranks passed different tensors ({per_rank}, layouts compared by hash); "
                         f"every rank must pass the same shapes and dtypes in the same order")
    descs = sorted({s.desc for s in specs})
    keys = f"{items[0][0]}..{items[-1][0]}" if items else ""
    verify(table, op="allreduce", error=error, local={"compressor": ", ".join(descs), "key": keys})


def split(buf: torch.Tensor, n: int, rank: int) -> List[torch.Tensor]:
    """Rank ``rank``'s bytes cut into its ``n`` payloads, by the lengths in front of them."""
    head = 8 * n
    lengths = np.frombuffer(buf[:head].cpu().numpy().tobytes(), dtype="<i8") if buf.numel() >= head else None
    if lengths is None or (lengths < 0).any() or head + int(lengths.sum()) != buf.numel():
        raise ValueError(f"allreduce_fused: the bytes from rank {rank} do not hold {n} payloads as announced; "
                         f"ranks run different gradcomp versions or the data was corrupted")
    return list(buf[head:].split([int(x) for x in lengths]))
