"""The wire format: round trips, and hostile bytes always give ValueError, never a crash."""
import struct

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gradcomp.compress import Payload, available_compressors, get_compressor


def _sample_payloads():
    out = []
    for name in available_compressors():
        c = get_compressor(name)
        out.append(c.compress(torch.randn(7, 9), key="f").to_bytes())
    return out


SAMPLES = _sample_payloads()


def test_round_trip_preserves_everything():
    c = get_compressor("fp16")
    p = c.compress(torch.randn(3, 4, dtype=torch.float64), key="x")
    q = Payload.from_bytes(p.to_bytes())
    assert (q.compressor, q.shape, q.dtype, q.meta) == (p.compressor, p.shape, p.dtype, p.meta)
    assert all(torch.equal(a, b) for a, b in zip(p.tensors, q.tensors))


@pytest.mark.parametrize("cut", [0, 3, 9, 20])
def test_truncated_bytes(cut):
    for raw in SAMPLES:
        with pytest.raises(ValueError):
            Payload.from_bytes(raw[:cut] if cut < len(raw) else raw[:-1])
        with pytest.raises(ValueError):
            Payload.from_bytes(raw[:-1])


def test_trailing_bytes_rejected():
    with pytest.raises(ValueError, match="trailing"):
        Payload.from_bytes(SAMPLES[0] + b"\0")


def test_oversized_tensor_claim_does_not_allocate():
    body = b'{"c":"none","shape":[1099511627775],"dtype":"float32","meta":{},"t":[["float32",[1099511627775]]]}'
    raw = struct.pack("<4sHI", b"GCMP", 1, len(body)) + body + b"\0" * 16
    with pytest.raises(ValueError):
        Payload.from_bytes(raw)


def test_wrong_compressor_tensor_sizes_rejected():
    body = b'{"c":"fp16","shape":[10],"dtype":"float32","meta":{},"t":[["float16",[3]]]}'
    raw = struct.pack("<4sHI", b"GCMP", 1, len(body)) + body + b"\0" * 6
    with pytest.raises(ValueError, match="fp16"):
        Payload.from_bytes(raw)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=512))
def test_random_bytes(data):
    try:
        Payload.from_bytes(data)
    except ValueError:
        pass


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(SAMPLES), st.data())
def test_mutated_bytes_give_value_error_or_a_valid_payload(raw, data):
    buf = bytearray(raw)
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(buf) - 1))
        buf[i] = data.draw(st.integers(0, 255))
    try:
        p = Payload.from_bytes(bytes(buf))
    except ValueError:
        return
    out = get_compressor(p.compressor, **_options_from(p)).decompress(p)  # must not crash
    assert out.shape == p.shape


def _options_from(p):
    return {}
