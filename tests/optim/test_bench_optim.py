"""Smoke test of ``python -m gradcomp.bench optim``: real ranks, a tiny run, the JSON contract
and the bad-option errors (the benchmark itself is never part of the unit-test run)."""
import json
import subprocess
import sys

import pytest

FIELDS = ("method", "world_size", "steps", "warmup_steps", "test_accuracy", "step_ms", "bytes_per_step",
          "volume_ratio", "accuracy_vs_dense_pp", "loss_curve", "ranks_agree")


def _bench(*args, timeout=180):
    return subprocess.run([sys.executable, "-m", "gradcomp.bench", "optim", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_tiny_run_reports_measured_bytes_and_accuracy(tmp_path):
    pytest.importorskip("sklearn")
    out = tmp_path / "o.json"
    proc = _bench("--world-size", "2", "--epochs", "2", "--hidden", "32", "--no-progress",
                  "--methods", "adam-ddp,onebit-adam@20%", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "loopback" in proc.stdout and "onebit-adam@20%" in proc.stdout
    records = json.loads(out.read_text())
    assert [r["method"] for r in records] == ["adam-ddp", "onebit-adam@20%"]
    for r in records:
        assert all(f in r for f in FIELDS) and r["ranks_agree"]
    dense, onebit = records
    assert dense["volume_ratio"] == 1.0 and onebit["warmup_steps"] == round(0.2 * onebit["steps"])
    # measured: 20 % of the steps dense, the rest ~1 bit per element (headers weigh at this size)
    assert 1.5 < onebit["volume_ratio"] < 5


@pytest.mark.parametrize("args, word", [(["--methods", "bogus"], "--methods"), (["--epochs", "0"], "--epochs"),
                                        (["--lr", "0"], "--lr"), (["--step-time", "--methods", "lamb-ddp"], "--methods")])
def test_bad_options_name_the_option(args, word):
    proc = _bench(*args)
    assert proc.returncode != 0 and word in proc.stderr
