"""``compressor="auto"`` as a runtime strategy: trials, link probe, codec timing, decisions.

The runtime (``gradcomp.training.engine.Runtime``) asks an :class:`AutoStrategy` per bucket
and per iteration (see ``Routing``); the package docstring (``gradcomp.training.auto``) says
what it does. The cost model is ``cost.py``, the plan ``plan.py`` (both pure), the residual
moves ``router.py``; this module measures and keeps the state.
"""
from __future__ import annotations

import itertools
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from gradcomp.collectives import agree, choose_algorithm, exchange_bucket, plan_buckets, rank_of, worker
from gradcomp.compress import compressor_class

from ..engine import Routing, Runtime
from ..policy import DENSE
from . import cost
from .candidates import AutoPolicy, Candidate
from .cost import PROBE_NUMEL
from .link import Link
from .plan import Option, PlanBucket, plan
from .router import Router

log = logging.getLogger("gradcomp.auto")

_STATE_VERSION = 1


@dataclass
class _Bucket:
    """What auto knows about one bucket (its parameter names)."""

    names: Tuple[str, ...]
    meta: List[torch.Tensor] = field(default_factory=list)  # shape and dtype of each gradient (no storage)
    nbytes: float = 0.0  # dense bytes
    trials: int = 0  # trial exchanges submitted
    ready_ms: float = 0.0  # submission time in its iteration, from the iteration's first bucket
    dense_ms: List[float] = field(default_factory=list)  # real dense exchanges (trials)
    # its gradients' indices in pieces whose copies fit trial_memory_mb (a larger gradient alone)
    pieces: List[List[int]] = field(default_factory=list)
    # per timed piece, per candidate: (codec ms, bytes per round, gathered bytes) on this rank
    timings: Dict[int, Dict[str, Tuple[float, List[float], float]]] = field(default_factory=dict)
    choice: Optional[str] = None
    predicted: Dict[str, float] = field(default_factory=dict)  # ms per candidate at the last decision
    runs: List[float] = field(default_factory=list)  # the chosen method's last real exchanges, ms
    real: Dict[str, float] = field(default_factory=dict)  # per method, its real exchange (fastest rank), ms
    verify_at: Optional[int] = None  # the iteration that checks a new choice against its real exchanges
    failed: bool = False  # a choice measured slower than predicted: only measured methods from now on
    norm: Optional[torch.Tensor] = None  # gradient norm at the last trial or check (Accordion)
    last_norm: Optional[float] = None
    critical: bool = False

    @property
    def measured(self) -> Optional[float]:
        return min(self.runs) if self.runs else None

    @property
    def timed(self) -> bool:
        """Whether every piece's codecs were timed."""
        return bool(self.pieces) and len(self.timings) == len(self.pieces)

    def codec(self, label: str) -> Optional[Tuple[float, List[float], float]]:
        """Candidate ``label`` on the whole bucket: codec ms, bytes per round and gathered bytes
        summed over its pieces (None until every piece is timed)."""
        parts = [t.get(label) for t in self.timings.values()] if self.timed else [None]
        if any(p is None for p in parts):
            return None
        done = [p for p in parts if p is not None]
        rounds = [sum(r) for r in itertools.zip_longest(*(p[1] for p in done), fillvalue=0.0)]
        return sum(p[0] for p in done), rounds, sum(p[2] for p in done)


class AutoStrategy(Routing):
    """The strategy of ``compressor="auto"``: see the package docstring. Bound to one runtime
    (:meth:`bind`), whose iteration, ranks and worker it uses."""

    prepares_ahead = False  # each bucket's exchange is timed or chosen in its job (exchange)

    def __init__(self, policy: AutoPolicy, *, trial_steps: int, trial_memory_mb: float, verify_steps: int,
                 margin: float, tolerance: float, recheck_every: Optional[int], accordion: bool,
                 accordion_threshold: float, link: Optional[Link]) -> None:
        self.policy = policy
        self._rt: Optional[Runtime] = None
        self.settings_text = (f" trial_steps={trial_steps} trial_memory_mb={trial_memory_mb} "
                              f"verify_steps={verify_steps} margin={margin} tolerance={tolerance} "
                              f"recheck_every={recheck_every} accordion={accordion}:{accordion_threshold}")
        self.trial_steps, self.margin, self.tolerance = trial_steps, float(margin), float(tolerance)
        self.trial_memory_mb = float(trial_memory_mb)
        self.verify_steps = verify_steps
        self.recheck_every, self.accordion, self.accordion_threshold = recheck_every, accordion, accordion_threshold
        self.link: Optional[Link] = link
        self.fixed_link = link is not None
        self.router = Router(policy)
        self.syncs = 0  # host syncs auto itself made (package docstring)
        self.history: List[Dict[str, Any]] = []  # every decision and re-decision
        self.buckets: Dict[Tuple[str, ...], _Bucket] = {}
        self.order: List[Tuple[str, ...]] = []  # the buckets of the current (or last) iteration, in order
        self.layout: List[Tuple[str, ...]] = []  # the buckets of the last complete iteration, in order
        self._t0 = 0.0
        self.mode: Dict[Tuple[str, ...], str] = {}  # "trial" / "check" / "run", set at submission
        self._scratch: Dict[str, Any] = {}  # codecs that time candidates without touching live state
        self._last_check = 0
        self._all_dense = True  # no decided bucket uses a codec (set at each iteration's start)
        # trial copies to time when the iteration ends: (bucket, piece, gradients, device)
        self.untimed: List[Tuple[_Bucket, int, List[torch.Tensor], torch.device]] = []
        self._copy: Dict[Tuple[str, ...], List[int]] = {}  # pieces to copy, per trial bucket of the iteration
        self._planned = 0  # bytes of the copies planned in this iteration
        self.trial_bytes = 0  # bytes of gradient copies held now for timing candidates
        self.trial_bytes_peak = 0  # the most held at once so far (bounded by trial_memory_mb)

    def bind(self, runtime: Runtime) -> None:
        """Serve ``runtime`` (its iteration, ranks, group and worker)."""
        self._rt = runtime

    @property
    def rt(self) -> Runtime:
        assert self._rt is not None, "AutoStrategy.bind(runtime) first"
        return self._rt

    @property
    def world(self) -> int:
        return self.rt.world

    @property
    def iteration(self) -> int:
        return self.rt.iteration

    @property
    def group(self) -> Any:
        return self.rt.group

    # ---- configuration ------------------------------------------------------------------
    def config(self, config: Dict[str, str]) -> None:
        config["compressor and policy"] += self.settings_text  # the link is measured, not configured

    def set_link(self, link: Link) -> None:
        """Use ``link`` from the next decision on (every rank alike); nothing is refit."""
        if not isinstance(link, Link):
            raise ValueError(f"set_link takes a gradcomp.training.auto.Link, got {type(link).__name__}")
        self.link, self.fixed_link = link, True

    # ---- the hot path (submitting thread) -------------------------------------------------
    def route(self, runtime: Runtime, names: Sequence[str],
              grads: Sequence[torch.Tensor]) -> List[Tuple[str, torch.Tensor, Any]]:
        key = tuple(names)
        first = not runtime.in_iteration  # the iteration's first bucket: decide here, no exchange in flight
        if first:
            self._begin(grads)
            # an owed residual added to this iteration's gradients must come back when the
            # iteration is skipped: then its finiteness is observed, as with any codec state
            self._all_dense = not self.router.carry and all(b.choice in (None, DENSE) for b in self.buckets.values())
        bucket = self.buckets.get(key)
        if bucket is None:
            bucket = self.buckets[key] = _Bucket(key)
        if not bucket.meta:  # first seen (or loaded from a checkpoint): the shapes routing needs
            bucket.meta = [torch.empty(g.shape, dtype=g.dtype, device="meta") for g in grads]
            bucket.nbytes = float(sum(g.numel() * g.element_size() for g in grads))
        self.order.append(key)
        now = time.perf_counter()
        if first:
            self._t0, self._planned, self._copy = now, 0, {}
        bucket.ready_ms = 1e3 * (now - self._t0)
        cand = self.policy.by_label[bucket.choice] if bucket.choice is not None else None
        if self.world == 1:
            mode = "run"
        elif cand is None:
            mode = "trial" if self.iteration >= self.policy.default.start_iter else "run"
            bucket.trials += mode == "trial"
            if mode == "trial" and not bucket.timed:
                self._copy[key] = self._pieces_to_copy(bucket)
        else:
            mode = "check" if bucket.verify_at is not None or self._checking() else "run"
        self.mode[key] = mode
        if cand is None or cand.policy is None:
            return [(n, g, None) for n, g in zip(names, grads)]
        return [(n, g, cand.policy.route(n, g, self.iteration)) for n, g in zip(names, grads)]

    def _pieces_to_copy(self, bucket: _Bucket) -> List[int]:
        """The pieces of ``bucket`` whose gradients this iteration copies to time the candidates
        on: those not timed yet, in order, while the copies held until the iteration ends stay
        within ``trial_memory_mb`` (a piece larger than that, one gradient, only when nothing else
        is held). Decided on the submitting thread, from shapes alone: every rank alike."""
        if not bucket.pieces:
            bucket.pieces = plan_buckets(list(zip(bucket.names, bucket.meta)), self.trial_memory_mb)
        budget, take = self.trial_memory_mb * 2 ** 20, []
        for i, piece in enumerate(bucket.pieces):
            nbytes = sum(bucket.meta[j].numel() * bucket.meta[j].element_size() for j in piece)
            if i not in bucket.timings and (not self._planned or self._planned + nbytes <= budget):
                take.append(i)
                self._planned += nbytes
        return take

    def _checking(self) -> bool:
        return self.recheck_every is not None and self.iteration > 0 and self.iteration % self.recheck_every == 0

    def _begin(self, grads: Sequence[torch.Tensor]) -> None:
        """At an iteration's first bucket: probe the link once, decide what is ready to."""
        previous, self.order = self.order, []
        self.layout = list(dict.fromkeys(previous))
        if self.world == 1:
            return
        self.rt.start()  # the worker and the agreement first (a framework may start the group late)
        if self.link is None:
            self._probe(worker.device_of(grads))
        due = [k for k, b in ((k, self.buckets[k]) for k in dict.fromkeys(previous))
               if b.choice is None and b.trials >= self.trial_steps and b.dense_ms and b.timed]
        recheck = self._checking_due()
        verify = [k for k in dict.fromkeys(previous) if self.iteration >= (self.buckets[k].verify_at or math.inf)]
        if (due or recheck or verify) and previous:  # nothing seen yet (a resumed run's first bucket): nothing to do
            self._decide(list(dict.fromkeys(previous)), due, recheck, verify, worker.device_of(grads))

    def _checking_due(self) -> bool:
        """The iteration after a check step: its measurements are in."""
        return (self.recheck_every is not None and self.iteration > 1
                and (self.iteration - 1) % self.recheck_every == 0 and self.iteration - 1 != self._last_check
                and any(b.choice is not None for b in self.buckets.values()))

    # ---- inside the bucket's job (worker thread) -----------------------------------------------
    def exchange(self, runtime: Runtime, items: Sequence[Any], group, world: int, buffer: Optional[torch.Tensor],
                 label: str, layouts: Dict[Any, Any]) -> List[torch.Tensor]:
        key = tuple(n for n, _, _ in items)
        mode = self.mode.get(key, "run")
        self.router.add_carry(items)
        grads = [g for _, g, _ in items]
        device = worker.device_of(grads)
        timed = mode != "run" or device.type != "cuda"
        bucket = self.buckets[key]
        for piece in self._copy.pop(key, []) if mode == "trial" else []:
            # held until the iteration ends (end_iteration), so timing them delays no exchange
            copies = [grads[j].detach().clone() for j in bucket.pieces[piece]]
            self.untimed.append((bucket, piece, copies, device))
            self.trial_bytes += sum(c.numel() * c.element_size() for c in copies)
            self.trial_bytes_peak = max(self.trial_bytes_peak, self.trial_bytes)
        if mode != "run" and self.accordion:
            self.buckets[key].norm = torch.linalg.vector_norm(torch.stack(
                [torch.linalg.vector_norm(g.detach().float()) for g in grads]))
        start = self._clock(device) if timed else 0.0
        if self._all_dense:
            # no bucket goes through a codec, so a skipped step has no codec state to undo: the
            # finiteness witnesses (a pass over the gradients) would buy nothing
            out = exchange_bucket(items, group, world, buffer=buffer, label=label, observe=False)
        else:
            out = super().exchange(runtime, items, group, world, buffer, label, layouts)
        if timed:
            ms = 1e3 * (self._clock(device) - start)
            if mode == "trial":  # the codecs are timed when the iteration ends (end_iteration)
                bucket.dense_ms = (bucket.dense_ms + [ms])[-self.trial_steps:]
            else:
                bucket.runs = (bucket.runs + [ms])[-5:]
        return out

    def ended(self, runtime: Runtime, kept: bool) -> None:
        """After :meth:`Runtime.end_iteration`: the trial buckets' codecs are timed, once every
        exchange of the iteration is done, so that timing them neither delays a later bucket's
        exchange (nor the other ranks waiting in it) nor the submissions whose times the plan uses."""
        untimed, self.untimed = self.untimed, []
        while untimed:
            bucket, piece, grads, device = untimed.pop(0)
            names = [bucket.names[j] for j in bucket.pieces[piece]]
            bucket.timings[piece] = self._time_codecs(names, grads, device)
            self.trial_bytes -= sum(g.numel() * g.element_size() for g in grads)
            del grads  # the copy is freed here, before the next piece is timed

    def _clock(self, device: torch.device) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            self.syncs += 1
        return time.perf_counter()

    def _time_codecs(self, names: List[str], grads: List[torch.Tensor],
                     device: torch.device) -> Dict[str, Tuple[float, List[float], float]]:
        """Every compressed candidate on gradients ``grads`` (of parameters ``names``; scratch
        codecs): the least codec time of ``trial_steps`` runs, bytes per round and gathered."""
        w, out = self.world, {}
        for cand in self.policy.candidates:
            if cand.policy is None:
                continue
            base = self._scratch.get(cand.label)
            if base is None:
                base = self._scratch[cand.label] = compressor_class(cand.name)(**cand.codec.base.config.as_dict())
            feedback = cand.codec is not cand.codec.base
            gather = choose_algorithm(cand.codec, w)
            # the residuals live across steps: their memory is not part of a step's cost
            residuals = [torch.empty(g.shape, dtype=torch.float32, device=g.device) if feedback else None
                         for g in grads]
            times = []
            for _ in range(self.trial_steps):  # the least: the first run also warms up
                rounds: List[float] = [0.0]
                start = self._clock(device)
                gathered = self._run_codec(cand, base, gather, names, grads, residuals, rounds)
                times.append(1e3 * (self._clock(device) - start))
            out[cand.label] = (min(times), rounds, gathered)
        return out

    def _run_codec(self, cand: Candidate, base: Any, gather: str, names: List[str], grads: List[torch.Tensor],
                   residuals: List[Optional[torch.Tensor]], rounds: List[float]) -> float:
        """One run of candidate ``cand``'s codec (compressor ``base``) on ``grads``: what a
        bucket's exchange computes on this rank. Adds each round's bytes to ``rounds``; returns
        the bytes gathered (allgather and scatter-reduce payloads)."""
        w, gathered, policy = self.world, 0.0, cand.policy
        assert policy is not None  # a compressed candidate
        for name, g, res in zip(names, grads, residuals):
            if policy.route(name, g, self.iteration) is None:
                rounds[0] += g.numel() * g.element_size()
                continue
            if res is not None:  # error feedback: add the residual; update it unless kept in place
                torch.add(g, g, out=res)
                if not cand.codec.keeps_residual_in_place(g):
                    res.sub_(g)
            if base.multi_round:
                gen = base.rounds(g, name)
                sent, r = next(gen), 0
                try:
                    while True:
                        while len(rounds) <= r:
                            rounds.append(0.0)
                        rounds[r] += sent.numel() * sent.element_size()
                        sent, r = gen.send(sent), r + 1
                except StopIteration:
                    pass
            elif base.native:
                payload = base.compress(g, name)
                base.decompress(payload)
                rounds[0] += payload.tensors[0].numel() * payload.tensors[0].element_size()
            else:
                payload = base.compress(g, name)
                for _ in range(w if gather == "allgather" else 2):  # every rank's payload (or both phases') decoded
                    base.decompress(payload)
                if gather == "scatter-reduce":  # the server compresses the average again
                    base.compress(g, name)
                gathered += payload.nbytes
        return gathered

    # ---- measuring the link ---------------------------------------------------------------
    def _probe(self, device: torch.device) -> None:
        """Latency and rate of dense allreduce on the real group, the slowest rank's (one MAX
        allreduce, read once)."""
        def job(twin):
            group = twin(self.group)
            out = []
            for numel in (1, PROBE_NUMEL):
                t = torch.ones(numel, device=device)
                dist.all_reduce(t, group=group)  # warm-up (connections, buffers)
                times = []
                for _ in range(5):
                    start = self._clock(device)
                    dist.all_reduce(t, group=group)
                    times.append(1e3 * (self._clock(device) - start))
                out.append(min(times))  # a busy machine only adds time: the least is the link's
            figures = torch.tensor(out, dtype=torch.float64, device=device)
            dist.all_reduce(figures, op=dist.ReduceOp.MAX, group=group)
            return figures.tolist()

        small, big = worker.submit(job, (self.group,), False, device=device)
        self.syncs += 1
        self.link = cost.probed(small, big, self.world)
        self._log(f"link probe: {small:.3f} ms per message, {self.link.rate * 8e3 / 1e9:.3g} Gbit/s "
                  f"(dense allreduce of 4 B and {4 * PROBE_NUMEL} B, slowest rank)")

    # ---- deciding -------------------------------------------------------------------------
    def _decide(self, order: List[Tuple[str, ...]], due: List[Tuple[str, ...]], recheck: bool,
                verify: List[Tuple[str, ...]], device: torch.device) -> None:
        """Every rank: MAX-reduce the measurements (one allreduce), plan, agree, apply."""
        cands = self.policy.candidates
        rows = []
        for k in order:
            b = self.buckets[k]
            # exchanges as the fastest rank saw them (MAX of the negated): the others also waited for
            # the last rank to arrive; ready times, norms, codec costs and payload sizes as the
            # slowest and largest saw them: every input of the plan is the same on every rank
            row = [b.ready_ms, -min(b.dense_ms) if b.dense_ms else 1.0,
                   -b.measured if b.measured is not None else 1.0,
                   float(b.norm) if b.norm is not None else -1.0]  # a device read folded into this step's sync
            for c in cands:  # candidate: codec ms, bytes over its rounds, messages, gathered bytes
                ms, rounds, gathered = b.codec(c.label) or (-1.0, [], -1.0)
                row += [ms, sum(rounds), float(sum(1 for r in rounds if r)), gathered]
            rows.append(row)
        width = len(rows[0])

        def job(twin):
            t = torch.tensor(rows, dtype=torch.float64, device=device).reshape(-1)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=twin(self.group))
            return t.tolist()

        flat = worker.submit(job, (self.group,), False, device=device)
        self.syncs += 1
        table = {k: flat[i * width:(i + 1) * width] for i, k in enumerate(order)}
        for row in table.values():
            row[1], row[2] = -row[1], -row[2]  # back to times (negative: none)
        if recheck:
            self._last_check = self.iteration - 1
        before = {k: self.buckets[k].choice for k in order}
        if not self.fixed_link:  # real exchanges are believed over the model (the fastest rank's time)
            assert self.link is not None
            fits = ((self.buckets[k].nbytes, row[1]) for k, row in table.items())
            self.link = cost.refit(self.link, fits, self.world)
            for k in order:
                b, row = self.buckets[k], table[k]
                if row[1] > 0:
                    b.real[DENSE] = row[1]
                if b.choice is not None and row[2] >= 0:
                    b.real[b.choice] = row[2]
        assert self.link is not None
        costs = {k: cost.predict(self.link, self.world, cands, self.buckets[k].nbytes, table[k], self.buckets[k].real,
                                 self.buckets[k].predicted, not self.fixed_link) for k in order}
        for k in order:
            b, row = self.buckets[k], table[k]
            if self.accordion and row[3] >= 0:
                b.critical = b.last_norm is not None and abs(row[3] - b.last_norm) > self.accordion_threshold * max(
                    b.last_norm, 1e-30)
                b.last_norm = row[3]
        open_ = set(due) | ({k for k in order if self.buckets[k].choice is not None} if recheck else set())
        for k in verify:  # a new choice that its real exchanges do not confirm: dense, or another measured one
            b = self.buckets[k]
            b.verify_at = None
            if b.choice is not None and costs[k].get(b.choice, math.inf) > (1 - self.margin / 2) * costs[k][DENSE]:
                b.failed = True
                open_.add(k)
        if recheck:  # buckets that were never timed (a resumed run) keep their choice
            open_ = {k for k in open_ if k in due or self.buckets[k].timed}
        views = {k: PlanBucket(table[k][0], costs[k], k in open_, b.choice, b.critical, b.failed, frozenset(b.real))
                 for k, b in ((k, self.buckets[k]) for k in order)}
        chosen = plan(views, [Option(c.label, c.light) for c in cands], self.margin, self.tolerance)
        changed = {k: c for k, c in chosen.items() if c != before[k]}
        if changed:
            agree({"auto decisions": repr(sorted((list(k), c) for k, c in chosen.items()))}, self.group,
                  "when compressor='auto' decided", device=device)
            self.syncs += 1
        for k in order:
            b = self.buckets[k]
            b.predicted = costs[k]
            if k in changed:
                self._switch(b, before[k], changed[k])
                if not self.fixed_link and self.verify_steps and b.choice not in b.real:
                    b.verify_at = self.iteration + self.verify_steps
            if k in open_:
                b.runs = []

    # ---- changing method ------------------------------------------------------------------
    def _switch(self, bucket: _Bucket, old: Optional[str], new: Optional[str]) -> None:
        """Carry each parameter's owed residual from ``old``'s codec to ``new``'s (or into its next
        gradient: ``Router.switch``), log and record the decision."""
        moved = self.router.switch(bucket.names, bucket.meta, self.iteration, old, new)
        entry = {"iteration": self.iteration, "bucket": f"{bucket.names[0]}..{bucket.names[-1]}",
                 "params": len(bucket.names), "from": old, "to": new or DENSE,
                 "predicted_ms": {k: round(v, 3) for k, v in bucket.predicted.items()},
                 "measured_ms": None if bucket.measured is None else round(bucket.measured, 3),
                 "residuals_moved": moved, "reason": "re-decision" if old else "decision"}
        self.history.append(entry)
        bucket.choice = new or DENSE
        pred = bucket.predicted
        self._log(f"iteration {self.iteration}: bucket {entry['bucket']} ({len(bucket.names)} params) "
                  f"{'re-decided ' + str(old) + ' -> ' if old else 'decided '}{bucket.choice}; predicted "
                  + ", ".join(f"{k} {v:.2f} ms" for k, v in sorted(pred.items(), key=lambda kv: kv[1])[:4])
                  + (f"; measured {bucket.measured:.2f} ms" if bucket.measured is not None else ""))

    def owed(self, name: str, shape: Sequence[int]) -> torch.Tensor:
        """What this rank still owes parameter ``name`` (``Router.owed``)."""
        return self.router.owed(name, shape)

    # ---- what it knows --------------------------------------------------------------------
    def describe(self) -> str:
        """One line per bucket: its choice, predicted ms per candidate, measured ms."""
        lines = [f"compressor='auto' over {self.world} ranks; link "
                 + ("not measured yet" if self.link is None else
                    f"{self.link.alpha_ms:.3f} ms/message, {self.link.rate * 8e3 / 1e9:.3g} Gbit/s")
                 + f"; {len(self.history)} decisions; {self.syncs} host syncs"]
        for k in self._current():
            b = self.buckets[k]
            pred = ", ".join(f"{c} {v:.2f}" for c, v in sorted(b.predicted.items(), key=lambda kv: kv[1])[:3])
            lines.append(f"  {k[0]}..{k[-1]} ({len(k)} params): "
                         + (f"{b.choice} (predicted ms: {pred}" + (f"; measured {b.measured:.2f} ms" if
                                                                 b.measured is not None else "") + ")"
                            if b.choice else f"trial {b.trials}/{self.trial_steps}" + (
                                f", candidates timed on {len(b.timings)}/{len(b.pieces)} pieces"
                                if len(b.pieces) > 1 else "")))
        return "\n".join(lines)

    def summary(self) -> str:
        """The choices counted over the current buckets, e.g. ``"dense x2, topk x1"``."""
        counts: Dict[str, int] = {}
        for k in self._current():
            c = self.buckets[k].choice or "trial"
            counts[c] = counts.get(c, 0) + 1
        return ", ".join(f"{c} x{n}" for c, n in counts.items())

    def decisions(self) -> Dict[Tuple[str, ...], Optional[str]]:
        """The method chosen per bucket (its parameter names), None while on trial: the buckets
        of the last complete iteration, in its order (a layout replaced by another, such as
        DDP's first one, which it rebuilds after the first iteration, is no longer listed)."""
        return {k: self.buckets[k].choice for k in self._current()}

    def _current(self) -> List[Tuple[str, ...]]:
        """The buckets of the last complete iteration (all known ones before any, e.g. after a
        resume), in order."""
        order = self.layout if self.rt.in_iteration else self.order  # an iteration in flight: the last
        return list(dict.fromkeys(order or self.layout)) or list(self.buckets)

    def _log(self, text: str) -> None:
        if rank_of(self.group) == 0:
            log.info("gradcomp auto: %s", text)

    # ---- checkpoints ----------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        return {"auto": {"version": _STATE_VERSION,
                         "buckets": [{"names": list(k), "choice": b.choice, "predicted": dict(b.predicted),
                                      "real": dict(b.real), "failed": b.failed}
                                     for k, b in self.buckets.items() if b.choice],
                         "link": None if self.link is None else [self.link.alpha_ms, self.link.rate],
                         "carry": self.router.state_dict(),
                         "history": [dict(h) for h in self.history]}}

    def problem(self, state: Mapping[str, Any]) -> Optional[str]:
        auto = state.get("auto")
        if not isinstance(auto, Mapping) or auto.get("version") != _STATE_VERSION:
            return "it holds no compressor='auto' decisions (saved with a fixed compressor?); resume with the " \
                   "compressor it was saved with"
        unknown = {b.get("choice") for b in auto.get("buckets", [])} - set(self.policy.by_label)
        if unknown:
            return f"its decisions name methods {sorted(map(str, unknown))} that are not candidates here"
        return None

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        auto = state["auto"]
        self.buckets = {}
        for b in auto["buckets"]:
            key = tuple(b["names"])
            self.buckets[key] = _Bucket(key, choice=b["choice"], predicted=dict(b["predicted"]),
                                         real=dict(b["real"]), failed=bool(b["failed"]), trials=self.trial_steps)
        self.link = None if auto["link"] is None else Link(*auto["link"]) if not self.fixed_link else self.link
        self.router.load_state_dict(auto["carry"])
        self.history = [dict(h) for h in auto["history"]]
        self.order, self.layout = [], []
