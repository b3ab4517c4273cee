"""Checkpoint identity and agreement between ranks, for every layer.

- :func:`fingerprint`, :func:`describe_params`, :class:`Identity` (whose a checkpoint is and
  :meth:`Identity.mismatch`): pure, from :mod:`gradcomp.compress.identity`;
- :func:`names_of`: stable parameter names;
- :func:`agree`: the same ``ValueError`` on every rank unless every rank passed the same
  configuration;
- :func:`refuse_on_every_rank`: every rank passes what is wrong with its own checkpoint (None:
  nothing); if any rank has a problem, every rank raises the same ``ValueError`` before anything
  is loaded, so no rank loads while another refuses.

Both collectives are one small all-gather of objects run after the gradcomp jobs in flight
(see :mod:`gradcomp.collectives.worker`), on the device NCCL's object collectives use.
"""
from __future__ import annotations

from typing import Any, List, Mapping, Optional, Sequence

import torch
import torch.distributed as dist

from gradcomp.compress.identity import Identity, describe_params, fingerprint

from . import worker
from ._comm import backend_for, check_device_set, initialized, rank_of, world_of

__all__ = ["fingerprint", "describe_params", "names_of", "Identity", "agree", "refuse_on_every_rank"]


def names_of(params: Sequence[torch.Tensor], model: Optional[torch.nn.Module]) -> List[str]:
    """Stable names for ``params``: their names in ``model``, else ``param{i}`` by position."""
    if model is None:
        return [f"param{i}" for i in range(len(params))]
    by_id = {id(p): n for n, p in model.named_parameters()}
    missing = [i for i, p in enumerate(params) if id(p) not in by_id]
    if missing:
        raise ValueError(f"{len(missing)} parameter(s) (positions {missing[:5]}) are not parameters of the model "
                         f"given; pass the model whose parameters are trained")
    return [by_id[id(p)] for p in params]


def agree(config: Mapping[str, str], group, when: str, *, device: Optional[torch.device] = None,
          problem: Optional[str] = None) -> None:
    """Raise the same ``ValueError`` on every rank of ``group`` unless every rank passed the
    same ``config`` (field -> printable value), naming the first field that differs and each
    rank's value. ``problem``: why this rank has no configuration to compare (what it was given
    is invalid there, e.g. an option computed from its process rank): when any rank passes one,
    every rank raises the first such rank's, naming it. Runs under ``device`` (default: the
    device this thread's object collectives use on ``group``)."""
    check_device_set(group, device, f"gradcomp: agreeing {when}")  # NCCL's object collectives need set_device
    if device is None:
        device = _object_device(group)
    worker.submit(lambda twin: _agree(config, twin(group), when, problem), (group,), False, device=device)


def refuse_on_every_rank(problem: Optional[str], group, what: str, *, device: Optional[torch.device] = None) -> None:
    """Every rank of ``group`` passes its own ``problem`` (None or ``""``: its checkpoint fits);
    if any rank has one, every rank raises the same ``ValueError``
    ``"{what} refused the checkpoint (rank r: problem); nothing was loaded"`` (``r``: the first
    rank with a problem). Every rank must call it at the same point. Without a process group
    (or on one rank) it raises locally. ``device``: as for :func:`agree`."""
    if not initialized() or world_of(group) == 1:
        if problem:
            raise ValueError(_refusal(what, rank_of(group), problem))
        return
    check_device_set(group, device, what)  # NCCL's object collectives need set_device
    if device is None:
        device = _object_device(group)
    worker.submit(lambda twin: _refuse(problem, twin(group), what), (group,), False, device=device)


def _refusal(what: str, rank: int, problem: str) -> str:
    return f"{what} refused the checkpoint (rank {rank}: {problem}); nothing was loaded"


def _refuse(problem: Optional[str], group, what: str) -> None:
    gathered: List[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, problem or None, group=group)
    bad = [(r, p) for r, p in enumerate(gathered) if p]
    if bad:
        raise ValueError(_refusal(what, *bad[0]))


def _object_device(group) -> torch.device:
    """Where object collectives on ``group`` put their tensors, read on the caller's thread
    (NCCL: the current CUDA device, which ``torch.cuda.set_device`` sets)."""
    if backend_for(group, "cuda") == "nccl" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _agree(config: Mapping[str, str], group, when: str, problem: Optional[str] = None) -> None:
    digest = {k: fingerprint(v) for k, v in config.items()}
    gathered: List[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, (digest, dict(config), problem or None), group=group)
    failed = [(r, g[2]) for r, g in enumerate(gathered) if g[2]]
    if failed:
        r, said = failed[0]
        others = f" (and on rank(s) {[f for f, _ in failed[1:]]})" if len(failed) > 1 else ""
        raise ValueError(f"{said} (on rank {r}{others}; raised on every rank {when})")
    for field in config:
        values = [g[0].get(field) for g in gathered]
        if len(set(values)) > 1:
            texts = [str(g[1].get(field, "missing")) for g in gathered]
            at = _first_difference(texts)
            shown = ", ".join(f"rank {r}: {_short(t, at)}" for r, t in enumerate(texts))
            raise ValueError(f"ranks disagree on the {field} {when} ({shown}); every rank must build gradcomp's "
                             f"compression with the same configuration, model and checkpoint step")
    if any(set(g[0]) != set(digest) for g in gathered):
        raise ValueError(f"ranks disagree on what they compare {when}: every rank must run the same gradcomp "
                         f"version and call the same hook or optimizer")


def _first_difference(texts: Sequence[str]) -> int:
    """The first position at which the ``texts`` are not all equal (the shortest's length
    when one is a prefix of the others)."""
    at = 0
    for chars in zip(*texts):
        if len(set(chars)) > 1:
            break
        at += 1
    return at


def _short(text: str, at: int = 0, limit: int = 160) -> str:
    """``text`` when it has at most ``limit`` characters; else the ``limit`` characters from
    ``limit // 4`` before position ``at`` (moved back to fit at the end), with ``...`` added on
    each side that was cut (so at most ``limit + 6`` characters)."""
    if len(text) <= limit:
        return text
    start = max(0, min(at - limit // 4, len(text) - limit))
    return ("..." if start else "") + text[start:start + limit] + ("..." if start + limit < len(text) else "")
