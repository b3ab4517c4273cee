"""The benchmark's pure parts: model shapes, DDP-style buckets, method parsing (no ranks)."""
import math

import pytest

from gradcomp.bench import collective, shapes


def test_model_shapes_match_the_published_parameter_counts():
    assert shapes.summary(shapes.resnet18()) == {"layers": 62, "numel": 11_689_512}
    assert shapes.summary(shapes.resnet50()) == {"layers": 161, "numel": 25_557_032}
    assert shapes.summary(shapes.bert_base()) == {"layers": 199, "numel": 109_482_240}
    with pytest.raises(ValueError, match="resnet50"):
        shapes.model_layers("vgg")


def test_buckets_are_ddp_like():
    layers = shapes.resnet50()
    buckets = shapes.buckets(layers, 25.0)
    flat = [layer for bucket in buckets for layer in bucket]
    assert flat == layers[::-1], "buckets must hold every parameter once, in backward order"
    sizes = [4 * sum(math.prod(s) for _, s in b) for b in buckets]
    # a bucket closes with the tensor that reaches its cap: the first cap is 1 MB, then 25 MB
    assert sizes[0] >= 2**20 and 4 * sum(math.prod(s) for _, s in buckets[0][:-1]) < 2**20
    assert all(s - 4 * math.prod(b[-1][1]) < 25 * 2**20 for s, b in zip(sizes[1:], buckets[1:]))
    with pytest.raises(ValueError, match="bucket size"):
        shapes.buckets(layers, 0)


def test_matrix_shape_is_the_squarest_factorisation():
    assert collective.matrix_shape(25_000_000) == (5000, 5000)
    assert collective.matrix_shape(1 << 22) == (2048, 2048)
    assert collective.matrix_shape(12) == (3, 4)
    assert collective.matrix_shape(7) == (7,)  # a prime stays a vector


def test_method_parsing():
    specs = collective.parse_methods("topk:ratio=0.001,fp16,torch-powersgd:rank=2", "auto")
    assert [s["label"] for s in specs] == ["topk:ratio=0.001+ef", "fp16", "torch-powersgd:rank=2"]
    assert specs[0]["options"] == {"ratio": 0.001}
    both = collective.parse_methods("onebit", "both")
    assert [s["ef"] for s in both] == [False, True]
    assert collective.parse_methods("powersgd", "off")[0]["options"]["rank"] == 4  # the benchmark's rank
    for bad, match in (("zip", "unknown compressor"), ("topk:ratio", "name=value"), ("torch-fp16:x=1", "unknown"),
                       ("", "empty")):
        with pytest.raises(ValueError, match=match):
            collective.parse_methods(bad, "auto")
