"""The status word of an agreed exchange, and the checks of what it received.

An exchange on an agreed layout (``layouts.py``) sends no header: each rank's buffer starts
with an 8-byte int64 status word (:data:`OK`, :data:`FAILED` when the rank failed locally,
:data:`CHANGED` when its payloads no longer fit the layout). What only the data can show (a
peer's status, sparse indices out of range) is flagged on the device (:class:`Flags`) and read
with the step's finiteness, when the owner's transaction ends: no host read per exchange.
"""
from __future__ import annotations

from typing import Any, List

import torch

from gradcomp.compress import Payload
from gradcomp.compress.transaction import Deferred, Transaction

WORD = 8  # bytes of the status word in front of a rank's buffer
OK, FAILED, CHANGED = 0, 1, 2  # its values


def fail_where_refused(word: torch.Tensor, deferred: Deferred) -> None:
    """This rank's one-element int64 status ``word`` set to FAILED where a refusal of
    ``deferred`` holds, decided on the word's device (nothing read)."""
    bad = deferred.bad()
    word.copy_(torch.where(bad if bad.device == word.device else bad.to(word.device), FAILED, word))


def statuses(rows: torch.Tensor) -> torch.Tensor:
    """Every rank's status word (a device tensor, not read here)."""
    return rows[:, :WORD].contiguous().view(torch.int64).reshape(-1)


def status_problem(values: List[int]) -> str:
    failed = [r for r, v in enumerate(values) if v == FAILED]
    changed = [r for r, v in enumerate(values) if v == CHANGED]
    parts = []
    if failed:
        parts.append(f"rank(s) {failed} failed to compress their gradients (the error is raised there)")
    if changed:
        parts.append(f"the payloads of rank(s) {changed} no longer fit the layout agreed at the bucket's first "
                     f"exchange (only a payload's sizes may change between steps, and only for a compressor "
                     f"that declares fixed_size=False)")
    return "; ".join(parts) or "an agreed exchange failed"


class Flags:
    """The device flags of one agreed exchange: handed to the open transaction, which reads
    them with the step's finiteness; with none open, to one of their own, read at
    :meth:`settle` (one host read)."""

    def __init__(self, txn: Any) -> None:
        self.own = txn is None
        self.txn = Transaction() if txn is None else txn

    def add(self, bad: torch.Tensor, problem) -> None:
        self.txn.flag(bad, problem)

    def settle(self) -> None:
        if self.own and self.txn.problems:
            raise ValueError("; ".join(self.txn.problems))


def checked(comp: Any, payload: Payload, key: str, rank: int, flags: Flags) -> Payload:
    """A payload read from an agreed layout, made safe by its compressor
    (``Compressor.check_on_device``); what only its values can show is noted in ``flags``."""
    payload, bad = comp.check_on_device(payload)
    if bad is not None:
        flags.add(bad, lambda _: f"the payload of {key!r} from rank {rank} is invalid")
    return payload
