"""Resume compression state at another world size without losing gradient mass.

Each rank's state is its own: the hook's or optimizer's ``state_dict`` refuses another world
size. :func:`reshard_states` turns the states of *every* rank of a job (their saved files,
read by each new rank) into one state per rank of a job of another size, keeping what the
training still owes:

- a step applies the mean over ranks of the decoded payloads, so the gradient mass not yet
  applied is the *mean* of the ranks' residuals (DGC's accumulation likewise). Every new rank
  starts from that mean: the new mean is the same tensor, bit for bit up to the rounding of
  one mean;
- scatter-reduce's server-side residuals (three ranks or more) are owed to the mean itself,
  one chunk per rank: they are put together and added to that mean, since the chunk layout
  changes with the world size;
- EF21's local estimates become their mean (the aggregate estimate they average to; the
  server-side residuals go into the aggregate, which they kept short), DGC's velocity and
  signum's momentum their mean (both are linear in the gradients);
- warm starts (PowerSGD's Q), step counters and the iteration are the same on every rank and
  are kept; counters of scatter-reduce's per-chunk keys are dropped (new chunks, new keys).

The hierarchical exchange (``local_size``) keeps each gradient's state on one owner per node;
its states are refused here. Nothing else changes: the new state carries the new rank and
world size in its identity and loads like any other.
"""
from __future__ import annotations

import copy
import re
from typing import Any, Dict, List, Mapping, Sequence

import torch

_SERVER = re.compile(r"^(?P<key>.*)/chunk(?P<j>\d+)/server$")
_CHUNK = re.compile(r"/chunk\d+(/server)?$")


def reshard_states(states: Sequence[Mapping[str, Any]], world_size: int) -> List[Dict[str, Any]]:
    """One compression state per rank of a job of ``world_size`` ranks, from the states of every
    rank of the job that saved them (``states[r]``: rank ``r``'s ``HookState.state_dict()`` or
    the ``"gradcomp"`` entry of its ``CompressedOptimizer.state_dict()``). See the module
    docstring for what is kept and how; ``ValueError`` when the states are not one whole job."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r} must be an int >= 1")
    states = list(states)
    if not states or not all(isinstance(s, Mapping) and isinstance(s.get("identity"), Mapping) for s in states):
        raise ValueError("reshard_states needs the training state_dict of every rank (each with its identity)")
    ids = [s["identity"] for s in states]
    if sorted(i.get("rank") for i in ids) != list(range(len(states))) or any(i.get("world") != len(states) for i in ids):
        raise ValueError(f"reshard_states needs the states of all {ids[0].get('world')} ranks of one job, each once; "
                         f"got ranks {[i.get('rank') for i in ids]}")
    states = sorted(states, key=lambda s: s["identity"]["rank"])
    first = states[0]
    for s in states[1:]:
        for field, value, ref in (("config", s["identity"].get("config"), first["identity"].get("config")),
                                  ("names", s.get("names"), first.get("names"))):
            if value != ref:
                raise ValueError(f"the states differ in their {field}: they are not from one job")
        if s.get("iteration") != first.get("iteration") or set(s["codecs"]) != set(first["codecs"]):
            raise ValueError("the states were saved at different iterations or with other policies: not one job")
    if "owners" in first:
        raise ValueError("states of the hierarchical exchange (local_size) keep each gradient on one owner per node; "
                         "resharding them is not supported: resume on the same nodes")
    merged = dict(first)
    # the server-side residuals (in each codec's state, or beside the codecs in an older state)
    # go into the mean; a new layout starts its own
    merged["codecs"] = {p: _merge_codec([s["codecs"][p] for s in states],
                                        [s.get("servers", {}).get(p) or s["codecs"][p].get("server") for s in states])
                        for p in first["codecs"]}
    merged["servers"] = {}
    out = []
    for r in range(world_size):
        state = copy.deepcopy(merged)
        state["identity"] = {**first["identity"], "rank": r, "world": world_size}
        out.append(_relabel(state, r, world_size))
    return out


def _merge_codec(codecs: List[Mapping[str, Any]], servers: List[Any]) -> Dict[str, Any]:
    first = dict(codecs[0])
    if "kind" not in first:  # a compressor without feedback: its own state only
        return _merge_compressor(codecs)
    merged = dict(first)
    merged.pop("server", None)  # folded into the residuals below
    merged["compressor"] = _merge_compressor([c["compressor"] for c in codecs])
    merged["state"] = _mean([c["state"] for c in codecs])
    if first["kind"] == "ef21":
        merged["aggregate"] = dict(first.get("aggregate", {}))
    if first["kind"] == "dgc":
        merged["velocity"] = _mean([c.get("velocity", {}) for c in codecs])
    owed: Dict[str, List[torch.Tensor]] = {}
    for server in servers:
        for key, chunk in (server or {}).get("state", {}).items():
            m = _SERVER.match(key)
            if m is None:
                raise ValueError(f"unexpected server-side key {key!r}")
            owed.setdefault(m["key"], []).append((int(m["j"]), chunk))
    # owed to the mean: added to what every rank sends next (residual, accumulation), or for
    # EF21 to the aggregate estimate the mean is read from, which the server kept short by it
    target = merged["aggregate"] if first["kind"] == "ef21" else merged["state"]
    for key, chunks in owed.items():
        whole = torch.cat([c.reshape(-1) for _, c in sorted(chunks, key=lambda jc: jc[0])])
        res = target.get(key)
        if res is None or res.numel() != whole.numel():
            raise ValueError(f"the server-side residuals of {key!r} do not cover its state")
        target[key] = res + whole.to(res.dtype).reshape(res.shape)
    return merged


def _merge_compressor(states: List[Mapping[str, Any]]) -> Dict[str, Any]:
    first = dict(states[0])
    first["steps"] = {k: v for k, v in first.get("steps", {}).items() if not _CHUNK.search(k)}
    if "momentum" in first:  # signum
        first["momentum"] = _mean([s["momentum"] for s in states])
    return first


def _mean(per_rank: List[Mapping[str, torch.Tensor]]) -> Dict[str, torch.Tensor]:
    keys = set(per_rank[0])
    if any(set(p) != keys for p in per_rank):
        raise ValueError("the ranks' states hold different keys: not one job")
    out = {}
    for k in per_rank[0]:
        stack = torch.stack([p[k].to(torch.float64) for p in per_rank])
        out[k] = stack.mean(0).to(per_rank[0][k].dtype)
    return out


def _relabel(state: Dict[str, Any], rank: int, world: int) -> Dict[str, Any]:
    """The identity of every error-feedback state inside, for this rank and world size."""
    for codec in state["codecs"].values():
        if isinstance(codec.get("identity"), Mapping):
            codec["identity"] = {**codec["identity"], "rank": rank, "world": world}
    return state
