"""The collective benchmark's method specs decide error feedback by the library's rule
(``gradcomp.compress.wants_feedback``, as ``as_codec(error_feedback="auto")``)."""
from __future__ import annotations

from gradcomp.bench.collective import parse_methods
from gradcomp.compress import ErrorFeedback, as_codec


def test_auto_error_feedback_is_as_codecs():
    for m in parse_methods("topk,fp16,randomk,signum,int8", "auto"):
        assert m["ef"] == isinstance(as_codec(m["name"]), ErrorFeedback), m
    assert [m["ef"] for m in parse_methods("topk", "both")] == [False, True]


def test_train_bench_takes_auto():
    # compressor="auto" in the training benchmark: one run, error feedback left to auto itself
    import argparse

    from gradcomp.bench.train import methods

    args = argparse.Namespace(no_torch=True, compressors="auto,topk", error_feedback="auto")
    specs = methods(args)
    assert [s["label"] for s in specs] == ["auto", "topk+ef"]
    assert specs[0]["name"] == "auto" and specs[0]["ef"] is None
