"""What the benchmarks tell a user: the main job's recommendation and legend, the plots, the
help, the memory benchmark's rounds and partial results (no ranks: synthetic results, tiny chains)."""
import importlib.util
import json
import math
from collections import OrderedDict

import pytest
import torch
from torch import nn

from gradcomp.bench import cli, collective, projection, spread

HAVE_MPL = importlib.util.find_spec("matplotlib") is not None
needs_mpl = pytest.mark.skipif(not HAVE_MPL, reason="the plots need matplotlib (the bench extra)")
GBIT = 10**9


def _records():
    """A loopback run where the fastest methods are ones nobody should train with: randomk
    (unbiased only through its n/k rescale, rel.err ~10) and topk without error feedback."""
    dense = {"compressor": "dense", "method": "dense", "error_feedback": False, "collective_ms": 80.0,
             "bytes_per_rank": 16e6, "speedup": 1.0}

    def rec(label, ef, ms, nbytes, kind="gradcomp"):
        return {"compressor": label, "method": kind, "error_feedback": ef, "collective_ms": ms,
                "bytes_per_rank": nbytes, "speedup": 80.0 / ms}

    return [dense, rec("randomk", False, 30.0, 0.17e6), rec("topk", False, 35.0, 0.34e6),
            rec("topk+ef", True, 60.0, 0.34e6), rec("powersgd+ef", True, 70.0, 0.07e6),
            rec("qsgd", False, 200.0, 4.2e6), rec("torch-powersgd:rank=4", True, 90.0, 0.07e6, "torch-powersgd")]


def test_the_recommendation_comes_only_from_methods_to_train_with():
    records = _records()
    proj = projection.project(records, [GBIT, 100 * GBIT], None, 1000)
    assert [projection.trainable(r) for r in records] == [False, False, False, True, True, True, True]
    ranked = projection.recommend(proj, records, GBIT)
    assert [name for name, _ in ranked[:2]] == ["topk+ef", "powersgd+ef"]
    text = projection.summary(proj, True, records)
    first = next(line for line in text.splitlines() if "use " in line)
    assert "use topk+ef" in first and "runner-up powersgd+ef" in first, text
    assert "randomk" not in first and "use topk," not in first
    assert "randomk" in text.split("Left out of the recommendation")[1].splitlines()[0]  # named, with why
    assert "n/k" in text  # randomk's error is its rescale, not error feedback's doing
    assert "cannot know the accuracy on your task" in text
    # nothing trainable was run: say so, recommend nothing
    none = projection.summary(proj, True, records[:3])
    assert "no recommendation" in none and "use " not in none


def test_the_projection_table_explains_limit_and_of_limit():
    proj = projection.project(_records(), [GBIT, 10 * GBIT], None, 1000)
    text = projection.table(proj, "loopback")
    assert "limit@1Gbit/s" in text and "of limit" in text
    legend = text.split("\n\n")[-1]
    assert legend.startswith("compute:") and "limit@1Gbit/s: the fastest" in legend and "of limit:" in legend


def test_help_lists_every_subcommand_and_every_memory_option_has_help(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    listed = out.split("subcommands")[1].split("options:")[0]
    for sub in cli.SUBCOMMANDS:
        assert f"\n  {sub} " in listed, f"{sub} is missing from --help"
    from gradcomp.bench import memory

    bare = [a.option_strings for a in memory.parser()._actions if not a.help]
    assert not bare, f"memory options without help text: {bare}"


@needs_mpl
def test_the_plot_shows_the_projection_and_reads_clearly(tmp_path):
    from gradcomp.bench import plot

    assert len({plot._COMPRESS, plot._COMM, plot._DECOMP, plot._FASTER, plot._SLOWER}) == 5
    records = [dict(r, dense_ms=80.0, compress_ms=1.0, decompress_ms=1.0, ratio=2.0) for r in _records()]
    proj = projection.project(records, [GBIT, 10 * GBIT], None, 1000)
    fig = plot.collective_plot(records, str(tmp_path / "c.png"), "t", proj=proj)
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"
    bars, speed, where = fig.axes[:3]
    labels = [t.get_text() for t in speed.get_xticklabels()]
    assert "1x" in labels and len([t for t in labels if t]) >= 3, labels  # not only 1x labelled
    assert where.get_xscale() == "log" and "link rate" in where.get_xlabel()
    legend = [t.get_text() for t in where.get_legend().get_texts()]
    assert any(t.startswith("topk+ef") for t in legend) and not any(t.startswith("randomk ") for t in legend)
    assert any("measured" in t for t in legend)
    # the legends sit on the panels' top edge: no gap to tune
    assert bars.get_legend().get_bbox_to_anchor().y0 == pytest.approx(bars.get_window_extent().y1, abs=1)


@needs_mpl
def test_sharded_plot_flag_writes_the_plot(tmp_path, monkeypatch):
    pytest.importorskip("sklearn", reason="the sharded benchmark's data comes with scikit-learn")
    from gradcomp.bench import launch

    def fake(kind, cfg, world, **kw):  # the ranks' records, as the sharded run returns them
        assert kind == "sharded"
        return [[{"method": m, "state_bytes": 1e4 * (i + 1), "held_bytes": 2e4, "bytes_per_step": 3e3,
                  "step_ms": 5.0 + i, "test_accuracy": 0.9 + 0.01 * i, "state_vs_ddp": 1.0, "bytes_vs_zero": 1.0,
                  "speedup_vs_zero": 1.0, "accuracy_vs_dense_pp": 0.0, "ranks_agree": True, "phases_ms_rank0": {}}
                 for i, m in enumerate(cfg["methods"])]]

    monkeypatch.setattr(launch, "run_ranks", fake)
    png = tmp_path / "s.png"
    assert cli.main(["sharded", "--methods", "ddp-adamw,ours-dense", "--plot", str(png), "--no-progress"]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG"


# ---- the memory benchmark ----------------------------------------------------------------------
def _tiny(name, device, scale=1.0):
    torch.manual_seed(0)
    model = nn.Sequential(OrderedDict([(f"stage_{i}", nn.Sequential(nn.Linear(8, 8), nn.ReLU())) for i in range(4)]))
    return model, torch.randn(4, 8), torch.randint(0, 8, (4,)), "tiny"


def test_memory_rounds_alternate_the_methods():
    from gradcomp.bench import memory

    model, x, y, _ = _tiny("mlp", None)
    state = model.state_dict()
    calls, seen = [], []

    def forward(tag):
        def f(inp):
            calls.append(tag)
            return model(inp)
        return f

    methods = [memory.Method(t, "none", forward(t)) for t in "abc"]
    memory.rounds(model, state, methods, x, y, 3, lambda i: seen.append((i, [len(m.times) for m in methods])))
    assert calls == list("abcbcacab")  # one step of each per round, the order rotating
    assert seen == [(0, [1, 1, 1]), (1, [2, 2, 2]), (2, [3, 3, 3])]  # told after every round
    assert methods[0].ratios == [1.0, 1.0, 1.0] and all(len(m.ratios) == 3 for m in methods)


def test_memory_bench_writes_results_after_every_round_and_keeps_them_when_stopped(tmp_path, monkeypatch, capsys):
    from gradcomp.bench import memory

    monkeypatch.setattr(memory, "build", _tiny)
    monkeypatch.setattr(memory, "solve_time", lambda device: {"solve_s_max": 0.0})
    out = tmp_path / "m.json"
    argv = ["--model", "mlp", "--codecs", "int8", "--budgets", "0.5", "--repeats", "2", "--json", str(out)]
    assert memory.main(argv) == 0
    done = json.loads(out.read_text())
    assert done["complete"] and done["results"][0]["complete"]
    recs = done["results"][0]["records"]
    assert {r["rounds"] for r in recs} == {2} and recs[0]["method"] == "no saving"
    assert any(r["method"].startswith("plan lossless") for r in recs)
    table = capsys.readouterr().out
    rows = [line for line in table.splitlines() if "MiB" in line]
    assert len({line.index("MiB") for line in rows}) == 1, "the table's columns do not line up"

    # stopped in the second round: the file holds every method's first round
    steps, real = [0], memory.step
    per_round = len(recs)

    def stop_in_round_two(*a, **kw):
        steps[0] += 1
        if steps[0] > 1 + (per_round - 1) + per_round + 1:  # base, warm-ups, round one, one more
            raise KeyboardInterrupt
        return real(*a, **kw)

    monkeypatch.setattr(memory, "step", stop_in_round_two)
    with pytest.raises(KeyboardInterrupt):
        memory.main(argv)
    partial = json.loads(out.read_text())
    assert not partial["complete"] and not partial["results"][0]["complete"]
    assert {r["rounds"] for r in partial["results"][0]["records"]} == {1}


def test_long_labels_keep_the_tables_aligned():
    from gradcomp.bench import memory
    from gradcomp.memory import plan_memory
    from gradcomp.memory import schedule as sch
    from gradcomp.memory.planner import Plan

    base = {"peak_bytes": 2**20, "step_s": 0.1, "time_ratio": 1.0, "bit_identical": True, "grad_rel_error": 0.0}
    rows = [dict(base, method="no saving"), dict(base, method="plan bf16+int8 @ checkpoint_sequential(12)'s peak")]
    lines = memory.table(rows).splitlines()
    assert len({line.index("MiB") for line in lines[1:3]}) == 1 and lines[0].index("peak saved") > 40

    torch.manual_seed(0)
    model = nn.Sequential(OrderedDict([(f"a_rather_long_stage_name_of_a_real_model_{i}",
                                        nn.Sequential(nn.Linear(16, 16), nn.ReLU())) for i in range(4)]))
    plan = plan_memory(model, torch.randn(4, 16), 10**9, allow=("recompute", "compress"), repeats=1)
    n = plan.costs.length  # the widest cell a plan prints: a stored stage inside a recomputed segment
    wide = Plan(plan.costs, [sch.Recompute(0, n - 2, tuple(sch.Plain(i, "compress:lossless") for i in range(n - 1))),
                             sch.Plain(n - 1)], plan.budget, plan.names, plan.fingerprint, plan.device, plan.notes)
    text = str(wide).splitlines()
    table = [text[0]] + text[2:2 + n]
    assert len({len(line) for line in table}) == 1, "\n".join(table)
    assert "a_rather_long_stage_name_of_a_real_model_3" in text[2 + n - 1]  # names are not cut either


@needs_mpl
def test_memory_plot_labels_of_neighbouring_points_do_not_overlap(tmp_path):
    """ckpt(4) and ckpt(5) at nearly the same peak and time printed on top of each other."""
    from gradcomp.bench import memory

    def rec(method, kind, peak, ratio):
        return {"method": method, "kind": kind, "peak_bytes": peak, "time_ratio": ratio}

    recs = [rec("no saving", "none", 3 * 2**20, 1.0), rec("checkpoint_sequential(4)", "checkpoint", 1.25 * 2**20, 1.30),
            rec("checkpoint_sequential(5)", "checkpoint", 1.22 * 2**20, 1.31),
            rec("compressed_activations(int8)", "codec", 1.24 * 2**20, 1.29)]
    from gradcomp.bench.plot import _pyplot

    plt = _pyplot()
    fig, ax = plt.subplots()
    texts = [ax.annotate(r["method"], (r["peak_bytes"], r["time_ratio"]), textcoords="offset points",
                         xytext=(5, 4), fontsize=7) for r in recs]
    ax.scatter([r["peak_bytes"] for r in recs], [r["time_ratio"] for r in recs])
    memory.place_labels(fig, texts)
    boxes = [t.get_window_extent(fig.canvas.get_renderer()) for t in texts]
    assert not any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1:])
    plt.close(fig)
    memory.frontier_plot([{"model": "mlp", "records": recs}], str(tmp_path / "f.png"), "t")
    assert (tmp_path / "f.png").read_bytes()[:4] == b"\x89PNG"


def test_the_summary_says_below_which_link_rate_each_method_pays():
    records = _records()
    proj = projection.project(records, [GBIT, 100 * GBIT], None, 1000)
    by = {row["compressor"]: row for row in proj["rows"]}
    rate = projection.break_even(proj, by["topk+ef"])
    dense, topk = by["dense"], by["topk+ef"]

    def ms(row, R):
        return row["compute_ms"] + row["bytes_per_rank"] * 8 / (R * proj["efficiency"]) * 1e3

    assert ms(topk, rate) == pytest.approx(ms(dense, rate))  # level with dense exactly there
    assert ms(topk, rate / 2) < ms(dense, rate / 2) and ms(topk, rate * 2) > ms(dense, rate * 2)
    text = projection.summary(proj, True, records)
    line = next(t for t in text.splitlines() if t.startswith("Break-even"))
    for name in ("topk+ef", "powersgd+ef", "qsgd", "torch-powersgd:rank=4"):  # every method to train with
        assert f"{name} {projection.break_even_cell(by[name])}" in line, line
    assert "topk+ef 2.3G" in line and "randomk" not in line
    table = projection.table(proj, "loopback")
    assert "break-even" in table.splitlines()[1] and "(dense bytes - its bytes) * 8" in table
    assert next(t for t in table.splitlines() if t.startswith("topk+ef ")).endswith(" 2.3G")
    # no fewer bytes: never; no more compute: at every rate
    none = dict(by["topk+ef"], bytes_per_rank=dense["bytes_per_rank"])
    every = dict(by["topk+ef"], compute_ms=dense["compute_ms"], compute_span=dense["compute_span"])
    assert projection.break_even_cell(dict(none, break_even=projection.break_even(proj, none),
                                           break_even_span=projection.break_even_span(proj, none))) == "none"
    assert projection.break_even_cell(dict(every, break_even=projection.break_even(proj, every),
                                           break_even_span=(math.inf, math.inf))) == "every"


# ---- spreads and ties -----------------------------------------------------------------------------
def test_the_middle_half_and_when_two_spans_are_a_tie():
    assert spread.middle_half([21, 34, 22, 30, 25]) == (22, 30)  # the 2nd and 4th of five
    assert spread.middle_half([7.0]) == (7.0, 7.0)
    assert spread.versus((10, 12), (13, 20)) == "faster" and spread.versus((21, 25), (13, 20)) == "slower"
    assert spread.versus((19, 25), (13, 20)) == "tie" and spread.overlap((1, 2), (2, 3))
    assert spread.ratio_span((20, 30), (10, 15)) == (20 / 15, 3.0)


def _raw(times, dense_times, nbytes, rel_error=0.0):
    """One rank's raw result of a method, as ``collective._time_calls`` returns it."""
    return {"times_ms": times, "dense_times_ms": dense_times, "stats": [{"bytes": nbytes}] * len(times),
            "warm_stats": {}, "rel_error": rel_error, "setup_calls": 0, "settled": True}


def test_records_keep_each_methods_spread_and_call_overlapping_ones_a_tie():
    """dense ran 21-34 ms: a method at 25 ms is a tie with it, one at 10 ms is faster, and the
    speed-up is against the dense calls made beside each method's own."""
    methods = [{"label": "dense", "kind": "dense", "ef": False}, {"label": "a", "kind": "gradcomp", "ef": False},
               {"label": "b", "kind": "gradcomp", "ef": True}]
    dense = [21.0, 34.0, 22.0, 30.0, 25.0]
    rank = [_raw(dense, [], 100), _raw([26.0, 24.0, 27.0, 23.0, 25.0], [22.0, 30.0, 24.0, 33.0, 26.0], 50),
            _raw([10.0, 11.0, 9.0, 10.5, 9.5], [40.0, 41.0, 39.0, 42.0, 38.0], 10)]
    records = collective._records(methods, [rank, rank], {"repeats": 5, "warmup": 1}, 2, 1000)
    d, a, b = records
    assert d["vs_dense"] == "baseline" and d["collective_ms_span"] == [24.5, 38.5]  # all 15 dense calls
    assert sorted(d["collective_ms_repeats"]) == sorted(dense + rank[1]["dense_times_ms"] + rank[2]["dense_times_ms"])
    assert a["collective_ms"] == 25.0 and a["collective_ms_span"] == [24.0, 26.0] and a["vs_dense"] == "tie"
    assert a["dense_ms"] == 26.0 and a["speedup"] == pytest.approx(26.0 / 25.0)
    assert b["vs_dense"] == "faster" and b["dense_ms"] == 40.0 and b["speedup"] == pytest.approx(4.0)
    assert b["speedup_span"] == pytest.approx([39.0 / 10.5, 41.0 / 9.5])
    table = cli.collective_table(records)
    row = next(t for t in table.splitlines() if t.startswith("a "))
    assert "24.0-26.0" in row and row.split()[-3] == "tie", row
    assert "tie when they do" in " ".join(table.split())


def _spread_records(top_span, second_span):
    """Two methods to train with, 2.89x and 2.82x over dense at 1 Gbit/s, with given spreads."""
    dense = {"compressor": "dense", "method": "dense", "error_feedback": False, "collective_ms": 80.0,
             "collective_ms_span": [79.0, 81.0], "bytes_per_rank": 10e6}
    return [dense,
            {"compressor": "topk+ef", "method": "gradcomp", "error_feedback": True, "collective_ms": 27.7,
             "collective_ms_span": top_span, "bytes_per_rank": 0.2e6},
            {"compressor": "onebit+ef", "method": "gradcomp", "error_feedback": True, "collective_ms": 28.4,
             "collective_ms_span": second_span, "bytes_per_rank": 0.2e6}]


def test_the_summary_calls_methods_within_the_noise_a_tie_not_a_winner():
    records = _spread_records([26.0, 29.0], [27.0, 30.0])
    proj = projection.project(records, [GBIT], GBIT, 1000)
    text = projection.summary(proj, False, records)
    first = next(t for t in text.splitlines() if "use " in t)
    assert "use topk+ef" in first and "ties with it: onebit+ef" in first and "cannot tell them apart" in first
    assert "runner-up" not in first
    apart = _spread_records([27.0, 28.0], [28.2, 29.0])
    first = next(t for t in projection.summary(projection.project(apart, [GBIT], GBIT, 1000), False,
                                               apart).splitlines() if "use " in t)
    assert "runner-up onebit+ef" in first and "ties" not in first


def test_every_left_out_method_has_its_reason_and_auto_is_reported_not_projected():
    records = _records() + [
        {"compressor": n, "method": "gradcomp", "error_feedback": ef, "collective_ms": 50.0, "bytes_per_rank": 1e6,
         "speedup": 1.6} for n, ef in (("signsgd", False), ("threshold+ef", True), ("dgc+ef", True),
                                       ("int8+ef", True), ("none", False))] + [
        {"compressor": "auto", "method": "auto", "error_feedback": True, "collective_ms": 78.0,
         "bytes_per_rank": 16e6, "speedup": 1.03, "speedup_span": [0.9, 1.2], "vs_dense": "tie",
         "auto_choices": "dense x1"}]
    proj = projection.project(records, [GBIT], None, 1000)
    assert "auto" not in {row["compressor"] for row in proj["rows"]}
    text = projection.summary(proj, True, records)
    left = next(t for t in text.splitlines() if t.startswith("Left out"))
    for name, why in (("randomk", "n/k"), ("topk", "without error feedback"), ("signsgd", "+-1"),
                      ("threshold+ef", "tau"), ("dgc+ef", "approximate top-k"), ("int8+ef", "not measured"),
                      ("none", "identity")):
        assert f"{name}: " in left and why in left.split(f"{name}: ")[1].split(";")[0], (name, left)
    assert "auto: " not in left
    mine = next(t for t in text.splitlines() if t.startswith("auto chose"))
    assert "dense x1" in mine and "1.03x (0.90-1.20x)" in mine and "a tie with dense" in mine
    assert "not projected" in mine


@needs_mpl
def test_the_speed_up_bars_start_at_1x_and_the_run_says_where_it_sits(tmp_path):
    from gradcomp.bench import plot

    records = [dict(r, dense_ms=80.0, compress_ms=1.0, decompress_ms=1.0, ratio=2.0,
                    collective_ms_span=[r["collective_ms"] * 0.9, r["collective_ms"] * 1.1],
                    speedup_span=[r["speedup"] * 0.8, r["speedup"] * 1.2],
                    vs_dense="baseline" if r["compressor"] == "dense" else "faster") for r in _records()]
    proj = projection.project(records, [GBIT, 10 * GBIT], None, 1000)
    fig = plot.collective_plot(records, str(tmp_path / "c.png"), "t", proj=proj)
    speed, where = fig.axes[1], fig.axes[2]
    assert speed.get_xscale() == "log"
    lo, hi = speed.get_xlim()
    bars = speed.patches
    assert len(bars) == len(records)
    for bar, r in zip(bars, records):  # from 1x to the speed-up: a length that is the factor
        assert bar.get_x() == pytest.approx(1.0)
        assert bar.get_x() + bar.get_width() == pytest.approx(r["speedup"])
    assert lo < 1.0 < hi and math.log(hi) > math.log(max(r["speedup"] for r in records))
    legend = [t.get_text() for t in where.get_legend().get_texts()]
    run = next(t for t in legend if t.startswith("this run"))
    moved = projection.rate_label(int(float(f"{proj['run_rate']:.2g}")))
    assert f"dense all_reduce moved its bytes at {moved}" in run and "efficiency" in run


# ---- the memory benchmark's ratio column ----------------------------------------------------------
def test_memory_x_no_saving_is_the_ratio_of_the_printed_medians():
    """Under load a median of per-round ratios disagrees with the step column (here 1.50x
    against steps of 150 and 120 ms); the column a reader checks is step / no saving's step."""
    from gradcomp.bench import memory

    base, m = memory.Method("no saving", "none", None), memory.Method("ckpt", "checkpoint", None)
    base.times, m.times = [0.100, 0.120, 0.200], [0.150, 0.180, 0.150]
    base.ratios, m.ratios = [1.0, 1.0, 1.0], [1.5, 1.5, 0.75]
    rec = memory.record(m, "mlp", base)
    assert rec["time_ratio"] == pytest.approx(0.150 / 0.120)
    assert rec["round_ratio"] == 1.5 and rec["round_ratio_span"] == [1.125, 1.5]
    table = memory.table([memory.record(base, "mlp", base), rec])
    row = next(t for t in table.splitlines() if t.strip().startswith("ckpt"))
    assert "150.0 ms" in row and "1.25x" in row and "1.50x (1.12-1.50)" in row
    assert "step / no saving's step" in " ".join(table.split())
