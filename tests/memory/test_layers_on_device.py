"""The optimizers of the memory and optim layers on the device their tensors live on: on CPU here, and on CUDA where
``tools/gpu_check.sh`` runs the ``gpu`` tests. One process, no process group (the multi-rank
behaviour is in test_sharded.py and tests/optim/); what is checked is that each runs on the
device and keeps its exact contract there."""
import pytest
import torch

from gradcomp.memory import LowBitState, ShardedOptimizer, state_nbytes
from gradcomp.optim import OneBitAdam

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _model(device):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10)).to(device)


def _train(device, make, steps=6):
    model = _model(device)
    opt = make(model)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, y = torch.randn(32, 64, generator=g).to(device), torch.randint(0, 10, (32,), generator=g).to(device)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return torch.cat([p.detach().flatten() for p in model.parameters()]), opt


@pytest.mark.parametrize("device", DEVICES)
def test_sharded_optimizer_alone_is_the_inner_optimizer(device):
    ref, _ = _train(device, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3))
    got, _ = _train(device, lambda m: ShardedOptimizer(m.parameters(), torch.optim.AdamW, lr=1e-3))
    assert got.device.type == device and torch.equal(got, ref)


@pytest.mark.parametrize("device", DEVICES)
def test_one_bit_adam_is_adam_before_the_freeze_and_moves_after(device):
    ref, _ = _train(device, lambda m: torch.optim.Adam(m.parameters(), lr=1e-3), steps=4)
    got, _ = _train(device, lambda m: OneBitAdam(m.parameters(), lr=1e-3, freeze_step=4), steps=4)
    assert torch.equal(got, ref)
    before, _ = _train(device, lambda m: OneBitAdam(m.parameters(), lr=1e-3, freeze_step=4), steps=4)
    after, opt = _train(device, lambda m: OneBitAdam(m.parameters(), lr=1e-3, freeze_step=4), steps=8)
    assert torch.isfinite(after).all() and not torch.equal(after, before)  # the compressed steps move it
    assert all(v.device.type == device for s in opt.state.values() for v in s.values() if torch.is_tensor(v)
               and v.dim() > 0)


@pytest.mark.parametrize("device", DEVICES)
def test_eight_bit_state_stays_on_the_device_and_close_to_fp32(device):
    ref, _ = _train(device, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3))
    got, opt = _train(device, lambda m: LowBitState(torch.optim.AdamW(m.parameters(), lr=1e-3)))
    # 6 steps of lr 1e-3: within a fraction of the distance the parameters travelled
    assert (got - ref).abs().max() < 0.5 * 6e-3
    assert state_nbytes(opt) < 0.5 * sum(4 * 2 * p.numel() for p in _model(device).parameters())
