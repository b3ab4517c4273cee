"""The fused CPU loops through the collectives, on 2 real gloo ranks.

Error feedback's gradient added in the compressor's first pass, the sign residual's pass run
while the payloads are on the wire (an asynchronous all-gather), the two-payload sign mean by
nibble pairs and the sparse mean's own finiteness verdict: forced onto small tensors
(``cpu.threshold(1)``) and held to the reference paths (``cpu.threshold(NEVER)``) bit for bit —
results and residuals at every step, through ``allreduce`` (the checked wire) and
``allreduce_fused`` (its first exchange checked, then the agreed layout), with allgather (the
default on 2 ranks, its result allocated and faulted in while the payloads travel, and with
``into=True`` written into the inputs) and scatter-reduce (its chunks and its server feedback's
sum in the first pass, its reduction by the compressor's combine, and with ``into=True`` its
last phase written into the inputs) — and a step whose mean is not
finite leaves every rank's residuals of that transaction as they were.
"""
from __future__ import annotations

import pytest
import torch

from gradcomp.collectives import allgather, allreduce, allreduce_fused
from gradcomp.compress import ErrorFeedback, get_compressor
from gradcomp.compress import sign as sign_compressor
from gradcomp.kernels import cpu
from gradcomp.kernels.sign import sign_pack_reference

from ranks import run_ranks

NEVER = 1 << 62
NAMES = ["onebit", "efsignsgd", "topk"]
SHAPES = [(4099,), (64, 65)]
BAD_STEP = 2


def _grads(rank: int, step: int):
    g = torch.Generator().manual_seed(100 * step + rank)
    ts = [torch.randn(s, generator=g) for s in SHAPES]
    if step == BAD_STEP and rank == 1:
        ts[0][17] = float("inf")
    return ts


def _steps(name: str, rank: int, fused: bool, threshold: int, algorithm, into: bool = False):
    codecs = [ErrorFeedback(get_compressor(name)) for _ in SHAPES]
    outs, residuals, aliased = [], [], []
    with cpu.threshold(threshold):
        for step in range(4):
            ts = _grads(rank, step)
            if fused:
                got = allreduce_fused([(f"p{i}", t, c) for i, (t, c) in enumerate(zip(ts, codecs))],
                                      algorithm=algorithm, into=into)
                aliased.append([o.data_ptr() == t.data_ptr() for o, t in zip(got, ts)])
            else:
                got = [allreduce(t, c, key=f"p{i}", algorithm=algorithm) for i, (t, c) in enumerate(zip(ts, codecs))]
            outs.append([o.clone() for o in got])
            residuals.append([c.residual(f"p{i}") for i, c in enumerate(codecs)])
    return (outs, residuals, aliased) if into else (outs, residuals)


def _same(a, b):
    """Step by step the same results, NaN where the other has NaN."""
    return all(torch.equal(x.nan_to_num(), y.nan_to_num()) and torch.equal(x.isnan(), y.isnan())
               for sa, sb in zip(a, b) for x, y in zip(sa, sb))


def _equal(a, b):
    """Step by step the same tensors (residuals: finite)."""
    return all(torch.equal(x, y) for sa, sb in zip(a, b) for x, y in zip(sa, sb))


def _rank(rank: int, world: int):
    # the oracle's sign sums: the torch reference's float64 sums (the numpy path below the
    # threshold sums chunks in float32, whose decode values may differ in the last bit)
    sign_compressor.sign_pack = sign_pack_reference
    allgather.PREFAULT_MIN = 1  # the result allocated and faulted in while the payloads travel
    report, fused_runs = {}, {}
    for name, fused, algorithm in [(n, f, a) for n in NAMES for f in (False, True)
                                   for a in (None, "scatter-reduce")]:
        a_out, a_res = _steps(name, rank, fused, 1, algorithm)
        b_out, b_res = _steps(name, rank, fused, NEVER, algorithm)
        if fused:  # the oracle of into=True below
            fused_runs[(name, 1, algorithm)], fused_runs[(name, NEVER, algorithm)] = (a_out, a_res), (b_out, b_res)
        same = _same(a_out, b_out)
        same_res = _equal(a_res, b_res)
        bad_mean_finite = bool(torch.isfinite(a_out[BAD_STEP][0]).all())
        # the bad tensor's own allreduce is rolled back, the other one's commits; a fused
        # set is one transaction, rolled back whole
        pairs = list(zip(a_res[BAD_STEP], a_res[BAD_STEP - 1]))
        kept = all(torch.equal(x, y) for x, y in (pairs if fused else pairs[:1]))
        kept = kept and (fused or not torch.equal(*pairs[1]))
        report[(name, fused, algorithm)] = (same, same_res, bad_mean_finite, kept)
    into = {}  # allreduce_fused(into=True): the same bits and residuals, written into the inputs
    for (name, threshold, algorithm), (ref_out, ref_res) in fused_runs.items():
        out, res, aliased = _steps(name, rank, True, threshold, algorithm, into=True)
        into[(name, threshold, algorithm)] = (_same(out, ref_out), _equal(res, ref_res), all(all(a) for a in aliased))
    report["into"] = into
    return report


def test_fused_loops_through_the_collectives_give_the_reference_bits(tmp_path):
    if not cpu.warm():
        pytest.skip("numba is not importable here: the fused loops do not run")
    for rank, report in enumerate(run_ranks(_rank, 2, tmp_path)):
        for (name, threshold, algorithm), (same, same_res, aliased) in report.pop("into").items():
            where = (f"rank {rank}, {name}, allreduce_fused(into=True), {algorithm or 'allgather'}, "
                     f"threshold {threshold}")
            assert same and same_res, f"{where}: results or residuals differ from into=False"
            assert aliased, f"{where}: a mean was not written into its input"
        for (name, fused, algorithm), (same, same_res, bad_mean_finite, kept) in report.items():
            where = f"rank {rank}, {name}, {'allreduce_fused' if fused else 'allreduce'}, {algorithm or 'allgather'}"
            assert same, f"{where}: results differ from the reference path"
            assert same_res, f"{where}: residuals differ from the reference path"
            assert not bad_mean_finite, f"{where}: the step with an inf on rank 1 gave a finite mean"
            assert kept, f"{where}: the non-finite step changed the residuals"
