"""Checkpoints of a :class:`~gradcomp.sharded.ShardedOptimizer`: per rank, or consolidated.

- **sharded** (``state_dict()``): this rank's inner optimizer state (its shard tensors'),
  its master shards and its error-feedback state, under its identity (rank, world size,
  parameter names and shapes, configuration fingerprint). Loads on the same rank of the same
  world size only; resumes bit-identically.
- **consolidated** (``consolidated_state_dict(to)``): every rank's shard gathered on one rank
  and joined along each group's flat vector: per-element state (moments, 8-bit codes and
  their per-block scales — shards start on block boundaries, so joined blocks are the blocks
  of the whole vector), scalar state (``step``) once, the master vectors, the weights'
  error-feedback residuals joined, and the gradients' residuals as their mean over ranks (a
  rank's residual spans the whole vector but its own shard; the mean is what the average
  gradient still owes). Loads at any world size: each rank cuts its shard out of it, and each
  of the ``w - 1`` senders of a piece takes ``w / (w - 1)`` of the owed mean, so the mass owed
  is kept (on one rank nothing is sent and the gradients' residuals are dropped).

A checkpoint is checked on every rank before anything loads, and every rank raises the same
``ValueError`` when any rank's does not fit (another rank, world size, model or configuration).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from gradcomp.collectives import Identity, check_device_set, fingerprint, refuse_on_every_rank, worker
from gradcomp.collectives.shards import piece_key

from .layout import GroupLayout, bucket_key, parse_weight_key, weight_key
from .lowbit import PackedState, as_packed, is_packed, saved

FORMAT = "gradcomp.sharded/1"


@dataclass(frozen=True)
class ShardView:
    """What a checkpoint reads and writes of one rank's :class:`~gradcomp.sharded.ShardedOptimizer`
    (it builds one per call): the tensors are its own, so loading writes them in place."""

    rank: int
    world: int
    group: Any
    layouts: Sequence[GroupLayout]
    buckets: Sequence[Tuple[int, int, int]]  # (group, start, stop) of each bucket, in key order
    masters: Sequence[torch.Tensor]
    optimizer: torch.optim.Optimizer  # the inner one (LowBitState when state is low-bit)
    grad_feedback: Any  # ErrorFeedback of the gradients' reduce-scatter, or None
    weight_feedback: Any  # ErrorFeedback of the weights' all-gather, or None
    identity: Dict[str, Any]
    skipped: int
    # (group, (start, stop) of this rank's shard, or None for all of it) of each weight all-gather's piece
    weight_pieces: Sequence[Tuple[int, Optional[Tuple[int, int]]]] = ()


def _cpu(tree: Any) -> Any:
    """A deep copy of ``tree`` with its tensors on the CPU (low-bit state as saved dicts)."""
    if isinstance(tree, PackedState):
        return saved(tree.to("cpu"))
    if isinstance(tree, torch.Tensor):
        return tree.detach().cpu().clone()
    if isinstance(tree, dict):
        return {k: _cpu(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_cpu(v) for v in tree)
    return copy.deepcopy(tree)


def shard_state(view: ShardView) -> Dict[str, Any]:
    """This rank's checkpoint (``ShardedOptimizer.state_dict()``)."""
    return {"format": FORMAT, "kind": "sharded", "identity": view.identity,
            "inner": _cpu(view.optimizer.state_dict()), "master": _cpu(view.masters),
            "grad_feedback": None if view.grad_feedback is None else view.grad_feedback.state_dict(),
            "weight_feedback": None if view.weight_feedback is None else view.weight_feedback.state_dict(),
            "buckets": _bucket_plan(view), "skipped": view.skipped}


def _bucket_plan(view: ShardView) -> List[List[int]]:
    """``[group, start, stop]`` of each bucket, in key order: what the residual keys mean."""
    return [list(b) for b in view.buckets]


# ---- consolidated ------------------------------------------------------------------------------
def _grad_residuals(view: ShardView, residual: Any = None,
                    plan: Optional[List[List[int]]] = None) -> Optional[List[torch.Tensor]]:
    """This rank's gradient residuals laid out on each group's flat vector (zeros where none):
    independent of the bucket layout. ``residual``/``plan``: a saved error feedback's
    ``key -> tensor`` and the bucket plan its keys were made with (default: this run's)."""
    ef = view.grad_feedback
    if ef is None:
        return None
    if residual is None:
        residual = ef.residual
    buckets = list(view.buckets) if plan is None else [tuple(b) for b in plan]
    out = [torch.zeros(lay.numel, dtype=torch.float32) for lay in view.layouts]
    for k, (g, start, stop) in enumerate(buckets):
        splits = view.layouts[g].splits(start, stop)
        at = start
        for j, n in enumerate(splits):
            res = residual(piece_key(bucket_key(g, k), j))
            if n and res is not None and res.numel() == n:
                out[g][at:at + n] = res.reshape(-1).float().cpu()
            at += n
    return out


def _grad_pieces(view: ShardView, flat: List[torch.Tensor]) -> Dict[str, torch.Tensor]:
    """The residual of each (bucket, destination) of this run's layout, cut from ``flat``."""
    pieces: Dict[str, torch.Tensor] = {}
    for k, (g, start, stop) in enumerate(view.buckets):
        at = start
        for j, n in enumerate(view.layouts[g].splits(start, stop)):
            if n and j != view.rank:
                pieces[piece_key(bucket_key(g, k), j)] = flat[g][at:at + n]
            at += n
    return pieces


def _weight_residuals(view: ShardView, saved: Optional[Mapping[str, torch.Tensor]] = None
                      ) -> Optional[List[torch.Tensor]]:
    """This rank's weight residuals laid out on each group's master shard (zeros where none):
    independent of how the gathers were cut. ``saved``: a saved error feedback's ``key ->
    tensor`` (default: this run's); each key says where its residual lies
    (``layout.weight_key``)."""
    ef = view.weight_feedback
    if ef is None:
        return None
    if saved is None:
        saved = {weight_key(g, piece): ef.residual(weight_key(g, piece)) for g, piece in view.weight_pieces}
    out = [torch.zeros(m.numel(), dtype=torch.float32) for m in view.masters]
    for key, res in saved.items():
        where = parse_weight_key(str(key))
        if where is None or not isinstance(res, torch.Tensor) or not 0 <= where[0] < len(out):
            continue
        g, piece = where
        a, z = piece if piece is not None else (0, out[g].numel())
        if z > a and z <= out[g].numel() and res.numel() == z - a:
            out[g][a:z] = res.reshape(-1).float().cpu()
    return out


def _weight_pieces(view: ShardView, flat: List[torch.Tensor]) -> Dict[str, torch.Tensor]:
    """The weight residual of each piece this run gathers, cut from ``flat`` (one shard-sized
    tensor per group), in the masters' dtype."""
    pieces: Dict[str, torch.Tensor] = {}
    for g, piece in view.weight_pieces:
        a, z = piece if piece is not None else (0, view.masters[g].numel())
        if z > a:
            pieces[weight_key(g, piece)] = flat[g][a:z].to(view.masters[g].dtype)
    return pieces


def consolidated(view: ShardView, to: int) -> Optional[Dict[str, Any]]:
    if isinstance(to, bool) or not isinstance(to, int) or not 0 <= to < view.world:
        raise ValueError(f"to={to!r} must be a rank of the group (0 .. {view.world - 1})")
    inner = view.optimizer.state_dict()
    mine = {"state": [_cpu(view.optimizer.state.get(m, {})) for m in view.masters], "master": _cpu(view.masters),
            "grad": _grad_residuals(view), "weight": _weight_residuals(view)}
    if view.world == 1:
        parts = [mine]
    else:
        gathered: Optional[List[Any]] = [None] * view.world if view.rank == to else None
        dst = to if view.group is None else dist.get_global_rank(view.group, to)
        check_device_set(view.group, view.masters, "ShardedOptimizer.state_dict")  # NCCL's object collectives
        dist.gather_object(mine, gathered, dst=dst, group=view.group)
        if view.rank != to:
            return None
        assert gathered is not None
        parts = gathered
    ident = {k: v for k, v in view.identity.items() if k != "rank"}
    groups = range(len(view.masters))
    return {"format": FORMAT, "kind": "consolidated", "identity": ident,
            "param_groups": _cpu(inner["param_groups"]), "lowbit": _cpu(inner.get("lowbit")),
            "state": [_join_state([p["state"][g] for p in parts]) for g in groups],
            "master": [torch.cat([p["master"][g] for p in parts]) for g in groups],
            "grad_residual": None if mine["grad"] is None else
            [torch.stack([p["grad"][g] for p in parts]).mean(0) for g in groups],
            "weight_residual": None if mine["weight"] is None else
            [torch.cat([p["weight"][g] for p in parts]) for g in groups],
            "skipped": view.skipped}


def _join_state(states: List[Dict[str, Any]]) -> Dict[str, Any]:
    """One group's state from every rank's shard state, joined along the flat vector."""
    out: Dict[str, Any] = {}
    for key in dict.fromkeys(k for s in states for k in s):
        values = [s[key] for s in states if key in s]
        packed = [v for v in values if is_packed(v)]
        if packed:
            out[key] = PackedState.join([as_packed(v) for v in packed]).to_saved()
        elif isinstance(values[0], torch.Tensor) and values[0].dim() == 1:
            out[key] = torch.cat(values)
        else:
            out[key] = values[0]  # scalar state (step): the same on every rank
    return out


def _cut_state(state: Mapping[str, Any], numel: int, lo: int, hi: int) -> Dict[str, Any]:
    """This rank's ``[lo, hi)`` of a joined group state."""
    out: Dict[str, Any] = {}
    for key, v in state.items():
        if is_packed(v):
            out[key] = as_packed(v).cut(lo, hi).to_saved() if hi > lo else torch.zeros(0)
        elif isinstance(v, torch.Tensor) and v.dim() == 1 and v.numel() == numel:
            out[key] = v[lo:hi].clone()
        else:
            out[key] = copy.deepcopy(v)
    return out


# ---- loading -----------------------------------------------------------------------------------
def _mismatch(view: ShardView, sd: Any) -> str:
    """Why ``sd`` does not load on this rank (one sentence naming the fix), or ``""``."""
    if not isinstance(sd, Mapping) or sd.get("format") != FORMAT or sd.get("kind") not in ("sharded", "consolidated"):
        return ("the state_dict is not a ShardedOptimizer checkpoint of this gradcomp version (format "
                f"{sd.get('format') if isinstance(sd, Mapping) else type(sd).__name__!r}, expected {FORMAT!r})")
    saved, mine = sd.get("identity"), view.identity
    if not isinstance(saved, Mapping) or any(k not in saved for k in ("names", "shapes", "trainable", "config")):
        return "it carries no ShardedOptimizer identity (not a ShardedOptimizer checkpoint); it cannot be checked"
    if saved.get("names") != mine["names"] or saved.get("shapes") != mine["shapes"]:
        diff = [f"{a} {s}" for a, s in zip(saved.get("names") or [], saved.get("shapes") or [])
                if [a, s] not in [list(x) for x in zip(mine["names"], mine["shapes"])]][:3]
        return (f"the checkpoint holds the optimizer of other parameters (e.g. {diff or 'a different count'}); "
                f"load it into the model it was saved with")
    # a consolidated checkpoint loads at any rank and world size
    problem = identity(mine).mismatch(identity(saved), skip=("rank", "world") if sd["kind"] == "consolidated" else (),
                                      fixes=_FIXES)
    if problem:
        return problem
    unreadable = _unreadable_pack(sd)
    if unreadable:
        return unreadable
    if sd["kind"] == "consolidated":
        for g, (state, lay) in enumerate(zip(sd.get("state") or [], view.layouts)):
            lo = lay.shard(view.rank)[0]
            for key, v in (state or {}).items():
                if is_packed(v) and lo < as_packed(v).numel and not as_packed(v).is_boundary(lo):
                    return (f"its low-bit {key!r} of group {g} has a block across element {lo}, where this rank's "
                            f"shard starts; load it at the world size it was saved with and save it again")
    return ""


_FIXES = {"world": "a shard loads only at its own world size: save consolidated_state_dict() to reshard",
          "rank": "every rank loads its own shard (e.g. ckpt-rank{rank}.pt)",
          "config": "resume with the same optimizer class, options, compressor, weight compressor, state_bits and "
                    "stage",
          "frozen parameters": "freeze the same parameters to load it"}


def identity(d: Mapping[str, Any]) -> Identity:
    """The :class:`~gradcomp.collectives.Identity` of a ShardedOptimizer identity dict (what
    ``ShardedOptimizer.identity()`` returns and a checkpoint holds; a consolidated one has no
    rank): the parameters' names and shapes fingerprinted, the frozen ones as a field."""
    frozen = [n for n, t in zip(d["names"], d["trainable"]) if not t]
    return Identity(owner="ShardedOptimizer", rank=d.get("rank", -1), world=d.get("world", -1),
                    config=str(d["config"]), params=fingerprint(repr(list(zip(d["names"], map(list, d["shapes"]))))),
                    fields={"frozen parameters": repr(frozen)})


def _unreadable_pack(sd: Mapping[str, Any]) -> Optional[str]:
    """Why a low-bit pack in ``sd`` cannot be read (an unknown format, a missing field), or
    None: found here, every rank refuses, instead of one rank failing inside its inner load."""
    inner = sd.get("inner")
    states = (inner.get("state") or {}).values() if isinstance(inner, Mapping) else sd.get("state") or []
    for state in states:
        for key, v in (state.items() if isinstance(state, Mapping) else ()):
            if is_packed(v):
                try:
                    as_packed(v)
                except ValueError as exc:
                    return f"its low-bit {key!r} cannot be read ({exc})"
    return None


def load(view: ShardView, sd: Mapping[str, Any]) -> int:
    """Load ``sd`` (either kind) into ``view``'s tensors and optimizers, or raise the same
    ``ValueError`` on every rank; returns the checkpoint's count of skipped steps."""
    # the same ValueError on every rank when any rank's checkpoint does not fit
    refuse_on_every_rank(_mismatch(view, sd), view.group, "ShardedOptimizer.load_state_dict",
                         device=worker.device_of(view.masters))
    if sd["kind"] == "sharded":
        view.optimizer.load_state_dict(sd["inner"])
        for m, saved_master in zip(view.masters, sd["master"]):
            m.copy_(saved_master)
        for ef, saved_ef in ((view.grad_feedback, sd["grad_feedback"]), (view.weight_feedback, sd["weight_feedback"])):
            if ef is not None:
                # whose residuals these are (rank, world size, configuration) is the optimizer's
                # identity, checked on every rank above; the wrapper's own check would refuse on
                # this rank only, after the rest had loaded (and older checkpoints hold it in
                # another form)
                ef.load_state_dict({k: v for k, v in saved_ef.items() if k != "identity"})
        plan = sd.get("buckets")
        if view.grad_feedback is not None and plan is not None and plan != _bucket_plan(view):
            # saved with another bucket_mb: the residual keys name other buckets; re-key them
            state = sd["grad_feedback"]["state"]
            flat = _grad_residuals(view, state.get, plan)
            assert flat is not None
            _set_residuals(view.grad_feedback, _grad_pieces(view, flat))
        if view.weight_feedback is not None:
            # the weights' residual keys say which slice of the shard each holds: re-keyed for the
            # pieces this run gathers (prefetch cuts the gather into pieces; without it, one)
            weights = _weight_residuals(view, sd["weight_feedback"]["state"])
            assert weights is not None
            _set_residuals(view.weight_feedback, _weight_pieces(view, weights))
    else:
        _load_consolidated(view, sd)
    return int(sd["skipped"])


def _load_consolidated(view: ShardView, sd: Mapping[str, Any]) -> None:
    bounds = [lay.shard(view.rank) for lay in view.layouts]
    inner: Dict[str, Any] = {
        "state": {g: _cut_state(s, lay.numel, lo, hi)
                  for g, (s, lay, (lo, hi)) in enumerate(zip(sd["state"], view.layouts, bounds)) if s},
        "param_groups": copy.deepcopy(sd["param_groups"])}
    if sd.get("lowbit") is not None:
        inner["lowbit"] = copy.deepcopy(sd["lowbit"])
    view.optimizer.load_state_dict(inner)
    for m, full, (lo, hi) in zip(view.masters, sd["master"], bounds):
        m.copy_(full[lo:hi])
    if view.weight_feedback is not None:
        _set_residuals(view.weight_feedback, _weight_pieces(view, [full[lo:hi] for full, (lo, hi)
                                                                  in zip(sd["weight_residual"], bounds)]))
    if view.grad_feedback is not None and view.world > 1:
        # what the mean gradient still owes is the mean of the residuals; here w - 1 ranks send
        # each piece (its owner does not), so each holds w / (w - 1) of it
        mean = [r * (view.world / (view.world - 1)) for r in sd["grad_residual"]]
        _set_residuals(view.grad_feedback, _grad_pieces(view, mean))


def _set_residuals(ef: Any, residuals: Mapping[str, torch.Tensor]) -> None:
    """Make ``residuals`` the error-feedback state of ``ef`` (through its own state_dict)."""
    state = ef.state_dict()
    state["state"] = {k: v.clone() for k, v in residuals.items()}
    ef.load_state_dict(state)
