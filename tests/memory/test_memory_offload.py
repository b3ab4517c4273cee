"""offload_activations: gradients bit-identical to no offload; copies back in reverse pack order,
at most ``prefetch`` ahead of use and each prefetched before use (but the first); the host pool
reused across steps; a storage saved twice offloaded once; retain_graph; the ledger's figures;
the codec path; the CPU no-op. On CPU the transfer logic runs through a recording stand-in for
the CUDA mover (``_offload_cpu=True``); the ``gpu`` tests run it for real."""
import pytest
import torch
from torch import nn

from gradcomp.memory import codecs, offload
from gradcomp.memory.meter import MemoryMeter
from gradcomp.memory.offload import HostPool, offload_activations


class Event:
    """A stand-in copy event: done after ``polls`` more queries (a copy still in flight until then)."""

    def __init__(self, polls):
        self.polls = polls


class Recorder(offload._Mover):
    """Copies at once on the CPU and logs ("out", i), ("in", i), ("use", i) (the current stream
    waits for tensor i: its first use) and ("sync", i). ``delay``: polls a copy out stays in flight."""

    def __init__(self, delay=0):
        self.log, self.delay, self.allocs = [], delay, 0

    def alloc(self, nbytes, pinned):
        self.allocs += 1
        return torch.empty(nbytes, dtype=torch.uint8)

    def to_host(self, index, device, copy):
        self.log.append(("out", index))
        return copy(), Event(self.delay)

    def to_device(self, index, device, copy):
        self.log.append(("in", index))
        return copy(), Event(0)

    def done(self, event):
        if event is None or event.polls <= 0:
            return True
        event.polls -= 1
        return False

    def sync(self, event):
        self.log.append(("sync",))
        event.polls = 0

    def wait(self, index, device, event, tensors):
        self.log.append(("use", index))

    def ops(self, kind):
        return [op[1] for op in self.log if op[0] == kind]


def fake(prefetch=2, delay=0, pool=None, **kw):
    """An offload block whose CPU tensors take the offload path through a Recorder."""
    kw.setdefault("min_numel", 1024)
    ctx = offload_activations(prefetch, pin_memory=False, _mover=Recorder(delay), _offload_cpu=True,
                              _pool=pool if pool is not None else HostPool(), **kw)
    return ctx, ctx._mover


def mlp(depth=4, width=128):
    layers = [nn.Linear(64, width), nn.ReLU()]
    for _ in range(depth - 1):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 32))


def convs():
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.Tanh(),
                         nn.MaxPool2d(2), nn.Conv2d(8, 16, 3, padding=1), nn.Sigmoid(), nn.Flatten(),
                         nn.Linear(16 * 8 * 8, 4))


def grads(model, x, ctx=None, steps=1, loss=lambda y: (y * y).sum()):
    """Parameter gradients after ``steps`` forward/backward passes (inside ``ctx`` if given)."""
    model.zero_grad(set_to_none=True)
    for _ in range(steps):
        if ctx is None:
            out = loss(model(x))
        else:
            with ctx:
                out = loss(model(x))
        out.backward()
    return [p.grad.clone() for p in model.parameters()]


def assert_same(a, b):
    assert len(a) == len(b)
    for ga, gb in zip(a, b):
        assert torch.equal(ga, gb)


def check_schedule(log, prefetch):
    """Copies back in reverse pack order; at each first use at most ``prefetch`` others brought
    back and unused; returns the uses that found their tensor brought back ahead."""
    back = [op[1] for op in log if op[0] == "in"]
    assert back == sorted(back, reverse=True) and len(set(back)) == len(back)
    fetched, used, ahead_hits = set(), set(), 0
    for op in log:
        if op[0] == "in":
            fetched.add(op[1])
        elif op[0] == "use":
            i = op[1]
            assert len(fetched - used - {i}) <= prefetch
            ahead_hits += i in fetched and i not in used and log.index(("in", i)) < log.index(op) - 1
            used.add(i)
    return ahead_hits


# --------------------------------------------------------------------------- the offload path


@pytest.mark.parametrize("prefetch", [0, 1, 2, 3])
def test_mlp_bit_identical_and_schedule(prefetch):
    model, x = mlp(), torch.randn(64, 64)
    want = grads(model, x)
    ctx, mover = fake(prefetch)
    assert_same(grads(model, x, ctx), want)
    s = ctx.stats
    # saved: the input, each ReLU output (saved by the ReLU and by the next Linear: once), the
    # last Linear's output (twice by the loss: once); weights are parameters and stay as they are
    assert s.offloaded == 6 and s.deduplicated == 5 and s.kept == 4
    assert sorted(mover.ops("out")) == list(range(6)) == mover.ops("out")
    assert sorted(mover.ops("in")) == list(range(6))
    check_schedule(mover.log, prefetch)
    if prefetch == 0:
        assert s.on_demand == 6 and s.prefetched == 0
    else:  # only the first one used (the last saved) is copied back at its use
        assert s.on_demand == 1 and s.prefetched == 5 and mover.ops("in")[0] == 5
        assert s.max_ahead == min(prefetch, 5)
    assert s.resident == 5  # the second use of what the first already brought back
    print(f"\nprefetch={prefetch}: {s}")


def test_copies_back_overlap_compute():
    """With prefetch 2, the copy of tensor n-1 and n-2 starts when n is used, before their own use."""
    model, x = mlp(depth=6), torch.randn(64, 64)
    ctx, mover = fake(2)
    grads(model, x, ctx)
    log = [op for op in mover.log if op[0] in ("in", "use")]
    n = ctx.stats.offloaded
    assert log[:4] == [("in", n - 1), ("use", n - 1), ("in", n - 2), ("in", n - 3)]
    for i in range(n - 3, -1, -1):  # later copies start two uses ahead (the compute of two nodes)
        assert log.index(("in", i)) < log.index(("use", i + 1)) < log.index(("use", i))
    assert check_schedule(mover.log, 2) == n - 1


@pytest.mark.parametrize("channels_last", [False, True])
def test_conv_chain_bit_identical(channels_last):
    model, x = convs(), torch.randn(4, 3, 16, 16)
    if channels_last:
        model, x = model.to(memory_format=torch.channels_last), x.to(memory_format=torch.channels_last)
    want = grads(model, x)
    ctx, mover = fake(2, min_numel=512)
    assert_same(grads(model, x, ctx), want)
    assert ctx.stats.offloaded >= 5 and ctx.stats.on_demand == 1
    check_schedule(mover.log, 2)


def test_branches_keep_the_bound():
    """Two branches: backward does not use saved tensors in exact reverse order; the bound holds,
    gradients stay identical."""
    a, b, head = mlp(3), mlp(3), nn.Linear(32, 8)

    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.head = a, b, head

        def forward(self, x):
            return self.head(torch.tanh(self.a(x)) * torch.sigmoid(self.b(2 * x)))

    model, x = Two(), torch.randn(64, 64)
    want = grads(model, x)
    for prefetch in (1, 2, 4):
        ctx, mover = fake(prefetch, min_numel=256)
        assert_same(grads(model, x, ctx), want)
        fetched = mover.ops("in")
        assert len(fetched) == len(set(fetched)) == ctx.stats.offloaded
        ahead = set()
        for op in mover.log:
            if op[0] == "in":
                ahead.add(op[1])
            elif op[0] == "use":
                ahead.discard(op[1])
                assert len(ahead) <= prefetch


def test_pool_reused_across_steps():
    pool = HostPool()
    model, x = mlp(), torch.randn(64, 64)
    want = grads(model, x, steps=3)
    ctx, mover = fake(2, pool=pool)
    model.zero_grad(set_to_none=True)
    allocs = []
    for step in range(3):
        with ctx:
            loss = (model(x) ** 2).sum()
        loss.backward()
        allocs.append(pool.allocations)
        assert pool.cached_bytes == pool.allocated_bytes  # every buffer back once the graph is gone
    assert allocs[0] == 6 and allocs == [6, 6, 6] and mover.allocs == 6
    assert_same([p.grad for p in model.parameters()], want)
    # a new block on the same pool allocates nothing either
    ctx2, mover2 = fake(2, pool=pool)
    grads(model, x, ctx2)
    assert pool.allocations == 6 and mover2.allocs == 0
    print(f"\npool: {pool.allocations} buffers, {pool.allocated_bytes} bytes over 4 steps")
    pool.clear()
    assert pool.cached_bytes == 0


def test_buffers_return_when_graph_is_dropped():
    pool = HostPool()
    ctx, _ = fake(2, pool=pool)
    model, x = mlp(), torch.randn(64, 64)
    with ctx:
        loss = model(x).sum()
    assert pool.cached_bytes == 0 and pool.allocated_bytes > 0
    del loss  # no backward: the saved tensors go with the graph
    assert pool.cached_bytes == pool.allocated_bytes
    with ctx:
        model(x).sum().backward()
    assert not ctx._live and not ctx._on_host and not ctx._ahead and pool.allocations == 5


def test_dedup():
    w = torch.randn(32, 32, requires_grad=True)
    x = torch.randn(16, 32)

    def run(ctx):
        w.grad = None
        with ctx if ctx is not None else torch.enable_grad():
            r = torch.relu(x @ w)  # saves x (mm), r (relu)
            y = (r * r).sum() + (r.t() * 2).sum() + (r.t() @ r).sum()  # r twice (mul), r.t() and r (mm)
        y.backward()
        return w.grad.clone()

    ctx, mover = fake(2, min_numel=64)
    assert torch.equal(run(ctx), run(None))
    # stored: x, r, r.t() (other strides: its own copy); the three other saves of r found it stored
    assert ctx.stats.offloaded == 3 and ctx.stats.deduplicated == 3 and len(mover.ops("out")) == 3


def test_in_place_change_is_not_deduplicated():
    """A tensor saved, changed in place, saved again: the second save is a new version, stored on
    its own (the first saver's graph is never run, so autograd has nothing to object to)."""
    ctx, mover = fake(2, min_numel=64)
    w = torch.randn(64, requires_grad=True)
    x = torch.randn(64)
    with ctx:
        a = x * w  # saves x
        x.add_(1)
        b = x * w
    b.sum().backward()
    assert ctx.stats.offloaded == 2 and ctx.stats.deduplicated == 0
    assert torch.equal(w.grad, x)
    del a


def test_retain_graph_double_backward():
    model, x = mlp(), torch.randn(64, 64)
    model.zero_grad(set_to_none=True)
    loss = (model(x) ** 2).sum()
    loss.backward(retain_graph=True)
    loss.backward()
    want = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    ctx, mover = fake(2)
    with ctx:
        loss = (model(x) ** 2).sum()
    loss.backward(retain_graph=True)
    copies = len(mover.ops("in"))
    loss.backward()
    assert_same([p.grad for p in model.parameters()], want)
    assert len(mover.ops("in")) == copies == 6  # the second backward finds them all on the device
    assert ctx.stats.resident == 4 + 10


def test_create_graph_second_order():
    w = torch.randn(64, 64, requires_grad=True)
    x = torch.randn(32, 64)

    def run(ctx):
        w.grad = None
        if ctx is None:
            y = torch.tanh(x @ w).pow(3).sum()
        else:
            with ctx:
                y = torch.tanh(x @ w).pow(3).sum()
        (g,) = torch.autograd.grad(y, w, create_graph=True)
        g.square().sum().backward()
        return w.grad.clone()

    ctx, _ = fake(2, min_numel=64)
    assert torch.equal(run(ctx), run(None))


def test_ledger_figures():
    model, x = mlp(), torch.randn(64, 64)
    with MemoryMeter() as bare:
        loss = (model(x) ** 2).sum()
        live = bare.live_saved_bytes
        loss.backward()
    ctx, _ = fake(2)
    with MemoryMeter() as meter:
        with ctx:
            loss = (model(x) ** 2).sum()
        assert meter.live_saved_bytes == 0  # copies done: nothing on the device
        host = meter.ledger.live["host"]
        assert host == ctx.stats.bytes_to_host == live  # every activation saved is on the host
        loss.backward()
        assert meter.ledger.live == {"device": 0, "host": 0}
    assert meter.peak_host_bytes == live
    # in backward at most the tensor in use, the prefetched ones and the one still needed by a
    # second user are on the device
    assert 0 < meter.peak_saved_bytes <= 4 * 64 * 128 * 4 < bare.peak_saved_bytes
    print(f"\nsaved bytes: bare peak {bare.peak_saved_bytes}, offloaded device peak "
          f"{meter.peak_saved_bytes}, host peak {meter.peak_host_bytes}")


def test_ledger_counts_copies_in_flight_and_bounds_them():
    model, x = mlp(), torch.randn(64, 64)
    with MemoryMeter() as bare:
        loss = (model(x) ** 2).sum()
        live = bare.live_saved_bytes
    del loss
    ctx, mover = fake(2, delay=10 ** 9, max_in_flight=10)  # copies out never finish by themselves
    with MemoryMeter() as meter:
        with ctx:
            loss = (model(x) ** 2).sum()
        assert meter.live_saved_bytes == live and meter.ledger.live["host"] == live
        loss.backward()  # the device tensors still held are used as they are, nothing copied back
        s = ctx.stats
        assert mover.ops("in") == [] and s.on_demand == 0 and s.prefetched + s.resident == 10
        assert meter.ledger.live == {"device": live, "host": 0}  # the copies out still hold theirs
        for transfer in ctx._in_flight:
            transfer.event.polls = 0
        with ctx:  # the next use of the block lets go of the finished ones
            pass
        assert meter.ledger.live == {"device": 0, "host": 0}
    ctx, mover = fake(2, delay=10 ** 9, max_in_flight=2)
    grads(model, x, ctx)
    assert len(ctx._in_flight) <= 2 and ctx.stats.waited_out == 6 - 2
    assert mover.log.count(("sync",)) == 4


def test_cpu_is_a_no_op():
    model, x = mlp(), torch.randn(64, 64)
    want = grads(model, x)
    with MemoryMeter() as bare:
        grads(model, x)
    pool = HostPool()
    ctx = offload_activations(2, _pool=pool)
    with MemoryMeter() as meter:
        assert_same(grads(model, x, ctx), want)
    assert ctx.stats.offloaded == 0 and ctx.stats.kept == ctx.stats.saved == 15
    assert pool.allocations == 0 and meter.peak_host_bytes == 0
    assert meter.peak_saved_bytes == bare.peak_saved_bytes


def test_bad_arguments():
    for kw in ({"prefetch": -1}, {"prefetch": 1.5}, {"prefetch": True}, {"min_numel": -1},
               {"max_in_flight": 0}, {"pin_memory": "yes"}):
        args = {"prefetch": kw.pop("prefetch", 2), **kw}
        with pytest.raises(ValueError, match=next(iter(args if len(args) == 1 else kw))):
            offload_activations(**args)
    with pytest.raises(ValueError, match="codec"):
        offload_activations(codec="no-such-codec")  # the codec registry's error: the names it knows
    ctx = offload_activations()
    with ctx:
        with pytest.raises(RuntimeError, match="already open"):
            ctx.__enter__()


# --------------------------------------------------------------------------- the codec path

def round_trip_grads(model, x, codec, min_numel):
    """Gradients when each eligible saved tensor is replaced by the codec's round trip."""
    def pack(t):
        if t.is_floating_point() and t.numel() >= min_numel and not offload.is_parameter(t):
            return codec.encode(t.detach(), 0).decode()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = model(x)
        out = (y * y).sum()
    model.zero_grad(set_to_none=True)
    out.backward()
    return [p.grad.clone() for p in model.parameters()]


def test_codec_offload_path():
    model, x = mlp(), torch.randn(64, 64)
    want = round_trip_grads(model, x, codecs.get_codec("fp16"), 1024)
    ctx, mover = fake(2, codec="fp16")
    with MemoryMeter() as meter:
        got = grads(model, x, ctx)
    assert_same(got, want)
    s = ctx.stats
    assert s.offloaded == 6 and s.on_demand == 1 and s.prefetched == 5
    check_schedule(mover.log, 2)
    assert meter.peak_host_bytes == s.bytes_to_host < 6 * 64 * 128 * 4 * 0.6  # fp16: about half
    print(f"\ncodec fp16: {s.bytes_to_host} bytes to host")


def test_lossless_codec_sends_relu_outputs_smaller():
    model, x = mlp(), torch.randn(64, 64)
    want = grads(model, x)
    ctx, mover = fake(2, codec="lossless")
    assert_same(grads(model, x, ctx), want)
    s = ctx.stats
    # the ReLU outputs (about half zeros) go encoded; the input and the output would not shrink
    assert s.offloaded == 6 and s.encoded == 4
    raw = 16384 + 4 * 32768 + 8192
    assert s.bytes_to_host < 0.8 * raw
    check_schedule(mover.log, 2)
    print(f"\ncodec lossless: {s.bytes_to_host} of {raw} bytes to host")


def test_codec_only_on_cpu():
    model, x = mlp(), torch.randn(64, 64)
    want = round_trip_grads(model, x, codecs.get_codec("fp16"), 1024)
    pool = HostPool()
    ctx = offload_activations(2, codec="fp16", min_numel=1024, _pool=pool)
    with MemoryMeter() as meter:
        assert_same(grads(model, x, ctx), want)
    s = ctx.stats
    assert s.offloaded == 0 and s.encoded == 6 and s.deduplicated == 5 and pool.allocations == 0
    assert meter.peak_host_bytes == 0 and meter.peak_saved_bytes < 6 * 64 * 128 * 4 * 0.6


# --------------------------------------------------------------------------- on a GPU

def cuda_mlp(depth, width):
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers).cuda()


@pytest.mark.gpu
@pytest.mark.parametrize("prefetch", [0, 2])
def test_gpu_bit_identical(prefetch):
    model, x = cuda_mlp(6, 512), torch.randn(1024, 512, device="cuda")
    want = grads(model, x)
    assert_same(grads(model, x), want)  # the baseline itself is reproducible
    ctx = offload_activations(prefetch, min_numel=1024)
    for _ in range(2):
        assert_same(grads(model, x, ctx), want)
    torch.cuda.synchronize()
    s = ctx.stats
    assert s.offloaded == 2 * 7  # per step the input and the six ReLU outputs
    if prefetch:  # only the first use of a step may find its tensor not brought back yet
        assert s.on_demand <= 2 and s.prefetched >= 2 * (7 - 1) - s.resident


@pytest.mark.gpu
def test_gpu_peak_memory_lower():
    model, x = cuda_mlp(24, 1024), torch.randn(8192, 1024, device="cuda")

    def peak(ctx):
        grads(model, x, ctx)  # warm up (cuBLAS workspace, the pool)
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        grads(model, x, ctx)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base

    bare, off = peak(None), peak(offload_activations(2))
    print(f"\npeak CUDA bytes over a step: {bare / 2**20:.0f} MiB bare, {off / 2**20:.0f} MiB offloaded")
    assert off < 0.7 * bare


@pytest.mark.gpu
def test_gpu_pinned_pool_reused():
    pool = HostPool()
    model, x = cuda_mlp(4, 512), torch.randn(1024, 512, device="cuda")
    ctx = offload_activations(2, min_numel=1024, _pool=pool)
    counts = []
    for _ in range(3):
        grads(model, x, ctx)
        torch.cuda.synchronize()
        counts.append(pool.allocations)
    assert counts == [5, 5, 5]  # the input and four ReLU outputs, 2 MiB each
    assert all(b.is_pinned() for bufs in pool._free.values() for b in bufs)
    with MemoryMeter() as meter:
        grads(model, x, ctx)
    assert meter.peak_host_bytes == 5 * 1024 * 512 * 4 and pool.allocations == 5


@pytest.mark.gpu
def test_gpu_codec_path():
    impl = codecs.get_codec("fp16")
    model, x = cuda_mlp(4, 512), torch.randn(1024, 512, device="cuda")
    want = round_trip_grads(model, x, impl, 1024)
    ctx = offload_activations(2, codec="fp16", min_numel=1024)
    with MemoryMeter() as meter:
        got = grads(model, x, ctx)
    assert_same(got, want)
    assert ctx.stats.offloaded == ctx.stats.encoded == 5
    assert meter.peak_host_bytes == ctx.stats.bytes_to_host == 5 * 1024 * 512 * 2  # half of fp32
