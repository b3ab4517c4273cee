"""What keeping compression state transactional costs on the CPU path, measured side by side.

``python tools/state_cost.py [--numel N] [--repeats R]`` times, in one process with one thread,
the pieces a step adds when a non-finite or failed step must leave the state as it was
(see ``gradcomp.compress.transaction``), next to what they replace:

- the finiteness check of the averaged result (``all_finite``) against one copy of it;
- the residual update into the second buffer (``torch.add(old, g, out=other)``) against the
  in-place update it replaces (``res.add_(g)``);
- a whole ``ErrorFeedback`` step of a compressor with and without an open transaction, and a
  one-process ``allreduce`` with error feedback (which opens one);

medians over ``R`` repeats after one warm-up.
"""
from __future__ import annotations

import argparse

import torch

from gradcomp.collectives import allreduce
from gradcomp.compress import ErrorFeedback, get_compressor
from gradcomp.compress.transaction import Transaction, all_finite

from cpu_paths import median_ms  # tools/cpu_paths.py: python puts this script's folder first on sys.path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--numel", type=int, default=25_000_000)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    n, r = args.numel, args.repeats
    g = torch.randn(n)
    res = torch.randn(n)
    other = torch.empty(n)
    rows = [("all_finite(result)", median_ms(lambda: all_finite(g), r)),
            ("result.clone() (for scale)", median_ms(lambda: g.clone(), r)),
            ("res.add_(g) (in place, before)", median_ms(lambda: res.add_(g), r)),
            ("torch.add(res, g, out=other) (now)", median_ms(lambda: torch.add(res, g, out=other), r))]
    for name in ("onebit", "topk", "int8"):
        ef = ErrorFeedback(get_compressor(name))
        rows.append((f"ErrorFeedback({name}).compress, no transaction",
                     median_ms(lambda: ef.compressor.compress_residual(ef.accumulate_in_place(g, "w"), "w"), r)))

        def in_txn(ef=ef):
            txn = Transaction()
            with txn.active():
                ef.compressor.compress_residual(ef.accumulate_in_place(g, "w"), "w")
            txn.commit()

        rows.append((f"ErrorFeedback({name}).compress, in a transaction", median_ms(in_txn, r)))
        ef2 = ErrorFeedback(get_compressor(name))
        rows.append((f"allreduce(g, ErrorFeedback({name})), one process", median_ms(lambda: allreduce(g, ef2, key="w"), r)))
    print(f"# {n:,} fp32 elements, 1 thread, median of {r} after 1 warm-up (ms)")
    for label, ms in rows:
        print(f"{label:<58} {ms:8.1f}")


if __name__ == "__main__":
    main()
