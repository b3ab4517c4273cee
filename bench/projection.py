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
emulated run, and ``EFFICIENCY`` otherwise (bench/RESULTS.md, section 12, where the model is
checked against emulated runs). On a loopback run the "wire" is memory copies through the
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
"""
from __future__ import annotations

import math
import re
import statistics
import textwrap
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

EFFICIENCY = 0.94  # TCP payload rate over a tbf-shaped link, as a share of its nominal rate (section 12)
DEFAULT_LINKS = "1gbit,10gbit,25gbit,100gbit"
_UNITS = {"kbit": 10**3, "mbit": 10**6, "gbit": 10**9}


def parse_links(text: str) -> List[int]:
    """``"1gbit,10gbit"`` -> rates in bit/s."""
    out = []
    for part in (p.strip().lower() for p in text.split(",") if p.strip()):
        m = re.fullmatch(r"([0-9]*\.?[0-9]+)(kbit|mbit|gbit)", part)
        if not m:
            raise ValueError(f"--links {part!r}: give rates such as 1gbit, 10gbit, 100mbit (comma-separated)")
        out.append(int(float(m.group(1)) * _UNITS[m.group(2)]))
    if not out:
        raise ValueError("--links: name at least one rate")
    return out


def rate_label(bits: int) -> str:
    for unit, scale in (("Gbit", 10**9), ("Mbit", 10**6), ("kbit", 10**3)):
        if bits >= scale:
            return f"{bits / scale:g} {unit}/s"
    return f"{bits} bit/s"


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


def compute_ms(r: Dict[str, Any], rate_bit: Optional[float], eff: float) -> float:
    """The part of a record's time the link rate does not set (see the module docstring)."""
    if rate_bit is None:
        return r["collective_ms"]
    return max(0.0, r["collective_ms"] - r["bytes_per_rank"] * 8 / (rate_bit * eff) * 1e3)


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
                           "measured_rate": run_rate * run_eff / eff if run_rate else None}
    for r in records:
        if r.get("error") or r.get("collective_ms") is None:
            continue
        c = compute_ms(r, run_rate, run_eff)
        row = {"compressor": r["compressor"], "compute_ms": c, "bytes_per_rank": r["bytes_per_rank"], "at": {}}
        for R in links:
            t = c + r["bytes_per_rank"] * 8 / (R * eff) * 1e3
            limit = r["bytes_per_rank"] * 8 / R * 1e3 + one_pass
            row["at"][R] = {"ms": t, "limit_ms": limit, "of_limit": t / limit}
        out["rows"].append(row)
    if dense is not None:
        base = next(row for row in out["rows"] if row["compressor"] == dense["compressor"])
        for row in out["rows"]:
            for R in links:
                row["at"][R]["speedup"] = base["at"][R]["ms"] / row["at"][R]["ms"]
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


def table(proj: Dict[str, Any], measured_on: str) -> str:
    links = proj["links"]
    first = rate_label(links[0]).replace(" ", "")
    head = ["method", "compute"] + [f"@{rate_label(R).replace(' ', '')}" for R in links] + \
        [f"limit@{first}", "of limit"]
    rows = []
    for row in proj["rows"]:
        cells = [row["compressor"], f"{row['compute_ms']:.1f}"]
        cells += [f"{row['at'][R].get('speedup', float('nan')):.2f}x" for R in links]
        at = row["at"][links[0]]
        cells += [f"{at['limit_ms']:.1f}", f"{100 * at['of_limit']:.0f} %"]
        rows.append(cells)
    widths = [max(len(head[0]), *(len(r[0]) for r in rows))] + [max(9, len(h)) for h in head[1:]]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    units = ["", "ms"] + ["speed-up"] * len(links) + ["ms", ""]
    lines = [f"projected (link model, not measured): speed-up over dense allreduce at each link rate, from the "
             f"run above ({measured_on}); link efficiency {proj['efficiency']:.2f}, one pass over the gradient "
             f"{proj['pass_ms']:.1f} ms", line(head), line(units)] + [line(r) for r in rows]
    lines += ["", *textwrap.wrap(
        f"compute: the measured time the link rate does not set (compress, decode, sum, message latency). "
        f"limit@{first}: the fastest this method could be at {rate_label(links[0])} on this machine, its bytes "
        f"on the wire plus one pass over the gradient; of limit: projected time / that limit (100 % = at the "
        f"limit, 1000 % = 10x slower than it, time lost to compute).", 100)]
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


def _below(rate: float) -> str:
    if math.isinf(rate):
        return "at every link rate"
    return f"on links slower than {rate_label(int(float(f'{rate:.2g}')))}"


def summary(proj: Dict[str, Any], loopback: bool, records: Optional[List[Dict[str, Any]]] = None) -> str:
    """Plain sentences, one paragraph a line: where compression pays, which trainable method
    to start with and the runner-up, what the run cannot know."""
    links = proj["links"]
    records = records if records is not None else [
        {"compressor": row["compressor"], "error_feedback": row["compressor"].endswith("+ef")} for row in proj["rows"]]
    ranked = {R: recommend(proj, records, R) for R in links}
    pays = [R for R in links if ranked[R] and ranked[R][0][1] > 1.05]
    ok = {r["compressor"] for r in records if trainable(r)}
    # where each method to train with stops paying: the widest range of links first
    reach = sorted(((row["compressor"], break_even(proj, row)) for row in proj["rows"] if row["compressor"] in ok),
                   key=lambda t: -t[1])
    reach = [t for t in reach if t[1] > 0]
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
        where = (f"; {reach[0][0]} beats it {_below(reach[0][1])}"
                 + (f" (runner-up {reach[1][0]}, {_below(reach[1][1])})" if len(reach) > 1 else "")
                 if reach else "; none pays on any link")
        out.append(f"{lead}none beats dense allreduce at {rate_label(links[0])} or faster on this machine, so "
                   f"keep dense there{where}.")
    else:
        slowest_paying = min(pays)
        top, runner = ranked[slowest_paying][0], ranked[slowest_paying][1:2]
        second = f"; runner-up {runner[0][0]}, {runner[0][1]:.2f}x" if runner else ""
        out.append(f"{lead}at {rate_label(slowest_paying)} use {top[0]}, {top[1]:.2f}x over dense{second}.")
        own = dict(reach).get(top[0], 0.0)
        wider = [t for t in reach if t[1] > own][:2]
        out.append(f"Where compression pays (the link model's break-even): {top[0]} beats dense {_below(own)}"
                   + (f"; the widest range: {', '.join(f'{n} ({_below(r)})' for n, r in wider)}" if wider else "")
                   + ("" if math.isinf(reach[0][1]) else "; on faster links dense allreduce is as fast or faster")
                   + ".")
    left = sorted({r["compressor"] for r in records if r.get("method") != "dense" and r["compressor"] != "dense"
                   and not trainable(r)})
    if left:
        out.append(f"Left out of the recommendation whatever their speed (not in the README's list, or biased "
                   f"without error feedback): {', '.join(left)}.")
    out.append("rel.err is ||mean - exact mean|| / ||exact mean|| for one call. A biased compressor's "
               "(topk, signs, powersgd) is what it drops, which error feedback carries into later calls; an "
               "unbiased one's (qsgd, terngrad, randomk) is the noise of rescaling what it keeps (randomk scales "
               "k of n values by n/k), which averages out over steps but slows convergence.")
    out.append("This run measures time and bytes only: it cannot know the accuracy on your task. Check that "
               "with `python -m gradcomp.bench train` and on your own model before switching.")
    return "\n".join(out)
