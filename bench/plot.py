"""PNG plots of benchmark results (matplotlib, headless)."""
from __future__ import annotations

import math
from typing import Any, Dict, List, Optional


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install 'gradcomp[bench]'") from None
    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    return plt


# colours of the collective plot: the three phases, then faster/slower than dense (distinct hues)
_COMPRESS, _COMM, _DECOMP = "#d95f02", "#7570b3", "#e6ab02"
_FASTER, _SLOWER, _BASE = "#1b9e77", "#e7298a", "#999999"


def log_ticks(ax: Any, lo: float, hi: float, axis: str = "x", unit: str = "x") -> None:
    """Label a log axis at 1-2-5 steps of each decade within ``[lo, hi]`` (finer steps when the
    range is narrow), so more than ``1x`` carries a number."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    lo, hi = max(lo, 1e-12), max(hi, lo * 1.01)
    ticks: List[float] = []
    for subs in ((1, 2, 5), (1, 1.5, 2, 3, 5, 7), (1, 1.2, 1.5, 2, 2.5, 3, 4, 5, 6, 7, 8, 9)):
        ticks = [m * 10.0 ** e for e in range(math.floor(math.log10(lo)) - 1, math.ceil(math.log10(hi)) + 1)
                 for m in subs if lo <= m * 10.0 ** e <= hi]
        if len(ticks) >= 3:
            break
    which = ax.xaxis if axis == "x" else ax.yaxis
    which.set_major_locator(FixedLocator(ticks))
    which.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}{unit}"))
    which.set_minor_locator(NullLocator())


def collective_plot(records: List[Dict[str, Any]], path: str, title: str = "",
                    proj: Optional[Dict[str, Any]] = None) -> Any:
    """Top left: where each method's time goes (compress, communicate, decompress) beside dense;
    top right: measured speed-up over dense ``all_reduce``; below, with a projection
    (``bench/projection.py``): projected speed-up against the link rate per method, the
    measured points marked -- where compression pays. Returns the (closed) figure."""
    plt = _pyplot()
    from matplotlib.patches import Patch

    rows = [r for r in records if r.get("collective_ms") is not None]
    names = [r["compressor"] for r in rows]
    y = list(range(len(rows)))
    comp = [r["compress_ms"] or 0.0 for r in rows]
    decomp = [r["decompress_ms"] or 0.0 for r in rows]
    comm = [max(r["collective_ms"] - c - d, 0.0) for r, c, d in zip(rows, comp, decomp)]
    top_h = 0.32 * len(rows) + 1.6
    with_proj = bool(proj and proj.get("rows") and any("speedup" in v for v in proj["rows"][0]["at"].values()))
    # constrained layout: it makes room for the outside legends and the spanning panel
    fig = plt.figure(figsize=(14, top_h + (6.0 if with_proj else 0) + 0.9), layout="constrained")
    grid = fig.add_gridspec(2 if with_proj else 1, 2, height_ratios=[top_h, 6.0] if with_proj else None)
    ax1 = fig.add_subplot(grid[0, 0])
    ax2 = fig.add_subplot(grid[0, 1], sharey=ax1)
    ax1.barh(y, comp, color=_COMPRESS, label="compress")
    ax1.barh(y, comm, left=comp, color=_COMM, label="communicate + rest")
    ax1.barh(y, decomp, left=[c + m for c, m in zip(comp, comm)], color=_DECOMP, label="decompress")
    spans = [r.get("collective_ms_span") for r in rows]
    if any(spans):  # each call's middle half, around the median's total
        ax1.errorbar([r["collective_ms"] for r in rows], y, xerr=_whiskers([r["collective_ms"] for r in rows], spans),
                     fmt="none", ecolor="k", elinewidth=1, capsize=3, label="calls' middle half")
    if rows:
        ax1.axvline(rows[0]["dense_ms"], color="k", ls="--", lw=1, label="dense all_reduce")
    ax1.set_yticks(y, names)
    ax1.invert_yaxis()
    ax1.set_xlabel("ms per call (median, slowest rank)")
    longest = max([c + m + d for c, m, d in zip(comp, comm, decomp)] + [rows[0]["dense_ms"] if rows else 0.0]
                  + [s[1] for s in spans if s])
    ax1.set_xlim(0, longest * 1.08 if longest > 0 else 1.0)  # the longest bar stops short of the frame
    # legends just above each panel: no gap to size, and the bottom bars stay uncovered
    ax1.legend(loc="lower left", bbox_to_anchor=(0, 1.0), ncol=2, fontsize=8, frameon=False,
               borderaxespad=0.2, handlelength=1.4, columnspacing=1.0)
    _speed_panel(ax2, rows, y)
    if with_proj and proj is not None:
        _projection_panel(fig.add_subplot(grid[1, :]), rows, proj)
    fig.suptitle(title, fontsize=9)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return fig


def _whiskers(centres: List[float], spans: List[Any]) -> List[List[float]]:
    """``errorbar``'s ``xerr`` (below, above) from each centre to its span's ends (none: 0)."""
    below = [c - s[0] if s else 0.0 for c, s in zip(centres, spans)]
    above = [s[1] - c if s else 0.0 for c, s in zip(centres, spans)]
    return [[max(v, 0.0) for v in below], [max(v, 0.0) for v in above]]


_TIE = "#c7c7c7"  # within the run's noise of dense


def _speed_panel(ax: Any, rows: List[Dict[str, Any]], y: List[int]) -> None:
    """Measured speed-up over dense: a bar from 1x to each method's speed-up on a log axis (its
    length is the factor, the same for 2x faster as for 2x slower), the middle half of the calls
    as whiskers, coloured faster / slower / tie (``bench/spread.py``)."""
    from matplotlib.patches import Patch

    speed = [r.get("speedup") or 0.0 for r in rows]
    if not any(s > 0 for s in speed):  # one rank: nothing crosses a wire, so there is no speed-up to draw
        ax.set_xlabel("speed-up over dense all_reduce (none: nothing is sent with one rank)")
        ax.tick_params(axis="y", labelleft=False)
        return
    colour = {"faster": _FASTER, "slower": _SLOWER, "tie": _TIE, "baseline": _BASE}
    ok = [(yi, r, s) for yi, r, s in zip(y, rows, speed) if s > 0]
    ax.barh([yi for yi, _, _ in ok], [s - 1.0 for _, _, s in ok], left=1.0,
            color=[colour.get(r.get("vs_dense", ""), _TIE if r["compressor"] != "dense" else _BASE) for _, r, _ in ok])
    spans = [r.get("speedup_span") for _, r, _ in ok]
    if any(spans):
        ax.errorbar([s for _, _, s in ok], [yi for yi, _, _ in ok], xerr=_whiskers([s for _, _, s in ok], spans),
                    fmt="none", ecolor="k", elinewidth=1, capsize=3)
    ax.axvline(1.0, color="k", lw=1.2)
    from matplotlib.lines import Line2D

    ax.legend(handles=[Patch(color=_FASTER, label="faster than dense"), Patch(color=_SLOWER, label="slower than dense"),
                       Patch(color=_TIE, label="a tie: middle halves overlap"),
                       Line2D([], [], color="k", marker="|", lw=1, label="calls' middle half")],
              loc="lower left", bbox_to_anchor=(0, 1.0), ncol=2, fontsize=8, frameon=False, borderaxespad=0.2,
              handlelength=1.4)
    ax.tick_params(axis="y", labelleft=False)
    ends = [v for s in spans if s for v in s if 0 < v < math.inf] + [s for _, _, s in ok]
    lo, hi = min(ends + [1.0]), max(ends + [1.0])
    reach = max(hi, 1.0 / lo, 1.25)  # the same room either side of 1x: a bar's length is its factor
    ax.set_xscale("log")
    ax.set_xlim(1.0 / (reach * 1.15), reach * 4)  # room for the labels on the right
    log_ticks(ax, 1.0 / (reach * 1.15), reach * 4)
    for yi, r, s in ok:  # right of the bar, its whisker and the 1x line
        end = max(1.0, s, (r.get("speedup_span") or (s, s))[1])
        ax.text(end * 1.03, yi, " " + _speed_label(r), va="center", fontsize=7)
    ax.set_xlabel("measured speed-up over dense all_reduce (log, bars from 1x)")


def _projection_panel(ax: Any, rows: List[Dict[str, Any]], proj: Dict[str, Any]) -> None:
    """Projected speed-up over dense against the link rate, one line per method (the methods to
    train with in colour, the others thin grey), each measured run's point marked where its
    own link sits on the rate axis."""
    from . import projection

    by = {r["compressor"]: r for r in rows}
    first = proj["links"][0]  # the legend ranks the methods by their projection at the first rate
    lines = sorted((row for row in proj["rows"] if row["compressor"] != "dense"),
                   key=lambda row: -row["at"][first].get("speedup", 0.0))
    dense = next((row for row in proj["rows"] if row["compressor"] == "dense"), None)
    if dense is None or not lines:
        ax.set_axis_off()
        return
    rates = proj["links"]
    measured_at = proj.get("measured_rate")  # the nominal rate a link would need to reproduce the run
    lo = min(rates + ([measured_at] if measured_at else [])) / 10  # slow links too: where compression pays
    hi = max(rates + ([measured_at] if measured_at else [])) * 2
    xs = [lo * (hi / lo) ** (i / 120) for i in range(121)]
    eff = proj["efficiency"]

    def at(row: Dict[str, Any], R: float) -> float:
        return row["compute_ms"] + row["bytes_per_rank"] * 8 / (R * eff) * 1e3

    ax.axhspan(1.0, 1e6, color=_FASTER, alpha=0.06, lw=0)
    ax.axhline(1.0, color="k", lw=1.2, label="dense all_reduce (1x)")
    ax.text(0.005, 0.985, "above 1x (shaded): faster than dense, compression pays", transform=ax.transAxes,
            va="top", fontsize=8, color=_FASTER)
    palette = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22",
               "#000080", "#808000", "#00a0a0")
    ys_all, coloured = [], 0
    for row in lines:
        ys = [at(dense, R) / at(row, R) for R in xs]
        ys_all += ys
        rec = by.get(row["compressor"], {"compressor": row["compressor"]})
        if projection.trainable(rec):
            colour = palette[coloured % len(palette)]
            coloured += 1
            kw = {"color": colour, "lw": 1.8, "zorder": 3, "label": f"{row['compressor']}  "
                  f"({row['at'][first].get('speedup', float('nan')):.2f}x at {projection.rate_label(first)})"}
        else:
            colour = "#bbbbbb"
            kw = {"color": colour, "lw": 0.9, "zorder": 2}
        ax.plot(xs, ys, **kw)
        if measured_at and rec.get("speedup"):
            ax.plot([measured_at], [rec["speedup"]], marker="o", ms=6 if kw["zorder"] == 3 else 4, color=colour,
                    mec="k", mew=0.6, ls="none", zorder=4)
    ax.plot([], [], color="#bbbbbb", lw=0.9, label="not recommended for training\n(e.g. randomk, biased without EF)")
    if measured_at:
        ax.plot([], [], marker="o", color="w", mec="k", ls="none", label="measured in this run")
        for r in rows:  # auto: measured only, its choices hold for this link alone (bench/projection.py)
            if not projection.projected(r) and r.get("speedup"):
                ys_all.append(r["speedup"])
                ax.plot([measured_at], [r["speedup"]], marker="*", ms=11, color="#ffd92f", mec="k", mew=0.6,
                        ls="none", zorder=5, label=f"{r['compressor']}: measured only (it re-decides on other links)")
        ax.axvline(measured_at, color="k", ls=":", lw=0.8, label=projection.measured_label(proj))
        ax.text(measured_at, 0.02, " this run", transform=ax.get_xaxis_transform(), fontsize=7, rotation=90,
                va="bottom")
    for R in rates:
        ax.axvline(R, color="#dddddd", lw=0.8, zorder=1)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ymin, ymax = max(min(ys_all), 0.01), max(max(ys_all), 1.5)  # below 0.01x nothing is worth reading
    ax.set_ylim(ymin / 1.2, ymax * 1.3)
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    decades = [10.0 ** e for e in range(math.ceil(math.log10(lo)), math.floor(math.log10(hi)) + 1)]
    ax.xaxis.set_major_locator(FixedLocator(sorted(set(decades) | set(float(R) for R in rates))))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: projection.rate_label(int(round(v)))))
    ax.xaxis.set_minor_locator(NullLocator())
    log_ticks(ax, ymin / 1.2, ymax * 1.3, "y")
    ax.set_xlabel("link rate per rank (bit/s, log)")
    ax.set_ylabel("projected speed-up over dense (log)")
    ax.set_title("projected with the link model (bench/projection.py), not measured: the measured compute time "
                 "kept, each method's bytes put on a link of each rate", fontsize=9)
    ax.grid(alpha=0.25, which="major")
    ax.legend(loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8, frameon=False,
              title=f"to train with, ranked at {projection.rate_label(first)}", title_fontsize=8)


def _byte_unit(n: float) -> "tuple[str, float]":
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return unit, scale
    return "B", 1.0


def sharded_plot(records: List[Dict[str, Any]], path: str, title: str = "") -> None:
    """``bench sharded``: per method, optimizer state per rank, parameter + gradient + master
    bytes, bytes sent per step, step time and test accuracy, side by side (one bar each)."""
    plt = _pyplot()
    from matplotlib.patches import Patch

    panels = (("state_bytes", "optimizer state per rank"), ("held_bytes", "param + grad + master per rank"),
              ("bytes_per_step", "sent per step per rank"), ("step_ms", "step time (ms, median, slowest rank)"),
              ("test_accuracy", "test accuracy (%)"))
    names = [r["method"] for r in records]
    y = list(range(len(records)))
    fig, axes = plt.subplots(1, len(panels), figsize=(3.1 * len(panels) + 1.6, 0.36 * len(records) + 2.2),
                             sharey=True, layout="constrained")
    for ax, (field, label) in zip(axes, panels):
        raw = [float(r.get(field) or 0.0) for r in records]
        if field.endswith("bytes") or field == "bytes_per_step":
            unit, scale = _byte_unit(max(raw))
            label, spec = f"{label} ({unit})", ".3g"
        else:
            scale, spec = (0.01, ".2f") if field == "test_accuracy" else (1.0, ".3g")
        vals = [v / scale for v in raw]
        ax.barh(y, vals, color=["#1f77b4" if n.startswith("ours") else "#999999" for n in names])
        top, low = max(vals + [1e-12]), min(vals) if vals else 0.0
        for yi, v in zip(y, vals):
            ax.text(v, yi, " " + format(v, spec), va="center", fontsize=7)
        if field == "test_accuracy":  # the differences are tenths of a point: zoom in on them
            ax.set_xlim(max(0.0, low - 2 * (top - low) - 1.0), top + 0.6 * (top - low) + 0.8)
        else:
            ax.set_xlim(0, top * 1.35)
        ax.set_xlabel(label, fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(axis="x", alpha=0.3)
    axes[0].set_yticks(y, names, fontsize=8)
    axes[0].invert_yaxis()
    fig.legend(handles=[Patch(color="#1f77b4", label="gradcomp's ShardedOptimizer"),
                        Patch(color="#999999", label="PyTorch (DDP + AdamW, ZeroRedundancyOptimizer)")],
               loc="outside lower center", ncol=2, fontsize=8, frameon=False)
    fig.suptitle(title, fontsize=9)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _speed_label(r: dict) -> str:
    """``1.85x  (2.0x less data)``, ``1.02x tie  (1.0x less data)``; what is missing (one rank
    sends nothing) said in words."""
    if r.get("compressor") == "dense":
        return "the baseline (whiskers: its calls' spread)"
    speed = f"{r['speedup']:.2f}x" if r.get("speedup") is not None else "no speed-up"
    if r.get("vs_dense") == "tie":
        speed += " tie"
    ratio = f"{r['ratio']:.1f}x less data" if r.get("ratio") is not None else "nothing sent"
    return f"{speed}  ({ratio})"


def _smooth(values: List[float], window: int) -> List[float]:
    """Trailing moving average (the per-step loss of a small batch is noisy)."""
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


# one colour per method family (``topk`` and ``topk+ef`` alike; the line style tells them apart),
# ordered so that neighbours in the legend never get two warm colours in a row
_FAMILY_COLOURS = ("#1f77b4", "#2ca02c", "#d62728", "#9467bd", "#17becf", "#8c564b", "#e377c2", "#bcbd22",
                   "#ff7f0e", "#7f7f7f")
_REFERENCE = "torch-allreduce"  # dense: drawn wide and grey under the others, which often share its bits


def _family(method: str) -> str:
    return method.split("+")[0].split(":")[0]


def training_plot(runs: List[Dict[str, Any]], path: str, title: str = "") -> None:
    """Training loss per step (left, smoothed over an epoch) and test error per epoch (right, log
    scale: the first epochs and the last tenths of a point both show): PyTorch's hooks dashed,
    gradcomp's with error feedback solid, without it dotted; one colour per method family; the
    legend below both panels."""
    from matplotlib.ticker import MaxNLocator, NullFormatter, ScalarFormatter

    plt = _pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5.8))
    families: List[str] = []
    for run in runs:
        if run["method"] != _REFERENCE and _family(run["method"]) not in families:
            families.append(_family(run["method"]))
    for run in runs:
        style = "--" if run.get("source") == "torch" else ("-" if run.get("error_feedback") else ":")
        window = max(1, run["steps"] // max(run["epochs"], 1))
        family = _family(run["method"])
        colour = _FAMILY_COLOURS[families.index(family) % len(_FAMILY_COLOURS)] if family in families else ""
        kw = {"color": colour, "ls": style, "lw": 1.4, "label": run["method"],
              "zorder": 3 if run.get("source") == "torch" else 2}  # the references stay visible
        if run["method"] == _REFERENCE:
            kw.update(color="#b0b0b0", ls="-", lw=4.0, zorder=1, label=f"{_REFERENCE} (dense)")
        ax1.plot(_smooth(run["loss_curve"], window), **kw)
        ax2.plot(range(1, len(run["accuracy_curve"]) + 1), [100 * (1 - a) for a in run["accuracy_curve"]],
                 marker=".", **kw)
    ax1.set_yscale("log")
    ax1.set_xlabel("step")
    ax1.set_ylabel("training loss (mean over ranks, moving average over an epoch)")
    ax2.set_xlabel("epoch")
    ax2.set_ylabel("test error (%, log scale; accuracy = 100 - error)")
    ax2.set_yscale("log")
    ax2.yaxis.set_major_formatter(ScalarFormatter())
    ax2.yaxis.set_minor_formatter(NullFormatter())
    ax2.set_yticks([t for t in (1, 2, 3, 5, 10, 20, 30, 50, 100)
                    if any(t / 2 <= 100 * (1 - a) <= 2 * t for r in runs for a in r["accuracy_curve"])])
    ax2.xaxis.set_major_locator(MaxNLocator(integer=True))
    handles, labels = ax1.get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 7), fontsize=8, frameon=False)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def loss_plot(records: List[Dict[str, Any]], path: str, title: str = "") -> None:
    """``bench diloco``: validation loss against tokens seen (left) and against training time
    (right), one line per method (``ddp`` wide and grey under the others); the legend below."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(13, 5.6))
    for i, r in enumerate(records):
        kw: Dict[str, Any] = {"color": _FAMILY_COLOURS[i % len(_FAMILY_COLOURS)], "lw": 1.4, "marker": ".",
                              "label": r["method"], "ls": "--" if r["kind"] in ("ddp", "local") else "-"}
        if r["method"] == "ddp":
            kw.update(color="#b0b0b0", ls="-", lw=4.0, zorder=1)
        for ax, x in zip(axes, ("tokens", "seconds")):
            ax.plot([c[x] for c in r["val_curve"]], [c["val_loss"] for c in r["val_curve"]], **kw)
    start = min(r["val_curve"][0]["val_loss"] for r in records)
    low = min(c["val_loss"] for r in records for c in r["val_curve"])
    for ax, label in zip(axes, ("tokens seen, all workers together", "training time, slowest rank (s)")):
        ax.set_xlabel(label)
        ax.set_ylabel("validation loss (nats/char, held-out files; mean of the workers)")
        ax.set_ylim(low * 0.97, low + (start - low) * 0.5)  # the first steps' drop would flatten the rest
        ax.grid(alpha=0.25)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 6), fontsize=8, frameon=False)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
