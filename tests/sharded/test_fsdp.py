"""``compress_fsdp`` on real FSDP2 (``fully_shard``) ranks: one 2-rank spawn checks every case.

Invariants protected:

- the dense custom reduce-scatter gives FSDP2's own gradients bit for bit (fp32 and a bf16
  ``reduce_dtype``; ``reshard_after_forward`` both ways), and ``set_gradient_divide_factor``
  scales them exactly (4 on 2 ranks: half of the default);
- a compressed run (int8 reduce-scatter, bf16 all-gather, gradient accumulation under
  ``set_requires_gradient_sync(False)``) keeps error feedback's invariant per shard: what each
  owner received over the steps plus what the senders still owe it is the dense mean's sum;
  the unsharded weights every forward sees are identical on both ranks;
- a non-finite step (rank 1 only) is skipped on both ranks and changes no residual and no
  weight, and a GradScaler is backed off; resuming from a checkpoint (model, optimizer and
  residuals) continues bit for bit; a checkpoint of another rank is refused on every rank;
- ranks that disagree on the configuration raise the same error; HSDP and a multi-round
  compressor are refused;
- with a compressed all-gather every forward sees the current weights, whatever moved them:
  foreach and fused optimizers (which move no DTensor version counter), bf16 parameters, the
  plain ``optimizer.step()`` loop, writes through ``p.data`` and ``to_local()``,
  ``load_state_dict`` (``assign=True`` too) and a distributed checkpoint loaded in place; and the
  loss falls as plain FSDP2's; backward's re-gathers give the forward's bits;
- resuming is bit-identical with frozen parameters under a compressed all-gather;
- a loop that leaves a step decision open (no ``fsdp.step``) keeps no non-finite residual after
  a NaN on one rank and warns once; synced accumulation under ``fsdp.step`` skips a NaN step on
  every rank; an invalid received payload undoes the step and raises the same error everywhere.
"""
from __future__ import annotations

import copy

import pytest
import torch

from ranks import run_ranks

STEPS = 4


def _shard(model, reshard=True, mp=None):
    from torch.distributed.fsdp import fully_shard

    kw = {"reshard_after_forward": reshard, **({"mp_policy": mp} if mp is not None else {})}
    for child in model.children():
        if any(True for _ in child.parameters()):
            fully_shard(child, **kw)
    fully_shard(model, **kw)
    return model


def _build(kind, seed=0, freeze=(), **kw):
    """``kind`` from tests/models.py under ``fully_shard`` (each child with parameters, then the
    root); parameters whose names start with one of ``freeze`` are frozen first."""
    from models import model

    torch.manual_seed(seed)
    m = model(kind)
    for name, p in m.named_parameters():
        if name.startswith(tuple(freeze)):
            p.requires_grad_(False)
    return _shard(m, **kw)


def _locals(model):
    return [p.to_local().detach().clone() for p in model.parameters()]


def _grads(model):
    return [p.grad.to_local().detach().clone() for p in model.parameters()]


def _loss(model, x, y, rank):
    return torch.nn.functional.cross_entropy(model(x[rank::2]), y[rank::2])


def _dense_identical(rank, kind, reshard, mp):
    """FSDP2's own gradients and the dense custom comm's, step by step: bit-identical."""
    from models import data

    from gradcomp.sharded import compress_fsdp

    x, y = data(kind, 32, seed=1)
    ref, ours, halved = _build(kind, reshard=reshard, mp=mp), _build(kind, reshard=reshard, mp=mp), \
        _build(kind, reshard=reshard, mp=mp)
    compress_fsdp(ours, None)
    compress_fsdp(halved, None)
    for m in halved.modules():
        if hasattr(m, "set_gradient_divide_factor"):
            m.set_gradient_divide_factor(4.0)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, ours, halved)]
    same, scaled = True, True
    for step in range(3):
        for m, o in zip((ref, ours, halved), opts):
            o.zero_grad()
            _loss(m, x[8 * step:8 * step + 8], y[8 * step:8 * step + 8], rank).backward()
        g_ref, g_ours, g_half = _grads(ref), _grads(ours), _grads(halved)
        same &= all(torch.equal(a, b) for a, b in zip(g_ref, g_ours))
        if step == 0:  # the same weights once only: the halved model then trains on other steps
            scaled &= all(torch.equal(a * 0.5, c) for a, c in zip(g_ref, g_half))
        for o in opts:
            o.step()
    return same and all(torch.equal(a, b) for a, b in zip(_locals(ref), _locals(ours))), scaled


def _spy(handle):
    """Record every reduce-scatter's flat input and output on this rank, per module."""
    seen = {k: [] for k in handle.keys}
    real = handle._reduce_scatter

    def spy(key, output, flat, group, op):
        real(key, output, flat, group, op)
        seen[key].append((flat.detach().clone(), output.detach().clone()))

    handle._reduce_scatter = spy
    return seen


def _weights_seen(model):
    """Every leaf module's parameters as its forward sees them (unsharded), per forward."""
    seen = []

    def hook(mod, args):
        seen.append([p.detach().clone() for p in mod.parameters(recurse=False)])

    for m in model.modules():
        if any(True for _ in m.parameters(recurse=False)) and not list(m.children()):
            m.register_forward_pre_hook(hook)
    return seen


def _regathers(handle):
    """Per all-gather call in backward (the re-gather of ``reshard_after_forward=True``): whether
    it gave the bits of the module's forward gather."""
    last, same = {}, []
    real = handle._all_gather

    def spy(key, output, shard, group, async_op=False):
        pending = real(key, output, shard, group, async_op)
        if pending is not None:
            pending.wait()
        if torch._C._current_graph_task_id() == -1:  # not in backward
            last[key] = output.detach().clone()
        elif key in last:
            same.append(torch.equal(last[key], output))
        return pending

    handle._all_gather = spy
    return same


def _compressed_run(rank, world):
    """int8 RS + bf16 AG on the transformer: EF invariant, equal replicas, a skipped step, resume."""
    import torch.distributed as dist
    from models import data

    from syncs import HostSyncs

    from gradcomp.collectives.shards import piece_key
    from gradcomp.sharded import compress_fsdp

    x, y = data("transformer", 64, seed=2)
    model = _build("transformer")
    h = compress_fsdp(model, "int8", all_gather="bf16")
    seen, weights, regathers = _spy(h), _weights_seen(model), _regathers(h)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    out = {"stepped": [], "skip_kept_state": None, "skip_kept_weights": None}
    snapshot = None
    counts = {id(calls): 0 for calls in seen.values()}
    for step in range(STEPS + 2):
        xb, yb = x[8 * step:8 * step + 8], y[8 * step:8 * step + 8]
        if step == 3:  # resume point: everything a checkpoint holds
            snapshot = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()), h.state_dict())
        before = (copy.deepcopy(h.state_dict()), _locals(model))
        model.set_requires_gradient_sync(False)  # accumulate one micro-batch without exchanging it
        _loss(model, xb[:4], yb[:4], rank).backward()
        model.set_requires_gradient_sync(True)
        loss = _loss(model, xb[4:], yb[4:], rank)
        if step == 1 and rank == 1:
            loss = loss * float("inf")
        with HostSyncs() as syncs:
            loss.backward()
            out["stepped"].append(h.step(opt))
        out["syncs"] = syncs.sites  # the last step's
        opt.zero_grad()
        if not out["stepped"][-1]:  # rolled back: its exchanges owe nothing
            for calls in seen.values():
                del calls[counts[id(calls)]:]
        counts = {id(calls): len(calls) for calls in seen.values()}
        if step == 1:
            # the weight residual moved in this step's forward (the weights of step 0 were new)
            out["skip_kept_state"] = _same(before[0]["reduce_scatter"], h.state_dict()["reduce_scatter"])
            out["skip_kept_weights"] = all(torch.equal(a, b) for a, b in zip(before[1], _locals(model)))
    final = _locals(model)
    out["skipped"] = h.skipped
    out["decision"] = type(h.decision).__name__ == "StepDecision" and h.decision.skipped == h.skipped
    # error feedback per shard: sum_t out_t + (1/w) sum_{r != me} e_{r->me} == sum_t mean_r(piece_me of input_r)
    residuals = h.state_dict()["reduce_scatter"]["state"]
    gathered = [None] * world
    dist.all_gather_object(gathered, ({k: [f for f, _ in v] for k, v in seen.items()}, residuals))
    worst = 0.0
    for key, calls in seen.items():
        got = sum(o.double() for _, o in calls)
        want = 0
        for t in range(len(calls)):
            pieces = [g[0][key][t].view(world, -1)[rank].double() for g in gathered]
            want = want + sum(pieces) / world
        owed = sum(g[1][piece_key(key, rank)].double() for r, g in enumerate(gathered) if r != rank) / world
        gap = float((got + owed - want).abs().max() / (want.abs().max() + 1e-12))
        worst = gap if not gap <= worst else worst  # a NaN stays
    out["ef_worst"] = worst
    out["ef_calls"] = sum(len(v) for v in seen.values())
    out["weights_seen"] = [[w.tolist() for w in ws] for ws in weights]
    out["regathers"] = (len(regathers), all(regathers))
    # resume: a fresh model loads the snapshot and runs the last steps again
    model2 = _build("transformer", seed=5)
    h2 = compress_fsdp(model2, "int8", all_gather="bf16")
    opt2 = torch.optim.Adam(model2.parameters(), lr=1e-2)
    model2.load_state_dict(snapshot[0])
    opt2.load_state_dict(snapshot[1])
    h2.load_state_dict(snapshot[2])
    for step in range(3, STEPS + 2):
        xb, yb = x[8 * step:8 * step + 8], y[8 * step:8 * step + 8]
        model2.set_requires_gradient_sync(False)
        _loss(model2, xb[:4], yb[:4], rank).backward()
        model2.set_requires_gradient_sync(True)
        _loss(model2, xb[4:], yb[4:], rank).backward()
        h2.step(opt2)
        opt2.zero_grad()
    out["resume_identical"] = all(torch.equal(a, b) for a, b in zip(final, _locals(model2)))
    # another rank's checkpoint, on rank 1 only: refused on both ranks, nothing loaded
    other = [None] * world
    dist.all_gather_object(other, h.state_dict())
    try:
        h2.load_state_dict(other[0])
        out["refused"] = None
    except ValueError as exc:
        out["refused"] = str(exc)
    return out


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(u, v) for u, v in zip(a, b))
    return a == b


def _scaler_run(rank):
    """onebit RS under a GradScaler on the conv net: an overflow on rank 1 is skipped everywhere."""
    from models import data

    from gradcomp.sharded import compress_fsdp

    x, y = data("cnn1d", 32, seed=3)
    model = _build("cnn1d", reshard=False)
    h = compress_fsdp(model, "onebit")
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    stepped, scales, kept = [], [], None
    for step in range(3):
        before = copy.deepcopy(h.state_dict())
        loss = _loss(model, x[8 * step:8 * step + 8], y[8 * step:8 * step + 8], rank)
        if step == 1 and rank == 1:
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        stepped.append(h.step(opt, scaler))
        scales.append(scaler.get_scale())
        opt.zero_grad()
        if step == 1:
            kept = _same(before["reduce_scatter"], h.state_dict()["reduce_scatter"])
    return stepped, scales, kept


def _refusals(rank):
    from gradcomp.sharded import compress_fsdp

    said = {}
    for case, spec, kw in (("disagree", "int8" if rank == 0 else "onebit", {}), ("multi_round", "powersgd", {}),
                           ("unknown", "int8" if rank == 0 else "no-such-codec", {}),
                           ("regather_alone", "int8", {"regather": "local"}),
                           ("regather_unknown", "int8", {"regather": "cache", "all_gather": "bf16"})):
        try:
            compress_fsdp(_build("cnn1d"), spec, **kw)
            said[case] = None
        except ValueError as exc:
            said[case] = str(exc)
    return said


# ---- the weights every forward sees, whatever changed them (optimizer paths, writes, loads) ------------

GAP = {"bf16": 2.0 ** -6, "int8": 2.0 ** -5}  # |forward's weight - weight| / max|weight|: the codec's error
TRAIN_STEPS = 6


def _seen_by_forward(model):
    """The parameters of every leaf module as its last forward saw them (unsharded), by name."""
    seen = {}
    for fqn, m in model.named_modules():
        if any(True for _ in m.parameters(recurse=False)) and not list(m.children()):
            def hook(mod, args, fqn=fqn):
                for n, p in mod.named_parameters(recurse=False):
                    seen[f"{fqn}.{n}"] = p.detach().float().clone()
            m.register_forward_pre_hook(hook)
    return seen


def _full(model):
    """Every parameter's whole tensor (a collective: call on every rank, between iterations)."""
    return {n: p.full_tensor().detach().float().clone() for n, p in model.named_parameters()}


def _gap(seen, full):
    """The largest gap between what a forward saw and the weights it should have seen, relative to
    the largest weight of the parameter's module (a quantized gather's error scales with its
    block's largest value, and a module's parameters share blocks)."""
    scale = {}
    for n in seen:
        leaf = n.rsplit(".", 1)[0]
        scale[leaf] = max(scale.get(leaf, 1e-12), float(full[n].abs().max()))
    return max(float((seen[n] - full[n]).abs().max()) / scale[n.rsplit(".", 1)[0]] for n in seen)


def _ours(message) -> bool:
    return "fsdp.step" in str(message.message)


def _train(model, opt, h, x, y, rank, steps, plain=False, seen=None):
    """``steps`` iterations; the forward's weight gap to the sharded weights at each (with
    ``seen``), then the loss on all of ``x`` after them."""
    gaps = []
    for step in range(steps):
        full = _full(model) if seen is not None else None
        loss = _loss(model, x[8 * step:8 * step + 8], y[8 * step:8 * step + 8], rank)
        if seen is not None:
            gaps.append(_gap(seen, full))
        loss.backward()
        if plain or h is None:
            opt.step()
        else:
            h.step(opt)
        opt.zero_grad()
    with torch.no_grad():
        final = float(_loss(model, x, y, rank))
    return gaps, final


def _optimizer_paths(rank, path):
    """Each optimizer path GPU users take, with a compressed all-gather, against plain FSDP2 with
    the same optimizer: every forward sees the current weights (to the codec's error) and the
    loss goes down as FSDP2's does."""
    import warnings

    from models import data
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from gradcomp.sharded import compress_fsdp, overlap_gathers

    x, y = data("transformer", 8 * TRAIN_STEPS, seed=6)
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    def adamw(ps):
        return torch.optim.AdamW(ps, lr=1e-2, foreach=True)

    def fused(ps):
        return torch.optim.Adam(ps, lr=1e-2, fused=True)

    cases = {
        "adamw_foreach": (adamw, None, "bf16", False, False),
        "adam_fused": (fused, None, "bf16", False, False),
        "sgd_plain": (lambda ps: torch.optim.SGD(ps, lr=0.2, momentum=0.9, foreach=False), None, "bf16", False,
                      False),
        "adamw_foreach_bf16_params": (adamw, bf16, "int8", False, False),
        # asynchronous prefetched gathers, backward's re-gathers decoded locally (the fast path at 1 Gbit/s)
        "adam_fused_bf16_params_overlapped_local": (fused, bf16, "int8", False, True),
        # the plain loop (optimizer.step(), no fsdp.step): trains too, and says once how to make it exact
        "adamw_foreach_plain_loop": (adamw, None, "bf16", True, False),
    }
    out, plain_fsdp = {}, {}
    for name, (make, mp, codec, plain, fast) in cases.items():
        if (make, mp) not in plain_fsdp:  # FSDP2's own run with this optimizer: (first loss, last loss)
            ref = _build("transformer", mp=mp)
            with torch.no_grad():
                first = float(_loss(ref, x, y, rank))
            plain_fsdp[make, mp] = (first, _train(ref, make(ref.parameters()), None, x, y, rank, TRAIN_STEPS)[1])
        start, ref_final = plain_fsdp[make, mp]
        model = _build("transformer", mp=mp)
        h = compress_fsdp(model, "int8", all_gather=codec, regather="local" if fast else "wire")
        if fast:
            overlap_gathers(model, [c for c in model.children() if any(True for _ in c.parameters())])
        seen = _seen_by_forward(model)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            gaps, final = _train(model, make(model.parameters()), h, x, y, rank, TRAIN_STEPS, plain=plain, seen=seen)
        out[name] = {"gaps": gaps, "limit": GAP[codec], "start": start, "ref": ref_final, "ours": final,
                     "warnings": sum(_ours(w) for w in caught)}
    return out


def _weight_writes(rank, path):
    """Weights changed by something other than an optimizer step (through ``p.data``, through
    ``to_local()``, ``load_state_dict`` with and without ``assign``, a distributed checkpoint
    loaded in place): the next forward sees the new weights. ``fsdp.step`` steps an optimizer of
    another tensor, so nothing else moves the weights."""
    import torch.distributed.checkpoint as dcp
    from models import data

    from gradcomp.sharded import compress_fsdp

    x, y = data("transformer", 16, seed=7)
    first, second, third = (_build("transformer", seed=s) for s in (9, 11, 13))
    first_state, second_state = copy.deepcopy(first.state_dict()), copy.deepcopy(second.state_dict())
    dcp.save(third.state_dict(), checkpoint_id=f"{path}/third")
    model = _build("transformer")
    h = compress_fsdp(model, "int8", all_gather="bf16")
    seen = _seen_by_forward(model)
    idle = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)

    def flip_data():
        with torch.no_grad():
            for p in model.parameters():
                p.data.mul_(-1.0)

    def flip_local():
        with torch.no_grad():
            for p in model.parameters():
                p.to_local().mul_(-0.5)

    def dcp_in_place():
        dcp.load(model.state_dict(), checkpoint_id=f"{path}/third")

    # each write gives weights the model never held before
    writes = {"p.data": flip_data, "to_local": flip_local,
              "load_state_dict": lambda: model.load_state_dict(copy.deepcopy(first_state)),
              "dcp_load": dcp_in_place,
              "load_state_dict_assign": lambda: model.load_state_dict(copy.deepcopy(second_state), assign=True)}
    out = {}
    for name, write in writes.items():
        _loss(model, x[:8], y[:8], rank).backward()  # an iteration on the current weights
        h.step(idle)
        model.zero_grad()
        write()
        full = _full(model)
        _loss(model, x[8:], y[8:], rank).backward()  # the first forward after the write
        out[name] = _gap(seen, full)
        h.step(idle)
        model.zero_grad()
    return out


def _frozen_resume(rank):
    """Frozen parameters (whole FSDP modules and one tensor of a trained module) with a
    compressed all-gather: train 3 steps, save; 3 more, versus loading into a fresh model and
    running the same 3: the same losses and parameters, bit for bit."""
    from models import data

    from gradcomp.sharded import compress_fsdp

    x, y = data("transformer", 48, seed=8)
    frozen = ("embed.", "norm1.", "head.bias")

    def make(seed):
        model = _build("transformer", seed=seed, freeze=frozen)
        h = compress_fsdp(model, "int8", all_gather="int8")
        # foreach=False: the trained weights' version counters move, so only the frozen ones are at stake
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, foreach=False)
        return model, h, opt

    def run(model, h, opt, steps):
        losses = []
        for step in steps:
            loss = _loss(model, x[8 * step:8 * step + 8], y[8 * step:8 * step + 8], rank)
            losses.append(loss.detach().clone())
            loss.backward()
            h.step(opt)
            opt.zero_grad()
        return losses

    model, h, opt = make(0)
    run(model, h, opt, range(3))
    snapshot = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()), h.state_dict())
    went_on = run(model, h, opt, range(3, 6))
    model2, h2, opt2 = make(5)
    model2.load_state_dict(snapshot[0])
    opt2.load_state_dict(snapshot[1])
    h2.load_state_dict(snapshot[2])
    resumed = run(model2, h2, opt2, range(3, 6))
    return {"losses": [(float(a), float(b)) for a, b in zip(went_on, resumed)],
            "same_losses": all(torch.equal(a, b) for a, b in zip(went_on, resumed)),
            "same_params": all(torch.equal(a, b) for a, b in zip(_locals(model), _locals(model2)))}


def _nan_on(module, name="weight"):
    """A switch: while ``on`` is true, the gradient of ``module.<name>`` gets a NaN in its first
    row on this rank (the row lies in rank 0's shard: only rank 0's reduced shard is hit)."""
    state = {"on": False, "hooked": set()}

    def poison(grad):
        if not state["on"]:
            return grad
        grad = grad.clone()
        grad[0] = float("nan")
        return grad

    def pre(mod, args):
        p = getattr(mod, name)  # the unsharded parameter of this forward
        if id(p) not in state["hooked"]:
            state["hooked"].add(id(p))
            p.register_hook(poison)

    module.register_forward_pre_hook(pre)
    return state


def _residuals_finite(h) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in h.state_dict()["reduce_scatter"]["state"].values())


class _Shared(torch.nn.Module):
    """A layer applied twice per forward: FSDP2 reduce-scatters it twice in one backward."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.twice, self.head = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16), torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.head(torch.relu(self.twice(torch.relu(self.twice(torch.relu(self.first(x)))))))


def _open_decisions(rank):
    """Loops that leave a step decision open: a GradScaler loop without ``fsdp.step`` with a NaN
    on rank 1 (rank 0 skips the step, rank 1 takes it): no residual stays non-finite and later
    gradients are finite on every rank, with one warning naming the fix. Accumulation with a
    synced backward per micro-batch under ``fsdp.step``, a NaN in the first: the step is
    skipped on both ranks and no compression state changes, without a warning. A layer used
    twice per forward (reduce-scattered twice in one backward): still one read per step."""
    import warnings

    from models import data

    from gradcomp.sharded import compress_fsdp

    out = {}
    x, y = data("transformer", 48, seed=10)
    model = _build("transformer")
    h = compress_fsdp(model, "int8")
    nan = _nan_on(model.head)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, foreach=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    grads_finite = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(5):
            nan["on"] = step == 1 and rank == 1
            scaler.scale(_loss(model, x[8 * step:8 * step + 8], y[8 * step:8 * step + 8], rank)).backward()
            grads_finite.append(all(bool(torch.isfinite(p.grad.to_local()).all()) for p in model.parameters()))
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    out["scaler_loop"] = {"grads_finite": grads_finite, "residuals_finite": _residuals_finite(h),
                          "warnings": sum(_ours(w) for w in caught), "skipped": h.skipped}

    model = _build("cnn1d")
    h = compress_fsdp(model, "int8")
    nan = _nan_on(model[7])
    opt = torch.optim.SGD(model.parameters(), lr=0.05, foreach=True)
    xc, yc = data("cnn1d", 48, seed=11)
    stepped, kept = [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):
            before = copy.deepcopy(h.state_dict()["reduce_scatter"])
            for micro in range(2):
                nan["on"] = step == 1 and micro == 0 and rank == 1
                start = 16 * step + 8 * micro
                _loss(model, xc[start:start + 8], yc[start:start + 8], rank).backward()
            stepped.append(h.step(opt))
            opt.zero_grad()
            kept.append(_same(before, h.state_dict()["reduce_scatter"]))
    out["synced_accumulation"] = {"stepped": stepped, "kept": kept, "skipped": h.skipped,
                                  "residuals_finite": _residuals_finite(h),
                                  "warnings": sum(_ours(w) for w in caught)}

    # a layer used twice is reduce-scattered twice in one backward: that is not a second backward
    from syncs import HostSyncs

    torch.manual_seed(0)
    model = _shard(_Shared())
    h = compress_fsdp(model, "int8", all_gather="bf16")
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    xs, ys = torch.randn(16, 16, generator=torch.Generator().manual_seed(13)), torch.arange(16) % 4
    for step in range(2):
        with HostSyncs() as syncs:
            torch.nn.functional.cross_entropy(model(xs[rank::2]), ys[rank::2]).backward()
            h.step(opt)
        opt.zero_grad()
    out["shared_layer_syncs"] = sum(n for site, n in syncs.sites.items()
                                    if "sharded/fsdp.py" in site or "training/step.py" in site)
    return out


def _invalid_payload(rank):
    """topk on its agreed layout, and from the second step rank 1 sends an index out of range:
    rank 0's check on the device flags it, step() undoes the iteration and both ranks raise the
    same ValueError naming rank 0."""
    from models import data

    from gradcomp.sharded import compress_fsdp

    x, y = data("cnn1d", 16, seed=12)
    model = _build("cnn1d")
    h = compress_fsdp(model, "topk", compressor_options={"ratio": 0.1})
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    _loss(model, x[:8], y[:8], rank).backward()
    h.step(opt)
    opt.zero_grad()
    if rank == 1:
        real = h.grad_codec.compress

        def corrupt(tensor, key):
            payload = real(tensor, key)
            payload.tensors[1][0] = payload.numel  # one past the end
            return payload

        h.grad_codec.compress = corrupt
    before = copy.deepcopy(h.state_dict()["reduce_scatter"])
    _loss(model, x[8:], y[8:], rank).backward()
    try:
        h.step(opt)
        said = None
    except ValueError as exc:
        said = str(exc)
    return {"said": said, "kept": _same(before, h.state_dict()["reduce_scatter"]), "skipped": h.skipped}


def _prefetch_run(rank):
    """The compressed all-gather asynchronous, where FSDP2 overlaps its own: unshard_async_op with
    explicit forward prefetching (and backward's implicit one, re-gathering after
    reshard_after_forward) against the same model gathered synchronously. Bit for bit the same
    losses and weights, foreach AdamW; the gathers FSDP asked for asynchronously returned a Work
    FSDP waited on, and the gather of each next module started before the module before it
    computed. ``regather="local"`` (asynchronous too): the same bits again, and backward's
    re-gathers send nothing (the all-gather's bytes are the forward's only)."""
    from models import data

    from gradcomp.collectives import reset_telemetry, telemetry
    from gradcomp.sharded import compress_fsdp, overlap_gathers

    x, y = data("transformer", 24, seed=21)
    runs = {}
    for mode in ("sync", "async", "local"):
        model = _build("transformer", seed=3)
        handle = compress_fsdp(model, "int8", all_gather="bf16", regather="local" if mode == "local" else "wire")
        parts = [c for c in model.children() if any(True for _ in c.parameters())]
        events, works = [], []
        if mode != "sync":
            overlap_gathers(model, parts)
        names = {id(m): n for n, m in model.named_children()}
        for m in parts:
            m.register_forward_pre_hook(lambda mod, a: events.append(("compute", names[id(mod)])))
        real = handle._all_gather

        def spy(key, output, shard, group, async_op=False, real=real, events=events, works=works):
            events.append(("gather", key))
            pending = real(key, output, shard, group, async_op)
            works.append(pending is not None)
            return pending

        handle._all_gather = spy
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
        losses = []
        for step in range(3):
            if step == 2:  # the last step's all-gather bytes: forward only, or forward and backward
                reset_telemetry()
            loss = _loss(model, x[8 * step:8 * step + 8], y[8 * step:8 * step + 8], rank)
            loss.backward()
            handle.step(opt)
            opt.zero_grad()
            losses.append(float(loss))
        sent = telemetry()["by_op"]["all_gather/compressed"]
        runs[mode] = {"losses": losses, "weights": _locals(model), "works": works, "events": events,
                      "gathers": sent["calls"], "bytes": sent["bytes_sent"]}
    a, s, loc = runs["async"], runs["sync"], runs["local"]

    def ahead(events):  # each module's first gather comes before the first compute of the one before it
        order = list(dict.fromkeys(n for kind, n in events if kind == "compute"))
        return all(events.index(("gather", nxt)) < events.index(("compute", cur)) for cur, nxt in zip(order, order[1:]))

    return {"same": a["losses"] == s["losses"] and all(torch.equal(p, q) for p, q in zip(a["weights"], s["weights"])),
            "async_works": sum(a["works"]), "sync_works": sum(s["works"]), "ahead": ahead(a["events"]),
            "sync_ahead": ahead(s["events"]), "losses": a["losses"],
            "local_same": loc["losses"] == s["losses"] and all(torch.equal(p, q) for p, q in
                                                               zip(loc["weights"], s["weights"])),
            "gathers": (s["gathers"], loc["gathers"]), "bytes": (s["bytes"], loc["bytes"])}


def _all_checks(rank, world, path):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return {"dense_fp32": _dense_identical(rank, "transformer", True, None),
            "dense_bf16": _dense_identical(rank, "cnn1d", False, MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)),
            "compressed": _compressed_run(rank, world), "scaler": _scaler_run(rank), "refusals": _refusals(rank),
            "optimizers": _optimizer_paths(rank, path), "writes": _weight_writes(rank, path),
            "frozen_resume": _frozen_resume(rank), "open": _open_decisions(rank),
            "invalid": _invalid_payload(rank), "prefetch": _prefetch_run(rank)}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """Every rank's results of the one 2-rank spawn (``_all_checks``) the tests below read."""
    path = tmp_path_factory.mktemp("fsdp")
    return run_ranks(_all_checks, 2, path, str(path), timeout_s=180)


def test_compress_fsdp_on_two_ranks(ranks):
    r0, r1 = ranks
    for r in (r0, r1):
        assert r["dense_fp32"] == (True, True), "dense custom reduce-scatter differs from FSDP2's (fp32)"
        assert r["dense_bf16"] == (True, True), "dense custom reduce-scatter differs from FSDP2's (bf16 reduce)"
        c = r["compressed"]
        assert c["stepped"] == [True, False, True, True, True, True] and c["skipped"] == 1
        assert c["decision"], "skipped is not the counter of the handle's StepDecision"
        assert c["skip_kept_state"] and c["skip_kept_weights"], "a skipped step changed the state or weights"
        assert c["ef_calls"] > 0 and c["ef_worst"] < 1e-5, f"error feedback lost mass: {c['ef_worst']}"
        assert c["regathers"][0] > 0 and c["regathers"][1], "a re-gather of unchanged weights gave other bits"
        assert c["resume_identical"], "resuming from the checkpoint did not continue bit for bit"
        # compress_fsdp's own reads and its step decision's (gradcomp.training.step)
        ours = {site: n for site, n in c["syncs"].items() if "sharded/fsdp.py" in site or "training/step.py" in site}
        assert sum(ours.values()) == 1, f"compress_fsdp's own host syncs per step (the decision only): {ours}"
        # every exchange of a step after the first travels on its agreed layout: no size round, no parsing
        wire = {site: n for site, n in c["syncs"].items() if "collectives/" in site}
        assert not wire, f"the collectives read back during a step on agreed layouts: {wire}"
        stepped, scales, kept = r["scaler"]
        assert stepped == [True, False, True] and kept
        assert scales[1] == scales[0] * 0.5, scales
    assert r0["compressed"]["refused"] == r1["compressed"]["refused"] is not None
    assert "rank 1" in r0["compressed"]["refused"]
    assert r0["compressed"]["weights_seen"] == r1["compressed"]["weights_seen"], "replicas differ"
    assert r0["scaler"][1] == r1["scaler"][1]
    for case in ("disagree", "unknown"):
        assert r0["refusals"][case] == r1["refusals"][case] is not None, case
    assert "ranks disagree on the compressor" in r0["refusals"]["disagree"]
    assert "multi-round" in r0["refusals"]["multi_round"]
    assert "pass all_gather=" in r0["refusals"]["regather_alone"]
    assert "'cache' is not one of 'wire', 'local'" in r0["refusals"]["regather_unknown"]


def test_asynchronous_gather_overlaps_and_changes_no_bit(ranks):
    """``set_unshard_async_op(True)`` and forward prefetching: the compressed all-gather returns a
    Work FSDP waits on, the next module's gather starts before this module computes, and the
    losses and weights are those of the synchronous gather, bit for bit."""
    for r in ranks:
        p = r["prefetch"]
        assert p["same"], f"the asynchronous gather changed the training: {p['losses']}"
        assert p["async_works"] > 0 and p["sync_works"] == 0, p
        assert p["ahead"] and not p["sync_ahead"], f"a module's gather did not start before the previous computed: {p}"
        assert p["local_same"], "regather='local' changed the training"
        wire, local = p["gathers"]
        assert local < wire and 2 * p["bytes"][1] <= p["bytes"][0] + 1024, p  # backward re-gathers: no bytes


def test_every_optimizer_path_trains(ranks):
    """foreach and fused optimizers (they move a DTensor's weights without bumping its version
    counter), a plain SGD, bf16 parameters with an int8 all-gather (also asynchronous and
    prefetched, with ``regather="local"``, under fused Adam), and the plain ``optimizer.step()``
    loop: every forward sees the current weights to the codec's error, and the loss falls as
    plain FSDP2's does with the same optimizer."""
    assert "adam_fused_bf16_params_overlapped_local" in ranks[0]["optimizers"]
    for rank, r in enumerate(ranks):
        for name, c in r["optimizers"].items():
            assert max(c["gaps"]) < c["limit"], f"rank {rank} {name}: a forward saw stale weights, gaps {c['gaps']}"
            drop, ref_drop = c["start"] - c["ours"], c["start"] - c["ref"]
            assert ref_drop > 0 and drop > 0.8 * ref_drop, f"rank {rank} {name}: loss {c} (FSDP2's fell {ref_drop})"
            want = 1 if name.endswith("plain_loop") else 0
            assert c["warnings"] == want, f"rank {rank} {name}: {c['warnings']} warnings naming fsdp.step"


def test_forward_sees_weights_written_outside_an_optimizer(ranks):
    """Writes through ``p.data`` and ``to_local()``, ``load_state_dict`` (also ``assign=True``,
    which replaces the parameters) and a distributed checkpoint loaded in place: the next
    forward sees the new weights."""
    for rank, r in enumerate(ranks):
        for name, gap in r["writes"].items():
            assert gap < GAP["bf16"], f"rank {rank}: after a write through {name} the forward saw other weights ({gap})"


def test_resume_is_bit_identical_with_frozen_weights(ranks):
    """Frozen parameters under a compressed all-gather: resuming from model, optimizer and
    compress_fsdp checkpoints gives the losses and parameters of the run that went on."""
    for rank, r in enumerate(ranks):
        c = r["frozen_resume"]
        assert c["same_losses"] and c["same_params"], f"rank {rank}: resumed run differs: losses {c['losses']}"


def test_open_decision_keeps_no_nonfinite_residual(ranks):
    """A NaN on rank 1 in a GradScaler loop that never calls fsdp.step: rank 0 (whose shard it
    hit) skips, rank 1 steps; no residual stays non-finite, every later gradient is finite, one
    warning names the fix. Accumulating with synced backwards under fsdp.step is not such a
    loop: a NaN micro-batch skips the step on both ranks, changes nothing, warns nothing."""
    r0, r1 = ranks
    assert r0["open"]["scaler_loop"]["grads_finite"][1] is False, "the NaN did not reach rank 0's shard"
    for rank, r in enumerate(ranks):
        s = r["open"]["scaler_loop"]
        assert s["residuals_finite"], f"rank {rank}: a residual stayed non-finite"
        assert all(s["grads_finite"][2:]), f"rank {rank}: gradients after the NaN step: {s['grads_finite']}"
        assert s["warnings"] == 1 and s["skipped"] == 1, s
        a = r["open"]["synced_accumulation"]
        assert a["stepped"] == [True, False, True] and a["skipped"] == 1, a
        assert a["kept"][1] and a["residuals_finite"] and a["warnings"] == 0, a
        assert r["open"]["shared_layer_syncs"] == 1, "a layer used twice made compress_fsdp read more than once a step"


def test_invalid_payload_undoes_the_step_on_every_rank(ranks):
    """A received payload that fails its check on the device: the step is undone (no residual
    changed) and every rank raises the same error, naming the rank that found it."""
    r0, r1 = ranks
    assert r0["invalid"]["said"] is not None and r0["invalid"]["said"] == r1["invalid"]["said"], \
        (r0["invalid"], r1["invalid"])
    assert "rank 0" in r0["invalid"]["said"] and "invalid" in r0["invalid"]["said"], r0["invalid"]["said"]
    for r in ranks:
        assert r["invalid"]["kept"] and r["invalid"]["skipped"] == 1, r["invalid"]


def test_refusals_without_ranks():
    """torch < 2.9 and an HSDP mesh are refused with errors naming the fix."""
    from unittest import mock

    from gradcomp.sharded import fsdp

    with mock.patch.object(torch, "__version__", "2.8.0"):
        assert "torch >= 2.9" in fsdp._torch_problem() and "2.8.0" in fsdp._torch_problem()
    assert fsdp._torch_problem() is None

    class Mesh:
        ndim = 2

    assert "HSDP" in fsdp._mesh_problem([Mesh()])
    assert "fully_shard" in fsdp._mesh_problem([])
    assert fsdp._op_scale(torch.distributed.ReduceOp.SUM, 4) == 4.0
    assert fsdp._op_scale(torch.distributed.ReduceOp.PREMUL_SUM(0.25), 2) == 0.5
    with pytest.raises(ValueError, match="MAX"):
        fsdp._op_scale(torch.distributed.ReduceOp.MAX, 2)


@pytest.mark.gpu
def test_compress_fsdp_cuda_one_rank(tmp_path):
    """On one GPU under NCCL: the comms keep every tensor on the GPU and training steps (FSDP
    calls no comm on a group of one, so the comms are also called directly)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    assert run_ranks(_cuda_one, 1, tmp_path, timeout_s=120, torchrun_env=True, strict=False) == [True]


def _cuda_one(rank, world):
    import torch.distributed as dist
    from models import data
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from gradcomp.sharded import compress_fsdp

    torch.cuda.set_device(0)
    dist.init_process_group("nccl")
    mesh = init_device_mesh("cuda", (1,))
    torch.manual_seed(0)
    from models import model as make

    model = make("transformer").cuda()
    for child in model.children():
        if any(True for _ in child.parameters()):
            fully_shard(child, mesh=mesh)
    fully_shard(model, mesh=mesh)
    h = compress_fsdp(model, "int8", all_gather="bf16")
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x, y = data("transformer", 16, seed=0)
    for _ in range(2):
        torch.nn.functional.cross_entropy(model(x.cuda()), y.cuda()).backward()
        assert h.step(opt)
        opt.zero_grad()
    key, group = h.keys[0], mesh.get_group()
    n = sum(p.numel() for p in h._params[key])  # a group of one: the shard is the whole module
    flat = torch.randn(n, device="cuda")
    out = h.reduce_scatters[key].allocate((n,), dtype=torch.float32, device=flat.device)
    h.reduce_scatters[key](out, flat, group, dist.ReduceOp.AVG)
    full = torch.empty(n, device="cuda")
    h.all_gathers[key](full, flat, group)
    ok = out.is_cuda and full.is_cuda and torch.equal(out, flat) and torch.allclose(full, flat, rtol=1e-2)
    dist.destroy_process_group()
    return bool(ok)
