"""The entry point: :func:`make_runtime`, and :class:`AutoRuntime`, the runtime of
``compressor="auto"``: a :class:`~gradcomp.training.engine.Runtime` that holds an
:class:`~gradcomp.training.auto.strategy.AutoStrategy` (the runtime asks it per bucket and
per iteration) and shows what it knows."""
from __future__ import annotations

import math
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from ..engine import Runtime
from ..policy import Policy
from .candidates import CANDIDATES, AutoPolicy
from .link import Link
from .strategy import AutoStrategy

__all__ = ["make_runtime", "AutoRuntime"]


def make_runtime(compressor: Any, options: Mapping[str, Any], group=None,
                 local_size: Optional[int] = None) -> Runtime:
    """The runtime for a ``compressor`` argument: an :class:`AutoRuntime` for ``"auto"`` (its
    keywords in ``options``), else a :class:`Runtime` of ``Policy(compressor, **options)``
    (fixed routing)."""
    if isinstance(compressor, str) and compressor == "auto":
        return AutoRuntime(group, local_size, **options)
    return Runtime(Policy(compressor, **options), group, local_size)


class AutoRuntime(Runtime):
    """The training runtime of ``compressor="auto"`` (see the package docstring): a runtime
    whose strategy is an :class:`AutoStrategy` (:attr:`auto`), built from auto's keywords, with
    what the strategy knows (decisions, link, history) shown on the runtime the user holds."""

    def __init__(self, group=None, local_size: Optional[int] = None, *, candidates: Sequence[Any] = CANDIDATES,
                 trial_steps: int = 3, trial_memory_mb: float = 25.0, verify_steps: int = 2, margin: float = 0.1,
                 tolerance: float = 0.02, recheck_every: Optional[int] = 200, accordion: bool = False,
                 accordion_threshold: float = 0.5, link: Optional[Link] = None, **settings: Any) -> None:
        if local_size is not None:
            raise ValueError("compressor='auto' does not support local_size (hierarchical exchange) yet; pass a "
                             "fixed compressor with local_size, or drop local_size")
        if isinstance(link, str):  # "10gbit,0.05ms": the one link parser
            link = Link.parse(link, "compressor='auto': link=")
        for key, value, ok, rule in (
                ("trial_steps", trial_steps, isinstance(trial_steps, int) and trial_steps >= 1, "an int >= 1"),
                ("trial_memory_mb", trial_memory_mb, isinstance(trial_memory_mb, (int, float)) and math.isfinite(
                    trial_memory_mb) and trial_memory_mb > 0, "a finite number > 0 (megabytes)"),
                ("verify_steps", verify_steps, isinstance(verify_steps, int) and verify_steps >= 0, "an int >= 0"),
                ("margin", margin, isinstance(margin, (int, float)) and 0 <= margin < 1, "a number in [0, 1)"),
                ("tolerance", tolerance, isinstance(tolerance, (int, float)) and 0 <= tolerance < 1,
                 "a number in [0, 1)"),
                ("recheck_every", recheck_every, recheck_every is None or (
                    isinstance(recheck_every, int) and recheck_every >= 1), "None or an int >= 1"),
                ("accordion", accordion, isinstance(accordion, bool), "True or False"),
                ("accordion_threshold", accordion_threshold,
                 isinstance(accordion_threshold, (int, float)) and accordion_threshold > 0, "a number > 0"),
                ("link", link, link is None or isinstance(link, Link),
                 "None, a gradcomp.training.auto.Link or text such as '10gbit,0.05ms'")):
            if isinstance(value, bool) and key != "accordion" or not ok:
                raise ValueError(f"compressor='auto': {key}={value!r} is not allowed; {key} must be {rule}")
        policy = AutoPolicy(candidates, **settings)
        self.auto = AutoStrategy(policy, trial_steps=trial_steps, trial_memory_mb=trial_memory_mb,
                                 verify_steps=verify_steps, margin=margin, tolerance=tolerance,
                                 recheck_every=recheck_every, accordion=accordion,
                                 accordion_threshold=accordion_threshold, link=link)
        super().__init__(policy, group, None, strategy=self.auto)
        self.auto.bind(self)
        self.policy: AutoPolicy
        self.label = "auto"

    # ---- what the strategy knows, on the runtime ------------------------------------------
    @property
    def link(self) -> Optional[Link]:
        """The link the decisions use (measured, or given: ``link=``, :meth:`set_link`)."""
        return self.auto.link

    @property
    def history(self) -> List[Dict[str, Any]]:
        """Every decision and re-decision."""
        return self.auto.history

    @property
    def syncs(self) -> int:
        """Host syncs auto itself made (the package docstring)."""
        return self.auto.syncs

    @property
    def trial_steps(self) -> int:
        return self.auto.trial_steps

    @property
    def verify_steps(self) -> int:
        return self.auto.verify_steps

    @property
    def trial_bytes(self) -> int:
        """Bytes of gradient copies held now for timing candidates."""
        return self.auto.trial_bytes

    @property
    def trial_bytes_peak(self) -> int:
        """The most gradient-copy bytes held at once so far (bounded by ``trial_memory_mb``)."""
        return self.auto.trial_bytes_peak

    def set_link(self, link: Link) -> None:
        """Use ``link`` from the next decision on (every rank alike); nothing is refit."""
        self.auto.set_link(link)

    def owed(self, name: str, shape: Sequence[int]) -> torch.Tensor:
        """What this rank still owes parameter ``name`` (of ``shape``), over every candidate
        (``Router.owed``)."""
        return self.auto.owed(name, shape)

    def describe(self) -> str:
        """One line per bucket: its choice, predicted ms per candidate, measured ms."""
        return self.auto.describe()

    def summary(self) -> str:
        """The choices counted over the current buckets, e.g. ``"dense x2, topk x1"``."""
        return self.auto.summary()

    def decisions(self) -> Dict[Tuple[str, ...], Optional[str]]:
        """The method chosen per bucket (its parameter names), None while on trial
        (``AutoStrategy.decisions``)."""
        return self.auto.decisions()
