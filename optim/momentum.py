"""``MomentumExchange``: the compressed mean of a flat tensor with error feedback on both sides.

1-bit Adam's exchange (Tang et al. 2021): every rank compresses its tensor plus its *worker*
residual, the chunk owners average the decoded chunks, compress that average plus their
*server* residual, and every rank decodes the result. It is gradcomp's ``scatter-reduce``
allreduce with an ``ErrorFeedback`` wrapper (``gradcomp.collectives``), so, exactly at every
step, ``mean_r(sent_r + worker_old_r) + server_old == delivered + mean_r(worker_new_r) +
server_new``: nothing is lost, only delayed. A compressor that scatter-reduce cannot carry
(multi-round PowerSGD, or one that declares ``native``) travels by the algorithm the
collectives choose for it, with error feedback on the worker side only.

A step whose mean is not finite keeps no residual change (the collectives' transaction), and
the residuals survive ``state_dict`` / ``load_state_dict`` bit-identically.
"""
from __future__ import annotations

from typing import Any, Dict, Mapping, Optional

import torch

from gradcomp.collectives import ALGORITHMS, allreduce, allreduce_fused, choose_algorithm, server_feedback, server_key
from gradcomp.compress import Compressor, ErrorFeedback
from gradcomp.compress.transaction import Transaction

SCATTER_REDUCE = "scatter-reduce"


class MomentumExchange:
    """The compressed, error-compensated mean of one flat tensor per step over ``group``."""

    def __init__(self, compressor: Compressor, group=None, key: str = "momentum") -> None:
        self.feedback = ErrorFeedback(compressor)
        self.group = group
        self.key = key
        cls = ALGORITHMS[SCATTER_REDUCE]
        # the two-sided exchange when scatter-reduce takes the codec, else the collectives' choice
        self.algorithm: Optional[str] = SCATTER_REDUCE if cls.unsuitable(compressor) is None else None
        self._layouts: Dict[Any, Any] = {}  # the flat tensor's agreed layout, once checked

    @property
    def compressor(self) -> Compressor:
        return self.feedback.compressor

    def algorithm_on(self, world: int) -> str:
        return choose_algorithm(self.feedback, world, self.algorithm)

    def mean(self, flat: torch.Tensor) -> torch.Tensor:
        """The compressed mean of ``flat`` (a new tensor, the same bits on every rank); the
        residuals of both sides take what the wire did not carry.

        The optimizers exchange the same flat layout at every step (every rank checked the
        parameters when it was built), so after the first, checked exchange the payloads of a
        fixed-size codec travel on the agreed layout: no header and no host read
        (``allreduce_fused``'s ``layouts``), the same bits."""
        if self.algorithm == SCATTER_REDUCE:
            return allreduce_fused([(self.key, flat, self.feedback)], self.group, algorithm=SCATTER_REDUCE,
                                   layouts=self._layouts)[0]
        return allreduce(flat, self.feedback, key=self.key, group=self.group, algorithm=self.algorithm)

    def finite_mean(self, flat: torch.Tensor) -> Optional[torch.Tensor]:
        """:meth:`mean`, or None when it is not finite on every rank (the same verdict
        everywhere: the mean is the same bits), in which case no residual changed. The
        verdict is read once, with the exchange's validity flags: the step's one host read."""
        txn = Transaction()
        with txn.active():
            try:
                mean = self.mean(flat)
            except BaseException:
                txn.rollback()
                raise
        txn.observe(mean)  # the owner checks its results (the exchange joined this transaction)
        problems = txn.problems
        if problems or not txn.finite:
            txn.rollback()
            if problems:
                raise ValueError(f"{self.key} exchange: " + "; ".join(problems))
            return None
        txn.commit()
        return mean

    # ---- the residuals -----------------------------------------------------------------------
    def worker_residual(self, numel: int) -> torch.Tensor:
        """This rank's worker residual over the whole flat tensor (zeros before the first step;
        scatter-reduce compresses each chunk of it in place)."""
        res = self.feedback.residual(self.key)
        return res.reshape(-1) if res.numel() == numel else torch.zeros(numel)

    def server_residual(self, numel: int, rank: int, world: int) -> torch.Tensor:
        """The server residual of the chunk this rank owns (empty without scatter-reduce)."""
        if self.algorithm_on(world) != SCATTER_REDUCE:
            return torch.zeros(0)
        q, extra = divmod(numel, world)  # torch.tensor_split's sizes: the first chunks one larger
        n = q + (rank < extra)
        res = server_feedback(self.feedback).residual(server_key(self.key, rank))
        return res.reshape(-1) if res.numel() == n else torch.zeros(n)

    def state_dict(self) -> Dict[str, Any]:
        return {"worker": self.feedback.state_dict()}  # the server residuals inside: one owner

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._layouts.clear()  # the next exchange is checked again
        self.feedback.load_state_dict(state["worker"])
        if "server" in state:  # saved when the server part was kept beside the worker's
            server_feedback(self.feedback).load_state_dict(state["server"])
