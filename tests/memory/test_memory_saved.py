"""``compressed_activations``: gradients exact with the lossless codec and close with int8,
saved bytes really smaller (measured by ``MemoryMeter``) and never larger, one encoding per
saved memory, keyed reproducibility, and composition with ``torch.utils.checkpoint``."""
import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from gradcomp.memory.codecs import BlockQuant, Lossless
from gradcomp.memory.meter import MemoryMeter
from gradcomp.memory.saved import compressed_activations


def mlp(width=1024, depth=3, d_in=256, d_out=16, seed=0):
    torch.manual_seed(seed)
    layers = [nn.Linear(d_in, width), nn.ReLU()]
    for _ in range(depth - 2):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, d_out))


def convnet(seed=0):
    torch.manual_seed(seed)
    # no bias before the BatchNorm: its gradient would be 0 up to rounding, any error "infinite"
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(32 * 8 * 8, 10))


def step(model, x, ctx=None, forward=None, retain=False):
    """The parameter gradients of one forward+backward (inside ``ctx`` when given) and the
    meter's peak saved bytes. ``model``: a module, or a list of the leaves to differentiate."""
    params = list(model.parameters()) if isinstance(model, nn.Module) else model
    for p in params:
        p.grad = None
    forward = forward or model
    with MemoryMeter() as meter:
        if ctx is None:
            forward(x).square().mean().backward(retain_graph=retain)
        else:
            with ctx:
                forward(x).square().mean().backward(retain_graph=retain)
    assert meter.live_saved_bytes == 0  # the graph is gone and so is every holding
    return [p.grad.clone() for p in params], meter.peak_saved_bytes


def rel_err(got, want):
    return max(float((g - w).norm() / w.norm().clamp(min=1e-30)) for g, w in zip(got, want))


def identical(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


class Counting(BlockQuant):
    """int8 that counts the tensors the hook asks it to encode."""

    def __init__(self):
        super().__init__(8)
        self.calls = 0

    def encode_if_smaller(self, t, key, limit):
        self.calls += 1
        return super().encode_if_smaller(t, key, limit)


class CountingLossless(Lossless):
    def __init__(self):
        self.calls = 0

    def encode_if_smaller(self, t, key, limit):
        self.calls += 1
        return super().encode_if_smaller(t, key, limit)


# ---- exactness and accuracy ---------------------------------------------------------------------

def test_lossless_gradients_are_bit_identical():
    for model, x in [(mlp(), torch.randn(64, 256)), (convnet(), torch.randn(8, 3, 16, 16))]:
        want, _ = step(model, x)
        ctx = compressed_activations("lossless", min_numel=1024)
        got, _ = step(model, x, ctx)
        assert identical(got, want)
        assert ctx.stats.encoded >= 2 and ctx.stats.ratio > 1.3, ctx.stats


def test_int8_gradients_are_close():
    for model, x, tol in [(mlp(), torch.randn(64, 256), 0.03), (convnet(), torch.randn(8, 3, 16, 16), 0.05)]:
        want, _ = step(model, x)
        ctx = compressed_activations("int8", min_numel=1024)
        got, _ = step(model, x, ctx)
        err = rel_err(got, want)
        print(f"int8 {type(model[0]).__name__} chain: worst relative gradient error {err:.4f}")
        assert err < tol and ctx.stats.encoded >= 3
        assert all(g.shape == w.shape for g, w in zip(got, want))


# ---- memory ----------------------------------------------------------------------------------

def test_int8_peak_saved_bytes_is_over_3_5x_smaller():
    model, x = mlp(width=2048, depth=3, d_in=512), torch.randn(64, 512)
    _, plain = step(model, x)
    figures = {}
    for codec in ["int8", "int4", "int2", "lossless", "bf16"]:
        _, figures[codec] = step(model, x, compressed_activations(codec))
    print(f"peak saved bytes: none {plain}, " + ", ".join(f"{c} {b} ({plain / b:.2f}x)" for c, b in figures.items()))
    assert plain / figures["int8"] >= 3.5
    assert plain / figures["int4"] >= 6.5 and plain / figures["int2"] >= 11
    assert plain / figures["bf16"] >= 1.9 and plain / figures["lossless"] >= 1.5


def test_the_hook_never_increases_memory():
    torch.manual_seed(0)
    dense = nn.Sequential(nn.Linear(256, 1024), nn.Tanh(), nn.Linear(1024, 1024), nn.Tanh(), nn.Linear(1024, 8))
    x = torch.randn(64, 256)
    _, plain = step(dense, x)
    ctx = compressed_activations("lossless")
    _, hooked = step(dense, x, ctx)
    assert hooked <= plain and ctx.stats.encoded == 0  # tanh outputs have no zeros to drop

    # saved tensors that are parameters or inputs the caller keeps anyway (exclude)
    w = nn.Parameter(torch.randn(512, 512))
    inp = torch.randn(64, 512)
    row = torch.randn(1, 512)
    for codec in ["int8", "lossless"]:
        _, plain = step([w], inp, forward=lambda t: (t @ w) * row)
        ctx = compressed_activations(codec, exclude=[inp])
        _, hooked = step([w], inp, ctx, forward=lambda t: (t @ w) * row)
        assert hooked <= plain, (codec, hooked, plain)
    # a broadcast (stride 0) view holds one row of storage: its payload would be larger
    leaf, other_leaf = torch.randn(1, 8192, requires_grad=True), torch.randn(64, 8192, requires_grad=True)

    def forward(_):
        row, other = leaf * 1, other_leaf * 1  # activations, not leaves
        return row.expand(64, 8192) * other

    _, plain = step([leaf, other_leaf], None, forward=forward)
    ctx = compressed_activations("int8")
    _, hooked = step([leaf, other_leaf], None, ctx, forward=forward)
    # encoded: `other` and the product (saved by square); the broadcast row is kept
    assert hooked < plain and ctx.stats.encoded == 2 and ctx.stats.kept == 1, ctx.stats


def test_small_and_integer_tensors_are_kept():
    model, x = convnet(), torch.randn(8, 3, 16, 16)
    ctx = compressed_activations("int8", min_numel=10**9)
    want, plain = step(model, x)
    got, hooked = step(model, x, ctx)
    assert identical(got, want) and hooked == plain and ctx.stats.encoded == 0
    ctx = compressed_activations("int8", min_numel=1)  # MaxPool's int64 indices stay as they are
    got, _ = step(model, x, ctx)
    assert ctx.stats.kept > 0 and rel_err(got, want) < 0.05


# ---- one encoding per saved memory -------------------------------------------------------------

def test_a_storage_saved_twice_is_encoded_once():
    for codec in [Counting(), CountingLossless()]:
        model, x = mlp(width=512, depth=2, d_in=128), torch.randn(64, 128).relu()  # shrinks losslessly too
        ctx = compressed_activations(codec, min_numel=2048)
        step(model, x, ctx)
        # x (saved by the first Linear) and the ReLU output (saved by ReLU and by the next Linear)
        assert codec.calls == ctx.stats.encoded == 2 and ctx.stats.shared == 1, ctx.stats
    # a (b, s, d) activation and the (b*s, d) view the next Linear saves share one payload
    codec = Counting()
    model, x = mlp(width=512, depth=2, d_in=128), torch.randn(4, 16, 128)
    ctx = compressed_activations(codec, min_numel=2048)
    want, _ = step(model, x)
    got, _ = step(model, x, ctx)
    assert codec.calls == 2 and ctx.stats.shared == 1 and rel_err(got, want) < 0.03


def test_views_into_an_encoded_tensor_share_its_payload():
    a, b = torch.randn(128, 256, requires_grad=True), torch.randn(128, 64, requires_grad=True)

    def forward(_):
        h = (a * 1).relu()  # ReLU saves h
        y = h.t() @ b  # mm saves the transpose h.t() (and the leaf b)
        z = h[:, 10:200].sin()  # sin saves a slice of h
        return torch.cat([y.flatten(), z.flatten()])

    want, _ = step([a, b], None, forward=forward)
    codec = CountingLossless()
    ctx = compressed_activations(codec, min_numel=1024)
    got, _ = step([a, b], None, ctx, forward=forward)
    assert identical(got, want)
    # encoded: h and the output (saved by step's square); both views of h are served by h's payload
    assert codec.calls == ctx.stats.encoded == 2 and ctx.stats.shared == 2, ctx.stats


def test_a_tensor_modified_in_place_is_encoded_again():
    codec = CountingLossless()
    h = torch.randn(64, 128).relu()
    w = torch.randn(64, 128, requires_grad=True)
    with compressed_activations(codec, min_numel=1):
        first = (h * w).sum()  # saves h; its payload stays alive with this graph
        h.add_(1)  # a new version of the same memory
        (h * w).sum().backward()  # saves h again: it must not be served the old payload
    assert codec.calls == 2 and torch.equal(w.grad, h)
    del first


# ---- keys --------------------------------------------------------------------------------------

@pytest.mark.parametrize("codec", ["int8", "int2"])
def test_same_key_same_gradients_different_key_different(codec):
    model, x = mlp(width=512), torch.randn(32, 256)
    a, _ = step(model, x, compressed_activations(codec, key=7))
    b, _ = step(model, x, compressed_activations(codec, key=7))
    c, _ = step(model, x, compressed_activations(codec, key=8))
    assert identical(a, b) and not identical(a, c)
    # one object entered twice with its key: each entry restarts the count, same bits
    ctx = compressed_activations(codec, key=7)
    d, _ = step(model, x, ctx)
    e, _ = step(model, x, ctx)
    assert identical(d, a) and identical(e, a) and ctx.entry_key == 7
    # no key: every entry draws a fresh one
    ctx = compressed_activations(codec)
    f, _ = step(model, x, ctx)
    first = ctx.entry_key
    g, _ = step(model, x, ctx)
    assert ctx.entry_key != first and not identical(f, g)
    h, _ = step(model, x, compressed_activations(codec, key=first))  # and that key reproduces it
    assert identical(f, h)


def test_retain_graph_backward_twice():
    for codec in ["int8", "lossless"]:
        model, x = mlp(width=512), torch.randn(32, 256)
        want, _ = step(model, x)
        model.zero_grad(set_to_none=True)
        with compressed_activations(codec, key=1):
            loss = model(x).square().mean()
            loss.backward(retain_graph=True)
            first = [p.grad.clone() for p in model.parameters()]
            loss.backward()  # the payloads decode again
        second = [p.grad for p in model.parameters()]
        assert all(torch.allclose(s, 2 * f) for s, f in zip(second, first))
        if codec == "lossless":
            assert identical(first, want)


# ---- checkpointing -----------------------------------------------------------------------------

@pytest.mark.parametrize("reentrant", [True, False])
def test_composes_with_checkpoint(reentrant):
    model, x = mlp(width=512, depth=4), torch.randn(32, 256)
    head, body = model[:2], model[2:]

    def forward(inp):  # the checkpointed body's input requires grad (it comes from the head)
        return checkpoint(body, head(inp), use_reentrant=reentrant)

    want, _ = step(model, x)
    got, _ = step(model, x, compressed_activations("lossless", min_numel=1024), forward=forward)
    assert identical(got, want)
    ctx = compressed_activations("int8", min_numel=1024)
    got, _ = step(model, x, ctx, forward=forward)
    # the body recomputes from its int8-decoded input: ReLU masks of recomputed pre-activations
    # near 0 flip, so the error is several times that of int8 without checkpointing (~0.01)
    err = rel_err(got, want)
    print(f"int8 around a checkpoint (reentrant={reentrant}): worst relative gradient error {err:.4f}")
    assert all(g.shape == w.shape for g, w in zip(got, want)) and err < 0.15 and ctx.stats.encoded >= 1

    def excluded(inp):  # the region's input kept as it is: nothing lossy reaches the recomputation
        h = head(inp)
        with compressed_activations("int8", min_numel=1024, exclude=[h]) as inner:
            out = checkpoint(body, h, use_reentrant=reentrant)
        assert inner.stats.encoded == 0 and inner.stats.kept >= 1
        return out

    got, _ = step(model, x, forward=excluded)
    assert identical(got, want)


# ---- arguments ---------------------------------------------------------------------------------

def test_bad_arguments_raise_value_error():
    with pytest.raises(ValueError, match="unknown activation codec"):
        compressed_activations("int3")
    with pytest.raises(ValueError, match="min_numel"):
        compressed_activations("int8", min_numel=-1)
    with pytest.raises(ValueError, match="key must be an int"):
        compressed_activations("int8", key="a")
    with pytest.raises(ValueError, match="block_size"):
        compressed_activations("int8", block_size=0)
    assert compressed_activations("int4", block_size=64).codec.block_size == 64
