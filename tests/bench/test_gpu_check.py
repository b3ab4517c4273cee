"""``tools/gpu_check.sh``'s logic, with bounded work and no wall-clock figure: what it collects
(with only the device's packages importable), how it counts and judges a part (minimums,
nothing collected is a failure, a failed test, a part killed at its limit), the budget
arithmetic and the report. The real run needs a CUDA GPU; the script is the check there."""
import contextlib
import importlib.util
import io
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gradcomp.kernels import _cupy

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ROOT / "tools"
SCRIPT = TOOLS / "gpu_check.sh"
PY = sys.executable


def _tool(name):
    """A script of tools/ as a module (tools/ is a folder of scripts outside the package, not a package)."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # before it runs: its dataclasses look their module up there
        spec.loader.exec_module(module)
    return sys.modules[name]


gc = _tool("gpu_check")


def _env(**extra):
    return dict(os.environ, PATH=f"{Path(PY).parent}{os.pathsep}{os.environ['PATH']}", **extra)


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_list_mode_collects_every_part_with_only_the_device_packages(tmp_path):
    report = tmp_path / "out" / "gpu_report.md"
    proc = subprocess.run(["bash", str(SCRIPT), "--list", str(report)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=1200, env=_env(GPU_CHECK_DEVICE_PACKAGES_ONLY="1"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    text = report.read_text()
    assert text.startswith("# gradcomp GPU check (--list")
    summary = text[text.index("## Summary"):]
    parts = gc.plan(ROOT, tmp_path)
    for p in parts:
        row = re.search(rf"^\| {re.escape(p.name)} \| ([^|]*) \| (\S+) \|", summary, re.M)
        assert row, f"{p.name} missing from the summary"
        if p.kind == "pytest":  # every test group has at least its minimum, collected without errors
            assert row.group(1).startswith("would run") and int(row.group(2)) >= p.minimum >= 1, row.group(0)
    assert re.search(r"^\| collect GPU tests \| ok \| \d+ \| 0 \|", summary, re.M), summary
    assert "- result: PASS" in text and (report.parent / "gpu_report.md.logs").is_dir()
    # tests of every GPU folder are among them (the multi-rank ones: gloo ranks on CUDA tensors)
    log = (report.parent / "gpu_report.md.logs" / "collect_GPU_tests.log").read_text()
    ids, errors = gc.read_collection(log)
    assert not errors and {i.split("/")[1] for i in ids} >= {"collectives", "training", "memory", "kernels"}


def test_a_part_is_judged_on_its_passed_tests_with_only_the_device_packages(tmp_path):
    """One pytest run through the device-packages mode: its tests pass, fail and skip, and one
    of them finds that a module only an extra provides is absent, to import and to find_spec."""
    refused = gc.refused_modules()
    assert not {"torch", "numpy", "pytest", "_pytest", "pluggy", "gradcomp"} & refused
    for name in ("hypothesis", "sklearn", "pytest_benchmark", "matplotlib"):
        assert importlib.util.find_spec(name) is None or name in refused, name
    (tmp_path / "test_some.py").write_text(
        "import importlib.util\nimport pytest\n"
        "def test_extras_absent():\n    assert importlib.util.find_spec('hypothesis') is None\n"
        "    with pytest.raises(ImportError):\n        import sklearn  # noqa: F401\n"
        "    import numpy  # noqa: F401\n"
        "def test_b(): pass\n@pytest.mark.skip(reason='x')\ndef test_c(): pass\n")
    (tmp_path / "test_bad.py").write_text("def test_a(): pass\ndef test_b(): assert False\n")
    logs = tmp_path / "logs"
    logs.mkdir()
    part = gc.Part("mixed", 60, 3, "pytest", gc.pytest_argv(PY, True) + ["-v", "-p", "no:cacheprovider"],
                   tests=[f"{tmp_path}/test_some.py", f"{tmp_path}/test_bad.py"])
    o = gc.run_part(part, 900, logs, ROOT)  # a guard against a hang only
    assert (o.passed, o.failed, o.skipped) == (3, 1, 1), Path(o.log).read_text()
    assert sorted(o.by_file.values()) == [[1, 1, 0], [2, 0, 1]]
    assert (o.ok, o.status) == (False, "FAILED: 1 failed, exit code 1")
    # the same counts without the failure: at least the minimum passes, fewer or all skipped does not
    assert gc.judge("pytest", 0, 3, 0, 3, 60) == (True, "ok")
    assert gc.judge("pytest", 0, 2, 0, 3, 60) == (False, "BELOW MINIMUM: 2 passed, at least 3 expected")
    assert gc.judge("pytest", 0, 0, 0, 1, 60)[0] is False
    # nothing collected (pytest's exit code 5), or nothing assigned to the part: a failure
    assert int(pytest.ExitCode.NO_TESTS_COLLECTED) == 5
    five = gc.Part("none", 60, 0, "pytest", [PY, "-c", "raise SystemExit(5)"], tests=["x.py"])
    o = gc.run_part(five, 600, logs, tmp_path)
    assert not o.ok and o.status == "NOTHING RAN: no tests collected (pytest exit 5)"
    o = gc.run_part(gc.Part("empty", 60, 0, "pytest", [PY, "-m", "pytest"]), 600, logs, tmp_path)
    assert not o.ok and o.status.startswith("NOTHING RAN")


def test_checks_counted_per_line_and_a_part_killed_at_its_limit(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()

    def lines(minimum, code, outputs=()):
        return gc.Part("p", 60, minimum, "lines" if minimum else "command", [PY, "-c", code], outputs=list(outputs))

    o = gc.run_part(lines(2, "print('PASS a'); print('PASS b')"), 600, logs, tmp_path)
    assert (o.ok, o.passed) == (True, 2)
    o = gc.run_part(lines(3, "print('PASS a'); print('PASS b')"), 600, logs, tmp_path)
    assert o.status == "BELOW MINIMUM: 2 passed, at least 3 expected"
    o = gc.run_part(lines(1, "print('PASS a'); print('FAIL b')"), 600, logs, tmp_path)
    assert not o.ok and (o.passed, o.failed) == (1, 1)
    o = gc.run_part(lines(0, "pass", [str(tmp_path / "never.json")]), 600, logs, tmp_path)
    assert (o.ok, o.status) == (False, "FAILED: wrote no never.json")
    # a command past its limit is killed with what it started and reported, whatever the load:
    # afterwards no process carrying this run's token is alive (none, if the kill came first)
    token = f"gpu-check-kill-{os.getpid()}-{tmp_path.name}"
    child = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)', " \
            "sys.argv[1]]); print('PASS started', flush=True); time.sleep(600)"
    part = gc.Part("p", 60, 1, "lines", [PY, "-c", child, token])
    o = gc.run_part(part, 1, logs, tmp_path)
    assert (o.ok, o.status) == (False, "TIMEOUT after 1s")
    # SIGKILL is sent to the whole group; on a loaded machine a killed process may take a moment
    # to leave the run queue, so look again (bounded) before calling it a survivor
    for _ in range(600):
        if not _alive_with(token):
            break
        time.sleep(0.05)
    assert _alive_with(token) == [], "a process of the killed part outlived it"


def _alive_with(token):
    """Pids of live (not zombie) processes whose command line holds ``token``."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if token.encode() in (proc / "cmdline").read_bytes() and \
                    (proc / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                found.append(int(proc.name))
        except (OSError, ValueError, IndexError):  # not a process, or gone meanwhile
            continue
    return found


def _fake_plan(gpus):
    env = json.dumps({"gpu_count": gpus, "gpus": [f"{i}: Fake GPU" for i in range(gpus)], "torch": "t"})
    return [gc.Part("environment", 30, 1, "lines", [PY, "-c", f"print('ENV {env}'); print('PASS read')"]),
            gc.Part("tests", 40, 1, "lines", [PY, "-c", "print('PASS one')"]),
            gc.Part("NCCL smoke: 2 ranks, one GPU each", 50, 4, "lines", [PY, "-c", "print('PASS a')"], needs_gpus=2)]


def test_budget_arithmetic():
    parts = gc.plan(ROOT, Path("logs"))
    one, two = gc.caps_total(parts, 1), gc.caps_total(parts, 2)
    assert one < two <= gc.MAX_BUDGET_S <= 540  # with start-up, one device command of 10 minutes
    assert one == sum(gc.CAPS.values()) - gc.CAPS["NCCL smoke: 2 ranks, one GPU each"]
    assert all(p.cap_s > 0 for p in parts) and {p.name for p in parts} == set(gc.CAPS)
    assert all(p.minimum >= 1 for p in parts if p.kind in ("pytest", "lines", "collect"))
    # a part runs until the sum of the caps up to it, never past the budget
    assert gc.limit_for(100, 500, 20.0) == 80
    assert gc.limit_for(100, 60, 20.0) == 40
    assert gc.limit_for(100, 500, 99.5) == 0


def test_report_of_a_run(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(gc, "plan", lambda root, logs, py=PY: _fake_plan(1))
    rc = gc.main([str(tmp_path / "r.md"), "--root", str(tmp_path)])
    text = (tmp_path / "r.md").read_text()
    assert rc == 0, text
    assert "1 GPU(s): 0: Fake GPU" in text and "budget 70s, the parts' caps add up to 70s" in text
    assert "NCCL between ranks was not exercised: this machine has 1 GPU(s), and NCCL needs one GPU per rank" in text
    assert re.search(r"^\| tests \| ok \| 1 \| 0 \| 0 \| 1 \| \d+s \| 40s", text, re.M), text
    assert "| NCCL smoke: 2 ranks, one GPU each | NOT RUN: needs 2 GPUs, 1 here |" in text
    out = capsys.readouterr().out
    assert "NCCL between ranks was not exercised" in out and "environment: 1 GPU(s): 0: Fake GPU" in out
    # no GPU: every later part fails, none is tried
    monkeypatch.setattr(gc, "plan", lambda root, logs, py=PY: _fake_plan(0))
    assert gc.main([str(tmp_path / "r0.md"), "--root", str(tmp_path)]) == 1
    text = (tmp_path / "r0.md").read_text()
    assert "| environment | FAILED: no CUDA GPU visible to torch |" in text and "| tests | NOT RUN: no CUDA GPU |" in text
    assert "- result: FAIL (3 of 3 parts" not in text and "- result: FAIL (2 of 3 parts" in text
    # a budget above what one device command allows is refused before anything runs
    assert gc.main([str(tmp_path / "r1.md"), "--budget", str(gc.MAX_BUDGET_S + 1)]) == 2


def test_environment_and_compile_helpers_without_a_gpu(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the script's own run checks these")
    assert gc.print_environment() == 0
    facts = gc.environment_facts(capsys.readouterr().out)
    assert facts["gpu_count"] == 0 and facts["torch"] == torch.__version__
    assert "no CUDA GPU visible" in gc.describe(facts)
    assert gc.compile_families() == 1
    assert capsys.readouterr().out.startswith("FAIL CuPy cannot see a CUDA device")


def test_tests_are_picked_by_marker_and_file():
    files = gc.gpu_test_files(ROOT)
    assert gc.KERNEL_TESTS in files and "tests/collectives/test_collectives_cuda.py" in files
    assert "tests/compress/test_finite.py" not in files  # no gpu marker: never collected there
    assert gc.part_of("tests/kernels/test_cuda_kernels.py::test_topk_exact[1]") == "kernel tests: select, sparse"
    assert gc.part_of("tests/kernels/test_cuda_kernels.py::test_quantize[x]").endswith("quant, plumbing, compressors")
    assert gc.part_of("tests/training/test_x.py::t") == gc.part_of("tests/memory/test_x.py::t") == \
        "GPU tests: collectives, training, memory (with gloo ranks on CUDA tensors)"
    assert gc.part_of("tests/pipeline/test_x.py::t") == "GPU tests: others (compressors, kernels)"
    ids, errors = gc.read_collection("a/test_x.py::t[1]\na/test_x.py::u\n\nERROR a/test_y.py - ImportError\n"
                                     "2 tests collected, 1 error in 0.1s\n")
    assert ids == ["a/test_x.py::t[1]", "a/test_x.py::u"] and errors == ["a/test_y.py"]
    # a run killed before it wrote its XML is counted from its -v lines
    assert gc.read_verbose("a/test_x.py::t[1] PASSED  [ 25%]\na/test_x.py::u FAILED  [ 50%]\n"
                           "b/test_y.py::v[a b] SKIPPED (why)  [ 75%]\nb/test_y.py::w ERROR  [100%]\n") == \
        {"a/test_x.py": [1, 1, 0], "b/test_y.py": [0, 1, 1]}
    nccl = _tool("gpu_check_nccl")
    assert next(p.minimum for p in gc.plan(ROOT, Path("logs")) if p.needs_gpus == 2) == len(nccl.CHECKS)
    assert next(p.minimum for p in gc.plan(ROOT, Path("logs")) if p.name == "NVRTC compile") == \
        len(_cupy.families()) >= 6


def _smoke_rank(rank, world):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):  # the PASS/FAIL lines the part counts
        rc = _tool("gpu_check_nccl").main(["--backend", "gloo", "--device", "cpu"])
    return rc, out.getvalue()


@pytest.mark.slow
def test_nccl_smoke_checks_run_on_gloo_ranks(tmp_path):
    """The NCCL smoke part's four checks, on 2 CPU ranks under the strict NCCL mode (gloo made
    as strict as NCCL): the script the 2-GPU run uses is not first run there."""
    from ranks import run_ranks

    (rc0, out0), (rc1, out1) = run_ranks(_smoke_rank, 2, tmp_path, timeout_s=120, torchrun_env=True)
    assert (rc0, rc1) == (0, 0), out0
    assert [line.split(":")[0] for line in out0.splitlines()] == \
        ["PASS hook", "PASS compressed_optimizer", "PASS pipeline", "PASS sharded"], out0
    assert out1 == ""  # rank 0 reports for both


def test_nccl_smoke_on_a_machine_without_gpus_says_it_needs_them():
    """No AttributeError from torch.cuda's CPU build: one line, what it needs and the CPU way."""
    import torch

    if torch.cuda.device_count() >= 1:
        pytest.skip("checks the message of a machine without a GPU")
    proc = subprocess.run([sys.executable, str(TOOLS / "gpu_check_nccl.py")], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "needs one CUDA GPU per rank" in proc.stderr and "--backend gloo --device cpu" in proc.stderr
