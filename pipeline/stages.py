"""This rank's stage of the model: cut from an ``nn.Sequential`` by a balance, or given.

``balance`` lists the layers of each stage, in order (``p * v`` entries for ``p`` pipeline
ranks and ``v`` virtual stages per rank; stage ``s`` goes to rank ``s % p`` as its virtual
stage ``s // p``), or is ``"auto"`` (:mod:`gradcomp.pipeline.balance`, measured on the group's
first rank and shared, so every rank cuts the same way). Without a balance, ``stages`` is this
rank's module, or a list of modules (one per virtual stage) for the interleaved schedule.

With ``memory_budget`` each of this rank's virtual stages runs under a ``gradcomp.memory``
plan: the stage's input for ``sample`` is computed by the layers before it, and ``plan_memory``
picks per layer keep / recompute / store through the lossless codec, the fastest schedule whose
saved activations of one micro-batch stay within the budget (gradients stay bit-identical).
"""
from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from torch import nn

from gradcomp.collectives import check_device_set

from .balance import auto_balance


class StagesOverBudget(ValueError):
    """``memory_budget`` is below what some of this rank's stages need: ``needed`` maps each
    such stage to the least budget (bytes) it can be planned within."""

    def __init__(self, budget: float, needed: Dict[int, int]) -> None:
        super().__init__(over_budget_message(budget, {s: (None, n) for s, n in needed.items()}))
        self.needed = needed


def over_budget_message(budget: float, needed: Mapping[int, Tuple[Optional[int], int]]) -> str:
    """The error for a ``memory_budget`` too small: ``needed`` maps stage -> (its rank or
    None, the least budget it plans within)."""
    least = max(n for _, n in needed.values())
    where = ", ".join(f"stage {s}{'' if r is None else f' (rank {r})'} needs at least {n} bytes ({_size(n)})"
                      for s, (r, n) in sorted(needed.items()))
    return (f"Pipeline: memory_budget={int(budget)} bytes ({_size(budget)}) of saved activations per micro-batch is "
            f"too small: {where}; raise memory_budget to at least {least}")


def _size(n: float) -> str:
    for unit, scale in (("GiB", 2 ** 30), ("MiB", 2 ** 20)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n / 2 ** 10:.2f} KiB"


def split(stages: Union[nn.Module, Sequence[nn.Module]], balance: Union[None, str, Sequence[int]], p: int, rank: int,
          schedule: str, virtual: Optional[int], sample: Optional[torch.Tensor], compressors: Tuple[Any, Any],
          link_bps: Optional[float], group: Any, memory_budget: Optional[float] = None
          ) -> Tuple[List[nn.Module], Optional[List[int]]]:
    """``(this rank's modules, one per virtual stage; the balance used, or None)``;
    :class:`StagesOverBudget` when ``memory_budget`` is too small for one of them."""
    if memory_budget is not None and (balance is None or sample is None):
        raise ValueError("memory_budget= plans each stage on its own input: it needs an nn.Sequential of the whole "
                         "model with balance= and sample= (one micro-batch of inputs)")
    if balance is None:
        return _given(stages, virtual), None
    if not isinstance(stages, nn.Sequential):
        raise ValueError(f"balance= cuts an nn.Sequential of the whole model; got {type(stages).__name__}")
    v = _virtual(virtual, schedule)
    if isinstance(balance, str):
        counts = _auto(stages, balance, p * v, sample, compressors, link_bps, group)
    else:
        counts = _explicit(balance, p, virtual)
    if sum(counts) != len(stages):
        raise ValueError(f"balance={counts} covers {sum(counts)} layers, the model has {len(stages)}")
    bounds = [sum(counts[:i]) for i in range(len(counts) + 1)]
    pieces = [stages[bounds[i]:bounds[i + 1]] for i in range(len(counts))]
    mine = [c * p + rank for c in range(len(counts) // p)]
    if memory_budget is not None and sample is not None:
        return _planned_all(stages, bounds, pieces, mine, sample, memory_budget), counts
    return [pieces[s] for s in mine], counts


def _given(stages: Union[nn.Module, Sequence[nn.Module]], virtual: Optional[int]) -> List[nn.Module]:
    """This rank's modules as given (no balance)."""
    if virtual is not None:
        raise ValueError("virtual= (virtual stages per rank) is read only with a balance; without one, pass this "
                         "rank's modules as a list")
    mods: List[nn.Module] = list(stages) if isinstance(stages, (list, tuple)) else [stages]  # type: ignore
    if not mods or not all(isinstance(m, nn.Module) for m in mods):
        raise ValueError("stages must be this rank's nn.Module (or a non-empty list of them, one per virtual stage), "
                         "or an nn.Sequential of the whole model with balance=")
    return mods


def _auto(model: nn.Sequential, balance: str, n: int, sample: Optional[torch.Tensor], compressors: Tuple[Any, Any],
          link_bps: Optional[float], group: Any) -> List[int]:
    """``balance="auto"``: measured and chosen on the group's first rank, broadcast to all."""
    if balance != "auto":
        raise ValueError(f"balance={balance!r} is not allowed; use 'auto' or a list of layers per stage")
    chosen: List[Any] = [None]
    if dist.get_rank(group) == 0:
        chosen[0] = auto_balance(model, sample, n, activation_codec=compressors[0], grad_codec=compressors[1],
                                 link_bps=link_bps).balance if sample is not None else "no sample"
    check_device_set(group, None, "Pipeline(balance='auto')")  # NCCL's object collectives need set_device
    dist.broadcast_object_list(chosen, src=_first(group), group=group)
    if chosen[0] == "no sample":
        raise ValueError("balance='auto' needs sample= (one micro-batch of inputs) on the group's first rank")
    return list(chosen[0])


def _explicit(balance: Sequence[int], p: int, virtual: Optional[int]) -> List[int]:
    counts = list(balance)
    if not counts or not all(isinstance(c, int) and not isinstance(c, bool) and c > 0 for c in counts):
        raise ValueError(f"balance={balance!r} is not allowed; it must list a positive int of layers per stage")
    v = len(counts) // p if len(counts) % p == 0 else 0
    if v < 1 or (virtual is not None and v != virtual):
        raise ValueError(f"balance has {len(counts)} stages; it needs {p} (one per pipeline rank) or a multiple "
                         f"of {p} for several virtual stages per rank")
    return counts


def _planned_all(model: nn.Sequential, bounds: List[int], pieces: List[nn.Module], mine: List[int],
                 sample: torch.Tensor, budget: float) -> List[nn.Module]:
    """This rank's stages, each under its memory plan; every stage is planned before a budget
    too small for some is reported, so the error names what each needs."""
    from gradcomp.memory import BudgetTooSmall

    out: List[nn.Module] = []
    needed: Dict[int, int] = {}
    for s in mine:
        try:
            out.append(_planned(model, bounds[s], pieces[s], sample, budget))
        except BudgetTooSmall as exc:
            needed[s] = int(exc.smallest_budget)
    if needed:
        raise StagesOverBudget(budget, needed)
    return out


def _planned(model: nn.Sequential, start: int, piece: nn.Module, sample: torch.Tensor, budget: float) -> nn.Module:
    """``piece`` (layers ``start:`` of ``model``) under the fastest lossless memory plan within ``budget``."""
    from gradcomp.memory import plan_memory

    with torch.no_grad():
        x = model[:start](sample) if start else sample
    return plan_memory(piece, x, budget, allow=("recompute", "compress"), repeats=1).apply(piece)


def _virtual(virtual: Optional[int], schedule: str) -> int:
    if virtual is None:
        return 2 if schedule == "interleaved" else 1
    if isinstance(virtual, bool) or not isinstance(virtual, int) or virtual < 1:
        raise ValueError(f"virtual={virtual!r} is not allowed; it must be an int >= 1 (virtual stages per rank)")
    return virtual


def _first(group: Any) -> int:
    return 0 if group is None else dist.get_global_rank(group, 0)
