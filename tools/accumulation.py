"""How the error of a reduced mean grows with the number of ranks: a bf16 ring against fp32
accumulation and against gradcomp's own reduce-scatter.

``python tools/accumulation.py [--ranks 2,4,8,16,32,64] [--numel 100000] [--seed 0] [--repeats 5]``
prints a markdown table of the relative error ``||reduced - exact|| / ||exact||`` of the mean
of N gradient vectors (exact: their float64 mean), the median over ``--repeats`` seeds, for
each N, and the growth of each column from the first N to the last.

One process: every rank's arithmetic is simulated exactly, element for element. The gradients
are float32, ``N(0, 1)`` noise per rank plus ``0.1`` times one signal shared by every rank.
Columns:

- ``ring bf16``: a ring reduce-scatter in bf16, as NCCL runs it: the partial sum of chunk ``c``
  starts on rank ``c + 1`` and passes ``N - 1`` hops, each adding one rank's (bf16) gradient
  and rounding to bf16; then the mean (``/ N`` in bf16, exact for N a power of two: dividing
  each input first, as a pre-multiplied average does, gives the same bits).
- ``tree bf16``: the same bf16 gradients summed pairwise, every add rounded to bf16.
- ``ring fp32``: the float32 gradients in a float32 ring (FSDP's reduction of fp32 gradients).
- ``bf16 -> fp32 sum``: each rank's gradient rounded to bf16 once, summed in float32, the mean
  rounded to bf16 once: an fp32 accumulation after decode.
- ``gc dense bf16`` / ``gc dense fp32``: gradcomp's dense reduce-scatter
  (``collectives/shards.py``, ``_dense_reduce``): every rank scales its tensor by ``1/N`` with
  gradcomp's ``scale_`` (line 92), the owner sums the received blocks in rank order into a
  tensor of the input's dtype (lines 94-101).
- ``gc int8 bf16`` / ``gc int8 fp32`` (``gc int4 ...`` with ``--codecs int8,int4``): gradcomp's
  compressed reduce-scatter (``_compressed_reduce``): each rank compresses every piece but its
  own with the real codec, error feedback as ``compress_fsdp`` builds it (line 114), and the
  owner of piece ``j`` zeroes a buffer of the input's dtype (line 138), adds its own piece
  and ``decompress_into(payload, out, accumulate=True)`` of the others in rank order (lines
  142-146), then ``scale_(out, N)`` (line 147). The payloads are the codec's own; only the wire
  between them is left out (it moves their bytes unchanged).
- ``gc int8 bf16, fp32 sum``: the very payloads of ``gc int8 bf16``, decoded into a float32
  buffer and the mean rounded to bf16 once: what the compressed path would give with an fp32
  accumulator (not what the code does; for comparison).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from typing import Callable, Dict, List, Optional, Sequence

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from gradcomp.collectives.shards import piece_key, scale_  # noqa: E402
from gradcomp.compress import as_codec  # noqa: E402

KEY = "rs"


def gradients(ranks: int, numel: int, seed: int) -> torch.Tensor:
    """``(ranks, numel)`` float32: per-rank ``N(0, 1)`` noise plus ``0.1`` times a shared signal."""
    gen = torch.Generator().manual_seed(seed)
    common = torch.randn(numel, generator=gen)
    return torch.randn(ranks, numel, generator=gen) + 0.1 * common


def exact_mean(grads: torch.Tensor) -> torch.Tensor:
    return grads.double().sum(0) / grads.shape[0]


def rel_error(reduced: torch.Tensor, exact: torch.Tensor) -> float:
    return float((reduced.double() - exact).norm() / exact.norm())


def splits(numel: int, ranks: int) -> List[int]:
    """Each rank's piece: equal lengths, the first ones one longer when ``numel % ranks``."""
    return [len(c) for c in torch.arange(numel).tensor_split(ranks)]


def ring(grads: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Ring reduce-scatter in ``dtype`` then the mean: chunk ``c``'s partial sum starts on rank
    ``c + 1`` and adds ranks ``c + 2, ..., c`` (mod N), rounded to ``dtype`` after every add."""
    n = grads.shape[0]
    x = grads.to(dtype)
    out = []
    for c, chunk in enumerate(x.split(splits(x.shape[1], n), dim=1)):
        partial = chunk[(c + 1) % n].clone()
        for hop in range(2, n + 1):
            partial = partial + chunk[(c + hop) % n]
        out.append(partial / n)
    return torch.cat(out)


def tree_bf16(grads: torch.Tensor) -> torch.Tensor:
    """Pairwise sum of the bf16 gradients, every add rounded to bf16, then the mean."""
    n = grads.shape[0]
    level = list(grads.to(torch.bfloat16))
    while len(level) > 1:
        level = [level[i] + level[i + 1] if i + 1 < len(level) else level[i] for i in range(0, len(level), 2)]
    return level[0] / n


def fp32_sum_of_bf16(grads: torch.Tensor) -> torch.Tensor:
    """Each gradient rounded to bf16 once, summed in float32 in rank order, the mean rounded to bf16."""
    acc = torch.zeros(grads.shape[1], dtype=torch.float32)
    for g in grads.to(torch.bfloat16):
        acc += g.float()
    return (acc / grads.shape[0]).to(torch.bfloat16)


def gc_dense(grads: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """gradcomp's dense reduce-scatter (shards.py ``_dense_reduce``) of the gradients cast to
    ``dtype``: every rank's tensor scaled by ``scale_`` (line 92); the owner of each piece
    starts from rank 0's block and adds the others in rank order in ``dtype`` (lines 94-101).
    Elementwise, so the whole tensor at once is every owner's piece at once."""
    scaled = [scale_(g.to(dtype).clone(), grads.shape[0]) for g in grads]
    out = scaled[0].clone()
    for b in scaled[1:]:
        out += b
    return out


def gc_payloads(grads: torch.Tensor, dtype: torch.dtype, codec: str) -> List[List[object]]:
    """``payloads[r][j]``: what rank ``r`` sends for piece ``j`` (None for its own), made as
    ``_compressed_reduce`` makes it (shards.py line 114), each rank with its own codec, built as
    ``compress_fsdp`` builds it (error feedback, a first step: no residual yet)."""
    n = grads.shape[0]
    sizes = splits(grads.shape[1], n)
    out: List[List[object]] = []
    for r, g in enumerate(grads.to(dtype)):
        comp = as_codec(codec, error_feedback="ef", wrappers="refuse")
        out.append([None if j == r or not sizes[j] else comp.compress(piece, piece_key(KEY, j))
                    for j, piece in enumerate(g.split(sizes))])
    return out


def gc_compressed(grads: torch.Tensor, dtype: torch.dtype, codec: str, payloads: Sequence[Sequence[object]],
                  acc_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """The owner's side of ``_compressed_reduce`` (shards.py) for every piece: a zeroed buffer
    (fp32 for a 16-bit input, else the input's dtype), the own piece added and the others
    decoded into it with ``decompress_into(..., accumulate=True)`` in rank order, then
    ``scale_`` and one rounding to ``dtype``. ``acc_dtype`` overrides the buffer's dtype
    (``torch.bfloat16``: what the code did before it summed 16-bit pieces in fp32)."""
    n = grads.shape[0]
    sizes = splits(grads.shape[1], n)
    base = as_codec(codec, error_feedback="ef", wrappers="refuse").base
    x = grads.to(dtype)
    out = []
    for j, piece in enumerate(x.split(sizes, dim=1)):
        acc = torch.zeros(sizes[j], dtype=acc_dtype or (dtype if dtype.itemsize >= 4 else torch.float32))
        for r in range(n):
            if r == j:
                acc += piece[r]
            else:
                base.decompress_into(payloads[r][j], acc, accumulate=True)
        out.append(scale_(acc, n).to(dtype))
    return torch.cat(out)


def methods(codecs: Sequence[str]) -> Dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    bf16, fp32 = torch.bfloat16, torch.float32
    table: Dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        "ring bf16": lambda g: ring(g, bf16),
        "tree bf16": tree_bf16,
        "ring fp32": lambda g: ring(g, fp32),
        "bf16 -> fp32 sum": fp32_sum_of_bf16,
        "gc dense bf16": lambda g: gc_dense(g, bf16),
        "gc dense fp32": lambda g: gc_dense(g, fp32),
    }
    for name in codecs:
        table[f"gc {name} bf16"] = compressed(name, bf16)
        table[f"gc {name} bf16, bf16 sum"] = compressed(name, bf16, bf16)
        table[f"gc {name} fp32"] = compressed(name, fp32)
    return table


def compressed(codec: str, dtype: torch.dtype,
               acc_dtype: Optional[torch.dtype] = None) -> Callable[[torch.Tensor], torch.Tensor]:
    """The ``gc <codec> ...`` column: fresh payloads of the gradients in ``dtype``, reduced."""
    def run(grads: torch.Tensor) -> torch.Tensor:
        return gc_compressed(grads, dtype, codec, gc_payloads(grads, dtype, codec), acc_dtype)
    return run


def measure(ranks: Sequence[int], numel: int, seed: int, repeats: int,
            codecs: Sequence[str] = ("int8",)) -> Dict[int, Dict[str, float]]:
    """``{N: {method: median relative error over the repeats}}``; repeat ``i`` uses seed ``seed + i``."""
    table = methods(codecs)
    result: Dict[int, Dict[str, float]] = {}
    for n in ranks:
        errs: Dict[str, List[float]] = {name: [] for name in table}
        for i in range(repeats):
            grads = gradients(n, numel, seed + i)
            exact = exact_mean(grads)
            for name, fn in table.items():
                errs[name].append(rel_error(fn(grads), exact))
        result[n] = {name: statistics.median(v) for name, v in errs.items()}
    return result


def markdown(result: Dict[int, Dict[str, float]]) -> str:
    ranks = sorted(result)
    names = list(result[ranks[0]])
    lines = ["| N | " + " | ".join(names) + " |", "|---:|" + "---:|" * len(names)]
    for n in ranks:
        lines.append(f"| {n} | " + " | ".join(f"{result[n][m]:.2e}" for m in names) + " |")
    lines.append(f"| growth {ranks[0]} -> {ranks[-1]} | "
                 + " | ".join(f"{result[ranks[-1]][m] / result[ranks[0]][m]:.2f}x" for m in names) + " |")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", default="2,4,8,16,32,64", help="comma-separated numbers of ranks")
    ap.add_argument("--numel", type=int, default=100_000, help="elements per gradient")
    ap.add_argument("--seed", type=int, default=0, help="seed of the first repeat (repeat i: seed + i)")
    ap.add_argument("--repeats", type=int, default=5, help="repeats per N; the table holds their median")
    ap.add_argument("--codecs", default="int8", help="comma-separated gradcomp codecs for the gc columns")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    ranks = [int(v) for v in args.ranks.split(",") if v]
    codecs = [c for c in args.codecs.split(",") if c]
    print(markdown(measure(ranks, args.numel, args.seed, args.repeats, codecs)))


if __name__ == "__main__":
    main()
