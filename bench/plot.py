"""PNG plots of benchmark results (matplotlib, headless)."""
from __future__ import annotations

from typing import Any, Dict, List


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install 'gradcomp[bench]'") from None
    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    return plt


def collective_plot(records: List[Dict[str, Any]], path: str, title: str = "") -> None:
    """Left: where each method's time goes (compress, communicate, decompress) beside dense;
    right: bytes per rank and speed-up over dense ``all_reduce``."""
    plt = _pyplot()
    rows = [r for r in records if r.get("collective_ms") is not None]
    names = [r["compressor"] for r in rows]
    y = list(range(len(rows)))
    comp = [r["compress_ms"] or 0.0 for r in rows]
    decomp = [r["decompress_ms"] or 0.0 for r in rows]
    comm = [max(r["collective_ms"] - c - d, 0.0) for r, c, d in zip(rows, comp, decomp)]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 0.38 * len(rows) + 2.8), sharey=True)
    ax1.barh(y, comp, color="#d95f02", label="compress")
    ax1.barh(y, comm, left=comp, color="#7570b3", label="communicate + rest")
    ax1.barh(y, decomp, left=[c + m for c, m in zip(comp, comm)], color="#1b9e77", label="decompress")
    if rows:
        ax1.axvline(rows[0]["dense_ms"], color="k", ls="--", lw=1, label="dense all_reduce")
    ax1.set_yticks(y, names)
    ax1.invert_yaxis()
    ax1.set_xlabel("ms per call (median, slowest rank)")
    longest = max([c + m + d for c, m, d in zip(comp, comm, decomp)] + [rows[0]["dense_ms"] if rows else 0.0])
    ax1.set_xlim(0, longest * 1.08 if longest > 0 else 1.0)  # the longest bar stops short of the frame
    # below the axes: inside, the legend covered the bottom bars
    ax1.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=4, fontsize=8, frameon=False)
    speed = [r["speedup"] or 0.0 for r in rows]
    ax2.barh(y, speed, color=["#999999" if r["compressor"] == "dense" else "#1b9e77" if s >= 1 else "#e7298a"
                              for r, s in zip(rows, speed)])
    ax2.axvline(1.0, color="k", lw=1)
    from matplotlib.patches import Patch

    ax2.legend(handles=[Patch(color="#1b9e77", label="faster than dense"),
                        Patch(color="#e7298a", label="slower than dense")],
               loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2, fontsize=8, frameon=False)
    for yi, r in zip(y, rows):
        ax2.text(r["speedup"] or 1.0, yi, " " + _speed_label(r), va="center", fontsize=7)
    if any(s > 0 for s in speed):
        ax2.set_xscale("log")
        ax2.set_xlim(right=max(max(speed), 1.0) * 4)  # room for the labels inside the frame
        from matplotlib.ticker import FuncFormatter, NullFormatter

        ax2.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}x"))
        ax2.xaxis.set_minor_formatter(NullFormatter())  # a narrow range labels its minor ticks on top of each other
        ax2.set_xlabel("speed-up over dense all_reduce (log)")
    else:  # one rank: nothing crosses a wire, so there is no speed-up to draw
        ax2.set_xlabel("speed-up over dense all_reduce (none: nothing is sent with one rank)")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _speed_label(r: dict) -> str:
    """``1.85x  (2.0x less data)``; what is missing (one rank sends nothing) said in words."""
    if r.get("compressor") == "dense":
        return "the baseline"
    speed = f"{r['speedup']:.2f}x" if r.get("speedup") is not None else "no speed-up"
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
