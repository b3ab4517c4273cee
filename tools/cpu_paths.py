"""One-process timings of the CPU paths that the collectives and the DDP hook spend most time
in: ``python tools/cpu_paths.py [--repeats N]`` (1 thread, medians after one warm-up).

- ``topk+ef`` and ``powersgd+ef`` over ResNet-50's 161 parameter shapes, as the hook runs them
  on one rank (PowerSGD's rounds driven alone, with and without ``out=`` the gradient);
- the quantizers on one 25M-element fp32 tensor: ``decompress`` (a new tensor),
  ``decompress_into`` (added into an existing buffer, as the collectives decode) and, for
  int8, ``ErrorFeedback.compress``;
- with ``--fused-min``, only that: onebit+ef and topk+ef over ResNet-50's tensors from the fused
  CPU loops' threshold (``kernels.cpu.FUSED_MIN``) to 2**18 elements, with the threshold at
  2**18 (its former value) and at its value, alternating over three rounds.
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch

from gradcomp.bench import shapes
from gradcomp.compress import ErrorFeedback, get_compressor
from gradcomp.kernels import cpu


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def _drive(gen):
    """A rounds generator alone: the average over one rank is its own tensor."""
    try:
        sent = next(gen)
        while True:
            sent = gen.send(sent.clone())
    except StopIteration as stop:
        return stop.value


def fused_min(layers: list, grads: list, repeats: int) -> None:
    """The error-feedback compress and decode of the tensors between :data:`cpu.FUSED_MIN` and
    2**18 elements (the old threshold), with the fused loops from each."""
    old, current = 1 << 18, cpu.FUSED_MIN
    mid = [(lay, g) for lay, g in zip(layers, grads) if current <= g.numel() < old]
    outs = [torch.zeros_like(g) for _, g in mid]
    print(f"# resnet50's {len(mid)} tensors of 2**{current.bit_length() - 1} to 2**{old.bit_length() - 1} "
          f"elements ({sum(g.numel() for _, g in mid):,})")
    try:
        for rnd in range(3):
            for threshold in (old, current):
                cpu.FUSED_MIN = threshold
                for name in ("onebit", "topk"):
                    ef = ErrorFeedback(get_compressor(name))
                    payloads = [ef.compress(g, key=n) for (n, _), g in mid]
                    comp = median_ms(lambda: [ef.compress(g, key=n) for (n, _), g in mid], repeats)
                    dec = median_ms(lambda: [ef.compressor.decompress_into(p, o, alpha=0.5)
                                             for p, o in zip(payloads, outs)], repeats)
                    print(f"round {rnd}  fused from 2**{threshold.bit_length() - 1}  {name}+ef  "
                          f"compress {comp:6.1f} ms   decompress_into {dec:5.1f} ms")
    finally:
        cpu.FUSED_MIN = current


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--fused-min", action="store_true", help="only the fused loops' threshold, old against current")
    args = ap.parse_args()
    torch.set_num_threads(1)
    r = args.repeats
    layers = shapes.resnet50()
    grads = [torch.randn(s, generator=torch.Generator().manual_seed(i)) for i, (_, s) in enumerate(layers)]
    print(f"# 1 thread, torch {torch.__version__}, medians of {r} after one warm-up")
    if args.fused_min:
        fused_min(layers, grads, r)
        return
    topk = ErrorFeedback(get_compressor("topk"))
    print(f"resnet50 (161 tensors)  topk+ef compress                  {median_ms(lambda: [topk.compress(g, key=n) for (n, _), g in zip(layers, grads)], r):8.1f} ms")
    for label, use_out in (("without out=", False), ("with out=grad", True)):
        ef = ErrorFeedback(get_compressor("powersgd", rank=4))
        work = [g.clone() for g in grads]

        def step():
            for (n, _), g in zip(layers, work):
                res = _drive(ef.rounds(g, n, out=g) if use_out else ef.rounds(g, n))
                if res.data_ptr() != g.data_ptr():
                    g.copy_(res)  # what the hook does with a result that is not the gradient
        try:
            print(f"resnet50 (161 tensors)  powersgd+ef rounds, {label:<14}{median_ms(step, r):8.1f} ms")
        except TypeError:  # a gradcomp from before rounds(out=)
            print(f"resnet50 (161 tensors)  powersgd+ef rounds, {label:<14}     n/a")
    x = torch.randn(25_000_000, generator=torch.Generator().manual_seed(0))
    out = torch.empty_like(x)
    for name in ("int8", "qsgd", "terngrad", "natural"):
        c = get_compressor(name)
        p = c.compress(x, key="w")
        print(f"25M fp32  {name:<9} decompress {median_ms(lambda: c.decompress(p), r):7.1f} ms   "
              f"decompress_into {median_ms(lambda: c.decompress_into(p, out, alpha=0.5), r):7.1f} ms")
    ef8 = ErrorFeedback(get_compressor("int8"))
    print(f"25M fp32  int8+ef   ErrorFeedback.compress {median_ms(lambda: ef8.compress(x, key='w'), r):7.1f} ms")


if __name__ == "__main__":
    main()
