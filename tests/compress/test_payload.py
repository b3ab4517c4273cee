"""The wire format: round trips, and hostile bytes always give ValueError, never a crash."""
import struct

import pytest
import torch
hypothesis = pytest.importorskip("hypothesis", reason="the wire-format fuzzing needs hypothesis (the test extra)")
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gradcomp.compress import Payload, available_compressors, get_compressor
from gradcomp.compress.payload import view_bytes


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


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=512), st.one_of(st.none(), st.integers(0, 2**32 - 1)))
def test_random_bytes_behind_a_valid_prefix(body, hlen):
    """Random bytes almost never start with the magic bytes: these pass that check, with the
    header length true (None) or random, so the header and tensor parsing see them."""
    raw = _framed(body) if hlen is None else struct.pack("<4sHI", b"GCMP", 1, hlen) + body
    try:
        Payload.from_bytes(raw)
    except ValueError:
        pass


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(SAMPLES), st.data())
def test_mutated_bytes_give_value_error_or_a_valid_payload(raw, data):
    buf = _mutated(raw, data)
    try:
        p = Payload.from_bytes(bytes(buf))
    except ValueError:
        return
    # the samples were made with default options, so a default compressor decodes them; a
    # decode whose values would overflow (randomk's rescale of a mutated value) refuses with
    # a ValueError that says why, never a crash or a silent inf
    try:
        out = get_compressor(p.compressor).decompress(p)
    except ValueError as exc:
        assert str(exc), "a refused decode must say why"
        return
    assert out.shape == p.shape


def _mutated(raw: bytes, data) -> bytearray:
    """``raw`` with one to four bytes changed, drawn by hypothesis."""
    buf = bytearray(raw)
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(buf) - 1))
        buf[i] = data.draw(st.integers(0, 255))
    return buf


def _framed(body: bytes) -> bytes:
    return struct.pack("<4sHI", b"GCMP", 1, len(body)) + body


@pytest.mark.parametrize("depth", [400, 5000])
def test_deeply_nested_header_is_a_value_error(depth):
    body = b'{"c":"none","shape":[1],"dtype":"float32","meta":{"x":' + b"[" * depth + b"]" * depth + b'},"t":[]}'
    with pytest.raises(ValueError, match="payload header"):
        Payload.from_bytes(_framed(body))


def test_a_large_header_is_refused_before_it_is_parsed():
    """A 1 MiB header of empty lists once took 25 MiB of heap before it was rejected."""
    import tracemalloc

    body = b"[" + b"[]," * ((1 << 20) // 3 - 1) + b"[]]"
    raw = _framed(body)
    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match="exceeds the limit of"):
            Payload.from_bytes(raw)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 3 * len(raw), f"{peak} bytes of heap for a {len(raw)}-byte payload"
    within = b'{"c":"none","shape":[1],"dtype":"float32","meta":{"x":[' + b"[]," * 2000 + b'[]]},"t":[]}'
    with pytest.raises(ValueError, match=r"holds 2006 '\[' or '\{'"):
        Payload.from_bytes(_framed(within))


def test_header_length_errors_say_which_limit():
    too_long = struct.pack("<4sHI", b"GCMP", 1, (1 << 20) + 99) + b" " * ((1 << 20) + 115)
    with pytest.raises(ValueError, match="exceeds the limit of 65536 bytes") as err:
        Payload.from_bytes(too_long)
    assert "follow" not in str(err.value)
    with pytest.raises(ValueError, match="truncated: the header needs 500 bytes, 20 follow"):
        Payload.from_bytes(struct.pack("<4sHI", b"GCMP", 1, 500) + b" " * 20)


@pytest.mark.parametrize("data", ["GCMP", None, [1, 2, 3]])
def test_from_bytes_of_something_else_is_a_value_error(data):
    with pytest.raises(ValueError, match=f"got {type(data).__name__}"):
        Payload.from_bytes(data)


def test_a_tiny_sparse_payload_claiming_a_huge_tensor_is_refused():
    """127 bytes that claim 2**40 - 1 elements would decompress into 4 TiB."""
    huge = 2**40 - 1
    raw = Payload("topk", (huge,), torch.float32, [torch.ones(1), torch.tensor([7])], {}).to_bytes()
    assert len(raw) < 128
    with pytest.raises(ValueError, match="memory; pass max_numel"):
        get_compressor("topk").decompress(Payload.from_bytes(raw))
    assert Payload.from_bytes(raw, max_numel=huge).numel == huge  # allowed explicitly, still parsed
    with pytest.raises(ValueError, match="more than the limit 1000"):
        Payload.from_bytes(raw, max_numel=1000)


@pytest.mark.parametrize("name", available_compressors())
def test_every_payload_fits_the_wire_bound(name):
    from gradcomp.compress.payload import max_wire_bytes

    for shape in [(1,), (2,), (7,), (1, 1), (1, 50), (50, 1), (3, 3), (2, 300), (2, 2, 2)]:
        for dtype in (torch.float16, torch.float32, torch.float64):
            p = get_compressor(name).compress(torch.randn(shape, dtype=dtype), key="b")
            raw = p.to_bytes()
            assert len(raw) <= max_wire_bytes(p.numel)
            Payload.from_bytes(raw)  # and the receiver's bound on the tensor data agrees


def test_tensor_data_beyond_the_bound_is_refused():
    raw = Payload("none", (1,), torch.float32, [torch.ones(64)], {}).to_bytes()
    with pytest.raises(ValueError, match="256 bytes, more than the 80 allowed for 1 elements"):
        Payload.from_bytes(raw)


def test_a_header_too_long_to_be_read_is_not_written():
    with pytest.raises(ValueError, match="exceeds the limit of 65536; keys and meta must be short"):
        get_compressor("randomk").compress(torch.randn(10), key="k" * 70000).to_bytes()


# ---- the wire format in a tensor (the pipeline's messages): the form off the CPU, on CPU tensors ----

def _views(raw: bytes, head=None, offset=0):
    buf = torch.zeros(offset + len(raw), dtype=torch.uint8)
    buf[offset:] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    return Payload._from_tensor_views(buf[offset:], None, head)


@pytest.mark.parametrize("offset", [0, 8, 3])  # aligned where it lies, and not: then copies
def test_tensor_views_parse_as_from_bytes(offset):
    for raw in SAMPLES:
        want = Payload.from_bytes(raw)
        for head in (None, raw[:5], raw[:40], raw):  # read here, partly given, all given
            got = _views(raw, head, offset)
            assert (got.compressor, got.shape, got.dtype, got.meta) == (want.compressor, want.shape, want.dtype,
                                                                        want.meta)
            assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(got.tensors, want.tensors))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_empty_tensors_parse_wherever_they_lie(dtype):
    """A payload with no values (threshold: nothing reached tau) holds tensors of no bytes;
    they parse at any offset, as empty tensors of their dtype, never as views of a slice of no
    bytes (which keeps a storage offset that need not be aligned)."""
    p = get_compressor("threshold", tau=1e3).compress(torch.randn(10).to(dtype), key="k")
    assert [t.numel() for t in p.tensors] == [0, 0]
    for offset in (0, 1, 3, 8):
        got = _views(p.to_bytes(), None, offset)
        assert [(t.dtype, t.shape) for t in got.tensors] == [(t.dtype, t.shape) for t in p.tensors]
        assert torch.equal(get_compressor("threshold").decompress(got), torch.zeros(10, dtype=dtype))
    rows = torch.zeros(4, 0, dtype=torch.uint8)  # what an all-gather of no bytes gives: row r starts at byte r
    for r in range(4):
        assert view_bytes(rows[r], dtype, (0, 3)).shape == (0, 3)


def test_write_wire_is_to_bytes_and_long_headers_are_read_whole():
    c = get_compressor("topk")
    p = c.compress(torch.randn(50), key="k")
    out = torch.full((p.wire_nbytes + 5,), 7, dtype=torch.uint8)
    assert p.write_wire(out) == p.wire_nbytes and out[:p.wire_nbytes].numpy().tobytes() == p.to_bytes()
    long = Payload(p.compressor, p.shape, p.dtype, p.tensors, {"note": "x" * 3000})  # past the first read
    got = _views(long.to_bytes())
    assert got.meta == long.meta and all(torch.equal(a, b) for a, b in zip(got.tensors, long.tensors))


@pytest.mark.parametrize("cut", [0, 3, 9, 20])
def test_tensor_views_refuse_what_from_bytes_refuses(cut):
    for raw in SAMPLES:
        with pytest.raises(ValueError):
            _views(raw[:cut] if cut < len(raw) else raw[:-1])
        with pytest.raises(ValueError):
            _views(raw[:-1])
    with pytest.raises(ValueError, match="trailing"):
        _views(SAMPLES[0] + b"\0")
    body = b'{"c":"fp16","shape":[10],"dtype":"float32","meta":{},"t":[["float16",[3]]]}'
    with pytest.raises(ValueError, match="fp16"):
        _views(struct.pack("<4sHI", b"GCMP", 1, len(body)) + body + b"\0" * 6)
    with pytest.raises(ValueError):
        Payload.from_tensor(torch.zeros(4, dtype=torch.int32))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(SAMPLES), st.data())
def test_tensor_views_of_mutated_bytes_agree_with_from_bytes(raw, data):
    buf = _mutated(raw, data)
    try:
        want = Payload.from_bytes(bytes(buf))
    except ValueError:
        with pytest.raises(ValueError):
            _views(bytes(buf))
        return
    got = _views(bytes(buf))
    assert got.compressor == want.compressor and all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                                                      for a, b in zip(got.tensors, want.tensors))


@pytest.mark.gpu
def test_wire_format_on_a_gpu_stays_there():
    """On a GPU the wire bytes are written on the device and parsed there: only the head is
    read back, the tensors are views of the received buffer."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    for name in available_compressors():
        c = get_compressor(name)
        p = c.compress(torch.randn(7, 9, device="cuda"), key="g")
        buf = torch.empty(p.wire_nbytes, dtype=torch.uint8, device="cuda")
        p.write_wire(buf)
        assert buf.cpu().numpy().tobytes() == p.to_bytes(), name
        q = Payload.from_tensor(buf)
        assert all(t.device.type == "cuda" for t in q.tensors), name
        assert torch.equal(c.decompress(q), c.decompress(p)), name
