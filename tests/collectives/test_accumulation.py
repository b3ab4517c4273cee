"""In what dtype gradcomp's reduce-scatter accumulates, and what that does to the error as the
number of ranks grows (``tools/accumulation.py`` measures it; these tests pin it).

What the code does (``collectives/shards.py``): the dense path scales each rank's tensor and
sums the received blocks in rank order into a tensor of the input's dtype (``_dense_reduce``,
``acc += b``: PyTorch's own rule, so the dense exchange keeps FSDP2's and DDP's bits); the
compressed path decodes every received piece into a buffer with
``decompress_into(..., accumulate=True)`` (``_compressed_reduce``), an fp32 buffer for a 16-bit
input, rounded to the input's dtype once at the end. So a compressed bf16 reduce-scatter's
error does not grow with the number of ranks as a bf16 ring's does. Deterministic seeds, no
wall time; one test runs 4 gloo ranks to check the tool's one-process simulation is the real
``reduce_scatter``, bit for bit.
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from ranks import run_ranks
from gradcomp.collectives.shards import reduce_scatter
from gradcomp.compress import as_codec

TOOLS = Path(__file__).resolve().parents[2] / "tools"
BF16, FP32 = torch.bfloat16, torch.float32


def _tool(name):
    """A script of tools/ as a module (tools/ is a folder of scripts outside the package, not a package)."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


acc = _tool("accumulation")

NUMEL = 20_000
SEEDS = (0, 1, 2)


def _err(fn, n):
    """The median over SEEDS of ``fn``'s relative error for ``n`` ranks."""
    errs = []
    for seed in SEEDS:
        grads = acc.gradients(n, NUMEL, seed)
        errs.append(acc.rel_error(fn(grads), acc.exact_mean(grads)))
    return sorted(errs)[len(errs) // 2]


def test_compressed_reduce_of_bf16_sums_the_decodings_in_fp32():
    """The owner's buffer for a bf16 input is fp32: the result is, bit for bit, the decodings
    added in rank order in fp32, scaled, and rounded to bf16 once (and not a bf16 sum rounded
    after every add)."""
    n = 8
    grads = acc.gradients(n, NUMEL, 0)
    payloads = acc.gc_payloads(grads, BF16, "int8")
    got = acc.gc_compressed(grads, BF16, "int8", payloads)
    assert got.dtype == BF16
    base = as_codec("int8", error_feedback="ef", wrappers="refuse").base
    sizes = acc.splits(NUMEL, n)
    pieces = []
    for j, own in enumerate(grads.to(BF16).split(sizes, dim=1)):
        total = torch.zeros(sizes[j], dtype=BF16)
        total32 = torch.zeros(sizes[j], dtype=FP32)
        for r in range(n):
            term = own[r] if r == j else base.decompress(payloads[r][j]).to(BF16)
            total = total + term  # a bf16 add: rounded to bf16
            total32 += term.float()
        pieces.append((total / n, (total32 * (1.0 / n)).to(BF16)))
    assert torch.equal(got, torch.cat([p[1] for p in pieces]))
    assert not torch.equal(got, torch.cat([p[0] for p in pieces]))


def test_an_fp32_input_is_accumulated_in_fp32():
    grads = acc.gradients(4, NUMEL, 0)
    assert acc.gc_dense(grads, FP32).dtype == FP32
    assert acc.gc_compressed(grads, FP32, "int8", acc.gc_payloads(grads, FP32, "int8")).dtype == FP32


def test_the_compressed_error_of_a_bf16_input_does_not_grow_as_a_bf16_ring_does():
    """From 2 to 32 ranks the error of a bf16 ring and of the dense bf16 path (PyTorch's rule,
    kept for its bits) grows more than 2x; the fp32 accumulation of the same bf16 gradients does
    not (at most 1.5x). The int8 path accumulates in fp32: its error grows little (at most
    1.5x), and a bf16 accumulation of the same payloads would add to it at 32 ranks (over 1.2x)."""
    ring = {n: _err(lambda g: acc.ring(g, BF16), n) for n in (2, 32)}
    dense = {n: _err(lambda g: acc.gc_dense(g, BF16), n) for n in (2, 32)}
    fp32_sum = {n: _err(acc.fp32_sum_of_bf16, n) for n in (2, 32)}
    assert ring[32] > 2 * ring[2]
    assert dense[32] > 2 * dense[2]
    assert fp32_sum[32] <= 1.5 * fp32_sum[2]

    def int8(g, acc_dtype=None):
        return acc.gc_compressed(g, BF16, "int8", acc.gc_payloads(g, BF16, "int8"), acc_dtype=acc_dtype)

    ours = {n: _err(int8, n) for n in (2, 32)}
    assert ours[32] <= 1.5 * ours[2]
    assert _err(lambda g: int8(g, BF16), 32) > 1.2 * ours[32]


def _rank_reduce_scatter(rank, world, numel, seed):
    grads = acc.gradients(world, numel, seed)
    sizes = acc.splits(numel, world)
    out = {}
    for dtype in (BF16, FP32):
        flat = grads[rank].to(dtype)
        out[("dense", dtype)] = reduce_scatter(flat, sizes, key="rs")
        codec = as_codec("int8", error_feedback="ef", wrappers="refuse")
        out[("int8", dtype)] = reduce_scatter(flat, sizes, compressor=codec, key=acc.KEY)
    return out


@pytest.mark.parametrize("world", [4])
def test_the_simulation_is_the_real_reduce_scatter(tmp_path, world):
    """tools/accumulation.py reproduces ``reduce_scatter`` on real gloo ranks bit for bit, dense
    and int8, bf16 and fp32 inputs (a piece length that is not a multiple of the int8 block)."""
    numel = 4 * 1000 + 3
    results = run_ranks(_rank_reduce_scatter, world, tmp_path, numel, 5)
    grads = acc.gradients(world, numel, 5)
    for dtype in (BF16, FP32):
        real_dense = torch.cat([r[("dense", dtype)] for r in results])
        real_int8 = torch.cat([r[("int8", dtype)] for r in results])
        assert real_dense.dtype == dtype and real_int8.dtype == dtype
        assert torch.equal(real_dense, acc.gc_dense(grads, dtype))
        assert torch.equal(real_int8, acc.gc_compressed(grads, dtype, "int8", acc.gc_payloads(grads, dtype, "int8")))
