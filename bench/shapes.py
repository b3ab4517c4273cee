"""Realistic gradient shapes: the parameters of ResNet-18, ResNet-50 and BERT-base, in DDP buckets.

The shapes are generated from each architecture's definition (no model is built, nothing is
downloaded) and grouped the way ``DistributedDataParallel`` does by default: parameters in
reverse order (the order backward produces their gradients), a first bucket of 1 MB, then
buckets of up to 25 MB.
"""
from __future__ import annotations

import math
from typing import Dict, List, Tuple

Shape = Tuple[int, ...]
Layer = Tuple[str, Shape]


def resnet50(num_classes: int = 1000) -> List[Layer]:
    """Parameter names and shapes of torchvision's ``resnet50()`` (25,557,032 parameters)."""
    layers: List[Layer] = [("conv1.weight", (64, 3, 7, 7)), ("bn1.weight", (64,)), ("bn1.bias", (64,))]
    inplanes = 64
    for stage, (planes, blocks) in enumerate(zip((64, 128, 256, 512), (3, 4, 6, 3)), start=1):
        for b in range(blocks):
            p = f"layer{stage}.{b}"
            convs = ((planes, inplanes, 1), (planes, planes, 3), (planes * 4, planes, 1))  # 1x1, 3x3, 1x1
            for i, (cout, cin, k) in enumerate(convs, 1):
                layers += [(f"{p}.conv{i}.weight", (cout, cin, k, k)), (f"{p}.bn{i}.weight", (cout,)),
                           (f"{p}.bn{i}.bias", (cout,))]
            if b == 0:
                layers += [(f"{p}.downsample.0.weight", (planes * 4, inplanes, 1, 1)),
                           (f"{p}.downsample.1.weight", (planes * 4,)), (f"{p}.downsample.1.bias", (planes * 4,))]
            inplanes = planes * 4
    return layers + [("fc.weight", (num_classes, 2048)), ("fc.bias", (num_classes,))]


def resnet18(num_classes: int = 1000) -> List[Layer]:
    """Parameter names and shapes of torchvision's ``resnet18()`` (11,689,512 parameters):
    basic blocks of two 3x3 convolutions."""
    layers: List[Layer] = [("conv1.weight", (64, 3, 7, 7)), ("bn1.weight", (64,)), ("bn1.bias", (64,))]
    inplanes = 64
    for stage, planes in enumerate((64, 128, 256, 512), start=1):
        for b in range(2):
            p = f"layer{stage}.{b}"
            for i, cin in enumerate((inplanes, planes), 1):
                layers += [(f"{p}.conv{i}.weight", (planes, cin, 3, 3)), (f"{p}.bn{i}.weight", (planes,)),
                           (f"{p}.bn{i}.bias", (planes,))]
            if b == 0 and inplanes != planes:
                layers += [(f"{p}.downsample.0.weight", (planes, inplanes, 1, 1)),
                           (f"{p}.downsample.1.weight", (planes,)), (f"{p}.downsample.1.bias", (planes,))]
            inplanes = planes
    return layers + [("fc.weight", (num_classes, 512)), ("fc.bias", (num_classes,))]


def bert_base(vocab: int = 30522, hidden: int = 768, layers: int = 12, ffn: int = 3072,
              positions: int = 512) -> List[Layer]:
    """Parameter names and shapes of BERT-base's encoder and pooler (109,482,240 parameters)."""
    out: List[Layer] = [("embeddings.word", (vocab, hidden)), ("embeddings.position", (positions, hidden)),
                        ("embeddings.token_type", (2, hidden)), ("embeddings.norm.weight", (hidden,)),
                        ("embeddings.norm.bias", (hidden,))]
    for i in range(layers):
        p = f"layer{i}"
        for name in ("query", "key", "value", "attn_out"):
            out += [(f"{p}.{name}.weight", (hidden, hidden)), (f"{p}.{name}.bias", (hidden,))]
        out += [(f"{p}.attn_norm.weight", (hidden,)), (f"{p}.attn_norm.bias", (hidden,)),
                (f"{p}.ffn_in.weight", (ffn, hidden)), (f"{p}.ffn_in.bias", (ffn,)),
                (f"{p}.ffn_out.weight", (hidden, ffn)), (f"{p}.ffn_out.bias", (hidden,)),
                (f"{p}.ffn_norm.weight", (hidden,)), (f"{p}.ffn_norm.bias", (hidden,))]
    return out + [("pooler.weight", (hidden, hidden)), ("pooler.bias", (hidden,))]


MODELS = {"resnet18": resnet18, "resnet50": resnet50, "bert-base": bert_base}


def model_layers(name: str) -> List[Layer]:
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; available: {', '.join(MODELS)}")
    return MODELS[name]()


def buckets(layers: List[Layer], bucket_mb: float = 25.0, first_mb: float = 1.0,
            element_size: int = 4) -> List[List[Layer]]:
    """Layers grouped like DDP's buckets: reverse order, a small first bucket, then ``bucket_mb``."""
    if bucket_mb <= 0:
        raise ValueError(f"bucket size must be > 0 MB, not {bucket_mb}")
    out: List[List[Layer]] = [[]]
    size, cap = 0, first_mb * 2**20
    for name, shape in reversed(layers):
        # as DDP: a bucket closes once it reaches its cap, with the tensor that crossed it
        out[-1].append((name, shape))
        size += math.prod(shape) * element_size
        if size >= cap:
            out.append([])
            size, cap = 0, bucket_mb * 2**20
    return [b for b in out if b]


def summary(layers: List[Layer]) -> Dict[str, int]:
    return {"layers": len(layers), "numel": sum(math.prod(s) for _, s in layers)}
