"""``compressor="auto"``: per bucket, the fastest expected exchange, from measurements.

``ddp_comm_hook("auto", model=...)`` and ``CompressedOptimizer(opt, "auto", ...)`` build an
:class:`AutoRuntime`. What it does, per bucket (a bucket is its tuple of parameter names, so a
DDP rebuild of the buckets is a new bucket):

1. **Link.** At the first bucket, a probe of two sizes (one element, ``PROBE_NUMEL``) of dense
   allreduce on the real group gives the per-message latency ``alpha`` and the rate; the
   slowest rank's figures (one MAX allreduce). Every real dense exchange during the trials is
   timed too and the rate is refit from the bandwidth-bound ones (``FIT_MIN_BYTES`` or more,
   and ``FIT_LATENCIES`` latencies or more at the current rate: a small bucket's time is
   latency and overheads, no measure of the rate; ``link=`` injects a fixed :class:`Link`
   instead, and then nothing is refit: decisions depend on codec costs only).
2. **Trials** (``trial_steps`` exchanges of the bucket, default 3): the bucket is exchanged
   *dense* (an exact average: trials never change what training sees), and, once the
   iteration's exchanges are done, each candidate's codec is timed on a copy of the bucket's
   real gradients (its compress, decode, rounds and error-feedback passes; scratch codecs, so
   no live state changes; the least of ``trial_steps`` runs), with its payload bytes. The
   copies are held from the bucket's exchange to the iteration's end, so they are bounded:
   an iteration copies at most ``trial_memory_mb`` (default 25, one default DDP bucket) of
   gradients, in pieces of whole gradients (a gradient larger than that alone); a bucket
   whose pieces do not fit in one iteration stays on trial (dense) until every piece was
   timed, in later iterations. :attr:`AutoRuntime.trial_bytes_peak` is the most held at once.
3. **Decision** (at the start of the next iteration, on every rank alike): every measured input
   of the plan (submission and exchange times, gradient norms, codec times and payload sizes:
   a variable-size candidate such as ``threshold`` sends what each rank's gradients hold, and
   the largest rank's payload sets the wire time) is MAX-reduced over the ranks in ONE
   allreduce, so every rank runs the same deterministic plan on the same numbers: predicted
   time = codec time + rounds * alpha + wire bytes / rate; the worker exchanges buckets one
   after another from the moment each is submitted, so a bucket's exchange hides behind the
   rest of backward and the last ones do not: the plan
   minimises the step's exposed time (last finish minus the last submission), takes a
   compressed method for a bucket only when it beats dense by ``margin``, then gives each
   bucket, earliest first, the most faithful candidate (the candidates' order) that keeps the
   exposed time within ``tolerance`` of the step, and finally falls back to all-dense when
   that is predicted no slower. The decisions are checked with
   :func:`gradcomp.collectives.agree` (the same error on every rank if they ever differ).
4. **Refresh** (every ``recheck_every`` iterations, None: never): the chosen methods' real
   exchange times (timed around each exchange; MAX-reduced) replace a prediction they exceed
   by half, the link is refit, and buckets are decided again; each change is a re-decision.
   ``accordion=True`` adds Accordion's rule (Agarwal et al. 2021): a bucket whose gradient
   norm changed by more than ``accordion_threshold`` (relative) since the last check is in a
   critical regime and takes only light methods (8 or more bits per element) until it calms.

**Accuracy guard.** Biased candidates run with residual error feedback (16-bit casts
excepted, as everywhere in gradcomp); a biased candidate without it is refused. A bucket that
changes method carries each parameter's owed residual over — the error-feedback residual and,
on more than two ranks, scatter-reduce's server residual of its chunk — into the new method's
residual, or into the next gradient when the new method keeps none: no gradient mass is lost.
Adding it to the gradient is part of the iteration's transaction: a skipped iteration (not
finite: the step a loss scaler skips) gives it back, and it goes with the next gradient.

While every bucket is dense (trials, or dense decisions) and no residual waits for the
gradients, the exchange skips the finiteness witnesses of gradcomp's step transaction (a pass
over the gradients): there is no state a skipped step would have to undo, so an all-dense
``"auto"`` costs what DDP's allreduce does.

**Host syncs.** None per tensor on the hot path (a decided bucket's step is a dict lookup and,
for CPU tensors, a clock read around the exchange). Counted in :attr:`AutoRuntime.syncs`:
the probe (one read of the MAX-reduced figures), each decision or check (one read of the
MAX-reduced measurements, plus one object all-gather for the agreement when something
changed), and on CUDA a device synchronize around each timed trial codec and each exchange
timed on a check step (a CUDA exchange is asynchronous; wall time would mean nothing).

What it cannot know: the accuracy of a method on the user's task (it protects it only with
error feedback and the candidates' order), compute that contends with compression on the
same device, and a link that changes between checks.
"""
from __future__ import annotations

import ast
import itertools
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from gradcomp.collectives import agree, choose_algorithm, exchange_bucket, plan_buckets, rank_of, worker
from gradcomp.compress import ErrorFeedback, compressor_class, transaction

from .engine import Runtime
from .policy import DENSE, Policy

log = logging.getLogger("gradcomp.auto")

#: the default candidates, most faithful first (the order breaks ties and guides the accuracy pass)
CANDIDATES = ("dense", "fp16", "bf16", "int8", "powersgd:rank=8", "powersgd:rank=4", "topk", "onebit")
PROBE_NUMEL = 1 << 18  # 1 MiB of fp32: long enough on a fast link, ~0.1 s at 100 Mbit/s
#: a real dense exchange refits the rate only when it sends this many bytes or more...
FIT_MIN_BYTES = 1 << 18
#: ... and would take this many latencies at the current rate (bytes, not latency, set its time)
FIT_LATENCIES = 4
_STATE_VERSION = 1
_POLICY_KEYS = ("start_iter", "min_compression_rate", "min_numel", "compress_1d")


@dataclass(frozen=True)
class Link:
    """A link model: ``alpha_ms`` per message (a small allreduce) and ``rate`` bytes per ms
    that one rank sends."""

    alpha_ms: float
    rate: float  # bytes per millisecond

    def ms(self, sent_bytes: float, messages: int) -> float:
        return messages * self.alpha_ms + sent_bytes / self.rate

    @classmethod
    def of(cls, alpha_ms: float, gbit: float) -> "Link":
        """A link of ``gbit`` Gbit/s with ``alpha_ms`` per message."""
        return cls(float(alpha_ms), gbit * 1e9 / 8 / 1e3)


@dataclass
class Candidate:
    """One method auto may choose: its label, the policy that routes each gradient (dense for
    small and 1-D tensors, as for a fixed compressor), and that policy's codec."""

    label: str
    name: str
    options: Dict[str, Any]
    policy: Optional[Policy]  # None: dense

    @property
    def codec(self) -> Any:
        return None if self.policy is None else self.policy.default.codec

    @property
    def light(self) -> bool:
        """8 or more bits per element (what Accordion's critical regime allows)."""
        base = None if self.codec is None else self.codec.base
        return base is None or (base.fixed_size and base.bits_per_element() >= 8)


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


def parse_candidate(spec: Any) -> Tuple[str, str, Dict[str, Any]]:
    """``(label, name, options)`` from ``"powersgd:rank=4"`` or ``("powersgd", {"rank": 4})``."""
    if isinstance(spec, tuple) and len(spec) == 2 and isinstance(spec[0], str) and isinstance(spec[1], Mapping):
        name, options = spec[0], dict(spec[1])
    elif isinstance(spec, str) and spec.strip():
        name, *pairs = [p.strip() for p in spec.split(":")]
        options = {}
        for pair in pairs:
            if "=" not in pair:
                raise ValueError(f"auto: candidate {spec!r}: option {pair!r} must look like name=value")
            k, v = pair.split("=", 1)
            try:
                options[k.strip()] = ast.literal_eval(v.strip())
            except (ValueError, SyntaxError):
                options[k.strip()] = v.strip()
    else:
        raise ValueError(f"auto: a candidate is a name such as 'topk' or 'powersgd:rank=4', or (name, options); "
                         f"got {spec!r}")
    label = name + "".join(f":{k}={v}" for k, v in sorted(options.items()))
    return label, name, options


class AutoPolicy(Policy):
    """The candidates of ``compressor="auto"`` as one policy: each candidate's codec under its
    label (so the runtime's checkpoint keeps every candidate's residuals and warm starts)."""

    def __init__(self, candidates: Sequence[Any] = CANDIDATES, **settings: Any) -> None:
        unknown = sorted(set(settings) - set(_POLICY_KEYS))
        if unknown:
            raise ValueError(f"compressor='auto': unknown keyword(s) {', '.join(unknown)}; auto takes candidates=, "
                             f"trial_steps=, trial_memory_mb=, verify_steps=, margin=, tolerance=, "
                             f"recheck_every=, accordion=, accordion_threshold=, link= and the policy keywords "
                             f"{', '.join(_POLICY_KEYS)} (layers= and error_feedback= need a fixed compressor)")
        super().__init__("none", **settings)
        if isinstance(candidates, (str, tuple)) and not (isinstance(candidates, tuple) and all(
                isinstance(c, (str, tuple)) for c in candidates)):
            raise ValueError(f"compressor='auto': candidates must be a list of names, got {candidates!r}")
        self.candidates: List[Candidate] = []
        for spec in candidates:
            label, name, options = parse_candidate(spec)
            if any(c.label == label for c in self.candidates):
                raise ValueError(f"compressor='auto': candidate {label!r} is listed twice")
            policy = None if name == DENSE else Policy(name, **options, **settings)
            cand = Candidate(label, name, options, policy)
            codec = cand.codec
            if codec is not None and codec is codec.base and not codec.base.unbiased and not (
                    codec.base.fixed_size and codec.base.bits_per_element() >= 16):
                raise ValueError(f"compressor='auto': candidate {label!r} is biased and runs without error feedback "
                                 f"(it decodes to a scale-free sign); auto takes biased methods only with error "
                                 f"feedback: leave it out of candidates")
            if codec is not None and codec is not codec.base and not isinstance(codec, ErrorFeedback):
                raise ValueError(f"compressor='auto': candidate {label!r} uses {codec.kind} feedback; auto carries "
                                 f"residuals of residual error feedback only")
            self.candidates.append(cand)
        if not any(c.label == DENSE for c in self.candidates):
            raise ValueError("compressor='auto': candidates must include 'dense' (the method auto never loses to)")
        self.by_label = {c.label: c for c in self.candidates}

    def codecs(self) -> Dict[str, Any]:
        return {c.label: c.codec for c in self.candidates if c.codec is not None}

    def describe(self) -> str:
        return "auto(" + ", ".join(f"{c.label}: {'dense' if c.codec is None else repr(c.codec)}"
                                   for c in self.candidates) + ")"


def make_runtime(compressor: Any, options: Mapping[str, Any], group=None,
                 local_size: Optional[int] = None) -> Runtime:
    """The runtime for a ``compressor`` argument: an :class:`AutoRuntime` for ``"auto"`` (its
    keywords in ``options``), else a :class:`Runtime` of ``Policy(compressor, **options)``."""
    if isinstance(compressor, str) and compressor == "auto":
        return AutoRuntime(group, local_size, **options)
    return Runtime(Policy(compressor, **options), group, local_size)


class AutoRuntime(Runtime):
    """The training runtime of ``compressor="auto"`` (see the module docstring)."""

    prepares_ahead = False  # each bucket's exchange is timed or chosen in its job (exchange)

    def __init__(self, group=None, local_size: Optional[int] = None, *, candidates: Sequence[Any] = CANDIDATES,
                 trial_steps: int = 3, trial_memory_mb: float = 25.0, verify_steps: int = 2, margin: float = 0.1,
                 tolerance: float = 0.02, recheck_every: Optional[int] = 200, accordion: bool = False,
                 accordion_threshold: float = 0.5, link: Optional[Link] = None, **settings: Any) -> None:
        if local_size is not None:
            raise ValueError("compressor='auto' does not support local_size (hierarchical exchange) yet; pass a "
                             "fixed compressor with local_size, or drop local_size")
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
                ("link", link, link is None or isinstance(link, Link), "None or a gradcomp.training.auto.Link")):
            if isinstance(value, bool) and key != "accordion" or not ok:
                raise ValueError(f"compressor='auto': {key}={value!r} is not allowed; {key} must be {rule}")
        self._settings_text = (f" trial_steps={trial_steps} trial_memory_mb={trial_memory_mb} "
                               f"verify_steps={verify_steps} margin={margin} tolerance={tolerance} "
                               f"recheck_every={recheck_every} accordion={accordion}:{accordion_threshold}")
        super().__init__(AutoPolicy(candidates, **settings), group, None)
        self.policy: AutoPolicy
        self.label = "auto"
        self.trial_steps, self.margin, self.tolerance = trial_steps, float(margin), float(tolerance)
        self.trial_memory_mb = float(trial_memory_mb)
        self.verify_steps = verify_steps
        self.recheck_every, self.accordion, self.accordion_threshold = recheck_every, accordion, accordion_threshold
        self.link: Optional[Link] = link
        self._fixed_link = link is not None
        self.syncs = 0  # host syncs auto itself made (module docstring)
        self.history: List[Dict[str, Any]] = []  # every decision and re-decision
        self._buckets: Dict[Tuple[str, ...], _Bucket] = {}
        self._order: List[Tuple[str, ...]] = []  # the buckets of the current (or last) iteration, in order
        self._layout: List[Tuple[str, ...]] = []  # the buckets of the last complete iteration, in order
        self._t0 = 0.0
        self._mode: Dict[Tuple[str, ...], str] = {}  # "trial" / "check" / "run", set at submission
        self._carry: Dict[str, torch.Tensor] = {}  # owed residual to add to the next gradient (dense/cast)
        self._scratch: Dict[str, Any] = {}  # codecs that time candidates without touching live state
        self._last_check = 0
        self._all_dense = True  # no decided bucket uses a codec (set at each iteration's start)
        # trial copies to time when the iteration ends: (bucket, piece, gradients, device)
        self._untimed: List[Tuple[_Bucket, int, List[torch.Tensor], torch.device]] = []
        self._copy: Dict[Tuple[str, ...], List[int]] = {}  # pieces to copy, per trial bucket of the iteration
        self._planned = 0  # bytes of the copies planned in this iteration
        self.trial_bytes = 0  # bytes of gradient copies held now for timing candidates
        self.trial_bytes_peak = 0  # the most held at once so far (bounded by trial_memory_mb)

    # ---- configuration ------------------------------------------------------------------
    def _config(self, params=None) -> Dict[str, str]:
        config = super()._config(params)
        config["compressor and policy"] += self._settings_text  # the link is measured, not configured
        return config

    def set_link(self, link: Link) -> None:
        """Use ``link`` from the next decision on (every rank alike); nothing is refit."""
        if not isinstance(link, Link):
            raise ValueError(f"set_link takes a gradcomp.training.auto.Link, got {type(link).__name__}")
        self.link, self._fixed_link = link, True

    # ---- the hot path (submitting thread) -------------------------------------------------
    def route(self, names: Sequence[str], grads: Sequence[torch.Tensor]) -> List[Tuple[str, torch.Tensor, Any]]:
        key = tuple(names)
        first = self._txn is None  # the iteration's first bucket: decide here, no exchange in flight
        if first:
            self._begin(grads)
            # an owed residual added to this iteration's gradients must come back when the
            # iteration is skipped: then its finiteness is observed, as with any codec state
            self._all_dense = not self._carry and all(b.choice in (None, DENSE) for b in self._buckets.values())
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = _Bucket(key)
        if not bucket.meta:  # first seen (or loaded from a checkpoint): the shapes routing needs
            bucket.meta = [torch.empty(g.shape, dtype=g.dtype, device="meta") for g in grads]
            bucket.nbytes = float(sum(g.numel() * g.element_size() for g in grads))
        self._order.append(key)
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
        self._mode[key] = mode
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
        previous, self._order = self._order, []
        self._layout = list(dict.fromkeys(previous))
        if self.world == 1:
            return
        self.start()  # the worker and the agreement first (a framework may start the group late)
        if self.link is None:
            self._probe(worker.device_of(grads))
        due = [k for k, b in ((k, self._buckets[k]) for k in dict.fromkeys(previous))
               if b.choice is None and b.trials >= self.trial_steps and b.dense_ms and b.timed]
        recheck = self._checking_due()
        verify = [k for k in dict.fromkeys(previous) if self.iteration >= (self._buckets[k].verify_at or math.inf)]
        if (due or recheck or verify) and previous:  # nothing seen yet (a resumed run's first bucket): nothing to do
            self._decide(list(dict.fromkeys(previous)), due, recheck, verify, worker.device_of(grads))

    def _checking_due(self) -> bool:
        """The iteration after a check step: its measurements are in."""
        return (self.recheck_every is not None and self.iteration > 1
                and (self.iteration - 1) % self.recheck_every == 0 and self.iteration - 1 != self._last_check
                and any(b.choice is not None for b in self._buckets.values()))

    # ---- inside the bucket's job (worker thread) -----------------------------------------------
    def exchange(self, items: Sequence[Any], group, world: int, buffer: Optional[torch.Tensor],
                 label: str) -> List[torch.Tensor]:
        key = tuple(n for n, _, _ in items)
        mode = self._mode.get(key, "run")
        for name, grad, _ in items:  # owed residual of a method left behind
            if name in self._carry:
                # a change of the iteration's transaction: a skipped iteration gives it back
                transaction.replace(self._carry, name)
                grad.add_(self._carry.pop(name).to(grad.dtype).view(grad.shape))
        grads = [g for _, g, _ in items]
        device = worker.device_of(grads)
        timed = mode != "run" or device.type != "cuda"
        bucket = self._buckets[key]
        for piece in self._copy.pop(key, []) if mode == "trial" else []:
            # held until the iteration ends (end_iteration), so timing them delays no exchange
            copies = [grads[j].detach().clone() for j in bucket.pieces[piece]]
            self._untimed.append((bucket, piece, copies, device))
            self.trial_bytes += sum(c.numel() * c.element_size() for c in copies)
            self.trial_bytes_peak = max(self.trial_bytes_peak, self.trial_bytes)
        if mode != "run" and self.accordion:
            self._buckets[key].norm = torch.linalg.vector_norm(torch.stack(
                [torch.linalg.vector_norm(g.detach().float()) for g in grads]))
        start = self._clock(device) if timed else 0.0
        if self._all_dense:
            # no bucket goes through a codec, so a skipped step has no codec state to undo: the
            # finiteness witnesses (a pass over the gradients) would buy nothing
            out = exchange_bucket(items, group, world, buffer=buffer, label=label, observe=False)
        else:
            out = super().exchange(items, group, world, buffer, label)
        if timed:
            ms = 1e3 * (self._clock(device) - start)
            if mode == "trial":  # the codecs are timed when the iteration ends (end_iteration)
                bucket.dense_ms = (bucket.dense_ms + [ms])[-self.trial_steps:]
            else:
                bucket.runs = (bucket.runs + [ms])[-5:]
        return out

    def end_iteration(self, keep: bool = True) -> bool:
        """As :meth:`Runtime.end_iteration`; then the trial buckets' codecs are timed, once every
        exchange of the iteration is done, so that timing them neither delays a later bucket's
        exchange (nor the other ranks waiting in it) nor the submissions whose times the plan uses."""
        kept = super().end_iteration(keep)
        untimed, self._untimed = self._untimed, []
        while untimed:
            bucket, piece, grads, device = untimed.pop(0)
            names = [bucket.names[j] for j in bucket.pieces[piece]]
            bucket.timings[piece] = self._time_codecs(names, grads, device)
            self.trial_bytes -= sum(g.numel() * g.element_size() for g in grads)
            del grads  # the copy is freed here, before the next piece is timed
        return kept

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
        w = self.world

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
        sent = 2 * (w - 1) / w * 4 * PROBE_NUMEL
        self.link = Link(small, sent / max(big - small, 1e-3))
        self._log(f"link probe: {small:.3f} ms per message, {self.link.rate * 8e3 / 1e9:.3g} Gbit/s "
                  f"(dense allreduce of 4 B and {4 * PROBE_NUMEL} B, slowest rank)")

    # ---- deciding -------------------------------------------------------------------------
    def _decide(self, order: List[Tuple[str, ...]], due: List[Tuple[str, ...]], recheck: bool,
                verify: List[Tuple[str, ...]], device: torch.device) -> None:
        """Every rank: MAX-reduce the measurements (one allreduce), plan, agree, apply."""
        cands = self.policy.candidates
        rows = []
        for k in order:
            b = self._buckets[k]
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
        before = {k: self._buckets[k].choice for k in order}
        if not self._fixed_link:  # real exchanges are believed over the model (the fastest rank's time)
            self._refit(table)
            for k in order:
                b, row = self._buckets[k], table[k]
                if row[1] > 0:
                    b.real[DENSE] = row[1]
                if b.choice is not None and row[2] >= 0:
                    b.real[b.choice] = row[2]
        costs = {k: self._costs(k, table[k]) for k in order}
        for k in order:
            b, row = self._buckets[k], table[k]
            if self.accordion and row[3] >= 0:
                b.critical = b.last_norm is not None and abs(row[3] - b.last_norm) > self.accordion_threshold * max(
                    b.last_norm, 1e-30)
                b.last_norm = row[3]
        open_ = set(due) | ({k for k in order if self._buckets[k].choice is not None} if recheck else set())
        for k in verify:  # a new choice that its real exchanges do not confirm: dense, or another measured one
            b = self._buckets[k]
            b.verify_at = None
            if b.choice is not None and costs[k].get(b.choice, math.inf) > (1 - self.margin / 2) * costs[k][DENSE]:
                b.failed = True
                open_.add(k)
        if recheck:  # buckets that were never timed (a resumed run) keep their choice
            open_ = {k for k in open_ if k in due or self._buckets[k].timed}
        plan = self._plan(order, costs, open_, {k: table[k][0] for k in order})
        changed = {k: c for k, c in plan.items() if c != before[k]}
        if changed:
            agree({"auto decisions": repr(sorted((list(k), c) for k, c in plan.items()))}, self.group,
                  "when compressor='auto' decided", device=device)
            self.syncs += 1
        for k in order:
            b = self._buckets[k]
            b.predicted = costs[k]
            if k in changed:
                self._switch(b, before[k], changed[k])
                if not self._fixed_link and self.verify_steps and b.choice not in b.real:
                    b.verify_at = self.iteration + self.verify_steps
            if k in open_:
                b.runs = []

    def _refit(self, table: Mapping[Tuple[str, ...], List[float]]) -> None:
        """The rate from the real dense exchanges that are bandwidth-bound (every rank the same:
        MAX-reduced times): at least ``FIT_MIN_BYTES`` sent, and a wire time at the current rate
        of at least ``FIT_LATENCIES`` latencies. A small bucket's time is latency and the
        machine's overheads: a rate fit from it is nonsense (a fast link would look like a
        modem's), so without a large bucket the probe's rate stays."""
        assert self.link is not None
        w, link, sent, spent = self.world, self.link, 0.0, 0.0
        floor = max(FIT_MIN_BYTES, FIT_LATENCIES * link.alpha_ms * link.rate)
        for k, row in table.items():
            nbytes = 2 * (w - 1) / w * self._buckets[k].nbytes
            if row[1] > 0 and nbytes >= floor:
                sent += nbytes
                spent += max(row[1] - link.alpha_ms, 1e-3)
        if sent and spent:
            self.link = Link(link.alpha_ms, sent / spent)

    def _costs(self, key: Tuple[str, ...], row: List[float]) -> Dict[str, float]:
        """Predicted ms of each candidate for bucket ``key`` (the dense one measured, when the link
        is measured too)."""
        assert self.link is not None
        w, b, link = self.world, self._buckets[key], self.link
        ring = 2 * (w - 1) / w
        out: Dict[str, float] = {}
        dense_bytes = b.nbytes
        for i, cand in enumerate(self.policy.candidates):
            if cand.label in b.real and not self._fixed_link:
                out[cand.label] = b.real[cand.label]
                continue
            if cand.policy is None:
                out[cand.label] = link.ms(ring * dense_bytes, 1)
                continue
            ms, sent, messages, gathered = row[4 + 4 * i:8 + 4 * i]
            if ms < 0 or gathered < 0:  # not timed (a resumed run): the saved prediction
                if cand.label in b.predicted:
                    out[cand.label] = b.predicted[cand.label]
                continue
            t = ms + link.ms(ring * sent, int(messages))
            if gathered:
                t += link.ms((w - 1) * gathered, 2) if w == 2 else link.ms(ring * gathered, 4)
            out[cand.label] = t
        return out

    def _plan(self, order: List[Tuple[str, ...]], costs: Mapping[Tuple[str, ...], Dict[str, float]],
              open_: set, readies: Mapping[Tuple[str, ...], float]) -> Dict[Tuple[str, ...], Optional[str]]:
        """The choice per bucket: see the module docstring, step 3 (pure: every rank the same)."""
        pref = {c.label: i for i, c in enumerate(self.policy.candidates)}
        ready = [readies[k] for k in order]

        def exposed(choice: Sequence[Optional[str]]) -> float:
            f = 0.0
            for k, r, c in zip(order, ready, choice):
                f = max(f, r) + costs[k].get(c or DENSE, costs[k][DENSE])
            return f - (ready[-1] if ready else 0.0)

        def allowed(k) -> List[str]:
            b = self._buckets[k]
            return [c.label for c in self.policy.candidates if c.label in costs[k] and (not b.critical or c.light)
                    and (not b.failed or c.label in b.real)]

        choice: List[Optional[str]] = []
        for k in order:
            b = self._buckets[k]
            if k not in open_:
                choice.append(b.choice)
                continue
            dense = costs[k][DENSE]
            best = min(allowed(k), key=lambda c: (costs[k][c], pref[c]))
            choice.append(best if costs[k][best] <= (1 - self.margin) * dense else DENSE)
        best_time = exposed(choice)
        slack = self.tolerance * (ready[-1] - ready[0] + best_time) if ready else 0.0
        for i, k in enumerate(order):  # earliest first: they have the most backward to hide behind
            if k not in open_:
                continue
            for c in sorted(allowed(k), key=pref.__getitem__):
                if pref[c] >= pref[choice[i] or DENSE]:
                    break
                trial = choice[:i] + [c] + choice[i + 1:]
                if exposed(trial) <= best_time + slack:
                    choice[i] = c
                    break
        dense_all = [DENSE if k in open_ else self._buckets[k].choice for k in order]
        if exposed(dense_all) <= exposed(choice) * (1 + self.margin) and self.margin:
            choice = dense_all
        return {k: c for k, c in zip(order, choice) if k in open_} | {
            k: self._buckets[k].choice for k in order if k not in open_}

    # ---- changing method ------------------------------------------------------------------
    def _switch(self, bucket: _Bucket, old: Optional[str], new: Optional[str]) -> None:
        """Carry each parameter's owed residual from ``old``'s codec to ``new``'s (or into its next
        gradient), log and record the decision."""
        p = self.policy
        old_c, new_c = p.by_label.get(old) if old else None, p.by_label[new or DENSE]
        moved = 0
        for name, meta in zip(bucket.names, bucket.meta):
            src = None if old_c is None or old_c.policy is None else old_c.policy.route(name, meta, self.iteration)
            dst = None if new_c.policy is None else new_c.policy.route(name, meta, self.iteration)
            if src is dst:
                continue
            owed = self._take(src, name, meta.shape)
            if owed is None:
                continue
            moved += 1
            if isinstance(dst, ErrorFeedback):
                if name in self._carry:
                    owed = owed + self._carry.pop(name).view(owed.shape)
                held = dst.residual(name)
                dst.update(name, owed + held.view(owed.shape) if held.dim() else owed, torch.zeros_like(owed))
            else:
                self._carry[name] = owed if name not in self._carry else self._carry[name] + owed
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

    def _take(self, codec: Any, name: str, shape: torch.Size) -> Optional[torch.Tensor]:
        """Remove and return what ``codec`` owes parameter ``name`` (None when nothing): its
        error feedback's residual and scatter-reduce server residual (``ErrorFeedback.take``)."""
        if not isinstance(codec, ErrorFeedback):
            return None
        owed = codec.take(name)
        return None if owed is None else owed.reshape(shape)

    def owed(self, name: str, shape: Sequence[int]) -> torch.Tensor:
        """What this rank still owes parameter ``name`` (of ``shape``), summed over every
        candidate: what each candidate's error feedback owes it (``ErrorFeedback.owed``: its
        residual and ``w`` times its scatter-reduce server residual of its chunk), and a carry
        waiting for the next gradient; changes nothing. With the averages sent, it closes the
        error-feedback invariant: over the ranks, ``sum(g) == w * sum(averages) + sum(owed)``."""
        total = torch.zeros(math.prod(shape), dtype=torch.float64)
        for codec in self.policy.codecs().values():
            part = codec.owed(name, torch.float64) if isinstance(codec, ErrorFeedback) else None
            if part is not None:
                total += part.reshape(-1).cpu()
        if name in self._carry:
            total += self._carry[name].reshape(-1).double().cpu()
        return total.view(*shape)

    # ---- what it knows --------------------------------------------------------------------
    def describe(self) -> str:
        """One line per bucket: its choice, predicted ms per candidate, measured ms."""
        lines = [f"compressor='auto' over {self.world} ranks; link "
                 + ("not measured yet" if self.link is None else
                    f"{self.link.alpha_ms:.3f} ms/message, {self.link.rate * 8e3 / 1e9:.3g} Gbit/s")
                 + f"; {len(self.history)} decisions; {self.syncs} host syncs"]
        for k in self._current():
            b = self._buckets[k]
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
            c = self._buckets[k].choice or "trial"
            counts[c] = counts.get(c, 0) + 1
        return ", ".join(f"{c} x{n}" for c, n in counts.items())

    def decisions(self) -> Dict[Tuple[str, ...], Optional[str]]:
        """The method chosen per bucket (its parameter names), None while on trial: the buckets
        of the last complete iteration, in its order (a layout replaced by another, such as
        DDP's first one, which it rebuilds after the first iteration, is no longer listed)."""
        return {k: self._buckets[k].choice for k in self._current()}

    def _current(self) -> List[Tuple[str, ...]]:
        """The buckets of the last complete iteration (all known ones before any, e.g. after a
        resume), in order."""
        order = self._order if self._txn is None else self._layout  # an iteration in flight: the last
        return list(dict.fromkeys(order or self._layout)) or list(self._buckets)

    def _log(self, text: str) -> None:
        if rank_of(self.group) == 0:
            log.info("gradcomp auto: %s", text)

    # ---- checkpoints ----------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        state = super().state_dict()
        state["auto"] = {"version": _STATE_VERSION,
                         "buckets": [{"names": list(k), "choice": b.choice, "predicted": dict(b.predicted),
                                      "real": dict(b.real), "failed": b.failed}
                                     for k, b in self._buckets.items() if b.choice],
                         "link": None if self.link is None else [self.link.alpha_ms, self.link.rate],
                         "carry": {n: t.detach().cpu().clone() for n, t in self._carry.items()},
                         "history": [dict(h) for h in self.history]}
        return state

    def _problem(self, state: Any) -> Optional[str]:
        problem = super()._problem(state)
        if problem:
            return problem
        auto = state.get("auto")
        if not isinstance(auto, Mapping) or auto.get("version") != _STATE_VERSION:
            return "it holds no compressor='auto' decisions (saved with a fixed compressor?); resume with the " \
                   "compressor it was saved with"
        unknown = {b.get("choice") for b in auto.get("buckets", [])} - set(self.policy.by_label)
        if unknown:
            return f"its decisions name methods {sorted(map(str, unknown))} that are not candidates here"
        return None

    def load_state_dict(self, state: Mapping[str, Any], what: str = "load_state_dict of the compression state") -> None:
        super().load_state_dict(state, what)
        auto = state["auto"]
        self._buckets = {}
        for b in auto["buckets"]:
            key = tuple(b["names"])
            self._buckets[key] = _Bucket(key, choice=b["choice"], predicted=dict(b["predicted"]),
                                         real=dict(b["real"]), failed=bool(b["failed"]), trials=self.trial_steps)
        self.link = None if auto["link"] is None else Link(*auto["link"]) if not self._fixed_link else self.link
        self._carry = {n: t.clone() for n, t in auto["carry"].items()}
        self.history = [dict(h) for h in auto["history"]]
        self._order, self._layout = [], []
