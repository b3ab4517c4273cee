"""One step decision: the same object in every layer that steps.

A step that exchanged something ends the same way everywhere: each rank says what it found
(flags: "a reduced value was not finite", "a received payload failed its check", ...), the
flags (and any values the step sums, such as a loss) go through one small all-reduce over the
group, read once on the host, and then every rank does the same thing — keep the step's state
changes (commit its transactions) or undo them (roll them back) and count the step as
skipped. ``skipped`` is the one counter every layer reports.

    decision = StepDecision(group, "DiLoCo")
    verdict = decision.reduce({"nonfinite": witness, "invalid": txn.flagged()})
    if decision.settle(verdict.clean, txn):
        ...  # apply the step

A flag is a bool, ``None`` (false), or a 0-d tensor that is non-zero for true; tensors stay on
their device until the one read (no host sync before it). Without a process group (one
process) the flags are read as they are, with the same single read.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Optional

import torch

from gradcomp.collectives.shards import sum_row

Flag = Any  # bool, None or a 0-d tensor (non-zero: true)


@dataclass(frozen=True)
class Verdict:
    """What every rank learned at the decision: each flag true on some rank; each sum over the
    ranks."""

    flags: Dict[str, bool] = field(default_factory=dict)
    sums: Dict[str, float] = field(default_factory=dict)

    @property
    def clean(self) -> bool:
        """No flag is raised on any rank: the step may keep its changes."""
        return not any(self.flags.values())

    def __getitem__(self, name: str) -> bool:
        return self.flags[name]


class StepDecision:
    """Flags -> one all-reduce -> commit or roll back, with one ``skipped`` counter.

    ``group``: the process group the step spans (None: the default group when one is
    initialised, else this process alone). ``owner`` names the layer in telemetry."""

    def __init__(self, group: Any = None, owner: str = "step") -> None:
        self.group = group
        self.owner = owner
        self.skipped = 0

    def reduce(self, flags: Mapping[str, Flag], sums: Optional[Mapping[str, Any]] = None,
               device: Optional[torch.device] = None) -> Verdict:
        """Every flag over every rank (true where true on any) and every sum (a number or a 0-d
        tensor, summed in float64), in one all-reduce of one float64 row on the group's device,
        read once. The same names in the same order on every rank."""
        sums = dict(sums or {})
        read = sum_row(list(flags.values()) + list(sums.values()), self.group, self.owner, device,
                       f"{self.owner}'s step decision").tolist()  # the decision's one host read
        names = list(flags)
        return Verdict({n: read[i] > 0 for i, n in enumerate(names)},
                       {n: read[len(names) + i] for i, n in enumerate(sums)})

    def settle(self, keep: bool, *transactions: Any) -> bool:
        """Commit every transaction (``keep``) or roll every one back and count the step as
        skipped. The same ``keep`` on every rank (from a :class:`Verdict`). True when kept."""
        for txn in transactions:
            if txn is None:
                continue
            txn.commit() if keep else txn.rollback()
        if not keep:
            self.skipped += 1
        return keep

    def skip(self) -> None:
        """Count a step skipped on every rank whose undoing the caller did itself."""
        self.skipped += 1


class Stepping:
    """A layer that steps: it holds one :class:`StepDecision` (``decision``) and reports the
    decision's counter as ``skipped`` (settable, for a ``load_state_dict`` that restores it)."""

    decision: StepDecision

    @property
    def skipped(self) -> int:
        """Steps (iterations) undone on every rank the decision spans, and counted."""
        return self.decision.skipped

    @skipped.setter
    def skipped(self, value: int) -> None:
        self.decision.skipped = value
