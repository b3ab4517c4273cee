"""``compressor="auto"``'s cost model: predicted milliseconds per candidate, from measurements.

Pure functions (no ranks, no clocks): every rank runs them on the same MAX-reduced numbers.
The wire part of every prediction is the collective algorithm's own statement of its cost
(``ALGORITHMS[name].wire``: bytes one rank sends and messages it waits for, a
``gradcomp.collectives.Cost``) on the :class:`~gradcomp.training.auto.link.Link`.
"""
from __future__ import annotations

from typing import Dict, Iterable, Mapping, Sequence, Tuple

from gradcomp.collectives import ALGORITHMS, Cost, choose_algorithm
from gradcomp.collectives.rounds import Rounds

from .candidates import Candidate
from .link import Link

__all__ = ["PROBE_NUMEL", "FIT_MIN_BYTES", "FIT_LATENCIES", "dense", "probed", "refit", "predict", "ROW"]

PROBE_NUMEL = 1 << 18  # 1 MiB of fp32: long enough on a fast link, ~0.1 s at 100 Mbit/s
#: a real dense exchange refits the rate only when it sends this many bytes or more...
FIT_MIN_BYTES = 1 << 18
#: ... and would take this many latencies at the current rate (bytes, not latency, set its time)
FIT_LATENCIES = 4
#: a bucket's measurements, per candidate, after its four leading figures (ready ms, dense ms,
#: the chosen method's ms, gradient norm): codec ms, bytes over its rounds, rounds, gathered bytes
ROW = 4


def dense(nbytes: float, world: int) -> Cost:
    """A dense bucket of ``nbytes``: one allreduce of itself (``native``'s cost)."""
    return ALGORITHMS["native"].wire(nbytes, world)


def probed(small_ms: float, big_ms: float, world: int) -> Link:
    """The link from the probe: dense allreduces of one element (``small_ms``: the latency) and
    of ``PROBE_NUMEL`` fp32 elements (``big_ms``)."""
    sent = dense(4 * PROBE_NUMEL, world).sent
    return Link(small_ms, sent / max(big_ms - small_ms, 1e-3))


def refit(link: Link, exchanges: Iterable[Tuple[float, float]], world: int) -> Link:
    """The rate from real dense exchanges, ``(dense bytes of the bucket, ms)`` each (ms <= 0:
    none), that are bandwidth-bound: at least ``FIT_MIN_BYTES`` sent, and a wire time at the
    current rate of at least ``FIT_LATENCIES`` latencies. A small bucket's time is latency and
    the machine's overheads: a rate fit from it is nonsense (a fast link would look like a
    modem's), so without a large bucket ``link`` stays."""
    sent, spent = 0.0, 0.0
    floor = max(FIT_MIN_BYTES, FIT_LATENCIES * link.alpha_ms * link.rate)
    for nbytes, ms in exchanges:
        wire = dense(nbytes, world).sent
        if ms > 0 and wire >= floor:
            sent += wire
            spent += max(ms - link.alpha_ms, 1e-3)
    return Link(link.alpha_ms, sent / spent) if sent and spent else link


def predict(link: Link, world: int, candidates: Sequence[Candidate], dense_bytes: float, row: Sequence[float],
            real: Mapping[str, float], saved: Mapping[str, float], use_real: bool) -> Dict[str, float]:
    """Predicted ms of each candidate for one bucket of ``dense_bytes``: its codec time plus
    the wire of its rounds (dense, native and multi-round payloads: an allreduce per round)
    and of its gathered payloads (the algorithm the codec takes on ``world`` ranks). ``row``:
    the bucket's MAX-reduced measurements (:data:`ROW`); ``real``: exchanges really measured
    per method, believed over the model when ``use_real`` (a measured link); ``saved``: the
    last predictions, kept for a candidate never timed (a resumed run)."""
    out: Dict[str, float] = {}
    for i, cand in enumerate(candidates):
        if cand.label in real and use_real:
            out[cand.label] = real[cand.label]
            continue
        if cand.policy is None:
            out[cand.label] = dense(dense_bytes, world).ms(link)
            continue
        ms, sent, messages, gathered = row[ROW + 4 * i:ROW + 4 + 4 * i]
        if ms < 0 or gathered < 0:  # not timed (a resumed run): the saved prediction
            if cand.label in saved:
                out[cand.label] = saved[cand.label]
            continue
        t = ms + Rounds.wire(sent, world, rounds=int(messages)).ms(link)
        if gathered:
            t += ALGORITHMS[choose_algorithm(cand.codec, world)].wire(gathered, world).ms(link)
        out[cand.label] = t
    return out

