"""``DiLoCo``: train across slow links by exchanging rarely — H local steps, then one
compressed exchange of the pseudo-gradient (DiLoCo, Douillard et al. 2023; Streaming DiLoCo,
Douillard et al. 2025).

Every worker (a process, or a data-parallel group of processes inside one "worker": plain DDP
or FSDP2 on fast links) runs the user's inner optimizer on its own data. Every ``sync_every``
(H) inner steps the *pseudo-gradient* Δ = global − local of the model's parameters is averaged
over the workers (the ``outer_group``, the slow links), compressed with any gradcomp compressor
and error feedback, and the outer optimizer (default: SGD, lr 0.7, Nesterov momentum 0.9) steps
the last global copy with it; the new global copy becomes the parameters (mixed with the local
ones by ``alpha``).

Streaming: with F ``fragments`` the parameters are cut into F pieces and one piece is synced
every H/F inner steps (each piece once every H; piece ``s mod F`` at the s-th committed sync),
its exchange started ``delay`` (τ) inner steps before its sync on gradcomp's worker thread, so
the exchange runs while those inner steps compute. The math is torchft's ``DiLoCo`` where the
settings overlap (checked against it in the tests):

- at sync time minus τ: Δ = backup − local for the fragment, averaged over the outer group;
- at sync time: the outer optimizer steps the backup (the last global copy) with the averaged Δ
  as its gradient; the result is the new backup; the parameters become ``lerp(new global,
  local, alpha)`` (``alpha = 0``: the global copy).

Contracts, as for every gradcomp layer: at construction the parameters are broadcast over the
outer group from its first rank and every rank checks that the others have the same H, F, τ, α,
compressor, outer optimizer settings and parameter layout (the same ``ValueError`` everywhere
otherwise). A non-finite pseudo-gradient on any rank skips that outer step on every rank: the
outer state, the global copy and the error-feedback residuals stay as they were, the parameters
go back to the global copy, ``skipped`` counts it and training goes on. Between syncs nothing
reads the device; at a sync one small all-reduce carries the flags (finite, payloads valid) and
is read once. ``state_dict`` / ``load_state_dict`` hold the inner optimizer, the global copies,
the outer optimizers, the residuals, the counters and an exchange in flight, and resume
bit-identically; another world size or configuration is refused on every rank.
"""
from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from gradcomp.collectives import allreduce, rank_of, world_of
from gradcomp.collectives.identity import Identity, describe_params, fingerprint
from gradcomp.compress import as_codec
from gradcomp.compress.transaction import Transaction
from gradcomp.training.step import StepDecision, Stepping
from gradcomp.training.wrapper import broadcast_params

from . import _common as common

__all__ = ["DiLoCo", "default_outer_optimizer"]


AUTO_CANDIDATES = ("none", "int8", "int4", "int2")
#: auto moves to a smaller codec when the caller waited more than this share of its compute
#: between syncs, and back to a larger one when that one's exchange would still be hidden
WAIT_SHARE = 0.05



def default_outer_optimizer(params: Sequence[torch.Tensor]) -> torch.optim.Optimizer:
    """DiLoCo's outer optimizer: SGD with lr 0.7 and Nesterov momentum 0.9."""
    return torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)


@dataclass
class _Fragment:
    """One piece of the model, synced on its own: its parameters, their global copy (flat per
    dtype) and the outer optimizer that steps it."""

    index: int
    names: List[str]
    params: List[torch.Tensor]
    flats: Dict[torch.dtype, torch.Tensor] = field(default_factory=dict)  # the global copy, per dtype
    views: List[torch.Tensor] = field(default_factory=list)  # per parameter, into its dtype's flat
    spans: List[Tuple[torch.dtype, int, int]] = field(default_factory=list)  # per parameter: dtype, start, stop
    outer: Optional[torch.optim.Optimizer] = None


@dataclass
class _InFlight:
    """A fragment's exchange started ``delay`` steps before its sync."""

    fragment: int
    deltas: Dict[torch.dtype, torch.Tensor]  # what this rank sent (non-finite zeroed)
    bad: torch.Tensor  # 0-d bool: this rank's pseudo-gradient was not finite
    txn: Transaction
    futures: Dict[torch.dtype, Any]
    started: float
    codec: str = "none"  # the codec it was sent with
    done: List[float] = field(default_factory=list)  # when each exchange completed (on the worker)


def _local(p: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds of ``p``: its shard for a DTensor (FSDP2), else ``p``."""
    to_local = getattr(p, "to_local", None)
    return p.detach() if to_local is None else to_local().detach()


def _master_dtype(dtype: torch.dtype) -> torch.dtype:
    """The global copy's dtype: fp32 for 16-bit parameters (the outer steps accumulate there),
    the parameter's own otherwise."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


class DiLoCo(Stepping):
    """Wraps the inner ``optimizer``: ``opt.step()`` is an inner step, and every ``sync_every``
    inner steps one outer step of (a fragment of) the model over ``outer_group``.

    ``outer_optimizer``: a callable ``params -> Optimizer``, called once per fragment with the
    fragment's global copies (default :func:`default_outer_optimizer`). ``compressor``: None
    (dense fp32/fp64 mean) or any gradcomp compressor name or instance; biased ones get error
    feedback (``error_feedback``, as for the other layers; options as ``compressor_options``).
    ``fragments``: an int F (the trained parameters in order, cut into F pieces of near-equal
    size) or a list of submodules (each a fragment; together they must hold every trained
    parameter once). ``delay``: τ, inner steps between the start of a fragment's exchange and its
    sync (0 ≤ τ < sync_every / F). ``alpha``: after a sync the parameters are
    ``lerp(global, local, alpha)``. ``outer_group``: the process group across the slow links (a
    process group, or a ``DeviceMesh`` whose ``"outer"`` dimension (or only dimension) is it;
    default: every rank). With FSDP2 inside a worker each rank exchanges its own shards with its
    peers of the same position in the other workers."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, sync_every: int, *,
                 outer_optimizer: Optional[Callable[[Sequence[torch.Tensor]], torch.optim.Optimizer]] = None,
                 compressor: Any = None, fragments: Any = 1, delay: int = 0, alpha: float = 0.0,
                 outer_group: Any = None, error_feedback: Any = "auto",
                 compressor_options: Optional[Mapping[str, Any]] = None, broadcast: bool = True,
                 auto_candidates: Sequence[Any] = AUTO_CANDIDATES) -> None:
        if not isinstance(model, torch.nn.Module):
            raise ValueError(f"DiLoCo: model must be a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ValueError(f"DiLoCo wraps a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
            raise ValueError(f"DiLoCo: sync_every must be an int >= 1 (inner steps per outer step), got {sync_every!r}")
        if isinstance(delay, bool) or not isinstance(delay, int) or delay < 0:
            raise ValueError(f"DiLoCo: delay must be an int >= 0 (inner steps), got {delay!r}")
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0.0 <= float(alpha) <= 1.0:
            raise ValueError(f"DiLoCo: alpha must be a number in [0, 1], got {alpha!r}")
        self.model, self.optimizer = model, optimizer
        self.sync_every, self.delay, self.alpha = sync_every, delay, float(alpha)
        self.outer_group = _outer_group(outer_group)
        named: List[Tuple[str, torch.Tensor]] = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("DiLoCo: the model has no parameter that requires a gradient")
        common.trained([p for _, p in named], "DiLoCo")
        pieces = _fragments(fragments, model, named)
        if sync_every % len(pieces):
            raise ValueError(f"DiLoCo: sync_every ({sync_every}) must be a multiple of the number of fragments "
                             f"({len(pieces)}): one fragment is synced every sync_every / fragments inner steps")
        self.period = sync_every // len(pieces)  # inner steps between two syncs (of successive fragments)
        if delay >= self.period:
            raise ValueError(f"DiLoCo: delay ({delay}) must be smaller than sync_every / fragments ({self.period}): "
                             f"a fragment's exchange must end before the next one starts")
        self.auto = isinstance(compressor, str) and compressor == "auto"
        if self.auto:
            if compressor_options:
                raise ValueError("DiLoCo: compressor='auto' takes no compressor_options; choose its candidates "
                                 "with auto_candidates")
            names = list(auto_candidates)
            if not names or any(not isinstance(n, str) or n == "auto" for n in names):
                raise ValueError(f"DiLoCo: auto_candidates must be compressor names, least lossy first, got {names!r}")
        else:
            names = [compressor]
        #: the codecs this DiLoCo may send with (one, or auto's ladder, least lossy first); None: dense
        self.codecs: List[Any] = [self._make_codec(c, compressor_options, error_feedback) for c in names]
        self.compressor_name = "auto" if self.auto else _name(self.codecs[0])
        self._codec_config = repr([_name(c) if c is None else repr(getattr(c, "config", c)) for c in self.codecs])
        make_outer = default_outer_optimizer if outer_optimizer is None else outer_optimizer
        if not callable(make_outer):
            raise ValueError("DiLoCo: outer_optimizer must be a callable params -> torch.optim.Optimizer "
                             "(e.g. lambda ps: torch.optim.SGD(ps, lr=0.7, momentum=0.9, nesterov=True))")
        self.rank = rank_of(self.outer_group) if common.is_distributed(self.outer_group) else 0
        self.world = world_of(self.outer_group) if common.is_distributed(self.outer_group) else 1
        self.decision = StepDecision(self.outer_group, "DiLoCo")
        self.fragments = [_Fragment(i, names, params) for i, (names, params) in enumerate(pieces)]
        if broadcast and common.is_distributed(self.outer_group):
            broadcast_params([_local(p) for _, p in named], self.outer_group)
        for frag in self.fragments:
            self._build_global(frag)
            frag.outer = make_outer(frag.views)
            if not isinstance(frag.outer, torch.optim.Optimizer):
                raise ValueError(f"DiLoCo: outer_optimizer returned {type(frag.outer).__name__}, not a torch.optim.Optimizer")
        self.inner_steps = 0  # inner steps taken
        self.local_step = 0  # inner steps since the last sync
        self.syncs = 0  # outer steps kept (the fragment of the next sync is syncs mod F)
        self._flight: Optional[_InFlight] = None
        #: per fragment: the index in :attr:`codecs` of the codec its next exchange uses
        self.choice = [0] * len(self.fragments)
        self._last_sync = time.perf_counter()  # auto's window: the inner steps since the last sync
        #: per sync: fragment, kept, codec, the pseudo-gradient's dense bytes (the wire's are in
        #: gradcomp's telemetry), seconds waited at the sync, seconds the exchange and the sync took
        self.history: List[Dict[str, Any]] = []
        common.agree_config({"configuration": self._config(),
                             "parameters": describe_params([(n, _local(p)) for n, p in named])},
                            self.outer_group, "DiLoCo")

    # ---- the inner optimizer's face ---------------------------------------------------------
    @property
    def param_groups(self) -> List[Dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        return self.optimizer.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """One inner step; then, on schedule, start a fragment's exchange and/or sync it."""
        loss = self.optimizer.step() if closure is None else self.optimizer.step(closure)
        self.inner_steps += 1
        self.local_step += 1
        if self.local_step == self.period - self.delay:
            self._start(self.syncs % len(self.fragments))
        if self.local_step == self.period:
            self._sync()
            self.local_step = 0
        return loss

    def _make_codec(self, compressor: Any, options: Optional[Mapping[str, Any]], error_feedback: Any) -> Any:
        if compressor is None or (isinstance(compressor, str) and compressor == "none"):
            return None
        return as_codec(compressor, options, error_feedback=error_feedback, what="DiLoCo compressor")

    # ---- one outer step ---------------------------------------------------------------------
    def _start(self, index: int) -> None:
        """The fragment's pseudo-gradient (global − local), a non-finite one zeroed and flagged,
        averaged over the outer group on gradcomp's worker; nothing is read on the host."""
        frag = self.fragments[index]
        with torch.no_grad():
            deltas = {dt: torch.empty_like(flat) for dt, flat in frag.flats.items()}
            for p, (dt, a, z) in zip(frag.params, frag.spans):
                torch.sub(frag.flats[dt][a:z], _local(p).reshape(-1).to(dt), out=deltas[dt][a:z])
            bads = [~torch.isfinite(d).all() for d in deltas.values()]
            bad = torch.stack(bads).any() if len(bads) > 1 else bads[0]
            for d in deltas.values():
                d.masked_fill_(bad, 0.0)  # the exchange carries finite values; the flag decides
        self._send(index, deltas, bad)

    def _owed_elsewhere(self, index: int, txn: Transaction, deltas: Dict[torch.dtype, torch.Tensor]) -> None:
        """auto: what the other codecs' error feedback still owes this fragment joins its
        pseudo-gradient (taken inside the exchange's transaction: a skipped step gives it back),
        so a change of codec loses nothing."""
        for j, codec in enumerate(self.codecs):
            if j == self.choice[index] or codec is None or not hasattr(codec, "take"):
                continue
            with txn.active():
                for dt, d in deltas.items():
                    owed = codec.take(_key(index, dt))
                    if owed is not None:
                        d.add_(owed.reshape(-1).to(d.dtype))

    def _sync(self) -> None:
        flight, self._flight = self._flight, None
        assert flight is not None, "a sync always follows its start"
        frag = self.fragments[flight.fragment]
        waited = time.perf_counter()
        try:
            means = {dt: fut.wait() for dt, fut in flight.futures.items()}
        except BaseException:
            flight.txn.rollback()
            raise
        now = time.perf_counter()
        waited, exchange = now - waited, max(flight.done, default=now) - flight.started
        compute, self._last_sync = (now - self._last_sync) - waited, now
        verdict = self.decision.reduce({"nonfinite": flight.bad, "invalid": flight.txn.flagged()},
                                       {"wait": waited, "compute": compute, "exchange": exchange} if self.auto else None,
                                       device=flight.bad.device)
        if self.auto:  # the same sums on every rank: the same choice
            self.choice[flight.fragment] = next_choice(
                self.choice[flight.fragment], [_bits(c) for c in self.codecs], verdict.sums["wait"] / self.world,
                verdict.sums["compute"] / self.world, verdict.sums["exchange"] / self.world, self.delay / self.period)
        problems = flight.txn.problems if verdict["invalid"] else []
        kept = self.decision.settle(verdict.clean, flight.txn)
        with torch.no_grad():
            if kept:
                for view, (dt, a, z) in zip(frag.views, frag.spans):
                    view.grad = means[dt][a:z].view_as(view)
                assert frag.outer is not None
                frag.outer.step()
                frag.outer.zero_grad(set_to_none=True)
                self.syncs += 1
            for p, view in zip(frag.params, frag.views):
                local = _local(p)
                if kept and self.alpha:
                    local.copy_(torch.lerp(view, local.to(view.dtype), self.alpha))
                else:  # the new global copy, or (skipped) the last one
                    local.copy_(view)
        self.history.append({"fragment": flight.fragment, "inner_step": self.inner_steps, "kept": kept,
                             "codec": flight.codec, "exchange_s": exchange,
                             "dense_bytes": sum(d.numel() * d.element_size() for d in flight.deltas.values()),
                             "wait_s": waited, "flight_s": time.perf_counter() - flight.started})
        if problems:
            raise ValueError("DiLoCo: the outer step was skipped on every rank: " + "; ".join(problems))
        if not kept:
            warnings.warn(f"DiLoCo: outer step of fragment {flight.fragment} at inner step {self.inner_steps} "
                          f"skipped on every rank: a pseudo-gradient was not finite on some rank; the parameters "
                          f"went back to the last global copy ({self.skipped} skipped so far: opt.skipped)",
                          RuntimeWarning, stacklevel=3)

    # ---- construction -----------------------------------------------------------------------
    def _build_global(self, frag: _Fragment) -> None:
        sizes: Dict[torch.dtype, int] = {}
        for p in frag.params:
            dt = _master_dtype(p.dtype)
            n = _local(p).numel()
            frag.spans.append((dt, sizes.get(dt, 0), sizes.get(dt, 0) + n))
            sizes[dt] = sizes.get(dt, 0) + n
        device = _local(frag.params[0]).device
        frag.flats = {dt: torch.empty(n, dtype=dt, device=device) for dt, n in sizes.items()}
        with torch.no_grad():
            for p, (dt, a, z) in zip(frag.params, frag.spans):
                frag.flats[dt][a:z].copy_(_local(p).reshape(-1))
        frag.views = [frag.flats[dt][a:z].view(_local(p).shape) for p, (dt, a, z) in zip(frag.params, frag.spans)]

    def _config(self) -> str:
        outer = [{k: v for k, v in g.items() if k != "params"} for f in self.fragments
                 for g in (f.outer.param_groups if f.outer is not None else [])]
        return (f"DiLoCo H={self.sync_every} F={len(self.fragments)} delay={self.delay} alpha={self.alpha} "
                f"compressor={self.compressor_name} {self._codec_config} "
                f"fragments={[f.names for f in self.fragments]} outer={[type(f.outer).__name__ for f in self.fragments]} "
                f"{outer}")

    # ---- checkpoints ------------------------------------------------------------------------
    def _identity(self) -> Identity:
        return Identity(owner="DiLoCo", rank=self.rank, world=self.world, config=fingerprint(self._config()),
                        params=fingerprint(describe_params([(n, _local(p)) for f in self.fragments
                                                            for n, p in zip(f.names, f.params)])))

    def state_dict(self) -> Dict[str, Any]:
        """The inner optimizer's state and DiLoCo's: global copies, outer optimizers, residuals,
        counters, and the exchange in flight (its pseudo-gradient: a resumed run sends it again,
        the same bits). Call it on every rank at the same inner step: with an exchange in flight
        it waits for it and sends it once more after undoing it, so the saved residuals are those
        the exchange started from."""
        flight = self._flight
        if flight is not None:  # undo the exchange (its state is saved as it was before) and redo it
            try:
                for fut in flight.futures.values():
                    fut.wait()
            finally:
                flight.txn.rollback()
        ours: Dict[str, Any] = {
            "identity": self._identity().to_dict(), "inner_steps": self.inner_steps, "local_step": self.local_step,
            "syncs": self.syncs, "skipped": self.skipped,
            "globals": [{str(dt): flat.clone() for dt, flat in f.flats.items()} for f in self.fragments],
            "outer": [f.outer.state_dict() for f in self.fragments if f.outer is not None],
            "codec": [self._codec_state(c) for c in self.codecs], "choice": list(self.choice),
            "in_flight": None if flight is None else {
                "fragment": flight.fragment, "bad": flight.bad.clone(),
                "deltas": {str(dt): d.clone() for dt, d in flight.deltas.items()}},
        }
        if flight is not None:
            self._flight = None
            self._send(flight.fragment, flight.deltas, flight.bad)
        return {"inner": self.optimizer.state_dict(), "diloco": ours}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load :meth:`state_dict` on every rank at the same point (another rank's, world size's,
        model's or configuration's is refused with the same ``ValueError`` on every rank, and
        nothing is loaded); an exchange in flight is sent again."""
        ours = state_dict.get("diloco") if isinstance(state_dict, Mapping) else None
        problem = None if isinstance(ours, Mapping) and "inner" in state_dict else \
            "it holds no DiLoCo state (saved by another optimizer?)"
        saved = ours.get("identity") if isinstance(ours, Mapping) else None
        common.check_identity(problem, self._identity(), saved, self.outer_group if self.world > 1 else None,
                              "DiLoCo", self._config())
        assert isinstance(ours, Mapping)
        if self._flight is not None:  # drop the exchange in flight: its state is replaced
            for fut in self._flight.futures.values():
                fut.wait()
            self._flight.txn.rollback()
            self._flight = None
        self.optimizer.load_state_dict(state_dict["inner"])
        with torch.no_grad():
            for f, flats in zip(self.fragments, ours["globals"]):
                for dt, flat in f.flats.items():
                    flat.copy_(flats[str(dt)])
        for f, outer in zip(self.fragments, ours["outer"]):
            assert f.outer is not None
            f.outer.load_state_dict(outer)
        for codec, state in zip(self.codecs, ours["codec"]):
            self._load_codec_state(codec, state)
        self.choice = [int(c) for c in ours["choice"]]
        self.inner_steps, self.local_step = int(ours["inner_steps"]), int(ours["local_step"])
        self.syncs, self.skipped = int(ours["syncs"]), int(ours["skipped"])
        flight = ours.get("in_flight")
        if flight is not None:
            frag = self.fragments[int(flight["fragment"])]
            deltas = {dt: flight["deltas"][str(dt)].to(flat.device) for dt, flat in frag.flats.items()}
            self._send(frag.index, deltas, flight["bad"].to(next(iter(deltas.values())).device))

    def _send(self, index: int, deltas: Dict[torch.dtype, torch.Tensor], bad: torch.Tensor) -> None:
        """Start averaging a fragment's pseudo-gradient over the outer group on gradcomp's worker;
        the exchange's state changes (residuals) wait in its transaction for the decision."""
        txn = Transaction()
        futures: Dict[torch.dtype, Any] = {}
        if self.auto:
            self._owed_elsewhere(index, txn, deltas)
        codec = self.codecs[self.choice[index]]
        flight = _InFlight(index, deltas, bad, txn, futures, time.perf_counter(), _name(codec))
        with txn.active():
            for dt, d in deltas.items():
                futures[dt] = allreduce(d, "none" if codec is None else codec, key=_key(index, dt),
                                        group=self.outer_group, async_op=True)
                futures[dt].add_done_callback(lambda _f, fl=flight: fl.done.append(time.perf_counter()))
        self._flight = flight

    @staticmethod
    def _codec_state(codec: Any) -> Any:
        """A codec's state (an error-feedback wrapper's holds its server part too)."""
        return None if codec is None or not hasattr(codec, "state_dict") else codec.state_dict()

    @staticmethod
    def _load_codec_state(codec: Any, state: Any) -> None:
        if state is not None and codec is not None:
            codec.load_state_dict(state)

    def __repr__(self) -> str:
        return (f"DiLoCo(H={self.sync_every}, fragments={len(self.fragments)}, delay={self.delay}, alpha={self.alpha}, "
                f"compressor={self.compressor_name}, world={self.world}, syncs={self.syncs}, skipped={self.skipped})")


def next_choice(current: int, bits: Sequence[float], wait: float, compute: float, exchange: float,
                share: float) -> int:
    """auto's next codec for a fragment (an index into ``bits``, the candidates' bits per element,
    least lossy first), a pure function of what the last sync measured (means over the ranks):
    ``wait`` (seconds the caller waited for the exchange), ``compute`` (seconds of inner steps
    since the sync before) and ``exchange`` (seconds from the start of the exchange to its end);
    ``share``: the part of those inner steps the exchange may run beside (delay / steps between
    syncs; 0 without a delay).

    The exchange should be hidden: when the caller waited more than ``WAIT_SHARE`` of its
    compute, the next smaller codec; when the next larger codec's exchange (this one's time
    scaled by its bytes) would take less than half the time it may hide in (``share`` of the
    compute, or ``WAIT_SHARE`` of it without a delay), the larger one."""
    if wait > WAIT_SHARE * compute and current + 1 < len(bits):
        return current + 1
    if current > 0:
        window = compute * share if share > 0 else WAIT_SHARE * compute
        larger = exchange * bits[current - 1] / max(bits[current], 1e-9)
        if larger < 0.5 * window:  # with a margin: timings are noisy
            return current - 1
    return current


def _bits(codec: Any) -> float:
    """Bits per element a codec sends (32 for the dense mean)."""
    base = getattr(codec, "compressor", codec)
    return 32.0 if codec is None else float(base.bits_per_element()) if getattr(base, "fixed_size", False) else 32.0


def _name(codec: Any) -> str:
    return "none" if codec is None else str(getattr(codec, "name", type(codec).__name__))


def _key(index: int, dtype: torch.dtype) -> str:
    """The exchange's key (its error feedback's) for a fragment's flat of one dtype."""
    return f"diloco/{index}/{str(dtype).replace('torch.', '')}"


def _outer_group(group: Any) -> Any:
    """A process group from ``group`` (None, a group, or a DeviceMesh: its "outer" dimension, or
    its only one)."""
    if group is None or not hasattr(group, "get_group"):
        return group
    names = getattr(group, "mesh_dim_names", None) or ()
    if "outer" in names:
        return group.get_group("outer")
    if group.ndim == 1:
        return group.get_group()
    raise ValueError(f"DiLoCo: outer_group is a {group.ndim}-D DeviceMesh without an 'outer' dimension "
                     f"(names {names}); name its dimensions ('outer', 'inner')")


def _fragments(fragments: Any, model: torch.nn.Module,
               named: List[Tuple[str, torch.Tensor]]) -> List[Tuple[List[str], List[torch.Tensor]]]:
    """The fragments, each (names, parameters), covering every trained parameter once."""
    if isinstance(fragments, bool) or not isinstance(fragments, (int, list, tuple)):
        raise ValueError(f"DiLoCo: fragments must be an int or a list of submodules, got {fragments!r}")
    if isinstance(fragments, int):
        if fragments < 1 or fragments > len(named):
            raise ValueError(f"DiLoCo: fragments must be between 1 and the number of trained parameters "
                             f"({len(named)}), got {fragments}")
        n = len(named)
        cum = [0]
        for _, p in named:
            cum.append(cum[-1] + _local(p).numel())
        bounds = [0]
        for k in range(1, fragments):  # the cut nearest k/F of the size, leaving a parameter to each piece
            target = cum[-1] * k / fragments
            bounds.append(min(range(bounds[-1] + 1, n - (fragments - k) + 1), key=lambda j: abs(cum[j] - target)))
        bounds.append(n)
        out = [([nm for nm, _ in named[a:z]], [p for _, p in named[a:z]]) for a, z in zip(bounds, bounds[1:])]
        return out
    by_id = {id(p): n for n, p in named}
    seen: Dict[int, int] = {}
    out = []
    for i, module in enumerate(fragments):
        if not isinstance(module, torch.nn.Module):
            raise ValueError(f"DiLoCo: fragments[{i}] is a {type(module).__name__}, not a submodule of the model")
        params: List[torch.Tensor] = [p for p in module.parameters() if p.requires_grad]
        for p in params:
            if id(p) not in by_id:
                raise ValueError(f"DiLoCo: fragments[{i}] holds a parameter that is not a trained parameter of the model")
            if id(p) in seen:
                raise ValueError(f"DiLoCo: parameter {by_id[id(p)]} is in fragments {seen[id(p)]} and {i}; "
                                 f"each parameter belongs to one fragment")
            seen[id(p)] = i
        if not params:
            raise ValueError(f"DiLoCo: fragments[{i}] has no trained parameter")
        out.append(([by_id[id(p)] for p in params], params))
    missing = [n for n, p in named if id(p) not in seen]
    if missing:
        raise ValueError(f"DiLoCo: trained parameters outside every fragment would never be synced: "
                         f"{', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}; add a fragment holding them")
    return out
