"""The PyTorch Lightning and Hugging Face Accelerate examples train with gradcomp's hook on 2
CPU processes (gloo), as their docstrings launch them. Each runs when its package is
installed (CI installs both: a few seconds each)."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
# the examples' MLP 64-256-10: fp32 gradient bytes one rank sends per step in a 2-rank ring all_reduce
DENSE_BYTES = 4 * (64 * 256 + 256 + 256 * 10 + 10)


def _run(argv, timeout=240):
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=EXAMPLES.parent)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    m = re.search(r"test accuracy ([\d.]+), (\d+) bytes sent per step per rank, world size (\d+)", done.stdout)
    assert m, done.stdout[-2000:]
    return float(m.group(1)), int(m.group(2)), int(m.group(3))


def _check(acc, sent, world):
    assert world == 2
    assert acc > 0.5  # 10 classes: chance is 0.1; 60 steps of SGD reach ~0.7
    assert 0 < sent < DENSE_BYTES / 4  # the hook ran (DDP's own allreduce would count 0) and compressed


def test_lightning_ddp_strategy_runs_the_hook_on_cpu():
    pytest.importorskip("lightning")
    _check(*_run([sys.executable, str(EXAMPLES / "train_lightning.py"), "--devices", "2", "--steps", "60",
                  "--compressor", "powersgd"]))


def test_accelerate_prepared_model_runs_the_hook():
    pytest.importorskip("accelerate")
    _check(*_run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                  str(EXAMPLES / "train_accelerate.py"), "--steps", "60", "--compressor", "powersgd"]))
