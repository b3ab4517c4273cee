"""Kernel micro-benchmarks on one GPU: achieved bandwidth of every CUDA kernel against the
device's measured copy bandwidth, and top-k against ``torch.topk``.

``python tools/kernel_bench.py [--numel N] [--out report.md]`` times each kernel on
``N = 2**26`` fp32 elements with CUDA events (after warm-up; medians of ``--reps`` runs) and
prints a markdown table. GB/s counts the bytes a kernel reads plus the bytes it writes
(every pass of a multi-pass kernel counted); "% copy" divides by the same figure for a
device-to-device ``copy_`` of N fp32 elements. The torch column times the torch path of the
same primitive on the same tensors (``runtime.torch_only()``). Targets: elementwise
compression kernels at >= 60% of copy; top-k of 1% at least 3x faster than ``torch.topk``.
"""
from __future__ import annotations

import argparse
import platform
import statistics
import sys
import traceback
from typing import Callable, List, Optional

import numpy as np
import torch

from gradcomp.kernels import bits, quant, rng, runtime, select, sign, sparse
from gradcomp.kernels.runtime import launch_bits as bits_k
from gradcomp.kernels.runtime import launch_quant as quant_k
from gradcomp.kernels.runtime import launch_rng as rng_k
from gradcomp.kernels.runtime import launch_select as select_k
from gradcomp.kernels.runtime import launch_sign as sign_k
from gradcomp.kernels.runtime import launch_sparse as sparse_k

COPY_TARGET = 0.60  # elementwise kernels: fraction of the measured copy bandwidth
TOPK_TARGET = 3.0  # speed-up of top-k (1%) over torch.topk


def time_ms(fn: Callable[[], object], reps: int, warmup: int = 3) -> float:
    """Median milliseconds of ``fn`` on the current stream, timed with CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    events = []
    for _ in range(reps):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        events.append((start, stop))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events)


class Row:
    def __init__(self, name: str, nbytes: float, kernel_ms: Optional[float], torch_ms: Optional[float],
                 target: bool, note: str = "") -> None:
        self.name, self.nbytes, self.kernel_ms, self.torch_ms = name, nbytes, kernel_ms, torch_ms
        self.target, self.note = target, note


def header(numel: int) -> List[str]:
    dev = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(dev)
    cupy = runtime.cupy()
    return [
        f"- GPU: {torch.cuda.get_device_name(dev)} ({props.multi_processor_count} SMs, "
        f"{props.total_memory / 2**30:.0f} GiB)",
        f"- torch {torch.__version__} (CUDA {torch.version.cuda}), CuPy {getattr(cupy, '__version__', 'missing')}, "
        f"numpy {np.__version__}, Python {platform.python_version()}",
        f"- N = {numel} fp32 elements ({numel * 4 / 2**20:.0f} MiB); CUDA-event medians after warm-up",
    ]


def run(numel: int, reps: int, device: Optional[torch.device] = None) -> List[str]:
    dev = device or torch.device("cuda", torch.cuda.current_device())
    n = numel
    gen = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(n, device=dev, generator=gen)
    lines = ["# Kernel benchmarks", ""] + header(n) + [""]

    src, dst = torch.empty_like(x).copy_(x), torch.empty_like(x)
    copy_ms = time_ms(lambda: dst.copy_(src), reps)
    copy_gbs = 8 * n / copy_ms / 1e6
    lines.append(f"Device-to-device copy: {copy_ms:.3f} ms, {copy_gbs:.0f} GB/s (read + write)")
    lines.append("")

    rows: List[Row] = []

    def bench(name: str, nbytes: float, kernel: Callable, ref: Optional[Callable], target: bool, note: str = ""):
        try:
            k_ms = time_ms(kernel, reps)
        except Exception as exc:  # one broken kernel must not hide the others
            traceback.print_exc()
            rows.append(Row(name, nbytes, None, None, target, f"error: {type(exc).__name__}: {exc}"[:120]))
            return
        t_ms = None
        if ref is not None:
            try:
                with runtime.torch_only():
                    t_ms = time_ms(ref, max(3, reps // 4), warmup=1)
            except Exception as exc:
                note = (note + f"; torch path failed: {type(exc).__name__}").strip("; ")
        rows.append(Row(name, nbytes, k_ms, t_ms, target, note))

    key = rng.stream_key(0, "bench", 1)
    bench("uniform (Philox4x64)", 4 * n, lambda: rng_k.launch_uniform(n, key, dev), lambda: rng.uniform(n, key, dev),
          False, "writes only; one Philox4x64-10 call per 8 numbers")
    bench("sign_pack, sum |x|", 4 * n + n / 8, lambda: sign_k.launch_sign_pack(x, "abs"),
          lambda: sign.sign_pack(x, "abs"), True)
    packed = torch.randint(0, 256, ((n + 7) // 8,), device=dev, dtype=torch.uint8)
    out = torch.empty(n, device=dev)
    bench("sign_unpack to fp32", n / 8 + 4 * n, lambda: sign_k.launch_sign_unpack(packed, n, 0.5, -0.5, out, False),
          lambda: sign.sign_unpack(packed, n, 0.5, -0.5, out=out), True)
    codes = torch.randint(0, 4, (n,), device=dev, dtype=torch.uint8)
    bench("pack_codes 2-bit", n + n / 4, lambda: bits_k.launch_pack_codes(codes, 2), lambda: bits.pack_codes(codes, 2),
          True)
    p2 = bits_k.launch_pack_codes(codes, 2)
    bench("unpack_codes 2-bit", n / 4 + n, lambda: bits_k.launch_unpack_codes(p2, n, 2),
          lambda: bits.unpack_codes(p2, n, 2), True)
    bench("block_absmax (512)", 4 * n, lambda: quant_k.launch_block_absmax(x, 512), lambda: quant.block_absmax(x, 512),
          True)
    bench("bucket_norms (512)", 4 * n, lambda: quant_k.launch_bucket_norms(x, 512), lambda: quant.bucket_norms(x, 512),
          True)
    nb = -(-n // 512)
    mult = torch.full((nb,), 127 / 4.0, device=dev)
    u = rng_k.launch_uniform(n, key, dev)
    bench("quantize_levels (given draws)", 9 * n, lambda: quant_k.launch_quantize_levels(x, mult, 512, 127, u),
          lambda: quant.quantize_levels(x, mult, 512, 127, u), True)
    q8 = quant_k.launch_quantize_levels(x, mult, 512, 127, None)
    scales = torch.rand(1, nb, device=dev)
    bench("dequantize int8 to fp32", n + 4 * n,
          lambda: quant_k.launch_dequantize_sum(q8.view(1, -1), 8, 0, scales, 512, out),
          lambda: quant.dequantize_levels(q8, scales[0], 512), True)
    ranks = 8
    rcodes = torch.randint(0, 256, (ranks, (2 * n + 7) // 8), device=dev, dtype=torch.uint8)
    rscales = torch.rand(ranks, nb, device=dev)
    bench(f"dequantize_sum 2-bit, {ranks} ranks", ranks * n / 4 + 4 * n,
          lambda: quant_k.launch_dequantize_sum(rcodes, 2, 1, rscales, 512, out, 1.0 / ranks),
          lambda: quant.dequantize_sum_reference(rcodes, 2, 1, rscales, 512, out, 1.0 / ranks), True)
    y = (x * 0.01).clamp_(-0.2, 0.2)
    bench("natural_codes, draws in-kernel", 5 * n, lambda: quant_k.launch_natural_codes(y, None, key),
          lambda: quant.natural_codes(y, u), True, "torch column: with given draws")
    ncodes = quant_k.launch_natural_codes(y, u)
    ntable = quant.natural_table(-3, torch.float32).reshape(1, 256).to(dev)
    bench("natural_decode to fp32", 5 * n, lambda: quant_k.launch_natural_decode_sum(ncodes.view(1, -1), ntable, out),
          lambda: quant.natural_decode(ncodes, -3), True)
    m = n // 100
    idx = torch.randint(0, n, (m,), device=dev)
    vals = torch.randn(m, device=dev)
    bench("scatter_add_checked, 1% random", 8 * m + 4 * m + 8 * m,
          lambda: sparse_k.launch_scatter_add_checked(out, idx, vals),
          lambda: sparse.scatter_add_checked(out, idx, vals), False, "random access; includes the range read-back")
    xa = x.abs()
    bench("threshold_indices (~1%)", 4 * n + 8 * m, lambda: select_k.launch_threshold_indices(xa, 2.576),
          lambda: select.threshold_indices(xa, 2.576), False, "includes the count read-back")

    lines += results_table(rows, copy_gbs)
    lines += topk_section(xa, reps)
    return lines


def results_table(rows: List[Row], copy_gbs: float) -> List[str]:
    out = ["| kernel | ms | GB/s | % copy | torch path ms | speed-up | target | note |",
           "|---|---:|---:|---:|---:|---:|---|---|"]
    for r in rows:
        if r.kernel_ms is None:
            out.append(f"| {r.name} | - | - | - | - | - | FAIL | {r.note} |")
            continue
        gbs = r.nbytes / r.kernel_ms / 1e6
        pct = gbs / copy_gbs
        torch_ms = f"{r.torch_ms:.3f}" if r.torch_ms is not None else "-"
        speed = f"{r.torch_ms / r.kernel_ms:.1f}x" if r.torch_ms is not None else "-"
        verdict = ("ok" if pct >= COPY_TARGET else "BELOW") if r.target else ""
        out.append(f"| {r.name} | {r.kernel_ms:.3f} | {gbs:.0f} | {100 * pct:.0f}% | {torch_ms} | {speed} | "
                   f"{verdict} | {r.note} |")
    below = [r.name for r in rows
             if r.target and (r.kernel_ms is None or r.nbytes / r.kernel_ms / 1e6 < COPY_TARGET * copy_gbs)]
    out += ["", f"Elementwise target (>= {COPY_TARGET:.0%} of copy): "
            + ("met by every marked kernel" if not below else "not met by " + ", ".join(below)), ""]
    return out


def topk_section(xa: torch.Tensor, reps: int) -> List[str]:
    n = xa.numel()
    k = n // 100
    lines = [f"## Top-k, k = 1% of {n} fp32 magnitudes", "",
             "| method | ms | vs gradcomp kernel |", "|---|---:|---:|"]
    results = {}
    for name, fn in (
        ("gradcomp kernel (exact set, ascending indices)", lambda: select_k.launch_topk_indices(xa, k)),
        ("torch.topk (sorted)", lambda: torch.topk(xa, k)),
        ("torch.topk (sorted=False)", lambda: torch.topk(xa, k, sorted=False)),
        ("gradcomp torch path (sampled threshold)", lambda: _torch_path_topk(xa, k)),
    ):
        try:
            results[name] = time_ms(fn, reps)
        except Exception as exc:
            traceback.print_exc()
            results[name] = None
            lines.append(f"| {name} | error: {type(exc).__name__} | |")
    ours = results.get("gradcomp kernel (exact set, ascending indices)")
    for name, ms in results.items():
        if ms is not None:
            lines.append(f"| {name} | {ms:.3f} | {ms / ours:.1f}x |" if ours else f"| {name} | {ms:.3f} | - |")
    same = None
    try:
        got = select_k.launch_topk_indices(xa, k)
        same = torch.equal(xa[got].sort().values, torch.topk(xa, k).values.sort().values)
    except Exception:
        traceback.print_exc()
    ref = results.get("torch.topk (sorted)")
    speed = ref / ours if (ours and ref) else None
    lines += ["", f"Same values as torch.topk: {same}. Speed-up over torch.topk: "
              + (f"{speed:.1f}x ({'ok' if speed >= TOPK_TARGET else 'BELOW'} target {TOPK_TARGET:.0f}x)"
                 if speed else "n/a"), ""]
    return lines


def _torch_path_topk(xa: torch.Tensor, k: int) -> torch.Tensor:
    with runtime.torch_only():
        return select.topk_indices(xa, k)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=int, default=2**26, help="elements per benchmark tensor (fp32)")
    ap.add_argument("--reps", type=int, default=20, help="timed runs per kernel (median reported)")
    ap.add_argument("--out", help="also write the markdown report to this file")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available() or not runtime.available():
        print("kernel_bench needs a CUDA GPU and CuPy; found "
              f"torch.cuda.is_available()={torch.cuda.is_available()}, CuPy usable={runtime.available()}")
        return 2
    lines = run(args.numel, args.reps)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
