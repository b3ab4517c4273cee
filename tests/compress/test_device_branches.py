"""The branches that tensors off the CPU take, run here on CPU tensors: every branch guarded by
``kernels.quant.may_hold`` (read on CPU, always taken elsewhere, decided there by
``torch.where``) gives the same payloads and decodings when taken on every call as when the
CPU's read skips it, on ordinary, tiny (subnormal steps), huge and non-finite data."""
import math

import pytest
import torch

from gradcomp.compress import get_compressor
from gradcomp.compress import int8, powersgd, qsgd
from gradcomp.kernels import quant

NAMES = ["int8", "qsgd", "terngrad", "powersgd"]


def _inputs():
    g = torch.Generator().manual_seed(7)
    for dtype in (torch.float32, torch.float64, torch.float16):
        yield torch.randn(40, 33, generator=g).to(dtype)
        yield (torch.randn(40, 33, generator=g, dtype=torch.float64) * 1e-42).to(dtype)  # subnormal steps in fp32
        yield (torch.randn(40, 33, generator=g, dtype=torch.float64) * 1e37).clamp(-3e38, 3e38).to(dtype)
        x = torch.randn(40, 33, generator=g).to(dtype)
        x[0, :10] = 0.0  # an all-zero block or column
        x[3, 3] = math.nan
        yield x
    x = torch.randn(40, 33, generator=g)
    x[:, 5] = 0.0  # a dead PowerSGD column
    yield x


def _run(name, x):
    c = get_compressor(name, **({"rank": 2} if name == "powersgd" else {}))
    out = []
    for step in range(2):  # PowerSGD's second step starts from the first's Q
        try:
            p = c.compress(x, key="k")
        except ValueError as exc:
            out.append(str(exc))
            continue
        out.append([t.clone() for t in p.tensors])
        out.append(c.decompress(p))
    return out


def _same(a, b):
    if isinstance(a, str) or isinstance(b, str):
        return a == b
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(u, v) for u, v in zip(a, b))
    if a.is_floating_point():
        return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())
    return torch.equal(a, b)


@pytest.mark.parametrize("name", NAMES)
def test_every_device_branch_gives_the_cpu_bits(name, monkeypatch):
    asked = []

    def always(flags):
        asked.append(bool(flags.any()))
        return True

    for x in _inputs():
        reference = _run(name, x)
        with monkeypatch.context() as m:
            for module in (quant, int8, qsgd, powersgd):
                m.setattr(module, "may_hold", always, raising=False)
            taken = _run(name, x)
        assert _same(reference, taken), (name, x.dtype)
    assert False in asked  # branches the CPU's read skips were taken
    if name != "terngrad":
        assert True in asked  # and branches that had work to do
