"""DiLoCo: torchft's math (to float rounding), synchronous SGD as its limit, compressed outer
gradients with error feedback, a non-finite pseudo-gradient skipped on every rank, agreement,
checkpoints that resume bit-identically (with an exchange in flight), two-level groups from a
2-D mesh. One spawn per world size runs every multi-rank case.

torchft is an optional test dependency: its ``DiLoCo`` runs here over the same gloo group with
a fixed quorum standing in for its fault-tolerance manager (no lighthouse; the bench's
``FixedQuorum``), so the comparison is of the algorithm alone."""
from __future__ import annotations

import copy
import importlib.util
import warnings

import pytest
import torch
import torch.distributed as dist

from gradcomp.bench.diloco import FixedQuorum
from gradcomp.optim import DiLoCo
from gradcomp.optim.diloco import WAIT_SHARE, next_choice
from ranks import run_ranks

STEPS = 12
HAVE_TORCHFT = importlib.util.find_spec("torchft") is not None
ORACLE_CASES = [(f, tau, alpha) for f in (1, 2) for tau in (0, 1) for alpha in (0.0, 0.5)]


def _model(dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)).to(dtype)


def _batch(rank, step, dtype):
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(6, 8, generator=g).to(dtype)
    return x, torch.sin(x[:, :4]) * 2


def _inner_step(model, opt, rank, step, dtype, poison=False):
    x, y = _batch(rank, step, dtype)
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    if poison:
        model[0].weight.grad.fill_(float("nan"))
    opt.step()
    return float(loss.detach())


def _same(a, b):
    """Equal nested state: tensors bit for bit."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _params(model):
    return torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])


def _pieces(model, f):
    return [model] if f == 1 else [model[0], model[2]]


def _outer(ps):
    return torch.optim.SGD(ps, lr=0.7, momentum=0.9, nesterov=True)


def _ours(rank, world, dtype, f, tau, alpha, H=4, **kw):
    model = _model(dtype)
    opt = DiLoCo(model, torch.optim.AdamW(model.parameters(), lr=1e-2), H, outer_optimizer=_outer,
                 fragments=1 if f == 1 else _pieces(model, f), delay=tau, alpha=alpha, **kw)
    for s in range(STEPS):
        _inner_step(model, opt, rank, s, dtype)
    return _params(model), opt


def _torchft(rank, world, dtype, f, tau, alpha, H=4):
    from torchft.local_sgd import DiLoCo as TorchftDiLoCo
    model = _model(dtype)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    pieces = _pieces(model, f)
    outers = [_outer(list(m.parameters())) for m in pieces]
    with TorchftDiLoCo(FixedQuorum(world), pieces, inner, outers, sync_every=H, fragment_sync_delay=tau,
                       fragment_update_alpha=alpha):
        for s in range(STEPS):
            _inner_step(model, inner, rank, s, dtype)
    return _params(model)


def _oracle(rank, world):
    out = {}
    for dtype in (torch.float64, torch.float32):
        for f, tau, alpha in ORACLE_CASES:
            ours, _ = _ours(rank, world, dtype, f, tau, alpha)
            out[(str(dtype), f, tau, alpha)] = (ours, _torchft(rank, world, dtype, f, tau, alpha))
    return out


def _sync_sgd(rank, world):
    """sync_every=1, outer SGD(lr=1) without momentum, inner SGD: synchronous data-parallel SGD."""
    model = _model(torch.float64)
    ref = copy.deepcopy(model)
    opt = DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.05), 1,
                 outer_optimizer=lambda ps: torch.optim.SGD(ps, lr=1.0))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    for s in range(6):
        _inner_step(model, opt, rank, s, torch.float64)
        x, y = _batch(rank, s, torch.float64)
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(ref(x), y).backward()
        for p in ref.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        ref_opt.step()
    return (_params(model) - _params(ref)).abs().max().item()


def _compressed(rank, world):
    out = {}
    for name in ("int8", "int4", "topk"):
        kw = {"compressor_options": {"ratio": 0.05}} if name == "topk" else {}
        model = _model()
        opt = DiLoCo(model, torch.optim.AdamW(model.parameters(), lr=1e-2), 4, compressor=name, fragments=2,
                     delay=1, **kw)
        losses = [_inner_step(model, opt, rank, s % 3, torch.float32) for s in range(24)]
        globals_ = torch.cat([flat for f in opt.fragments for flat in f.flats.values()])
        out[name] = (globals_, losses[0], losses[-1], opt.syncs, opt.skipped)
    return out


def _skip(rank, world):
    model = _model()
    opt = DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.05), 2, compressor="int8")
    for s in range(2):
        _inner_step(model, opt, rank, s, torch.float32)
    before = _params(model)
    residual = copy.deepcopy(opt.state_dict()["diloco"]["codec"])
    outer_before = copy.deepcopy(opt.fragments[0].outer.state_dict())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _inner_step(model, opt, rank, 2, torch.float32)
        _inner_step(model, opt, rank, 3, torch.float32, poison=(rank == 1))
    after_skip = _params(model)
    residual_after = opt.state_dict()["diloco"]["codec"]
    outer_after = opt.fragments[0].outer.state_dict()
    same_outer = torch.equal(outer_before["state"][0]["momentum_buffer"], outer_after["state"][0]["momentum_buffer"])
    skipped = opt.skipped
    # training goes on (rank 1's inner state is poisoned: give it a fresh inner optimizer)
    opt.optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for s in range(4, 8):
        _inner_step(model, opt, rank, s, torch.float32)
    return {"before": before, "after_skip": after_skip, "skipped": skipped, "syncs": opt.syncs,
            "same_outer": same_outer, "warned": any("skipped on every rank" in str(w.message) for w in caught),
            "same_residual": _same(residual, residual_after), "final": _params(model),
            "finite": bool(torch.isfinite(_params(model)).all())}


def _run_with_checkpoint(rank, world, save_at, codec):
    model = _model()
    kw = dict(compressor=codec, fragments=2, delay=1)
    opt = DiLoCo(model, torch.optim.AdamW(model.parameters(), lr=1e-2), 4, **kw)
    for s in range(save_at):
        _inner_step(model, opt, rank, s, torch.float32)
    state = copy.deepcopy(opt.state_dict())
    params = copy.deepcopy(model.state_dict())
    for s in range(save_at, 16):
        _inner_step(model, opt, rank, s, torch.float32)
    straight = _params(model)
    model2 = _model(seed=5)
    model2.load_state_dict(params)
    opt2 = DiLoCo(model2, torch.optim.AdamW(model2.parameters(), lr=1e-2), 4, broadcast=False, **kw)
    opt2.load_state_dict(state)
    for s in range(save_at, 16):
        _inner_step(model2, opt2, rank, s, torch.float32)
    return straight, _params(model2), opt2.syncs


def _reference_run(rank, world, codec):
    model = _model()
    opt = DiLoCo(model, torch.optim.AdamW(model.parameters(), lr=1e-2), 4, compressor=codec, fragments=2, delay=1)
    for s in range(16):
        _inner_step(model, opt, rank, s, torch.float32)
    return _params(model)


def _refusals(rank, world):
    out = {}
    model = _model()
    try:
        DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), 4 if rank == 0 else 8)
    except ValueError as exc:
        out["agree"] = str(exc)
    model = _model()
    opt = DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), 4)
    other = DiLoCo(_model(), torch.optim.SGD(_model().parameters(), lr=0.1), 2)
    try:
        other.load_state_dict(opt.state_dict())
    except ValueError as exc:
        out["config"] = str(exc)
    return out


def _host_reads(rank, world):
    """Host syncs per inner step (delay 0: a fragment's exchange starts and ends in its sync step,
    so the steps between syncs run nothing of DiLoCo's but the inner step)."""
    from syncs import HostSyncs
    model = _model()
    opt = DiLoCo(model, torch.optim.AdamW(model.parameters(), lr=1e-2), 8, compressor="int8", fragments=2)
    counts = []
    for s in range(12):
        with HostSyncs() as syncs:
            _inner_step(model, opt, rank, s, torch.float32)
        counts.append((opt.local_step, syncs.count))
    return counts


def _auto(rank, world):
    model = _model()
    opt = DiLoCo(model, torch.optim.AdamW(model.parameters(), lr=1e-2), 4, compressor="auto", fragments=2, delay=1)
    for s in range(24):
        _inner_step(model, opt, rank, s, torch.float32)
    state = opt.state_dict()["diloco"]
    return {"globals": torch.cat([flat for f in opt.fragments for flat in f.flats.values()]),
            "codecs": [h["codec"] for h in opt.history], "choice": state["choice"], "syncs": opt.syncs}


def _everything(rank, world):
    res = {"auto": _auto(rank, world), "host_reads": _host_reads(rank, world), "sync_sgd": _sync_sgd(rank, world), "compressed": _compressed(rank, world), "skip": _skip(rank, world),
           "refusals": _refusals(rank, world)}
    if HAVE_TORCHFT:
        res["oracle"] = _oracle(rank, world)
    for codec in (None, "int8"):
        for save_at in (3, 5, 8):  # 3, 5: between a start and its sync (in flight); 8: not
            res[("ckpt", codec, save_at)] = _run_with_checkpoint(rank, world, save_at, codec)
        res[("ref", codec)] = _reference_run(rank, world, codec)
    return res


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_ranks(_everything, 2, tmp_path_factory.mktemp("diloco"), timeout_s=120)


@pytest.mark.skipif(not HAVE_TORCHFT, reason="torchft is not installed (pip install torchft)")
@pytest.mark.parametrize("dtype,tol", [("torch.float64", 1e-12), ("torch.float32", 1e-6)])
@pytest.mark.parametrize("case", ORACLE_CASES)
def test_uncompressed_equals_torchft(runs, dtype, tol, case):
    for r in runs:
        ours, theirs = r["oracle"][(dtype, *case)]
        assert (ours - theirs).abs().max().item() <= tol


def test_sync_every_one_with_plain_outer_sgd_is_synchronous_sgd(runs):
    for r in runs:
        assert r["sync_sgd"] < 1e-12


@pytest.mark.parametrize("name", ["int8", "int4", "topk"])
def test_compressed_outer_gradients_train_and_keep_replicas_equal(runs, name):
    params = [r["compressed"][name][0] for r in runs]
    assert torch.equal(params[0], params[1])  # every worker holds the same global copy
    for r in runs:
        _, first, last, syncs, skipped = r["compressed"][name]
        assert last < first and syncs == 12 and skipped == 0


def test_a_non_finite_pseudo_gradient_is_skipped_on_every_rank(runs):
    for r in runs:
        s = r["skip"]
        assert s["skipped"] == 1 and s["warned"] and s["same_outer"]
        assert torch.equal(s["after_skip"], s["before"])  # back to the last global copy
        assert s["syncs"] == 3 and s["finite"] and s["same_residual"]
    assert torch.equal(runs[0]["skip"]["final"], runs[1]["skip"]["final"])


@pytest.mark.parametrize("codec", [None, "int8"])
@pytest.mark.parametrize("save_at", [3, 5, 8])
def test_resume_is_bit_identical(runs, codec, save_at):
    for r in runs:
        straight, resumed, _ = r[("ckpt", codec, save_at)]
        assert torch.equal(straight, resumed)
        assert torch.equal(straight, r[("ref", codec)])  # saving changes nothing


def test_no_host_read_between_syncs(runs):
    for r in runs:
        between = [n for local, n in r["host_reads"] if local != 0]
        at_sync = [n for local, n in r["host_reads"] if local == 0]
        assert between and all(n == 0 for n in between)
        assert at_sync and all(n >= 1 for n in at_sync)  # the decision's one read, and the exchange's own


def test_auto_chooses_the_same_codec_on_every_rank(runs):
    assert runs[0]["auto"]["codecs"] == runs[1]["auto"]["codecs"]
    assert runs[0]["auto"]["choice"] == runs[1]["auto"]["choice"]
    assert torch.equal(runs[0]["auto"]["globals"], runs[1]["auto"]["globals"])
    assert runs[0]["auto"]["syncs"] == 12 and set(runs[0]["auto"]["codecs"]) <= {"none", "int8", "int4", "int2"}


def test_auto_plan_is_a_function_of_the_measurements():
    bits = [32.0, 8.125, 5.0, 3.0]
    assert next_choice(0, bits, wait=1.0, compute=10.0, exchange=1.2, share=0.25) == 1  # waited: smaller
    assert next_choice(3, bits, wait=1.0, compute=10.0, exchange=1.2, share=0.25) == 3  # nothing smaller
    assert next_choice(2, bits, wait=0.0, compute=10.0, exchange=0.1, share=0.25) == 1  # int8 would hide too
    assert next_choice(1, bits, wait=0.0, compute=10.0, exchange=0.5, share=0.25) == 1  # dense would not
    assert next_choice(0, bits, wait=WAIT_SHARE * 10.0, compute=10.0, exchange=0.5, share=0.0) == 0
    assert next_choice(1, bits, wait=0.0, compute=10.0, exchange=0.001, share=0.0) == 0


def test_auto_moves_what_a_codec_owes_when_it_changes_codec():
    model = _model()
    opt = DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), 2, compressor="auto",
                 auto_candidates=("int4", "none"))
    opt.choice = [0]
    for s in range(2):
        _inner_step(model, opt, 0, s, torch.float32)
    key = "diloco/0/float32"
    assert opt.codecs[0].owed(key).abs().sum() > 0  # int4 left a residual
    opt.choice = [1]  # as if it had measured a fast link
    for s in range(2, 4):
        _inner_step(model, opt, 0, s, torch.float32)
    owed = opt.codecs[0].owed(key)
    assert owed is None or owed.abs().sum() == 0  # sent with the dense exchange
    assert opt.history[-1]["codec"] == "none"


def test_every_rank_refuses_together(runs):
    for r in runs:
        assert "DiLoCo" in r["refusals"]["agree"]
        assert "configuration" in r["refusals"]["config"]


def test_bad_arguments_are_refused_clearly():
    model = _model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    for kwargs, words in [({"sync_every": 0}, "sync_every"), ({"sync_every": 5, "fragments": 2}, "multiple"),
                          ({"sync_every": 4, "fragments": 2, "delay": 2}, "delay"),
                          ({"sync_every": 4, "alpha": 1.5}, "alpha"), ({"sync_every": 4, "fragments": 0}, "fragments"),
                          ({"sync_every": 4, "fragments": [model[0]]}, "outside every fragment"),
                          ({"sync_every": 4, "fragments": [model[0], model[0], model[2]]}, "one fragment"),
                          ({"sync_every": 4, "outer_optimizer": 3}, "callable")]:
        with pytest.raises(ValueError, match=words):
            DiLoCo(model, inner, **kwargs)


def test_one_process_trains_alone():
    model = _model()
    opt = DiLoCo(model, torch.optim.AdamW(model.parameters(), lr=1e-2), 3, compressor="int4")
    losses = [_inner_step(model, opt, 0, s % 2, torch.float32) for s in range(12)]
    assert opt.syncs == 4 and losses[-1] < losses[0]


def test_fragments_cut_by_size_in_order():
    model = torch.nn.Sequential(*[torch.nn.Linear(10, 10) for _ in range(4)])
    opt = DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), 4, fragments=4)
    assert [f.names for f in opt.fragments] == [["0.weight", "0.bias"], ["1.weight", "1.bias"],
                                               ["2.weight", "2.bias"], ["3.weight", "3.bias"]]


# ---- two levels: a 2-D mesh ("outer", "inner"), DDP or FSDP2 inside each worker --------------
def _two_level(rank, world, inner):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("outer", "inner"))
    model = _model(torch.float64)
    handle = None
    if inner == "ddp":
        net = torch.nn.parallel.DistributedDataParallel(model, process_group=mesh.get_group("inner"))
    else:
        fully_shard(model, mesh=mesh["inner"])
        net = model
        if inner == "compress_fsdp":  # gradcomp's dense reduce-scatter inside the worker
            from gradcomp.sharded import compress_fsdp
            handle = compress_fsdp(net, None)
    opt = DiLoCo(net, torch.optim.AdamW(net.parameters(), lr=1e-2), 4, outer_group=mesh, compressor=None)
    full = []
    for s in range(8):
        # every rank its own half of its worker's batch: worker w = rank // 2
        if handle is None:
            _inner_step(net, opt, rank, s, torch.float64)
        else:
            x, y = _batch(rank, s, torch.float64)
            torch.nn.functional.mse_loss(net(x), y).backward()
            handle.step(opt)  # the inner step (and DiLoCo's schedule) behind compress_fsdp's step decision
            opt.zero_grad()
        full.append(torch.cat([(p.full_tensor() if hasattr(p, "full_tensor") else p.detach()).reshape(-1)
                               for p in net.parameters()]))
    return {"params": full, "syncs": opt.syncs, "outer_size": dist.get_world_size(opt.outer_group)}


def _two_levels(rank, world):
    return {inner: _two_level(rank, world, inner) for inner in ("ddp", "fsdp", "compress_fsdp")}


@pytest.fixture(scope="module")
def mesh_runs(tmp_path_factory):
    return run_ranks(_two_levels, 4, tmp_path_factory.mktemp("diloco4"), timeout_s=120)


@pytest.mark.parametrize("inner", ["ddp", "fsdp", "compress_fsdp"])
def test_two_levels_from_a_2d_mesh(mesh_runs, inner):
    runs = [r[inner] for r in mesh_runs]
    assert all(r["syncs"] == 2 and r["outer_size"] == 2 for r in runs)
    for s in range(8):
        # the two ranks of a worker hold the same model at every step
        assert torch.equal(runs[0]["params"][s], runs[1]["params"][s])
        assert torch.equal(runs[2]["params"][s], runs[3]["params"][s])
    for s in (3, 7):  # after a sync every worker holds the global copy
        assert torch.equal(runs[0]["params"][s], runs[2]["params"][s])
    assert not torch.equal(runs[0]["params"][2], runs[2]["params"][2])  # between syncs the workers differ


def test_fsdp2_inside_a_worker_is_ddp_inside_to_rounding(mesh_runs):
    for r in mesh_runs:
        for a, b, c in zip(r["ddp"]["params"], r["fsdp"]["params"], r["compress_fsdp"]["params"]):
            assert (a - b).abs().max().item() < 1e-12
            assert (a - c).abs().max().item() < 1e-12


def test_bf16_parameters_keep_an_fp32_global_copy_and_foreach_inner_steps():
    """bf16 parameters (the GPU path): the global copy is fp32, so the outer steps accumulate
    there; the inner optimizer may be foreach or fused; the parameters are the global copy
    rounded to bf16 after a sync."""
    for flag in ("foreach", "fused"):
        model = _model(torch.bfloat16)
        opt = DiLoCo(model, torch.optim.AdamW(model.parameters(), lr=1e-2, **{flag: True}), 2, compressor="int8")
        assert all(flat.dtype == torch.float32 for f in opt.fragments for flat in f.flats.values())
        losses = [_inner_step(model, opt, 0, s % 2, torch.bfloat16) for s in range(8)]
        assert opt.syncs == 4 and losses[-1] < losses[0]
        for p, view in zip(opt.fragments[0].params, opt.fragments[0].views):
            assert p.dtype == torch.bfloat16 and torch.equal(p.detach(), view.to(torch.bfloat16))
