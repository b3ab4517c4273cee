"""``python -m gradcomp.bench diloco``: every method trains the character transformer from the same
start, its bytes are measured (DiLoCo sends far fewer than DDP, compressed DiLoCo fewer still),
the numbers of the table and the JSON are real, and the method names are checked in the parent."""
import importlib.util
import json
import math
import subprocess
import sys

import pytest

from gradcomp.bench import diloco

HAVE_MPL = importlib.util.find_spec("matplotlib") is not None


def test_method_names_parse_and_bad_ones_are_refused():
    spec = diloco.parse_method("streaming-f4-t5", 50)
    assert (spec["kind"], spec["fragments"], spec["delay"], spec["sync_every"]) == ("diloco", 4, 5, 52)
    spec = diloco.parse_method("diloco-topk", 50)
    assert spec["compressor"] == "topk" and spec["options"] == {"ratio": diloco.TOPK_RATIO}
    spec = diloco.parse_method("ddp-powersgd", 50)
    assert spec["kind"] == "ddp" and spec["options"]["rank"] == 4 and spec["sync_every"] is None
    assert diloco.parse_method("streaming-f2-t1-int4", 50)["compressor"] == "int4"
    for bad, match in (("sgd", "unknown method"), ("diloco-nosuch", "nosuch"), ("streaming-f2-t25", "delay")):
        with pytest.raises(ValueError, match=match):
            diloco.parse_method(bad, 50)


def test_diloco_bench_runs_tiny_and_reports_real_numbers(tmp_path):
    out, png = tmp_path / "d.json", tmp_path / "d.png"
    plot = ["--plot", str(png)] if HAVE_MPL else []
    methods = ["ddp", "diloco", "diloco-int8", "streaming-f2-t1", "local"]
    proc = subprocess.run(
        [sys.executable, "-m", "gradcomp.bench", "diloco", "--ranks", "2", "--steps", "40", "--sync-every", "10",
         "--eval-every", "20", "--methods", ",".join(methods), "--layers", "1", "--d-model", "32", "--context", "32",
         "--text-mb", "0.3", "--val-windows", "32", "--no-progress", "--json", str(out), *plot],
        capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = proc.stdout.split("\n| method")[1]
    assert all(f"| {m} " in table for m in methods) and "to ddp loss" in table
    by = {r["method"]: r for r in json.loads(out.read_text())}
    assert list(by) == methods
    ddp = by["ddp"]
    for r in by.values():
        assert [c["step"] for c in r["val_curve"]] == [0, 20, 40] and r["tokens"] == 40 * 2 * 16 * 32
        assert all(math.isfinite(c["val_loss"]) for c in r["val_curve"]), r["method"]
        assert r["val_loss"] < r["val_curve"][0]["val_loss"] - 0.5, r["method"]  # it learns
        assert r["wall_s"] > 0 and math.isfinite(r["val_vs_ddp_pct"]) and r["skipped"] == 0
    # bytes: measured, DiLoCo's far below DDP's (4 syncs against 40 exchanges), int8 a quarter of that
    assert ddp["bytes_sent"] > 0 and ddp["exchanges"] == 40 and ddp["bytes_vs_ddp"] == 1.0
    assert by["diloco"]["exchanges"] == 4 and by["streaming-f2-t1"]["exchanges"] == 8
    assert by["diloco"]["bytes_sent"] < ddp["bytes_sent"] / 8
    assert by["diloco"]["bytes_vs_ddp"] == pytest.approx(10, rel=0.05)
    assert by["diloco-int8"]["bytes_sent"] < by["diloco"]["bytes_sent"] / 3
    assert by["diloco"]["largest_exchange"] == pytest.approx(ddp["largest_exchange"], rel=0.05)  # the whole model
    assert by["diloco"]["median_exchange"] == pytest.approx(by["diloco"]["largest_exchange"], rel=0.01)
    assert by["streaming-f2-t1"]["largest_exchange"] < 0.8 * by["diloco"]["largest_exchange"]  # one fragment
    assert by["diloco"]["val_vs_diloco_pct"] == 0.0 and math.isfinite(by["diloco-int8"]["val_vs_diloco_pct"])
    assert by["local"]["bytes_sent"] == 0 and by["local"]["bytes_vs_ddp"] is None
    assert by["local"]["step_vs_local_pct"] == 0.0
    if HAVE_MPL:
        assert png.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.skipif(not diloco.HAVE_TORCHFT, reason="torchft is not installed")
def test_torchft_runs_beside_ours_and_agrees(tmp_path):
    """torchft's DiLoCo over the same group reaches the same loss as ours (the same math; the
    oracle test in tests/optim checks the parameters) and sends the same bytes."""
    out = tmp_path / "t.json"
    proc = subprocess.run(
        [sys.executable, "-m", "gradcomp.bench", "diloco", "--steps", "20", "--sync-every", "10", "--eval-every", "20",
         "--methods", "diloco,torchft", "--layers", "1", "--d-model", "32", "--context", "32", "--text-mb", "0.3",
         "--val-windows", "32", "--no-progress", "--json", str(out)], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ours, ft = json.loads(out.read_text())
    assert ft["val_loss"] == pytest.approx(ours["val_loss"], rel=1e-4)
    assert ft["exchanges"] == 2 and ft["bytes_sent"] == pytest.approx(ours["bytes_sent"], rel=0.01)


def test_bad_arguments_are_refused_before_any_rank_starts():
    for argv, match in ((["--methods", "ddp,ddp"], "once"), (["--ranks", "1"], "at least 2"),
                        (["--methods", "nosuch"], "unknown method")):
        proc = subprocess.run([sys.executable, "-m", "gradcomp.bench", "diloco", *argv], capture_output=True,
                              text=True, timeout=60)
        assert proc.returncode == 2 and match in proc.stderr, (argv, proc.stderr)
