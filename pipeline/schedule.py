"""Pipeline schedules: the fixed order of passes each rank runs.

A schedule is, for every rank, a list of :class:`Action` ``(kind, vstage, mb)``: a pass of
micro-batch ``mb`` on the rank's virtual stage ``vstage`` (a model chunk). With ``p`` ranks and
``v`` virtual stages per rank there are ``p * v`` stages; stage ``s`` lives on rank ``s % p`` as
its virtual stage ``s // p`` (``v == 1`` but for the interleaved schedule). The kinds of pass
are data, :data:`PASSES`: ``F`` (forward), ``B`` (the whole backward), or the backward in two,
``I`` (the input's gradient, what the stage before waits for) and ``W`` (the weights', any time
after its ``I``); each row says what the pass needs first on its own stage, which message it
waits for and which it sends, whether it takes or frees the micro-batch's activations and
what it costs. The runtime dispatches on it, :func:`simulate` and :func:`check_plan` read
it, so a new schedule is one builder and its rows here. The order of every message follows
from these lists: a pass that waits for ``act`` first receives its input from stage ``s - 1``
(when ``s > 0``), one that waits for ``grad`` its output's gradient from stage ``s + 1`` (when
``s < last``), and what a pass produces is sent as soon as it is done. Sends never block a
rank's schedule, receives do; so a schedule runs without deadlock exactly when :func:`simulate` finds an order in which
every receive's message was produced before — checked for every registered schedule in the
tests, over many ``(p, m, v)``. The same run (:func:`timeline`, with messages that take time
on links that carry one at a time) orders the step's messages for the transport
(:mod:`gradcomp.pipeline.transport`), identically on every rank.

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
- ``zb-h1`` (zero bubble, Qi et al., ICLR 2024, after their handcrafted schedule 1): ``I`` and
  ``W`` instead of ``B``; the ``W`` passes fill the waits for gradients. The order is the one a
  list scheduler finds with unit ``F``, ``I`` and ``W`` and free links (when a rank is free: an
  ``I`` whose gradient arrived, which the stage before waits for; else a forward whose input
  arrived, if memory allows; else its oldest ``W``; on stage 0, whose ``I`` sends nothing, the
  forward before the ``I``). Memory: rank ``r`` holds at most
  ``min(p, p - r + 1)`` micro-batches whose ``W`` has not run, so stage 0 holds ``p`` as in
  1F1B and no rank more (the other ranks one more than in 1F1B, which is what lets the last
  stage defer a ``W``). Bubble in the simulation: ``(p - 1) / (3 m + p - 1)`` on 2 ranks for
  every ``m >= 2`` (the paper's), against 1F1B's ``(p - 1) / (m + p - 1)``; 0.17 against 0.27 on 4 ranks, 8
  micro-batches (the textbook 0.11 needs the paper's hand-placed ``W``; not reached here).
- ``zb-h2`` (the paper's schedule 2): the same list scheduler with more memory, rank ``r``
  holding at most ``2 p - 1 - r`` micro-batches whose ``W`` has not run (stage 0 ``2 p - 1``,
  the paper's bound): the extra warm-up forwards fill the first stages' wait for gradients and
  the deferred ``W`` passes the cool-down. Bubble in the simulation: ``(p - 1) / (3 m + p - 1)``,
  the least any order of unit passes allows (the last stage cannot start before ``p - 1``
  forwards), for every ``m >= p`` (0.11 against ZB-H1's 0.17 and 1F1B's 0.27 on 4 ranks, 8
  micro-batches).
"""
from __future__ import annotations

from functools import lru_cache
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple


class PassKind(NamedTuple):
    """One kind of pass (a row of :data:`PASSES`)."""

    after: Tuple[str, ...]  # passes of the same micro-batch on the same stage that must have run first
    receives: Optional[str]  # the message it waits for: "act" (from stage s - 1) or "grad" (from s + 1)
    sends: Optional[str]  # the message it produces: "act" (to stage s + 1) or "grad" (to s - 1)
    holds: int  # +1: the micro-batch's activations are held from this pass on; -1: freed by it
    cost: Tuple[str, ...]  # which of simulate()'s pass costs it takes ("forward", "input", "weight")
    run: str  # the runtime's handler (Pipeline._pass_<run>)


PASSES: Dict[str, PassKind] = {
    "F": PassKind((), "act", "act", +1, ("forward",), "forward"),
    "B": PassKind(("F",), "grad", "grad", -1, ("input", "weight"), "backward"),
    "I": PassKind(("F",), "grad", "grad", 0, ("input",), "input"),
    "W": PassKind(("I",), None, None, -1, ("weight",), "weight"),
}
BACKWARDS = (("B",), ("I", "W"))  # each micro-batch's backward on each stage: B, or I then W


class Action(NamedTuple):
    """One pass of one micro-batch on one of a rank's virtual stages."""

    kind: str  # a key of PASSES
    vstage: int  # which of the rank's virtual stages, 0 .. v-1 (0 unless interleaved); stage vstage * p + rank
    mb: int  # micro-batch index


Builder = Callable[[int, int, int, int], List[Action]]  # (rank, p, m, v) -> that rank's actions


class Schedule(NamedTuple):
    """A registered schedule: its builder and the shapes it runs."""

    build: Builder
    virtual: bool  # True: v >= 2 virtual stages per rank and m a multiple of p; False: v == 1


SCHEDULES: Dict[str, Schedule] = {}


def _register(name: str, virtual: bool = False) -> Callable[[Builder], Builder]:
    def deco(fn: Builder) -> Builder:
        if name in SCHEDULES:
            raise ValueError(f"schedule {name!r} is registered twice")
        SCHEDULES[name] = Schedule(fn, virtual)
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


@_register("interleaved", virtual=True)
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


@_register("zb-h1")
def _zb_h1(rank: int, p: int, m: int, v: int) -> List[Action]:
    return list(_zero_bubble(p, m, tuple(min(p, p - r + 1) for r in range(p)))[rank])


@_register("zb-h2")
def _zb_h2(rank: int, p: int, m: int, v: int) -> List[Action]:
    return list(_zero_bubble(p, m, tuple(2 * p - 1 - r for r in range(p)))[rank])


@lru_cache(maxsize=64)
def _zero_bubble(p: int, m: int, cap: Tuple[int, ...]) -> Tuple[Tuple[Action, ...], ...]:
    """Every rank's F/I/W order from a list scheduler on unit passes and free links: at each
    time a rank is free it runs its next ``I`` if that gradient has arrived, else its next
    forward if its input has arrived and fewer than ``cap[rank]`` micro-batches await their
    ``W``, else its oldest ``W``; else it waits a unit. Rank 0 runs a forward it may run before
    an ``I``: its ``I`` sends no message, its forward sends the activation stage 1 waits for
    (with free links they cost the same; over a link the activation leaves a pass earlier:
    bench/results/pipeline.md#bubbles). Every pass is in micro-batch order."""
    plans: List[List[Action]] = [[] for _ in range(p)]
    f_done: Dict[Tuple[int, int], int] = {}  # (stage, mb) -> when its forward ended
    i_done: Dict[Tuple[int, int], int] = {}
    nf, ni, nw, free = [0] * p, [0] * p, [0] * p, [0] * p
    t = 0
    while any(nw[r] < m for r in range(p)):
        for r in range(p):
            if free[r] > t:
                continue
            kind = ""
            can_i = ni[r] < nf[r] and (r == p - 1 or i_done.get((r + 1, ni[r]), t + 1) <= t)
            can_f = nf[r] < m and nf[r] - nw[r] < cap[r] and (r == 0 or f_done.get((r - 1, nf[r]), t + 1) <= t)
            if can_i and not (r == 0 and can_f):  # stage 0's I sends nothing; its forward feeds stage 1
                kind, mb = "I", ni[r]
                ni[r] += 1
                i_done[(r, mb)] = t + 1
            elif can_f:
                kind, mb = "F", nf[r]
                nf[r] += 1
                f_done[(r, mb)] = t + 1
            elif nw[r] < ni[r]:
                kind, mb = "W", nw[r]
                nw[r] += 1
            if kind:
                plans[r].append(Action(kind, 0, mb))
                free[r] = t + 1
        t += 1
    return tuple(tuple(plan) for plan in plans)


def check_shape(schedule: str, p: int, m: int, v: int) -> None:
    """``ValueError`` unless ``schedule`` can run ``m`` micro-batches on ``p`` ranks with ``v``
    virtual stages each."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r} is not known; allowed: {', '.join(map(repr, SCHEDULES))}")
    if isinstance(m, bool) or not isinstance(m, int) or m < 1:
        raise ValueError(f"microbatches={m!r} is not allowed; it must be an int >= 1 (micro-batches per step)")
    if SCHEDULES[schedule].virtual:
        if v < 2:
            raise ValueError(f"schedule={schedule!r} needs at least 2 virtual stages (model chunks) per rank, got "
                             f"{v}: pass a list of modules per rank, or a balance of {2 * p} (or more, a multiple of "
                             f"{p}) stages")
        if m % p:
            raise ValueError(f"schedule={schedule!r} needs microbatches to be a multiple of the {p} pipeline "
                             f"stages, got microbatches={m}")
    elif v != 1:
        virtual = [n for n, sc in SCHEDULES.items() if sc.virtual]
        raise ValueError(f"schedule={schedule!r} runs one virtual stage (model chunk) per rank, got {v}; use "
                         f"schedule={virtual[0]!r} for several")


def check_plan(plans: Sequence[Sequence[Action]], p: int, m: int) -> None:
    """``ValueError`` unless every rank's actions are kinds of :data:`PASSES`, run on every
    stage each micro-batch's forward once and its backward once (``B``, or ``I`` then ``W``),
    each pass after the passes its row needs on its own stage, ``W`` in micro-batch order (the
    order the weights' gradients are summed in, as one process does)."""
    for r, plan in enumerate(plans):
        seen: Dict[Tuple[int, int], List[str]] = {}
        for a in plan:
            if a.kind not in PASSES:
                raise ValueError(f"rank {r}: pass kind {a.kind!r} is not one of {', '.join(PASSES)}")
            ran = seen.setdefault((a.vstage, a.mb), [])
            missing = [k for k in PASSES[a.kind].after if k not in ran]
            if missing or a.kind in ran:
                raise ValueError(f"rank {r}: {a} runs {'again' if a.kind in ran else 'before ' + missing[0]}")
            ran.append(a.kind)
        for (c, mb), ran in seen.items():
            if tuple(ran[1:]) not in BACKWARDS or ran[0] != "F":
                raise ValueError(f"rank {r}: virtual stage {c}, micro-batch {mb} runs {ran}; it must run F, then B "
                                 f"or I and W")
        if len(seen) != m * (1 + max((a.vstage for a in plan), default=0)):
            raise ValueError(f"rank {r} does not run every micro-batch")
        for c in {a.vstage for a in plan}:
            order = [a.mb for a in plan if a.vstage == c and PASSES[a.kind].holds < 0]
            if order != sorted(order):
                raise ValueError(f"rank {r}: the weights' gradients of virtual stage {c} are not summed in "
                                 f"micro-batch order ({order})")


def build(schedule: str, rank: int, p: int, m: int, v: int = 1) -> List[Action]:
    """Rank ``rank``'s actions under ``schedule`` (see the module docstring)."""
    check_shape(schedule, p, m, v)
    return SCHEDULES[schedule].build(rank, p, m, v)


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


def pass_costs(forward: float = 1.0, backward: float = 2.0, weight: Optional[float] = None) -> Dict[str, float]:
    """Each kind's cost from a forward's, a whole backward's and its weights' part (default:
    half of it; the input's part is the rest)."""
    parts = {"forward": forward, "weight": backward / 2 if weight is None else weight}
    parts["input"] = backward - parts["weight"]
    return {k: sum(parts[c] for c in kind.cost) for k, kind in PASSES.items()}


def produced(kind: str, s: int, mb: int, stages: int) -> Optional[Tuple[str, int, int]]:
    """The message ``(kind, boundary, mb)`` a pass on stage ``s`` sends, or None."""
    sends = PASSES[kind].sends
    if sends == "act" and s < stages - 1:
        return ("act", s, mb)
    if sends == "grad" and s > 0:
        return ("grad", s - 1, mb)
    return None


def received(kind: str, s: int, mb: int, stages: int) -> Optional[Tuple[str, int, int]]:
    """The message ``("act" | "grad", boundary, mb)`` a pass of ``kind`` on stage ``s`` waits
    for, or None."""
    receives = PASSES[kind].receives
    if receives == "act" and s > 0:
        return ("act", s - 1, mb)
    if receives == "grad" and s < stages - 1:
        return ("grad", s, mb)
    return None


def _needed(kind: str, s: int, mb: int, stages: int) -> List[Tuple[str, int, int]]:
    """What a pass waits for: its own stage's earlier passes ``(kind, s, mb)`` and the message
    it receives (:func:`received`)."""
    out = [(k, s, mb) for k in PASSES[kind].after]
    msg = received(kind, s, mb, stages)
    if msg is not None:
        out.append(msg)
    return out


def timeline(plans: Sequence[Sequence[Action]], p: int, *, forward: float = 1.0,
             backward: float = 2.0, weight: Optional[float] = None,
             message: float = 0.0) -> Dict[Tuple[str, int, int], float]:
    """When each pass ``(kind, stage, mb)`` of ``plans`` (every rank's actions) is done and each
    message ``("act" | "grad", boundary, mb)`` has arrived, with the given pass costs
    (:func:`pass_costs`) and each message taking ``message`` on its link from one rank to
    another, which carries one message at a time (0: free communication), each receive waiting
    for its message; ``ValueError`` naming the stuck ranks if the plans deadlock. The
    pipeline's transport orders its messages by these times, with messages that cost time
    (:mod:`gradcomp.pipeline.transport`)."""
    stages = p * (1 + max((a.vstage for plan in plans for a in plan), default=0))
    cost = pass_costs(forward, backward, weight)
    done: Dict[Tuple[str, int, int], float] = {}
    pos, clock = [0] * p, [0.0] * p
    link: Dict[Tuple[int, int], float] = {}  # (from rank, to rank) -> when its last message arrived
    while any(pos[r] < len(plans[r]) for r in range(p)):
        moved = False
        for r in range(p):
            if pos[r] == len(plans[r]):
                continue
            a = plans[r][pos[r]]
            s = a.vstage * p + r
            need = _needed(a.kind, s, a.mb, stages)
            if any(n not in done for n in need):
                continue
            start = max([clock[r]] + [done[n] for n in need])
            clock[r] = start + cost[a.kind]
            done[(a.kind, s, a.mb)] = clock[r]
            msg = produced(a.kind, s, a.mb, stages)
            if msg is not None:  # a link's messages all come from rank r, in its order: in time order
                to = (s + 1 if msg[0] == "act" else s - 1) % p  # the rank of the stage after or before
                done[msg] = link[(r, to)] = max(clock[r], link.get((r, to), 0.0)) + message
            pos[r] += 1
            moved = True
        if not moved:
            stuck = [f"rank {r} at {plans[r][pos[r]]}" for r in range(p) if pos[r] < len(plans[r])]
            raise ValueError(f"the schedule deadlocks on {p} ranks: {', '.join(stuck)}")
    return done


def simulate(schedule: str, p: int, m: int, v: int = 1, *, forward: float = 1.0, backward: float = 2.0,
             weight: Optional[float] = None) -> Simulation:
    """Run every rank's actions with the given pass costs (per virtual stage; ``weight``: the
    weights' part of ``backward``, half by default) and free communication, each receive
    waiting for its message; ``ValueError`` naming the stuck ranks if the schedule deadlocks,
    or if it is not a complete plan (:func:`check_plan`)."""
    plans = [build(schedule, r, p, m, v) for r in range(p)]
    try:
        check_plan(plans, p, m)
    except ValueError as exc:
        raise ValueError(f"schedule {schedule!r} on {p} ranks, {m} micro-batches: {exc}") from None
    try:
        done = timeline(plans, p, forward=forward, backward=backward, weight=weight)
    except ValueError as exc:
        raise ValueError(f"schedule {schedule!r} deadlocks on {p} ranks, {m} micro-batches: "
                         f"{str(exc).split(': ', 1)[1]}") from None
    cost = pass_costs(forward, backward, weight)
    busy, peak = [0.0] * p, [0] * p
    for r, plan in enumerate(plans):
        live = 0
        for a in plan:
            busy[r] += cost[a.kind]
            live += PASSES[a.kind].holds
            peak[r] = max(peak[r], live)
    return Simulation(max(done.values()), busy, peak)


def ideal_bubble(p: int, m: int, v: int = 1, schedule: str = "1f1b") -> float:
    """The textbook bubble fraction with a backward twice a forward: ``(p - 1) / (v m + p - 1)``
    (GPipe and 1F1B: ``v = 1``); ZB-H1 with the backward's halves equal, ``(p - 1) / (3 m + p - 1)``
    (its bound; :func:`simulate` finds it on 2 ranks, more on more ranks)."""
    if schedule.startswith("zb-"):
        return (p - 1) / (3 * m + p - 1)
    return (p - 1) / (v * m + p - 1)
