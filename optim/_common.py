"""What the optimizers of ``gradcomp.optim`` share: option checks, the process group, the
dense mean, agreement between ranks, and whose a checkpoint is.

Every check raises ``ValueError`` naming the option and what is allowed, before any state
exists. The dense mean is ``gradcomp.collectives.allreduce(t, "none")``: the bits of plain DDP
(scaled by ``1/w`` before the sum) and counted in gradcomp's telemetry like every other byte.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from gradcomp.collectives import allreduce, rank_of, world_of


# ---- option checks ---------------------------------------------------------------------------
def check_number(name: str, value: Any, *, low: float = 0.0, low_open: bool = False,
                 high: Optional[float] = None, high_open: bool = True) -> float:
    """``value`` as a float, or ``ValueError`` naming ``name`` and the allowed interval."""
    lo, hi = "(" if low_open else "[", ")" if high_open or high is None else "]"
    allowed = f"{lo}{low:g}, {'inf' if high is None else f'{high:g}'}{hi}"
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(float(value)):
        raise ValueError(f"{name}={value!r} is not allowed; it must be a finite number in {allowed}")
    v = float(value)
    if v < low or (low_open and v == low) or (high is not None and (v > high or (high_open and v == high))):
        raise ValueError(f"{name}={value!r} is not allowed; it must be in {allowed}")
    return v


def check_int(name: str, value: Any, low: int = 0) -> int:
    """``value`` as an int ``>= low``, or ``ValueError`` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name}={value!r} is not allowed; it must be an int >= {low}")
    return int(value)


def check_betas(betas: Any) -> Tuple[float, float]:
    """``(beta1, beta2)``, each in ``[0, 1)``."""
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"betas={betas!r} is not allowed; it must be a pair (beta1, beta2), each in [0, 1)")
    return (check_number("betas[0]", betas[0], high=1.0), check_number("betas[1]", betas[1], high=1.0))


def check_adam_options(lr: Any, betas: Any, eps: Any, weight_decay: Any) -> None:
    """The options every Adam-like optimizer here takes."""
    check_number("lr", lr)
    check_betas(betas)
    check_number("eps", eps)
    check_number("weight_decay", weight_decay)


def trained(params: Sequence[torch.Tensor], who: str) -> List[torch.Tensor]:
    """The parameters (every group's, in order), refusing sparse, complex and non-float ones."""
    for p in params:
        if not p.is_floating_point() or p.is_complex():
            raise ValueError(f"{who}: parameters must be real floating point tensors, got {p.dtype}")
        if p.is_sparse:
            raise ValueError(f"{who}: sparse parameters are not supported")
    return list(params)


# ---- the process group -----------------------------------------------------------------------
def live(group) -> bool:
    """Whether ``group`` spans more than this process (a process group is started)."""
    return dist.is_available() and dist.is_initialized() and world_of(group) > 1


def dense_mean(flat: torch.Tensor, group, key: str = "dense") -> torch.Tensor:
    """The mean of ``flat`` over ``group``, dense (DDP's bits, counted in telemetry); ``flat``
    itself with one process."""
    if not live(group):
        return flat
    return allreduce(flat, "none", key=key, group=group)


def agree_config(config: Mapping[str, str], group, who: str) -> None:
    """Raise the same ``ValueError`` on every rank unless every rank passed the same
    ``config`` (the training runtime's agreement check)."""
    if not live(group):
        return
    from gradcomp.training import agree

    agree(config, group, f"when {who} started")


def describe_params(params: Sequence[torch.Tensor]) -> str:
    return "; ".join(f"{tuple(p.shape)} {str(p.dtype).replace('torch.', '')}" for p in params)


# ---- whose a checkpoint is -------------------------------------------------------------------
def identity(group, config: str, params: Sequence[torch.Tensor]) -> Dict[str, Any]:
    """Rank, world size, configuration and parameter shapes: a checkpoint belongs to one rank
    of one job."""
    on = dist.is_available() and dist.is_initialized()
    return {"rank": rank_of(group) if on else 0, "world": world_of(group) if on else 1, "config": config,
            "params": describe_params(params)}


def check_identity(saved: Any, mine: Mapping[str, Any], who: str) -> None:
    """``ValueError`` unless ``saved`` (a state_dict's identity) is ``mine``, naming what differs."""
    if not isinstance(saved, Mapping):
        raise ValueError(f"{who}: the state_dict carries no identity; it is not a {who} state_dict")
    if saved.get("world") != mine["world"]:
        raise ValueError(f"{who}: the state_dict was saved on {saved.get('world')} ranks, this run has "
                         f"{mine['world']}; error-feedback residuals belong to one world size")
    if saved.get("rank") != mine["rank"]:
        raise ValueError(f"{who}: the state_dict is rank {saved.get('rank')}'s, loaded on rank {mine['rank']}; "
                         f"every rank saves and loads its own (e.g. ckpt-rank{mine['rank']}.pt)")
    if saved.get("params") != mine["params"]:
        raise ValueError(f"{who}: the state_dict was saved for other parameters ({saved.get('params')!s:.120}); "
                         f"load it into the model it was saved with")
    if saved.get("config") != mine["config"]:
        raise ValueError(f"{who}: the state_dict was saved with another configuration ({saved.get('config')}), "
                         f"this one is ({mine['config']}); resume with the same options")


def run_closure(closure: Optional[Callable[[], Any]]) -> Any:
    """The loss of ``closure`` (None without one), computed with gradients on."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def all_finite(tensors: Sequence[Optional[torch.Tensor]]) -> bool:
    """Whether every tensor is finite (one sync)."""
    from gradcomp.compress.transaction import all_finite as finite

    return finite([t for t in tensors if t is not None])
