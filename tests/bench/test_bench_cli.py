"""Smoke tests of ``python -m gradcomp.bench``: real ranks, tiny sizes, the JSON contract.

The benchmark itself is never part of the unit-test run; these only check that the command
line works end to end and reports what it promises.
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import importlib.util

import pytest

from gradcomp.bench import cli, netem

HAVE_MPL = importlib.util.find_spec("matplotlib") is not None

FIELDS = ("compressor", "world_size", "numel", "bytes_per_rank", "dense_bytes_per_rank", "ratio", "rel_error",
          "compress_ms", "decompress_ms", "collective_ms", "dense_ms", "speedup")
ROOT_REASON = None
if not sys.platform.startswith("linux") or os.geteuid() != 0 or not (shutil.which("ip") and shutil.which("tc")):
    ROOT_REASON = "--netem needs root, Linux and iproute2"


def _bench(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "gradcomp.bench", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_two_ranks_json_fields_and_plot(tmp_path):
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    plot = ["--plot", str(png)] if HAVE_MPL else []  # matplotlib comes with the bench extra
    proc = _bench("--world-size", "2", "--numel", "10000", "--compressors", "topk,fp16,torch-fp16",
                  "--repeats", "2", "--json", str(out), *plot)
    assert proc.returncode == 0, proc.stderr
    assert "torch " in proc.stdout and "loopback" in proc.stdout, "the environment header is missing"
    records = json.loads(out.read_text())
    assert [r["compressor"] for r in records] == ["dense", "topk+ef", "fp16", "torch-fp16"]
    for r in records:
        missing = [f for f in FIELDS if f not in r]
        assert not missing, f"{r['compressor']}: fields {missing} missing"
        assert r["world_size"] == 2 and r["numel"] == 10000
        assert r["collective_ms"] > 0 and r["dense_ms"] > 0
        assert r["speedup"] == pytest.approx(r["dense_ms"] / r["collective_ms"])
        assert r["bytes_per_rank"] > 0
        assert r["ratio"] == pytest.approx(r["dense_bytes_per_rank"] / r["bytes_per_rank"])
    by = {r["compressor"]: r for r in records}
    # two ranks: a ring allreduce sends the whole fp32 tensor once per rank
    assert by["dense"]["dense_bytes_per_rank"] == 4 * 10000 and by["dense"]["rel_error"] < 1e-6
    assert by["topk+ef"]["ratio"] > 20  # 1% of the values plus their indices, measured
    assert by["fp16"]["ratio"] == pytest.approx(2.0, rel=0.05) and by["fp16"]["rel_error"] < 1e-3
    assert by["torch-fp16"]["rel_error"] == pytest.approx(by["fp16"]["rel_error"], rel=1e-3)
    assert by["fp16"]["compress_ms"] is not None and by["torch-fp16"]["compress_ms"] is None
    # the default output projects the run to link rates, labelled as a projection, with the limit
    assert "projected (link model, not measured)" in proc.stdout and "@1Gbit/s" in proc.stdout
    assert "of limit" in proc.stdout and "rel.err is" in proc.stdout
    for r in records:
        at = r["projection"]["links"][str(10**9)]
        assert at["ms"] >= at["limit_ms"] * 0.5 and at["speedup"] > 0
    assert by["dense"]["projection"]["links"][str(10**9)]["speedup"] == pytest.approx(1.0)
    if HAVE_MPL:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_link_model_keeps_compute_and_puts_the_bytes_on_the_link():
    from gradcomp.bench import projection

    records = [{"compressor": "dense", "method": "dense", "collective_ms": 850.0, "bytes_per_rank": 100e6},
               {"compressor": "topk", "method": "gradcomp", "collective_ms": 120.0, "bytes_per_rank": 2e6}]
    proj = projection.project(records, [10**9, 10**10], 10**9, 1000)
    eff = proj["efficiency"]
    assert eff == pytest.approx(800 / 850)  # the dense row: 100 MB at 1 Gbit/s took 850 ms
    dense, topk = proj["rows"]
    assert dense["compute_ms"] == pytest.approx(0.0, abs=1e-9)
    assert topk["compute_ms"] == pytest.approx(120 - 16 / eff)  # 2 MB at 1 Gbit/s is 16 ms of wire
    assert topk["at"][10**10]["ms"] == pytest.approx(topk["compute_ms"] + 1.6 / eff)
    assert topk["at"][10**9]["speedup"] == pytest.approx(850 / 120)  # at the run's own rate: as measured
    assert projection.parse_links("100mbit, 25gbit") == [10**8, 25 * 10**9]
    with pytest.raises(ValueError, match="--links"):
        projection.parse_links("fast")


@pytest.mark.skipif(not HAVE_MPL, reason="the plot needs matplotlib (the bench extra)")
def test_one_rank_writes_json_and_plot(tmp_path):
    """With one rank nothing is sent (ratio and speed-up are None): the run and its plot still
    complete, so no plot of an earlier run is left beside the new JSON."""
    proc = subprocess.run([sys.executable, "-m", "gradcomp.bench", "--world-size", "1", "--numel", "10000",
                           "--compressors", "topk,fp16", "--repeats", "1"], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    records = json.loads((tmp_path / "gradcomp-bench.json").read_text())
    assert all(r["ratio"] is None for r in records if r["compressor"] != "dense")
    assert (tmp_path / "gradcomp-bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_arguments_are_one_clear_error(capsys):
    assert cli.main(["--compressors", "zip"]) == 2
    assert "unknown compressor 'zip'" in capsys.readouterr().err
    assert cli.main(["--compressors", "topk:ratio=2"]) == 2
    assert "ratio" in capsys.readouterr().err
    assert cli.main(["--numel", "0"]) == 2
    assert cli.main(["--netem", "fast"]) == 2
    assert "RATE" in capsys.readouterr().err
    assert cli.main(["--model", "resnet50", "--world-size", "4", "--local-size", "3"]) == 2
    assert "divide --world-size" in capsys.readouterr().err
    assert cli.main(["--world-size", "4", "--local-size", "2"]) == 2
    assert "with --model" in capsys.readouterr().err


def test_memory_on_a_device_this_machine_lacks_is_one_clear_error(capsys, tmp_path, monkeypatch):
    """No 'Torch not compiled with CUDA enabled' traceback, and nothing written."""
    import torch

    monkeypatch.chdir(tmp_path)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    assert cli.main(["memory", "--device", f"cuda:{gpus}", "--model", "mlp"]) == 2
    err = capsys.readouterr().err
    assert "has no such CUDA device" in err and "leave --device out" in err, err
    assert cli.main(["memory", "--device", "tpu9", "--model", "mlp"]) == 2
    assert "not a device torch knows" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_nodes_run_each_method_flat_and_hierarchical(tmp_path):
    out = tmp_path / "h.json"
    proc = _bench("--model", "resnet18", "--world-size", "4", "--local-size", "2", "--compressors", "onebit",
                  "--repeats", "1", "--json", str(out), "--no-progress", timeout=240)
    assert proc.returncode == 0, proc.stderr
    records = {r["compressor"]: r for r in json.loads(out.read_text())}
    assert set(records) == {"dense", "onebit+ef", "onebit+ef/node"}
    assert not records["onebit+ef"]["hierarchical"] and records["onebit+ef/node"]["hierarchical"]
    assert all(r["local_size"] == 2 and r["collective_ms"] > 0 for r in records.values())
    assert "onebit+ef/node" in proc.stdout


def test_netem_without_root_says_why_and_fails(monkeypatch, capsys):
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert cli.main(["--netem", "1gbit", "--numel", "1000"]) != 0
    err = capsys.readouterr().err
    assert "root" in err and "loopback" in err  # says why, and how to run without it


def _ours(pid):
    return [n for n in netem._namespaces() if n.startswith(f"{netem.PREFIX}{pid}-")]


@pytest.mark.skipif(ROOT_REASON is not None, reason=str(ROOT_REASON))
def test_netem_run_works_and_leaves_nothing(tmp_path):
    out = tmp_path / "n.json"
    proc = _bench("--netem", "1gbit", "--numel", "10000", "--compressors", "fp16", "--repeats", "1",
                  "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "emulated 1 Gbit/s" in proc.stdout
    assert [r["compressor"] for r in json.loads(out.read_text())] == ["dense", "fp16"]
    assert not any(n.startswith(netem.PREFIX) and not _alive(n) for n in netem._namespaces())


def _alive(name):
    pid = name[len(netem.PREFIX):].split("-")[0]
    return os.path.exists(f"/proc/{pid}")


@pytest.mark.skipif(ROOT_REASON is not None, reason=str(ROOT_REASON))
def test_ctrl_c_stops_the_ranks_and_removes_the_cluster():
    proc = subprocess.Popen([sys.executable, "-m", "gradcomp.bench", "--netem", "1gbit", "--numel", "1000000",
                             "--compressors", "fp16", "--repeats", "500", "--no-progress"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline, pids = time.monotonic() + 30, []
        while time.monotonic() < deadline and len(pids) < 2:  # wait until both ranks run
            time.sleep(0.2)
            names = [n for n in _ours(proc.pid) if not n.endswith("-hub")]
            pids = [p for n in names for p in subprocess.run(["ip", "netns", "pids", n], capture_output=True,
                                                             text=True).stdout.split()]
        assert len(pids) >= 2, "the ranks did not start"
        proc.send_signal(signal.SIGINT)
        err = proc.communicate(timeout=20)[1]
        assert proc.returncode == 130, err
        assert "interrupted" in err
        assert _ours(proc.pid) == []
        time.sleep(0.2)
        assert not [p for p in pids if os.path.exists(f"/proc/{p}")], "a rank outlived the benchmark"
    finally:
        if proc.poll() is None:
            proc.kill()


def test_train_smoke(tmp_path):
    pytest.importorskip("sklearn", reason="the training benchmark's data comes with scikit-learn (the bench extra)")
    out, png = tmp_path / "t.json", tmp_path / "t.png"
    plot = ["--plot", str(png)] if HAVE_MPL else []
    proc = _bench("train", "--epochs", "1", "--hidden", "32", "--compressors", "powersgd", "--error-feedback", "on",
                  "--json", str(out), *plot)
    assert proc.returncode == 0, proc.stderr
    assert "digits" in proc.stdout
    records = json.loads(out.read_text())
    by = {r["method"]: r for r in records}
    assert list(by) == ["torch-allreduce", "torch-fp16", "torch-powersgd:rank=4", "powersgd:rank=4+ef"]
    for r in records:
        assert r["ranks_agree"], f"{r['method']}: the ranks' weights differ after training"
        assert r["test_accuracy"] > 0.3 and r["step_ms"] > 0 and len(r["loss_curve"]) == r["steps"] > 0
        assert r["loss_curve"][-1] < r["loss_curve"][0]
    assert by["torch-allreduce"]["accuracy_vs_dense_pp"] == 0
    assert by["torch-fp16"]["bytes_per_step"] == pytest.approx(by["torch-allreduce"]["bytes_per_step"] / 2, rel=0.01)
    assert by["powersgd:rank=4+ef"]["bytes_per_step"] < by["torch-allreduce"]["bytes_per_step"] / 2
    if HAVE_MPL:
        assert png.read_bytes()[:4] == b"\x89PNG"


def test_train_subcommand_may_follow_options(monkeypatch):
    """`python -m gradcomp.bench --no-progress train ...` runs the training benchmark."""
    from gradcomp.bench import train

    seen = []
    monkeypatch.setattr(train, "main", lambda argv: seen.append(list(argv)) or 0)
    assert cli.main(["--no-progress", "train", "--epochs", "1"]) == 0
    assert seen == [["--no-progress", "--epochs", "1"]]


@pytest.mark.parametrize("sub", sorted(cli.SUBCOMMANDS))
def test_every_subcommand_explains_itself(sub, capsys):
    """``python -m gradcomp.bench <sub> --help`` prints its options (argparse formats help
    strings with %, so a stray % in one stops the whole command)."""
    with pytest.raises(SystemExit) as done:
        cli.main([sub, "--help"])
    assert done.value.code == 0
    assert "usage: python -m gradcomp.bench" in capsys.readouterr().out


def test_fsdp_hsdp_smoke(tmp_path):
    """``bench fsdp --hsdp 2`` on 4 ranks: FSDP2's own HSDP against compress_fsdp's replicas'
    all-reduce, dense and int8 with a bf16 all-gather (asynchronous, prefetched: --overlap's
    default); the compressed one sends fewer bytes, every method trains, and the step's
    breakdown, the compute-only step and the timeline of one step are reported."""
    pytest.importorskip("sklearn", reason="the FSDP benchmark's data comes with scikit-learn (the bench extra)")
    out, png = tmp_path / "h.json", tmp_path / "t.png"
    plot = ["--plot", str(png)] if HAVE_MPL else []
    proc = _bench("fsdp", "--world-size", "4", "--hsdp", "2", "--epochs", "1", "--width", "32", "--layers", "1",
                  "--methods", "hsdp-fp32,gc-hsdp-dense,gc-hsdp-int8-bf16ag", "--json", str(out), *plot, timeout=600)
    assert proc.returncode == 0, proc.stderr
    by = {r["method"]: r for r in json.loads(out.read_text())}
    assert set(by) == {"hsdp-fp32", "gc-hsdp-dense", "gc-hsdp-int8-bf16ag"}
    assert by["gc-hsdp-int8-bf16ag"]["bytes_per_step"] < by["gc-hsdp-dense"]["bytes_per_step"]
    for r in by.values():
        assert r["step_ms"] > 0 and r["test_accuracy"] > 0.1 and r["skipped"] == 0
        assert r["overlap"] and r["compute_only_ms"] > 0
        kinds = {e[0] for e in r["timeline_rank0"]}
        assert {"F", "B", "S", "AG", "RS"} <= kinds, kinds
        assert r["breakdown_ms_rank0"]["F"] > 0 and r["breakdown_ms_rank0"]["AG"] > 0
    assert by["hsdp-fp32"]["breakdown_ms_rank0"]["AR"] > 0  # FSDP2's own replicas' all-reduce
    assert "vs hsdp-fp32" in proc.stdout and "where a step's time goes" in proc.stdout
    assert not plot or png.stat().st_size > 0
    bad = _bench("fsdp", "--world-size", "4", "--hsdp", "3")
    assert bad.returncode == 2 and "--hsdp" in bad.stderr
