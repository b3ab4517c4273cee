"""The ledger of stored activation bytes: what every gradcomp saved-tensor hook reports.

PyTorch runs only the innermost ``saved_tensors_hooks``, so a meter cannot see what another
hook stores by installing its own. Instead every gradcomp hook (the meter's pass-through one,
``compressed_activations``, ``offload_activations``, the planner's stored checkpoints) reports
what it holds here, and every open :class:`~gradcomp.memory.meter.MemoryMeter` adds it up.

A holding is keyed: a tensor by its storage (two saved views of one storage count once), a
compressed payload by its own identity. It is released when the object that holds it is
collected (autograd frees a saved tensor's packed form when the graph is freed), so the
figures follow what is really alive, not what a model predicts.
"""
from __future__ import annotations

import threading
import weakref
from typing import Any, Dict, Hashable, List, Optional, Tuple

import torch

__all__ = ["Ledger", "active", "hold", "storage_key", "storage_nbytes"]

_lock = threading.Lock()
_open: List["Ledger"] = []  # the meters open now (any thread: backward may run elsewhere)


class Ledger:
    """Live and peak bytes of the holdings reported while it is open, per place
    (``"device"``: where the activations live, CPU included; ``"host"``: offloaded copies)."""

    def __init__(self) -> None:
        self.live: Dict[str, int] = {"device": 0, "host": 0}
        self.peak: Dict[str, int] = {"device": 0, "host": 0}
        self.holdings = 0  # how many were reported in all

    def _add(self, where: str, nbytes: int) -> None:
        self.live[where] += nbytes
        if nbytes > 0:
            self.holdings += 1
            if self.live[where] > self.peak[where]:
                self.peak[where] = self.live[where]


# key -> [nbytes, where, holders]: a storage saved twice is held once, released by its last holder
_held: Dict[Hashable, List[Any]] = {}


def active() -> bool:
    """Whether any meter is open (hooks skip the bookkeeping otherwise)."""
    return bool(_open)


def open_ledger(ledger: Ledger) -> None:
    with _lock:
        _open.append(ledger)


def close_ledger(ledger: Ledger) -> None:
    with _lock:
        _open.remove(ledger)


def storage_key(t: torch.Tensor) -> Tuple[str, int]:
    """The identity of ``t``'s storage (views of one storage share it)."""
    return (str(t.device), t.untyped_storage().data_ptr())


def storage_nbytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


def hold(owner: object, key: Hashable, nbytes: int, where: str = "device") -> Optional[weakref.finalize]:
    """Report that ``owner`` keeps ``nbytes`` under ``key`` alive until it is collected. Only the
    meters open now see it (a holding made before a meter opened is not counted by it).
    Returns the release: call it to end the holding earlier (once; later calls do nothing)."""
    if not _open or nbytes <= 0:
        return None
    with _lock:
        entry = _held.get(key)
        if entry is None:
            entry = _held[key] = [nbytes, where, 0, []]
        for ledger in _open:  # a meter opened since the storage was first held counts it from now
            if ledger not in entry[3]:
                entry[3].append(ledger)
                ledger._add(entry[1], entry[0])
        entry[2] += 1
    return weakref.finalize(owner, _release, key)


def _release(key: Hashable) -> None:
    with _lock:
        entry = _held.get(key)
        if entry is None:
            return
        entry[2] -= 1
        if entry[2] == 0:
            del _held[key]
            for ledger in entry[3]:
                ledger._add(entry[1], -entry[0])
