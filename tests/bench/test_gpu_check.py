"""``bench/gpu_check.sh`` runs unchanged on a machine without a GPU: every part is tried,
reported with its status, and the report is complete. The real run (tests passing, kernel
figures) needs a CUDA GPU; on one this test steps aside, the script is the check there."""
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gradcomp.kernels import _cupy

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu_check.sh"
PARTS = ["environment", "NVRTC compile", "GPU tests: rng, sign, bits", "GPU tests: select, sparse",
         "GPU tests: quant, plumbing, compressors", "GPU tests, others", "kernel benchmarks"]


@pytest.mark.skipif(torch.cuda.is_available() and _cupy.available(), reason="a GPU is here: run the script itself")
@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None, reason="needs bash and timeout")
def test_gpu_check_runs_unchanged_and_reports_every_part(tmp_path):
    report = tmp_path / "out" / "gpu_report.md"
    env = dict(os.environ, GPU_CHECK_BUDGET="120", PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    proc = subprocess.run(["bash", str(SCRIPT), str(report)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    text = report.read_text()
    assert text.startswith("# gradcomp GPU check")
    summary = text[text.index("## Summary"):]
    for part in PARTS:
        assert re.search(rf"^\| {re.escape(part)} \| ", summary, re.M), f"{part} missing from the summary"
    assert "| environment | ok" in summary
    assert "torch.cuda.is_available(): False" in text
    # without a GPU the kernel parts say so instead of passing vacuously
    assert re.search(r"\| NVRTC compile \| FAILED", summary)
    assert re.search(r"\| GPU tests: rng, sign, bits \| NOTHING RAN", summary)
    assert re.search(r"\| kernel benchmarks \| FAILED, exit code 2", summary)
    assert "kernel_bench needs a CUDA GPU" in text
    assert (report.parent / "gpu_report.md.logs").is_dir()
