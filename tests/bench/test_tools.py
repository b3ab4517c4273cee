"""The scripts of tools/ (the GPU check and one-off measurements, outside the wheel) start as
their docstrings say, from any folder: ``python tools/NAME.py --help`` answers, and the
pytest-benchmark file collects."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ROOT / "tools"
SCRIPTS = sorted(p.name for p in TOOLS.glob("*.py") if not p.name.startswith("test_"))


def test_every_script_of_tools_starts_from_any_folder(tmp_path):
    assert {"gpu_check.py", "gpu_check_nccl.py", "kernel_bench.py", "cpu_paths.py"} <= set(SCRIPTS)
    procs = {name: subprocess.Popen([sys.executable, str(TOOLS / name), "--help"], cwd=tmp_path,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for name in SCRIPTS}  # all at once: the work is bounded, the wait is only a guard against a hang
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0 and "usage:" in out, f"python tools/{name} --help:\n{out}{err}"


def test_the_compressor_benchmarks_collect():
    proc = subprocess.run([sys.executable, "-m", "pytest", "-n", "0", "-p", "no:cacheprovider", "--collect-only", "-q",
                           str(TOOLS / "test_bench_compressors.py")], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)  # a guard against a hang only
    assert proc.returncode == 0 and "tests collected" in proc.stdout, proc.stdout + proc.stderr
