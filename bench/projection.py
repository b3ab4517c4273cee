"""The link model: what a measured run says about links this machine does not have.

A collective's time splits into what does not depend on the link (compressing, decoding,
summing, the ranks' own overhead) and the wire: the bytes each rank sends, at the link's rate.
From one run, on loopback or an emulated link, the model keeps the first part as measured and
replaces the second::

    compute = collective time - bytes * 8 / (rate of the run's link * efficiency)
    projected(R) = compute + bytes * 8 / (R * efficiency)

so what the link does not set -- compressing, decoding, summing, and the latency of each
message (PowerSGD's rounds, the header exchanges) -- carries over as measured.

``bytes`` is the most any rank sent in one call, counted by the collectives (the pattern of
each algorithm is in it: a ring allreduce sends ``2 (w - 1) / w`` of the tensor, allgather
``w - 1`` payloads, scatter-reduce two partial payloads, PowerSGD its rounds of ``P`` and
``Q``). ``efficiency`` is the share of the nominal rate that TCP over the emulated link
delivers to a large transfer (headers, the shaper's bursts): measured from the dense row of an
emulated run, and ``EFFICIENCY`` otherwise (bench/results/collectives.md, "The link model
against emulated links", where the model is checked against emulated runs). On a loopback run the "wire" is memory copies through the
kernel's TCP stack; they are taken out at the rate the run's own dense allreduce shows. Where it breaks down: latency measured on one link is kept
on every other (a real network's round trip differs from the emulated one's), links whose
rate the ranks cannot fill (a slow CPU compressing at under the link rate is in
``compute`` and projects correctly; a NIC or switch that cannot take ``w`` full-duplex
streams is not modelled), and overlap with backward computation (a DDP step hides part of the
wire time; the model is the collective alone).

The **limit** of a method on a link is a lower bound on this machine: its wire time plus one
pass over the gradient at the memory bandwidth measured here (reading and writing the fp32
gradient once, what the cheapest compressor must at least do). ``% of limit`` says how far the
method is from it.

A method's **break-even** link rate is the rate below which it beats dense in this model: it
takes ``dense bytes - its bytes`` off the wire and costs ``its compute - dense's compute``, so

    break-even = (dense bytes - its bytes) * 8 / (efficiency * (its compute - dense compute))

("every rate" when it computes no more than dense and sends less; "none" when it sends no
fewer bytes). Each projected time and break-even also has the spread of the measured calls'
middle half (``bench/spread.py``); methods whose projected middle halves overlap at a rate are
a tie there, and the summary says so instead of naming a winner.

``compressor="auto"`` is measured but not projected: it decides from the link it measures, so
what it chose on this run's link says nothing about another link, where it would choose again.
"""
from __future__ import annotations

import math
import statistics
import textwrap
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from . import spread

EFFICIENCY = 0.94  # TCP payload rate over a tbf-shaped link, as a share of its nominal rate (bench/results/collectives.md)
DEFAULT_LINKS = "1gbit,10gbit,25gbit,100gbit"


def parse_links(text: str) -> List[int]:
    """``"1gbit,10gbit"`` -> rates in bit/s (``gradcomp.training.auto.link.parse_rate``)."""
    from gradcomp.training.auto.link import parse_rate

    out = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        try:
            out.append(parse_rate(part, "--links"))
        except ValueError:
            raise ValueError(f"--links {part!r}: give rates such as 1gbit, 10gbit, 100mbit (comma-separated)") from None
    if not out:
        raise ValueError("--links: name at least one rate")
    return out


def rate_label(bits: int) -> str:
    """``10**9`` -> ``"1 Gbit/s"`` (``gradcomp.training.auto.link.describe_rate``)."""
    from gradcomp.training.auto.link import describe_rate

    return describe_rate(bits)


def pass_ms(numel: int, repeats: int = 5) -> float:
    """Milliseconds of one pass over an fp32 gradient of ``numel`` elements on this machine:
    read it and write a result (``torch.add`` into a preallocated tensor), median of a few, on
    at least 32M elements (so that caches do not flatter it), scaled to ``numel``."""
    n = max(numel, 32 * 2**20)
    x = torch.randn(n)
    y = torch.empty_like(x)
    torch.add(x, x, out=y)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.add(x, x, out=y)
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times) * numel / n


def _dense_row(records: List[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    """The run's dense allreduce record (the baseline), if it ran."""
    return next((r for r in records if r.get("method") == "dense" and r.get("collective_ms")), None)


def efficiency_from(records: List[Dict[str, Any]], rate_bit: Optional[int]) -> float:
    """The link efficiency this run shows (its dense row on an emulated link), else the default."""
    if rate_bit is None:
        return EFFICIENCY
    dense = _dense_row(records)
    if dense is None or not dense.get("bytes_per_rank"):
        return EFFICIENCY
    wire_ms = dense["bytes_per_rank"] * 8 / rate_bit * 1e3
    return min(1.0, wire_ms / dense["collective_ms"])


def loopback_rate(records: List[Dict[str, Any]]) -> Optional[float]:
    """The rate at which a loopback run's dense allreduce moved its bytes (bit/s): the memory
    copies through the kernel's TCP stack that stand in for a wire there."""
    dense = _dense_row(records)
    if dense is None or not dense.get("bytes_per_rank"):
        return None
    return dense["bytes_per_rank"] * 8 / (dense["collective_ms"] / 1e3)


def measured_label(proj: Dict[str, Any]) -> str:
    """Where the run itself sits on the link-rate axis, and why there: on loopback, the rate at
    which its dense allreduce moved its bytes, as the nominal rate of a link that delivers it at
    the model's efficiency; on an emulated link, that link."""
    at = proj.get("measured_rate")
    if not at:
        return ""
    nominal = rate_label(int(float(f"{at:.2g}")))
    if proj.get("loopback"):
        moved = rate_label(int(float(f"{proj['run_rate']:.2g}")))
        return (f"this run: loopback, where dense all_reduce moved its bytes at {moved}\n"
                f"= a {nominal} link at the model's efficiency {proj['efficiency']:.2f}")
    return f"this run: the emulated {nominal} link"


def compute_ms(r: Dict[str, Any], rate_bit: Optional[float], eff: float, ms: Optional[float] = None) -> float:
    """The part of a record's time (or of ``ms``, one of its calls) the link rate does not set
    (see the module docstring)."""
    ms = r["collective_ms"] if ms is None else ms
    if rate_bit is None:
        return ms
    return max(0.0, ms - r["bytes_per_rank"] * 8 / (rate_bit * eff) * 1e3)


def measured_span(r: Dict[str, Any]) -> spread.Span:
    """The middle half of a record's timed calls (its median twice when it kept none)."""
    span = r.get("collective_ms_span")
    return (float(span[0]), float(span[1])) if span else (r["collective_ms"], r["collective_ms"])


def projected(r: Dict[str, Any]) -> bool:
    """Whether the link model may project a record: not ``compressor="auto"``, whose choices
    hold for the link it measured only."""
    return r.get("method") != "auto"


def project(records: List[Dict[str, Any]], links: Sequence[int], rate_bit: Optional[int],
            numel: int) -> Dict[str, Any]:
    """Per record and link: projected ms, speed-up over dense, limit and % of limit."""
    eff = efficiency_from(records, rate_bit)
    if rate_bit is None:  # loopback: take out its own transfers at the rate its dense row shows
        run_rate, run_eff = loopback_rate(records), 1.0
    else:
        run_rate, run_eff = float(rate_bit), eff
    one_pass = pass_ms(numel)
    dense = _dense_row(records)
    out: Dict[str, Any] = {"efficiency": eff, "pass_ms": one_pass, "links": list(links), "rows": [],
                           # the nominal rate at which the model reproduces the run itself
                           "measured_rate": run_rate * run_eff / eff if run_rate else None,
                           "run_rate": run_rate, "loopback": rate_bit is None}
    for r in records:
        if r.get("error") or r.get("collective_ms") is None or not projected(r):
            continue
        c = compute_ms(r, run_rate, run_eff)
        c_span = tuple(compute_ms(r, run_rate, run_eff, ms) for ms in measured_span(r))
        row = {"compressor": r["compressor"], "compute_ms": c, "compute_span": c_span,
               "bytes_per_rank": r["bytes_per_rank"], "at": {}}
        for R in links:
            wire = r["bytes_per_rank"] * 8 / (R * eff) * 1e3
            t = c + wire
            limit = r["bytes_per_rank"] * 8 / R * 1e3 + one_pass
            row["at"][R] = {"ms": t, "span": (c_span[0] + wire, c_span[1] + wire), "limit_ms": limit,
                            "of_limit": t / limit}
        out["rows"].append(row)
    if dense is not None:
        base = next(row for row in out["rows"] if row["compressor"] == dense["compressor"])
        for row in out["rows"]:
            for R in links:
                at = row["at"][R]
                at["speedup"] = base["at"][R]["ms"] / at["ms"]
                at["speedup_span"] = spread.ratio_span(base["at"][R]["span"], at["span"])
        for row in out["rows"]:
            row["break_even"] = break_even(out, row)
            row["break_even_span"] = break_even_span(out, row)
    return out


# The methods a user should train with (README.md, "Which compressor"): the family, and whether
# it needs error feedback to train (biased) or trains as it is (unbiased, or a 16-bit cast).
# PyTorch's PowerSGD hook carries its own error feedback. Others are measured but never
# recommended: randomk is unbiased only through its n/k rescale, whose variance grows with n/k;
# the plain signs, threshold, int8 and dgc are not on the list.
TRAINABLE: Dict[str, bool] = {"powersgd": True, "topk": True, "onebit": True, "efsignsgd": True,
                              "qsgd": False, "terngrad": False, "natural": False, "fp16": False, "bf16": False,
                              "torch-powersgd": False, "torch-fp16": False}


def family(label: str) -> str:
    """``topk:ratio=0.001+ef/node`` -> ``topk``."""
    return label.split("/")[0].split("+")[0].split(":")[0]


def trainable(record: Dict[str, Any]) -> bool:
    """Whether a record's method is one a user should train with: on the README's list, with
    error feedback where the compressor is biased."""
    needs_ef = TRAINABLE.get(family(record["compressor"]))
    if needs_ef is None:
        return False
    return bool(record.get("error_feedback")) or not needs_ef


def _two_digits(x: float) -> str:
    """``3.6``, ``560``, ``12``: two significant digits, never an exponent."""
    text = f"{x:.2g}"
    return f"{float(text):.0f}" if "e" in text else text


def short_rate(bits: float) -> str:
    """``3.6G``, ``560M``, ``every``, ``none``: a break-even rate in a table cell."""
    if math.isinf(bits):
        return "every"
    if bits <= 0:
        return "none"
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if bits >= scale:
            return f"{_two_digits(bits / scale)}{unit}"
    return _two_digits(bits)


def break_even_cell(row: Dict[str, Any]) -> str:
    """``3.6G (2.9-4.5G)``: the break-even from the medians, then from the spreads' ends (left
    out when they round to the same); ``-`` for dense itself."""
    mid, span = row.get("break_even"), row.get("break_even_span")
    if mid is None or row["compressor"] == "dense":
        return "-"
    ends = [short_rate(v) for v in span] if span is not None else []
    if not ends or ends[0] == ends[1] == short_rate(mid):
        return short_rate(mid)
    return f"{short_rate(mid)} ({ends[0]}-{ends[1]})"


def table(proj: Dict[str, Any], measured_on: str) -> str:
    links = proj["links"]
    first = rate_label(links[0]).replace(" ", "")
    head = ["method", "compute"] + [f"@{rate_label(R).replace(' ', '')}" for R in links] + \
        [f"limit@{first}", "of limit", "break-even"]
    rows = []
    for row in proj["rows"]:
        cells = [row["compressor"], f"{row['compute_ms']:.1f}"]
        cells += [f"{row['at'][R].get('speedup', float('nan')):.2f}x" for R in links]
        at = row["at"][links[0]]
        cells += [f"{at['limit_ms']:.1f}", f"{100 * at['of_limit']:.0f} %", break_even_cell(row)]
        rows.append(cells)
    widths = [max(len(head[0]), *(len(r[0]) for r in rows))] + [
        max(9, len(h), *(len(r[i + 1]) for r in rows)) for i, h in enumerate(head[1:])]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    units = ["", "ms"] + ["speed-up"] * len(links) + ["ms", "", "bit/s"]
    lines = [f"projected (link model, not measured): speed-up over dense allreduce at each link rate, from the "
             f"run above ({measured_on}); link efficiency {proj['efficiency']:.2f}, one pass over the gradient "
             f"{proj['pass_ms']:.1f} ms", line(head), line(units)] + [line(r) for r in rows]
    lines += ["", *textwrap.wrap(
        f"compute: the measured time the link rate does not set (compress, decode, sum, message latency). "
        f"limit@{first}: the fastest this method could be at {rate_label(links[0])} on this machine, its bytes "
        f"on the wire plus one pass over the gradient; of limit: projected time / that limit (100 % = at the "
        f"limit, 1000 % = 10x slower than it, time lost to compute). break-even: the link rate below which the "
        f"method beats dense, (dense bytes - its bytes) * 8 / (efficiency * (its compute - dense compute)), "
        f"from the medians, then (in brackets) from the ends of the calls' middle halves; every: it beats dense "
        f"at every rate; none: it sends no fewer bytes.", 100)]
    return "\n".join(lines)


def recommend(proj: Dict[str, Any], records: List[Dict[str, Any]], R: int) -> List[Tuple[str, float]]:
    """The trainable methods at link rate ``R``, fastest first: ``[(label, speed-up), ...]``."""
    ok = {r["compressor"] for r in records if trainable(r)}
    rows = [row for row in proj["rows"] if row["compressor"] in ok and "speedup" in row["at"][R]]
    return sorted(((row["compressor"], row["at"][R]["speedup"]) for row in rows), key=lambda t: -t[1])


def break_even(proj: Dict[str, Any], row: Dict[str, Any]) -> float:
    """The link rate (bit/s) below which ``row``'s method beats dense in the link model:
    ``inf`` when it wins at every rate, 0 when at none."""
    dense = next((r for r in proj["rows"] if r["compressor"] == "dense"), None)
    if dense is None:
        return 0.0
    saved_bits = (dense["bytes_per_rank"] - row["bytes_per_rank"]) * 8  # what it takes off the wire
    extra_ms = row["compute_ms"] - dense["compute_ms"]  # what it costs in compute
    if saved_bits <= 0:
        return 0.0
    if extra_ms <= 0:
        return math.inf
    return saved_bits / (proj["efficiency"] * extra_ms / 1e3)


def break_even_span(proj: Dict[str, Any], row: Dict[str, Any]) -> Tuple[float, float]:
    """The break-even rate when each compute time may lie anywhere in its calls' middle half:
    ``(lowest, highest)``."""
    dense = next((r for r in proj["rows"] if r["compressor"] == "dense"), None)
    if dense is None:
        return 0.0, 0.0
    lo_c, hi_c = row.get("compute_span", (row["compute_ms"],) * 2)
    lo_d, hi_d = dense.get("compute_span", (dense["compute_ms"],) * 2)

    def at(extra_ms: float) -> float:
        return break_even(proj, dict(row, compute_ms=dense["compute_ms"] + extra_ms))

    return at(hi_c - lo_d), at(lo_c - hi_d)


def _below(rate: float) -> str:
    if math.isinf(rate):
        return "at every link rate"
    return f"on links slower than {rate_label(int(float(f'{rate:.2g}')))}"


# Why a measured method is left out of the recommendation, per family (README.md, "Which
# compressor", keeps to the ones above). A method of the list run without the error feedback
# it needs is left out for that.
LEFT_OUT: Dict[str, str] = {
    "randomk": "unbiased only through its n/k rescale, whose variance grows with n/k (its rel.err)",
    "signsgd": "decodes to +-1 whatever the gradient's scale, and no error feedback can carry what that drops "
               "(efsignsgd and onebit keep the scale)",
    "signum": "a sign of momentum decoded to +-1: the scale is lost as with signsgd",
    "threshold": "sends a data-dependent amount: what it keeps depends on tau against your gradients' scale, "
                 "which this run's N(0, 1) draw does not have",
    "dgc": "an approximate top-k (a sampled threshold); its accuracy in training is not measured here "
           "(exact topk is on the list)",
    "int8": "its accuracy in training is not measured here (the 16-bit casts are the list's exact-first choice)",
    "none": "the identity: dense fp32 through gradcomp's path, a measure of its overhead",
}


def left_out_reason(record: Dict[str, Any]) -> Optional[str]:
    """Why ``record``'s method is not recommended (None: it may be)."""
    if record.get("method") == "dense" or record["compressor"] == "dense" or trainable(record):
        return None
    if record.get("method") == "auto":
        return ("it decides from the link it measures: on another link it would choose again, so its row is "
                "not projected (its measured result is above)")
    fam = family(record["compressor"])
    if TRAINABLE.get(fam):  # on the list, but biased and run without error feedback
        return "biased and run without error feedback: what it drops is lost for good"
    return LEFT_OUT.get(fam, "not on the README's list of methods to train with")


def speed_text(value: float, span: Optional[Sequence[float]]) -> str:
    """``2.89x (2.70-3.05x)``: a speed-up and its spread (left out when it rounds to nothing)."""
    text = f"{value:.2f}x"
    if span is None or f"{span[0]:.2f}" == f"{span[1]:.2f}":
        return text
    return f"{text} ({span[0]:.2f}-{span[1]:.2f}x)"


def summary(proj: Dict[str, Any], loopback: bool, records: Optional[List[Dict[str, Any]]] = None) -> str:
    """Plain sentences, one paragraph a line: where compression pays, which trainable method
    to start with (with the methods that tie with it), each one's break-even, what ``auto``
    chose, why each other method is left out, what the run cannot know."""
    links = proj["links"]
    records = records if records is not None else [
        {"compressor": row["compressor"], "error_feedback": row["compressor"].endswith("+ef")} for row in proj["rows"]]
    by_row = {row["compressor"]: row for row in proj["rows"]}
    ranked = {R: recommend(proj, records, R) for R in links}

    def span(name: str, R: int) -> Tuple[float, float]:
        at = by_row[name]["at"][R]
        return at.get("speedup_span", (at["speedup"], at["speedup"]))

    pays = [R for R in links if ranked[R] and span(ranked[R][0][0], R)[0] > 1.0]
    ok = {r["compressor"] for r in records if trainable(r)}
    # where each method to train with stops paying: the widest range of links first
    reach = sorted(((row["compressor"], break_even(proj, row)) for row in proj["rows"] if row["compressor"] in ok),
                   key=lambda t: -t[1])
    out = []
    if loopback:
        out.append("On loopback the 'link' is memory copies inside this machine, far faster than a network, so "
                   "most methods measure slower than dense above.")
    lead = ("Projected from the measured compute time and bytes, among the methods to train with (README's "
            "'Which compressor', error feedback where biased): ")
    if not any(ranked.values()):
        out.append("None of the methods run is one the README recommends training with (its 'Which compressor' "
                   "list, with error feedback where biased), so there is no recommendation.")
    elif not pays:
        paying = [t for t in reach if t[1] > 0]
        where = (f"; {paying[0][0]} beats it {_below(paying[0][1])}" if paying else "; none pays on any link")
        out.append(f"{lead}none beats dense allreduce beyond this run's noise at {rate_label(links[0])} or faster "
                   f"on this machine, so keep dense there{where}.")
    else:
        R = min(pays)
        (top, speed), rest = ranked[R][0], ranked[R][1:]
        top_span = by_row[top]["at"][R]["span"]
        ties = [(n, v) for n, v in rest if spread.overlap(by_row[n]["at"][R]["span"], top_span)]
        if ties:
            names = ", ".join(f"{n} {speed_text(v, span(n, R))}" for n, v in ties)
            out.append(f"{lead}at {rate_label(R)} use {top}, {speed_text(speed, span(top, R))} over dense, or what "
                       f"ties with it: {names}. Their projected middle halves overlap, so this run cannot tell them "
                       f"apart; pick by accuracy on your task.")
        else:
            second = f"; runner-up {rest[0][0]}, {speed_text(rest[0][1], span(rest[0][0], R))}" if rest else ""
            out.append(f"{lead}at {rate_label(R)} use {top}, {speed_text(speed, span(top, R))} over dense{second}.")
    if reach:
        out.append("Break-even, the link rate below which each method to train with beats dense in the link "
                   "model (bit/s; in brackets from the ends of its calls' middle half): " + "; ".join(
                       f"{n} {break_even_cell(by_row[n])}" for n, _ in reach) + ".")
    for r in records:
        if r.get("method") == "auto" and r.get("speedup") is not None:
            verdict = {"faster": "faster than dense", "slower": "slower than dense",
                       "tie": "a tie with dense (their middle halves overlap)"}.get(r.get("vs_dense", ""), "")
            out.append(f"{r['compressor']} chose {r.get('auto_choices') or '?'} on this run's link: measured "
                       f"{speed_text(r['speedup'], r.get('speedup_span'))} dense"
                       + (f", {verdict}" if verdict else "") + ", at the bytes and rel.err of those choices. It is "
                       "not projected: on another link it measures again and may choose otherwise.")
    left = {}
    for r in records:
        why = left_out_reason(r)
        if why is not None and r.get("method") != "auto":
            left[r["compressor"]] = why
    if left:
        out.append("Left out of the recommendation whatever their speed: "
                   + "; ".join(f"{n}: {why}" for n, why in sorted(left.items())) + ".")
    out.append("rel.err is ||mean - exact mean|| / ||exact mean|| for one call. A biased compressor's "
               "(topk, signs, powersgd) is what it drops, which error feedback carries into later calls; an "
               "unbiased one's (qsgd, terngrad, randomk) is the noise of rescaling what it keeps (randomk scales "
               "k of n values by n/k), which averages out over steps but slows convergence.")
    out.append("This run measures time and bytes only: it cannot know the accuracy on your task. Check that "
               "with `python -m gradcomp.bench train` and on your own model before switching.")
    return "\n".join(out)
