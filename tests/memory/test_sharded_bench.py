"""``python -m gradcomp.bench sharded``'s own logic, without ranks: options are checked with
clear errors, and the records' ratios come from the measured per-rank figures (the slowest
rank's step time, the largest bytes), never from a formula."""
from __future__ import annotations

import pytest

from gradcomp.bench import sharded


def _args(*argv):
    return sharded.parser().parse_args(list(argv))


@pytest.mark.parametrize("argv,message", [
    (["--methods", "zero,ours-fast"], "unknown \\['ours-fast'\\]; allowed: ddp-adamw"),
    (["--methods", ","], "none given"),
    (["--epochs", "0"], "--epochs must be >= 1"),
    (["--lr", "0"], "--lr must be > 0"),
    (["--bucket-mb", "-1"], "--bucket-mb must be > 0"),
])
def test_bad_options(argv, message):
    with pytest.raises(ValueError, match=message):
        sharded._check(_args(*argv))


def _run(ms, sent, state, acc, checksum=1.0):
    return {"times_ms": ms, "accuracy": acc, "bytes_per_step": sent, "state_bytes": state, "held_bytes": 10,
            "checksum": checksum, "phases": {}}


def test_records_are_the_measured_figures():
    names = ["ddp-adamw", "zero", "ours-int8g-bf16w"]
    warm = [99] * sharded.WARMUP  # not timed
    rank0 = [_run(warm + [10, 10], 100, 800, 0.9), _run(warm + [8, 8], 200, 400, 0.9),
             _run(warm + [2, 4], 40, 400, 0.905)]
    rank1 = [_run(warm + [10, 12], 100, 800, 0.5), _run(warm + [8, 8], 220, 420, 0.5),
             _run(warm + [3, 3], 50, 400, 0.5, checksum=2.0)]
    records = sharded._records(names, [rank0, rank1], {"epochs": 1}, 2)
    by = {r["method"]: r for r in records}
    assert by["zero"]["bytes_per_step"] == 220 and by["zero"]["state_bytes"] == 420  # the largest rank
    assert by["ddp-adamw"]["step_ms"] == 11  # median over the timed steps of the slowest rank: 10, 12
    assert by["ours-int8g-bf16w"]["speedup_vs_zero"] == pytest.approx(8 / 3.5)
    assert by["ours-int8g-bf16w"]["bytes_vs_zero"] == pytest.approx(50 / 220)
    assert by["ours-int8g-bf16w"]["accuracy_vs_dense_pp"] == pytest.approx(0.5)  # rank 0's test accuracy
    assert not by["ours-int8g-bf16w"]["ranks_agree"] and by["zero"]["ranks_agree"]
    text = sharded.table(records)
    assert text.startswith("| method") and "DIFFER" in text and "2.29x" in text
