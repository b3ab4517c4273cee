"""The masks of the compressed-momentum optimizers (elements whose variance is zero at the
freeze), one process:

- ``Mask.fill_`` gives ``masked_fill_(mask, 0.0)``'s bits, by positions (few masked) and by the
  bool mask (many, or a tensor that is not contiguous), on data with -0.0, NaN and infinities;
  ``flat`` / ``unflat_`` give the same bits with a ``Mask`` as with its bool tensor;
- OneBitAdam's sent tensor: Adam's momentum over the frozen denominator, zero where masked (the
  same bits as the formula); poisoned by an out-of-range gradient, it is NaN at every element
  that is not masked, and all NaN when every element is masked (the poison must reach the mean).
"""
import pytest
import torch

from gradcomp.optim import OneBitAdam
from gradcomp.optim._base import SPARSE_MASK, Mask, flat, unflat_, zero_masks


def _bits(t):
    return t.reshape(-1).view(torch.int32)


def _data(shape, seed):
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(shape, generator=g)
    t.view(-1)[:4] = torch.tensor([-0.0, float("nan"), float("inf"), -float("inf")])
    return t


@pytest.mark.parametrize("share", [0.01, SPARSE_MASK, 0.5])
def test_fill_gives_masked_fill_bits(share):
    g = torch.Generator().manual_seed(3)
    mask = torch.rand(64, 48, generator=g) < share
    (m,) = zero_masks([(~mask).float()])
    assert torch.equal(m.mask, mask) and (m.index is not None) == (int(mask.sum()) <= SPARSE_MASK * mask.numel())
    for t in (_data((64, 48), 1), _data((48, 64), 2).T):  # contiguous, and a transposed view
        want = t.clone().masked_fill_(mask, 0.0)
        got = m.fill_(t.clone())
        assert torch.equal(_bits(got.contiguous()), _bits(want.contiguous()))


def test_flat_and_unflat_take_masks_or_bools():
    shapes = [(30, 20), (7,), (5, 5)]
    tensors = [_data(s, i) for i, s in enumerate(shapes)]
    bools = [torch.arange(600).view(30, 20) % 97 == 0, None, torch.eye(5, dtype=torch.bool)]
    masks = [None if b is None else zero_masks([(~b).float()])[0] for b in bools]
    assert masks[0].index is not None and masks[2].index is None  # both ways are taken
    assert torch.equal(_bits(flat(tensors, masks)), _bits(flat(tensors, bools)))
    values = _data((sum(t.numel() for t in tensors),), 9)
    a, b = [torch.empty(s) for s in shapes], [torch.empty(s) for s in shapes]
    unflat_(a, masks, values)
    unflat_(b, bools, values)
    assert all(torch.equal(_bits(x), _bits(y)) for x, y in zip(a, b))


def _frozen(dead_inputs):
    """A linear layer whose first ``dead_inputs`` input features are always zero (their weight
    column never has a gradient: masked at the freeze), past OneBitAdam's freeze."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(8, 4)
    opt = OneBitAdam(layer.parameters(), lr=1e-2, freeze_step=2)
    x = torch.randn(16, 8)
    x[:, :dead_inputs] = 0
    for _ in range(3):
        opt.zero_grad()
        layer(x).square().mean().backward()
        opt.step()
    opt.zero_grad()
    layer(x).square().mean().backward()
    return layer, opt


def test_sent_momentum_is_the_formula_zero_where_masked():
    layer, opt = _frozen(3)
    masks = opt.masks()
    assert masks[0] is not None and int(masks[0].sum()) == 12 and masks[1] is None
    sent = opt.to_send(opt._grads(dense=False))
    want = []
    for p, d, m in zip(layer.parameters(), opt.denominators(), masks):
        u = torch.lerp(opt.state[p]["exp_avg"], p.grad, 0.1).div_(d)
        want.append((u if m is None else u.masked_fill_(m, 0.0)).reshape(-1))
    assert torch.equal(_bits(sent), _bits(torch.cat(want)))


@pytest.mark.parametrize("dead", [3, 8])
def test_poison_reaches_every_element_not_masked(dead):
    layer, opt = _frozen(dead)
    # out of the second moment's range: the step must be skipped everywhere
    grads = [g * 1e30 for g in opt._grads(dense=False)]
    sent = opt.to_send(grads)
    kept = torch.cat([torch.ones(p.numel(), dtype=torch.bool) if m is None else ~m.reshape(-1)
                      for p, m in zip(layer.parameters(), opt.masks())])
    if dead == 8:  # the weight is masked whole; the bias is not
        assert not kept[:32].any() and kept[32:].all()
    assert torch.isnan(sent[kept]).all() and (torch.isnan(sent[~kept]).all() or (sent[~kept] == 0).all())


def test_poison_when_every_element_is_masked():
    torch.manual_seed(0)
    layer = torch.nn.Linear(8, 4, bias=False)
    opt = OneBitAdam(layer.parameters(), lr=1e-2, freeze_step=1)
    opt.zero_grad()
    layer(torch.zeros(4, 8)).sum().backward()  # no gradient anywhere: everything is masked
    opt.step()
    assert not opt.has_unmasked()
    opt.zero_grad()
    layer(torch.ones(4, 8)).sum().backward()
    grads = [g * 1e30 for g in opt._grads(dense=False)]
    assert torch.isnan(opt.to_send(grads)).all()
