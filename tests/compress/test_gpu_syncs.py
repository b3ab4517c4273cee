"""On a GPU (skipped without one): a step of each compressor that the CPU counter finds at one
host sync per iteration (tests/training/test_host_syncs.py) makes no CUDA synchronisation of
its own: error feedback's compression, the receiver's ``check_on_device``, the decode into a
buffer and the combine of two payloads, under ``torch.cuda.set_sync_debug_mode("error")``
(every synchronising CUDA call made through torch raises), inside a transaction (so refusals
and flags stay on the device), with the CUDA kernels and with the torch code on CUDA
(``torch_only``). The CPU counter sees the torch ops gradcomp calls; this sees what the GPU
actually waits for, the kernels' launches included.
"""
from __future__ import annotations

import pytest
import torch

from gradcomp.compress import ErrorFeedback, get_compressor
from gradcomp.compress.transaction import Transaction
from gradcomp.kernels._launch import torch_only

pytestmark = pytest.mark.gpu

# the compressors at one host sync per iteration through the hook (BUDGET there); powersgd, multi-round,
# and threshold, bounded only on an agreed capacity, have their own tests below
NAMES = ["none", "fp16", "bf16", "onebit", "signsgd", "efsignsgd", "signum", "topk", "dgc", "randomk", "int8",
         "qsgd", "terngrad", "natural", "int4", "int2", "fp4"]
SIZES = [(64, 33), (4096,), (1 << 20,)]  # small, and past the whole-tensor selection's size


def _step(codec, tensors, key):
    """One step as the collectives make it: compress with feedback, check what arrived, decode."""
    base = codec.base if isinstance(codec, ErrorFeedback) else codec
    outs = []
    for i, t in enumerate(tensors):
        payload = codec.compress(t, key=f"{key}{i}")
        safe, _ = base.check_on_device(payload)
        out = torch.zeros(t.numel(), dtype=t.dtype, device=t.device)
        base.decompress_into(safe, out)
        outs.append(base.decompress_mean_into([safe, payload], torch.empty_like(out)))
    return outs


@pytest.mark.parametrize("kernels", ["cuda-kernels", "torch-only"])
@pytest.mark.parametrize("name", NAMES)
def test_a_step_makes_no_cuda_sync(name, kernels):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    g = torch.Generator(device="cuda").manual_seed(0)
    tensors = [torch.randn(s, device="cuda", generator=g) for s in SIZES]
    c = get_compressor(name)
    codec = c if name in ("none", "fp16", "bf16") or c.capabilities.unbiased else ErrorFeedback(c)
    _no_sync_step(codec, tensors, kernels)


def _no_sync_step(codec, tensors, kernels, bounds=None):
    """Two warm-up steps (kernels compiled, buffers made, warm starts drawn), then one under
    ``set_sync_debug_mode("error")`` inside a transaction: finite, nothing flagged. ``bounds``:
    the capacities (``payload_bounds``) in force. Returns its results."""
    from gradcomp.compress.sparse import payload_bounds
    mode = torch_only() if kernels == "torch-only" else torch.cuda.device(0)
    with mode, payload_bounds(bounds):
        for _ in range(2):
            _step(codec, tensors, "w")
        torch.cuda.synchronize()
        txn = Transaction()
        with txn.active():
            torch.cuda.set_sync_debug_mode("error")
            try:
                outs = _step(codec, tensors, "w")
            finally:
                torch.cuda.set_sync_debug_mode("default")
        assert txn.problems == [] and all(torch.isfinite(o).all() for o in outs)
        txn.commit()
    return outs


@pytest.mark.parametrize("kernels", ["cuda-kernels", "torch-only"])
def test_bounded_threshold_makes_no_cuda_sync(kernels):
    """threshold as its bounded exchanges run it (``payload_bounds``: a capacity per key that a
    sized exchange agreed): selection, residual, check and decode make no CUDA synchronisation,
    also where the count outgrows the capacity (the largest tensor's)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    g = torch.Generator(device="cuda").manual_seed(0)
    tensors = [torch.randn(s, device="cuda", generator=g) for s in SIZES]
    codec = ErrorFeedback(get_compressor("threshold", tau=1.0))
    caps = {f"w{i}": min(t.numel(), int((t.abs() >= 1.0).sum()) // (4 if i == 2 else 1) + 64)
            for i, t in enumerate(tensors)}
    outs = _no_sync_step(codec, tensors, kernels, caps)
    assert [o.numel() for o in outs] == [t.numel() for t in tensors]


@pytest.mark.parametrize("kernels", ["cuda-kernels", "torch-only"])
def test_powersgd_rounds_make_no_cuda_sync(kernels):
    """PowerSGD as the hook drives it (error feedback's rounds, the result written into the
    gradient): its device form repeats no round and reads no bound, so two warm-started steps
    of a matrix, a dead column and a 1-D tensor sent dense make no CUDA synchronisation."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    g = torch.Generator(device="cuda").manual_seed(0)
    tensors = [torch.randn(s, device="cuda", generator=g) for s in [(64, 33), (512, 3, 3, 3), (4096,)]]
    tensors[0][:, 5] = 0.0
    codec = ErrorFeedback(get_compressor("powersgd", rank=4))

    def step():
        outs = []
        for i, t in enumerate(tensors):
            gen = codec.rounds(t.clone(), f"p{i}", out=torch.empty_like(t))
            sent = next(gen)
            try:
                while True:
                    sent = gen.send(sent.clone())  # one rank: the average is the tensor itself
            except StopIteration as stop:
                outs.append(stop.value)
        return outs

    mode = torch_only() if kernels == "torch-only" else torch.cuda.device(0)
    with mode:
        step()  # warm-up: the warm starts drawn
        torch.cuda.synchronize()
        txn = Transaction()
        with txn.active():
            torch.cuda.set_sync_debug_mode("error")
            try:
                outs = step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        assert txn.problems == [] and all(torch.isfinite(o).all() for o in outs)
        txn.commit()
