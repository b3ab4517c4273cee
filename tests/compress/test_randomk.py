"""randomk: positions shared by (seed, key, step), every element kept with probability k/n,
unbiased after rescaling, a self-describing values-only payload that ranks can average."""
import math

import pytest
import torch

from gradcomp.compress import Payload, get_compressor
from gradcomp.compress.randomk import positions

from ranks import run_ranks


def _positions_of(c, x, key="w", step=None):
    p = c.compress(x, key=key, step=step)
    m = p.meta
    return positions(x.numel(), m["k"], m["seed"], m["key"], m["step"], x.device)


def test_same_seed_key_step_same_positions_else_different():
    x = torch.randn(10_000)
    a, b = get_compressor("randomk", seed=7), get_compressor("randomk", seed=7)
    pa = [_positions_of(a, x) for _ in range(3)]
    pb = [_positions_of(b, x) for _ in range(3)]
    assert all(torch.equal(u, v) for u, v in zip(pa, pb)), "two ranks would disagree"
    assert not torch.equal(pa[0], pa[1]) and not torch.equal(pa[1], pa[2]), "positions repeat across steps"
    assert not torch.equal(pa[0], _positions_of(get_compressor("randomk", seed=8), x, step=0))
    assert not torch.equal(pa[0], _positions_of(get_compressor("randomk", seed=7), x, key="v", step=0))


@pytest.mark.parametrize("n,k", [(1, 1), (10, 10), (1000, 10), (1003, 17), (50_000_000, 3)])
def test_positions_are_k_distinct_in_range(n, k):
    for step in range(5):
        idx = positions(n, k, 3, "w", step, torch.device("cpu"))
        assert idx.numel() == k and idx.dtype == torch.int64
        assert int(idx.min()) >= 0 and int(idx.max()) < n
        assert idx.unique().numel() == k


def test_every_element_is_kept_with_probability_k_over_n():
    n, k, steps = 50, 7, 2500  # n % k != 0: strata of 7 and 8 elements
    counts = torch.zeros(n)
    for step in range(steps):
        counts[positions(n, k, 0, "p", step, torch.device("cpu"))] += 1
    p = k / n
    sd = math.sqrt(steps * p * (1 - p))
    assert (counts - steps * p).abs().max() < 5 * sd, counts


def test_unbiased_mean_converges_to_input():
    n, steps = 40, 2000
    c = get_compressor("randomk", ratio=0.1)
    x = torch.randn(n, dtype=torch.float64)
    mean = torch.stack([c.decompress(c.compress(x, key="u")) for _ in range(steps)]).mean(0)
    # each draw is x_i * n/k with probability k/n, else 0: variance x_i^2 (n/k - 1)
    k = c.compress(x, key="u").meta["k"]
    sd = x.abs() * math.sqrt((n / k - 1) / steps)
    assert ((mean - x).abs() <= 5 * sd + 1e-12).all()
    assert c.unbiased and get_compressor("randomk", rescale=True).unbiased


def test_rescale_false_sends_plain_values():
    c = get_compressor("randomk", ratio=0.1, rescale=False)
    assert not c.unbiased
    x = torch.randn(200)
    out = c.decompress(c.compress(x, key="w"))
    kept = out != 0
    assert int(kept.sum()) == 20 and torch.equal(out[kept], x[kept])


def test_payload_is_values_only_and_self_describing():
    c = get_compressor("randomk", ratio=0.01, seed=12345)
    x = torch.randn(256, 256)
    p = c.compress(x, key="layer.w")
    assert len(p.tensors) == 1 and p.nbytes == 4 * 655
    assert 8 * p.nbytes / x.numel() == pytest.approx(c.bits_per_element(x.numel()))
    wire = Payload.from_bytes(p.to_bytes())
    assert torch.equal(get_compressor("randomk").decompress(wire), c.decompress(p))  # default-made receiver
    idx = positions(x.numel(), 655, 12345, "layer.w", 0, x.device)
    assert torch.equal(p.tensors[0], x.reshape(-1)[idx])


def test_values_can_be_averaged_across_ranks():
    """native: mean of the value tensors decodes to the mean of the decodings."""
    a, b = get_compressor("randomk", seed=1), get_compressor("randomk", seed=1)
    x, y = torch.randn(3000), torch.randn(3000)
    pa, pb = a.compress(x, key="g"), b.compress(y, key="g")
    avg = Payload(pa.compressor, pa.shape, pa.dtype, [(pa.tensors[0] + pb.tensors[0]) / 2], pa.meta)
    assert torch.allclose(a.decompress(avg), (a.decompress(pa) + b.decompress(pb)) / 2, atol=1e-6)


def _rank_fn(rank, world_size):
    import torch.distributed as dist

    c = get_compressor("randomk", ratio=0.05, seed=99)
    x = torch.randn(1000, generator=torch.Generator().manual_seed(rank))
    p = c.compress(x, key="bucket0")
    local = c.decompress(p)
    dist.all_reduce(p.tensors[0])
    p.tensors[0] /= world_size
    return x, local, c.decompress(p)


def test_two_gloo_ranks_agree(tmp_path):
    (x0, l0, avg0), (x1, l1, avg1) = run_ranks(_rank_fn, 2, tmp_path)
    assert torch.equal((l0 != 0), (l1 != 0)), "ranks kept different positions"
    assert torch.equal(avg0, avg1)
    assert torch.allclose(avg0, (l0 + l1) / 2, atol=1e-6)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nonfinite_input_poisons_every_value(bad):
    x = torch.randn(10_000)
    x[1234] = bad
    p = get_compressor("randomk").compress(x)
    assert torch.isnan(p.tensors[0]).all()
    big = torch.full((1000,), 3e38)  # finite, but its sum overflows: must not be poisoned
    assert torch.isfinite(get_compressor("randomk").compress(big).tensors[0]).all()


def test_malformed_meta_is_rejected():
    p = get_compressor("randomk", ratio=0.1).compress(torch.randn(100))

    def with_meta(**change):
        meta = dict(p.meta, **change)
        return Payload(p.compressor, p.shape, p.dtype, p.tensors, meta).to_bytes()

    for change, match in [({"k": 11}, "values have shape"), ({"k": 101}, "meta k"), ({"k": 0}, "k >= 1"),
                          ({"seed": -1}, "seed"), ({"key": 5}, "key"), ({"rescale": 1}, "rescale"),
                          ({"step": 1.5}, "step"), ({"extra": 1}, "exactly")]:
        with pytest.raises(ValueError, match=match):
            Payload.from_bytes(with_meta(**change))
    two = Payload(p.compressor, p.shape, p.dtype, p.tensors * 2, p.meta).to_bytes()
    with pytest.raises(ValueError, match="1 tensor"):
        Payload.from_bytes(two)
