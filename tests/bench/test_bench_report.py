"""What the benchmarks tell a user: the main job's recommendation and legend, the plots, the
help, the memory benchmark's rounds and partial results (no ranks: synthetic results, tiny chains)."""
import importlib.util
import json
from collections import OrderedDict

import pytest
import torch
from torch import nn

from gradcomp.bench import cli, projection

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
    assert len({line.index("MiB") for line in lines[1:]}) == 1 and lines[0].index("peak saved") > 40

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


def test_the_summary_says_below_which_link_rate_compression_pays():
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
    assert f"topk+ef beats dense on links slower than {projection.rate_label(int(float(f'{rate:.2g}')))}" in text
