"""``compressor="auto"``: per bucket, the fastest expected exchange, from measurements.

``ddp_comm_hook("auto", model=...)`` and ``CompressedOptimizer(opt, "auto", ...)`` build an
:class:`AutoRuntime`: a runtime whose strategy is an :class:`AutoStrategy` (``strategy.py``),
which the runtime asks per bucket and per iteration. The parts: ``link.py`` (the link model and
its parser), ``cost.py`` (predicted times: each collective algorithm's own ``wire`` cost on the
link), ``plan.py`` (the plan, a pure function of the measurements), ``router.py`` (owed
residuals moved when a bucket changes method), ``candidates.py``. What it does, per bucket (a
bucket is its tuple of parameter names, so a DDP rebuild of the buckets is a new bucket):

1. **Link.** At the first bucket, a probe of two sizes (one element, ``PROBE_NUMEL``) of dense
   allreduce on the real group gives the per-message latency ``alpha`` and the rate; the
   slowest rank's figures (one MAX allreduce). Every real dense exchange during the trials is
   timed too and the rate is refit from the bandwidth-bound ones (``FIT_MIN_BYTES`` or more,
   and ``FIT_LATENCIES`` latencies or more at the current rate: a small bucket's time is
   latency and overheads, no measure of the rate; ``link=`` injects a fixed :class:`Link`
   (or its text, ``"10gbit,0.05ms"``) instead, and then nothing is refit: decisions depend
   on codec costs only).
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
   time = codec time + messages * alpha + wire bytes / rate, the messages and bytes each
   collective algorithm states (``ALGORITHMS[name].wire``); the worker exchanges buckets one
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
from .candidates import CANDIDATES, AutoPolicy, Candidate, parse_candidate
from .cost import FIT_LATENCIES, FIT_MIN_BYTES, PROBE_NUMEL
from .link import Link, describe_rate, parse_rate
from .plan import Option, PlanBucket, plan
from .router import Router
from .runtime import AutoRuntime, make_runtime
from .strategy import AutoStrategy, log

__all__ = ["make_runtime", "AutoRuntime", "AutoStrategy", "AutoPolicy", "Candidate", "parse_candidate", "CANDIDATES",
           "Link", "parse_rate", "describe_rate", "PROBE_NUMEL", "FIT_MIN_BYTES", "FIT_LATENCIES", "Option",
           "PlanBucket", "plan", "Router", "log"]
