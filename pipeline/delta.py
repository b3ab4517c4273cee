"""AQ-SGD's delta mode (Wang et al. 2022): send the *change* of each sample's activation.

Both ends of a boundary keep, per sample id, the last activation the receiver reconstructed,
``m[id]``. The sender compresses ``a - m[ids]`` instead of ``a``, and both set
``m[ids] += decode(payload)`` — the sender from the decoding it computed while compressing,
the receiver from the payload — so the two copies stay bit-identical and the error of a
sample's reconstruction does not accumulate over epochs: once training settles, activations
change little between epochs and their deltas compress far better than the activations do.

A sample seen for the first time (or whose activation changed shape, a new sequence length) is
sent against zeros: its whole activation. A stage output of several tensors (a message of parts,
keyed ``key.i``) keeps a row per sample and floating-point value; its other values travel exact. The cache costs one activation per sample on each
side of each boundary (:attr:`DeltaFeedback.nbytes`, reported by ``Pipeline.delta_cache_bytes``).

It is an error-feedback-like wrapper (the ``Feedback`` protocol of ``gradcomp.collectives``'
``send``/``recv``: ``accumulate`` / ``update`` on the sender, ``combine`` on the receiver), so
the compressed point-to-point messages carry it unchanged. Every change goes through
``gradcomp.compress.transaction.replace``: a step whose result is not finite is undone.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple, Union

import torch

from gradcomp.compress import Compressor
from gradcomp.compress.transaction import replace


class DeltaFeedback:
    """One end of one boundary's delta channel; ``expect(key, ids)`` before each message."""

    kind = "delta"

    def __init__(self, compressor: Compressor) -> None:
        self.compressor = compressor
        # sample id (or (sample id, value) for a value of a message of parts) -> the reconstructed row
        self._rows: Dict[Union[int, Tuple[int, int]], torch.Tensor] = {}
        self._ids: Dict[str, List[int]] = {}  # message key -> the sample ids of its rows

    def __repr__(self) -> str:
        return f"DeltaFeedback({self.compressor!r})"

    @property
    def base(self) -> Compressor:
        """The compressor that encodes and decodes (as every wrapper's ``base``)."""
        return self.compressor

    def expect(self, key: str, ids: torch.Tensor) -> None:
        """The next message under ``key`` carries the samples ``ids`` (one per row)."""
        self._ids[key] = [int(i) for i in ids.reshape(-1).tolist()]

    @property
    def nbytes(self) -> int:
        """Bytes of cached activations on this end."""
        return sum(t.numel() * t.element_size() for t in self._rows.values())

    def _rows_of(self, key: Optional[str], rows: int) -> List[Union[int, Tuple[int, int]]]:
        """The cache's keys of a message's rows: its sample ids (``key.i``, value ``i`` of a
        message of parts: each id with ``i``)."""
        key = "" if key is None else key
        message, _, value = key.rpartition(".") if "." in key else (key, "", "")
        ids = self._ids.get(message)
        if ids is None or len(ids) != rows:
            raise ValueError(f"delta mode: the message {key!r} has {rows} rows but "
                             f"{'no' if ids is None else len(ids)} sample ids were given for it")
        return list(ids) if not value else [(i, int(value)) for i in ids]

    def _previous(self, key: Optional[str], like: torch.Tensor) -> torch.Tensor:
        zero = torch.zeros(like.shape[1:], dtype=torch.float32, device=like.device)
        rows = [self._rows.get(i) for i in self._rows_of(key, like.shape[0])]
        return torch.stack([r if r is not None and r.shape == zero.shape else zero for r in rows])

    def _store(self, key: Optional[str], value: torch.Tensor) -> None:
        for i, row in zip(self._rows_of(key, value.shape[0]), value.unbind(0)):
            replace(self._rows, i)  # an open transaction may have to undo it
            self._rows[i] = row.clone()

    # ---- the Feedback protocol -------------------------------------------------------------
    def accumulate(self, tensor: torch.Tensor, key: Optional[str]) -> torch.Tensor:
        return tensor.float() - self._previous(key, tensor)

    def update(self, key: Optional[str], acc: torch.Tensor, sent: torch.Tensor) -> None:
        self._store(key, self._previous(key, acc) + sent.float())

    def combine(self, key: Optional[str], averaged: torch.Tensor) -> torch.Tensor:
        out = self._previous(key, averaged) + averaged.float()
        self._store(key, out)
        return out

    def keeps_residual_in_place(self, tensor: torch.Tensor) -> bool:
        return False

    def accumulate_in_place(self, tensor: torch.Tensor, key: Optional[str]) -> torch.Tensor:
        raise NotImplementedError("delta mode keeps no residual in place")

    def state_dict(self) -> Dict[str, torch.Tensor]:
        return {(str(i) if isinstance(i, int) else f"{i[0]}.{i[1]}"): t.clone() for i, t in self._rows.items()}

    def load_state_dict(self, state: Dict[str, torch.Tensor]) -> None:
        self._rows = {_row_key(k): t.clone() for k, t in state.items()}


def _row_key(text: str) -> Union[int, Tuple[int, int]]:
    """A cache key from its state_dict text: ``"id"``, or ``"id.i"`` for value ``i`` of a message of parts."""
    sample, _, value = text.partition(".")
    return int(sample) if not value else (int(sample), int(value))
