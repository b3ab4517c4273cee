"""Pipeline schedules: the fixed order of forward and backward passes each rank runs.

A schedule is, for every rank, a list of :class:`Action` ``(kind, vstage, mb)``: ``"F"`` or
``"B"`` of micro-batch ``mb`` on the rank's virtual stage ``vstage`` (a model chunk). With ``p``
ranks and ``v`` virtual stages per rank there are ``p * v`` stages; stage ``s`` lives on rank
``s % p`` as its virtual stage ``s // p`` (``v == 1`` for GPipe and 1F1B). The order of every message follows from
these lists: a forward on stage ``s > 0`` first receives its input from stage ``s - 1``, a
backward on stage ``s < last`` first receives its output's gradient from stage ``s + 1``, and
what a pass produces is sent as soon as it is done. Sends never block a rank's schedule, receives
do; so a schedule runs without deadlock exactly when :func:`simulate` finds an order in which
every receive's message was produced before — checked for every registered schedule in the
tests, over many ``(p, m, v)``. The same run (:func:`timeline`) orders the step's messages for
the transport (:mod:`gradcomp.pipeline.transport`), identically on every rank.

- ``gpipe`` (Huang et al. 2019): all forwards, then all backwards (in micro-batch order, as
  ``torch.distributed.pipelining.ScheduleGPipe``); every stage holds the activations of all
  ``m`` micro-batches.
- ``1f1b`` (PipeDream-flush, Narayanan et al. 2021): rank ``r`` runs ``p - r - 1`` warm-up
  forwards, then alternates one forward and one backward; at most ``p - r`` micro-batches are
  in flight, so stage 0 holds at most ``p`` micro-batches of activations, whatever ``m``.
- ``interleaved`` (Megatron-LM's interleaved 1F1B): ``v >= 2`` virtual stages per rank,
  forwards in groups of ``p`` micro-batches per virtual stage; the bubble shrinks by ``v``
  (``(p - 1) / (v m + p - 1)`` in units of a full stage) at the price of ``v`` times the
  boundary messages. Needs ``m`` to be a multiple of ``p``.
"""
from __future__ import annotations

from typing import Callable, Dict, List, NamedTuple, Sequence, Tuple


class Action(NamedTuple):
    """One pass of one micro-batch on one of a rank's virtual stages."""

    kind: str  # "F" (forward) or "B" (backward)
    vstage: int  # which of the rank's virtual stages, 0 .. v-1 (0 unless interleaved); stage vstage * p + rank
    mb: int  # micro-batch index


Builder = Callable[[int, int, int, int], List[Action]]  # (rank, p, m, v) -> that rank's actions
SCHEDULES: Dict[str, Builder] = {}


def _register(name: str) -> Callable[[Builder], Builder]:
    def deco(fn: Builder) -> Builder:
        if name in SCHEDULES:
            raise ValueError(f"schedule {name!r} is registered twice")
        SCHEDULES[name] = fn
        return fn
    return deco


@_register("gpipe")
def _gpipe(rank: int, p: int, m: int, v: int) -> List[Action]:
    return [Action("F", 0, i) for i in range(m)] + [Action("B", 0, i) for i in range(m)]


@_register("1f1b")
def _one_f_one_b(rank: int, p: int, m: int, v: int) -> List[Action]:
    warm = min(p - rank - 1, m)
    out = [Action("F", 0, i) for i in range(warm)]
    for i in range(m - warm):
        out += [Action("F", 0, warm + i), Action("B", 0, i)]
    return out + [Action("B", 0, i) for i in range(m - warm, m)]


@_register("interleaved")
def _interleaved(rank: int, p: int, m: int, v: int) -> List[Action]:
    total = m * v

    def unit(k: int, forward: bool) -> Tuple[int, int]:
        vstage = (k % (p * v)) // p
        return (vstage if forward else v - 1 - vstage), (k // (p * v)) * p + k % p

    warm = min((p - rank - 1) * 2 + (v - 1) * p, total)
    out = [Action("F", *unit(k, True)) for k in range(warm)]
    for i in range(total - warm):
        out += [Action("F", *unit(warm + i, True)), Action("B", *unit(i, False))]
    return out + [Action("B", *unit(k, False)) for k in range(total - warm, total)]


def check_shape(schedule: str, p: int, m: int, v: int) -> None:
    """``ValueError`` unless ``schedule`` can run ``m`` micro-batches on ``p`` ranks with ``v``
    virtual stages each."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r} is not known; allowed: {', '.join(map(repr, SCHEDULES))}")
    if isinstance(m, bool) or not isinstance(m, int) or m < 1:
        raise ValueError(f"microbatches={m!r} is not allowed; it must be an int >= 1 (micro-batches per step)")
    if schedule == "interleaved":
        if v < 2:
            raise ValueError(f"schedule='interleaved' needs at least 2 virtual stages (model chunks) per rank, got "
                             f"{v}: pass a list of modules per rank, or a balance of {2 * p} (or more, a multiple of "
                             f"{p}) stages")
        if m % p:
            raise ValueError(f"schedule='interleaved' needs microbatches to be a multiple of the {p} pipeline "
                             f"stages, got microbatches={m}")
    elif v != 1:
        raise ValueError(f"schedule={schedule!r} runs one virtual stage (model chunk) per rank, got {v}; use "
                         f"schedule='interleaved' for several")


def build(schedule: str, rank: int, p: int, m: int, v: int = 1) -> List[Action]:
    """Rank ``rank``'s actions under ``schedule`` (see the module docstring)."""
    check_shape(schedule, p, m, v)
    return SCHEDULES[schedule](rank, p, m, v)


class Simulation(NamedTuple):
    """What :func:`simulate` found: the makespan, each rank's busy time, and the peak number of
    micro-batches whose activations each rank holds (forward done, backward not yet)."""

    makespan: float
    busy: List[float]
    peak_in_flight: List[int]

    @property
    def bubble(self) -> float:
        """Idle fraction of the ranks' time: ``1 - mean(busy) / makespan``."""
        return 1.0 - sum(self.busy) / (len(self.busy) * self.makespan)


def timeline(plans: Sequence[Sequence[Action]], p: int, *, forward: float = 1.0,
             backward: float = 2.0) -> Dict[Tuple[str, int, int], float]:
    """When each pass ``(kind, virtual stage, mb)`` of ``plans`` (every rank's actions) ends,
    with the given pass costs and free communication, each receive waiting for its message;
    ``ValueError`` naming the stuck ranks if the plans deadlock. The pipeline's transport
    orders its messages by these times (:mod:`gradcomp.pipeline.transport`)."""
    stages = p * (1 + max((a.vstage for plan in plans for a in plan), default=0))
    done: Dict[Tuple[str, int, int], float] = {}  # (kind, stage, mb) -> finish time
    pos, clock = [0] * p, [0.0] * p
    while any(pos[r] < len(plans[r]) for r in range(p)):
        moved = False
        for r in range(p):
            if pos[r] == len(plans[r]):
                continue
            a = plans[r][pos[r]]
            s = a.vstage * p + r
            if a.kind == "F":
                need = [("F", s - 1, a.mb)] if s > 0 else []
            else:
                need = [("F", s, a.mb)] + ([("B", s + 1, a.mb)] if s < stages - 1 else [])
            if any(n not in done for n in need):
                continue
            start = max([clock[r]] + [done[n] for n in need])
            clock[r] = start + (forward if a.kind == "F" else backward)
            done[(a.kind, s, a.mb)] = clock[r]
            pos[r] += 1
            moved = True
        if not moved:
            stuck = [f"rank {r} at {plans[r][pos[r]]}" for r in range(p) if pos[r] < len(plans[r])]
            raise ValueError(f"the schedule deadlocks on {p} ranks: {', '.join(stuck)}")
    return done


def simulate(schedule: str, p: int, m: int, v: int = 1, *, forward: float = 1.0, backward: float = 2.0) -> Simulation:
    """Run every rank's actions with the given pass costs (per virtual stage) and free communication,
    each receive waiting for its message; ``ValueError`` naming the stuck ranks if the
    schedule deadlocks or is missing a pass."""
    plans = [build(schedule, r, p, m, v) for r in range(p)]
    stages = p * v
    try:
        done = timeline(plans, p, forward=forward, backward=backward)
    except ValueError as exc:
        raise ValueError(f"schedule {schedule!r} deadlocks on {p} ranks, {m} micro-batches: "
                         f"{str(exc).split(': ', 1)[1]}") from None
    busy, peak = [0.0] * p, [0] * p
    for r, plan in enumerate(plans):
        live = 0
        for a in plan:
            busy[r] += forward if a.kind == "F" else backward
            live += 1 if a.kind == "F" else -1
            peak[r] = max(peak[r], live)
    want = {(k, s, i) for k in "FB" for s in range(stages) for i in range(m)}
    if set(done) != want or sum(len(plan) for plan in plans) != len(want):
        raise ValueError(f"schedule {schedule!r} does not run every pass once on {p} ranks, {m} micro-batches")
    return Simulation(max(done.values()), busy, peak)


def ideal_bubble(p: int, m: int, v: int = 1) -> float:
    """The textbook bubble fraction ``(p - 1) / (v m + p - 1)`` (GPipe and 1F1B: ``v = 1``)."""
    return (p - 1) / (v * m + p - 1)
