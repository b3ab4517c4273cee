"""CUDA tensors through the collectives (skipped without a GPU): the result stays on the
tensor's device, one process is the compressor's own round trip on that device, and two gloo
ranks sharing one GPU (gloo stages CUDA tensors through the host) hold the same bits."""
from __future__ import annotations

import pytest
import torch

from ranks import run_ranks
from gradcomp.collectives import ALGORITHMS, allreduce
from gradcomp.compress import ErrorFeedback, available_compressors, get_compressor

pytestmark = pytest.mark.gpu
NAMES = available_compressors()


def _suitable(c):
    return [a for a, cls in ALGORITHMS.items() if cls.unsuitable(c) is None]


def test_cuda_one_process_round_trip():
    for name in NAMES:
        for algo in _suitable(get_compressor(name)):
            if algo in ("rounds", "scatter-reduce"):
                continue  # their one-process forms are checked on the CPU; here: device handling
            t = torch.randn(33, 17, device="cuda")
            out = allreduce(t, get_compressor(name), key="k", algorithm=algo)
            c = get_compressor(name)
            expected = c.decompress(c.compress(t, "k"))
            assert out.device == t.device and out.dtype == t.dtype
            assert torch.equal(out, expected), f"{name}/{algo} on CUDA is not the local round trip"


def _ranks(rank, w):
    torch.cuda.set_device(0)
    out = {}
    for name in NAMES:
        c = ErrorFeedback(get_compressor(name))
        for algo in _suitable(c.compressor):
            t = torch.randn(40, 9, device="cuda", generator=torch.Generator("cuda").manual_seed(rank))
            res = allreduce(t, c, key=f"k/{algo}", algorithm=algo)
            out[(name, algo)] = (str(res.device), res.cpu())
    return out


def test_cuda_tensors_on_two_gloo_ranks_agree(tmp_path):
    r0, r1 = run_ranks(_ranks, 2, tmp_path, timeout_s=120)
    for combo, (device, value) in r0.items():
        assert device.startswith("cuda"), combo
        assert r1[combo][0] == device and torch.equal(value, r1[combo][1]), f"{combo}: ranks differ"
        assert torch.isfinite(value).all(), combo
