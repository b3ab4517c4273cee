"""``python -m gradcomp.bench train --model transformer``: the character-level transformer on the
standard library's source learns (validation loss below the unigram baseline) under every
method, and each method's bytes are counted; the corpus is split by file, deterministically."""
import importlib.util
import json
import subprocess
import sys

import pytest
import torch

from gradcomp.bench import text

HAVE_MPL = importlib.util.find_spec("matplotlib") is not None


def test_corpus_is_split_by_file_and_deterministic():
    a, b = text.corpus(200_000, seed=0), text.corpus(200_000, seed=0)
    assert torch.equal(a["train"], b["train"]) and torch.equal(a["val"], b["val"])
    assert a["train_files"] == b["train_files"] and a["val_files"] == b["val_files"]
    assert not set(a["train_files"]) & set(a["val_files"]), "a file is in both splits"
    assert len(a["train"]) == 200_000 and len(a["val"]) >= 200_000 // 9
    assert int(a["train"].max()) < text.VOCAB
    other = text.corpus(200_000, seed=1)
    assert other["train_files"] != a["train_files"]  # the seed picks the files
    # a unigram model knows Python source is mostly spaces and letters: far below uniform (ln 128)
    assert 2.5 < text.unigram_loss(a["train"], a["val"]) < 0.8 * torch.log(torch.tensor(128.0)).item()
    with pytest.raises(ValueError, match="lower --text-mb"):
        text.corpus(10**10, seed=0)


def test_transformer_learns_with_every_method_and_counts_bytes(tmp_path):
    out, png = tmp_path / "lm.json", tmp_path / "lm.png"
    plot = ["--plot", str(png)] if HAVE_MPL else []
    proc = subprocess.run(
        [sys.executable, "-m", "gradcomp.bench", "train", "--model", "transformer", "--steps", "60", "--lr", "0.01",
         "--eval-every", "30", "--layers", "1", "--d-model", "32", "--context", "32", "--text-mb", "0.3",
         "--val-windows", "64", "--no-progress", "--json", str(out), *plot],
        capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "standard library source" in proc.stdout and "unigram baseline" in proc.stdout
    records = json.loads(out.read_text())
    by = {r["method"]: r for r in records}
    assert list(by) == ["torch-allreduce", "torch-fp16", "torch-powersgd:rank=4", "fp16", "powersgd:rank=4+ef",
                        "onebit+ef", "topk+ef"]  # "auto" error feedback: on where biased, off for fp16
    dense = by["torch-allreduce"]
    unigram = dense["unigram_loss"]
    for r in records:
        assert r["ranks_agree"], f"{r['method']}: the ranks' weights differ"
        assert [s for s, _ in r["val_curve"]] == [0, 30, 60] and r["steps"] == 60 == len(r["loss_curve"])
        # every method learns: below the starting loss (about ln 128) by a wide margin
        assert r["val_loss"] < r["val_curve"][0][1] - 1.0, r["method"]
        assert 0 < r["bytes_per_step"] <= dense["bytes_per_step"] * 1.05, r["method"]
    # real learning, beyond character frequencies: context is used (60 steps reach ~3.08 < 3.35)
    for m in ("torch-allreduce", "torch-fp16", "fp16", "torch-powersgd:rank=4", "powersgd:rank=4+ef"):
        assert by[m]["val_loss"] < unigram - 0.1, (m, by[m]["val_loss"], unigram)
    # bytes: what each method's exchange sends, measured (not a constant)
    assert dense["bytes_per_step"] == pytest.approx(dense["dense_bytes_per_step"], rel=0.01)
    assert by["torch-fp16"]["bytes_per_step"] == pytest.approx(dense["bytes_per_step"] / 2, rel=0.01)
    assert by["fp16"]["bytes_per_step"] < 0.6 * dense["bytes_per_step"]
    for m in ("powersgd:rank=4+ef", "torch-powersgd:rank=4"):
        assert by[m]["bytes_per_step"] < dense["bytes_per_step"] / 3
    for m in ("onebit+ef", "topk+ef"):
        assert by[m]["bytes_per_step"] < dense["bytes_per_step"] / 10
    assert by["fp16"]["val_vs_dense"] == pytest.approx(0.0, abs=0.01)  # fp16 changes the loss by little
    if HAVE_MPL:
        assert png.read_bytes()[:4] == b"\x89PNG"
