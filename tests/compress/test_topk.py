"""topk: exactly k = max(1, round(ratio * n)) elements, the exact top-k set, 64 bits per kept
fp32 element, and indices validated before any decode scatters with them."""
import dataclasses
import struct

import pytest
import torch

from gradcomp.compress import ErrorFeedback, Payload, get_compressor


def _bytes_with(payload, tensors):
    """Wire bytes of ``payload`` with its tensors replaced (a hand-made, possibly hostile payload)."""
    return Payload(payload.compressor, payload.shape, payload.dtype, tensors, payload.meta).to_bytes()


@pytest.mark.parametrize("n,ratio,k", [(0, 0.01, 0), (1, 0.01, 1), (99, 0.01, 1), (250, 0.01, 2),
                                       (1000, 0.0015, 2), (1000, 0.5, 500), (1000, 1.0, 1000)])
def test_k(n, ratio, k):
    p = get_compressor("topk", ratio=ratio).compress(torch.randn(n))
    assert p.tensors[0].numel() == p.tensors[1].numel() == k


@pytest.mark.parametrize("n", [3000, 400_000])  # whole-tensor and sampled selection paths
def test_exact_top_k_against_torch_topk(n):
    x = torch.randn(n)
    c = get_compressor("topk", ratio=0.01)
    p = c.compress(x)
    values, indices = p.tensors
    k = round(0.01 * n)
    ref = torch.topk(x.abs(), k).indices.sort().values
    assert indices.dtype == torch.int32 and torch.equal(indices.long(), ref)
    assert torch.equal(values, x[ref])
    out = c.decompress(p)
    dense = torch.zeros(n)
    dense[ref] = x[ref]
    assert torch.equal(out, dense)


def test_ties_are_deterministic_and_lowest_index():
    x = torch.tensor([1.0, -3.0, 2.0, 3.0, -2.0, 2.0, 0.5])
    c = get_compressor("topk", ratio=4 / 7)
    idx = c.compress(x).tensors[1].tolist()
    assert idx == [1, 2, 3, 4]  # |-3|, |3|, then the two lowest-index 2s
    assert c.compress(x).tensors[1].tolist() == idx


def test_nan_is_kept_and_propagates():
    x = torch.randn(5000)
    x[4321] = float("nan")
    x[7] = float("-inf")
    out = get_compressor("topk", ratio=0.001).decompress(get_compressor("topk", ratio=0.001).compress(x))
    assert torch.isnan(out[4321]) and out[7] == float("-inf")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64], ids=str)
def test_values_keep_the_input_dtype(dtype):
    x = torch.randn(2000, dtype=dtype)
    p = get_compressor("topk", ratio=0.05).compress(x)
    assert p.tensors[0].dtype == dtype and p.tensors[1].dtype == torch.int32
    assert p.nbytes == 100 * (dtype.itemsize + 4)


def test_bits_per_element_follow_theory():
    c = get_compressor("topk", ratio=0.01)
    n = 1 << 16
    k = round(0.01 * n)
    assert c.bits_per_element(n) == pytest.approx(64 * k / n)
    assert 8 * c.compress(torch.randn(n)).nbytes == 64 * k
    # from 2**31 elements on, indices need int64: 96 bits per kept element
    assert c.bits_per_element(2**31) == pytest.approx(96 * round(0.01 * 2**31) / 2**31)
    assert c.bits_per_element(2**31 - 1) == pytest.approx(64 * round(0.01 * (2**31 - 1)) / (2**31 - 1))


def test_fused_decoding_equals_decompress():
    c = get_compressor("topk", ratio=0.02)
    x = torch.randn(30, 70)
    p, decoded = c.compress_decoded(x)
    assert torch.equal(decoded, c.decompress(p))
    ef = ErrorFeedback(get_compressor("topk", ratio=0.02))
    p = ef.compress(x, key="w")
    assert torch.equal(ef.residual("w") + ef.decompress(p), x)  # the residual is what was not sent


def test_hostile_indices_are_rejected_by_from_bytes():
    p = get_compressor("topk", ratio=0.1).compress(torch.randn(100))
    values, indices = p.tensors
    bad = {
        "index past the end": indices.clone().index_fill_(0, torch.tensor([9]), 100),
        "negative index": indices.clone().index_fill_(0, torch.tensor([0]), -1),
        "repeated index": indices.clone().index_fill_(0, torch.tensor([1]), int(indices[0])),
        "int64 indices for a small tensor": indices.long(),
    }
    for what, idx in bad.items():
        with pytest.raises(ValueError, match="topk"):
            Payload.from_bytes(_bytes_with(p, [values, idx]))
    with pytest.raises(ValueError, match="equal"):
        Payload.from_bytes(_bytes_with(p, [values[:5], indices]))
    with pytest.raises(ValueError, match="2 tensors"):
        Payload.from_bytes(_bytes_with(p, [values]))
    with pytest.raises(ValueError, match="dtype"):
        Payload.from_bytes(_bytes_with(p, [values.to(torch.int32), indices]))
    ok = Payload.from_bytes(p.to_bytes())
    assert torch.equal(get_compressor("topk").decompress(ok), get_compressor("topk").decompress(p))


def test_index_past_the_end_in_raw_bytes():
    """The same check on bytes edited directly, as a corrupted message would arrive."""
    p = get_compressor("topk", ratio=0.1).compress(torch.randn(50))
    raw = bytearray(p.to_bytes())
    last = len(raw) - 4  # the last int32 index
    raw[last:] = struct.pack("<i", 50)
    with pytest.raises(ValueError, match=r"\[0, 50\)"):
        Payload.from_bytes(bytes(raw))


def test_bad_ratio():
    for bad in (0.0, -0.1, 1.5, "0.1", True):
        with pytest.raises(ValueError, match="ratio"):
            get_compressor("topk", ratio=bad)


@pytest.mark.parametrize("name", ["topk", "dgc"])
def test_check_on_device_clamps_and_flags_what_only_values_show(name):
    """A payload read from an agreed layout: indices out of range or out of order are clamped
    (the decode stays in bounds) and flagged on the device, nothing read back; a valid one
    passes unchanged. Either way it is then ``checked``: decoding skips the host check."""
    from syncs import HostSyncs

    c = get_compressor(name, ratio=0.1)
    x = torch.randn(200)
    own = c.compress(x)
    assert own.checked  # built here: positions of the exact selection
    wire = dataclasses.replace(own, checked=False, tensors=[t.clone() for t in own.tensors])
    with HostSyncs() as syncs:
        safe, bad = c.check_on_device(wire)
        out = c.decompress(safe)
    assert syncs.count == 0, syncs.report()
    assert safe.checked and not bool(bad) and torch.equal(safe.tensors[1], own.tensors[1])
    assert torch.equal(out, c.decompress(own))
    for index, value in ((-1, 200), (0, -3), (5, int(own.tensors[1][4]))):  # past the end, negative, repeated
        tampered = dataclasses.replace(wire, tensors=[wire.tensors[0], wire.tensors[1].clone()])
        tampered.tensors[1][index] = value
        safe, bad = c.check_on_device(tampered)
        assert bool(bad), (index, value)
        assert 0 <= int(safe.tensors[1].min()) and int(safe.tensors[1].max()) < 200
        c.decompress_into(safe, torch.zeros(200))  # in bounds whatever arrived
    outside = dataclasses.replace(wire, tensors=[wire.tensors[0], wire.tensors[1].clone()])
    outside.tensors[1][-1] = 200
    with pytest.raises(ValueError, match="indices must lie"):  # a payload from outside is still checked
        c.decompress(outside)
