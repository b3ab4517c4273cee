"""DDP communication hooks on 2 real gloo ranks: every compressor, from iteration 0, resumable.

One spawn of ranks runs every check (spawning costs seconds); the tests below assert on its
results:

- the ``none`` hook gives exactly the parameters of plain DDP, and ``fp16`` on every tensor
  exactly those of PyTorch's ``fp16_compress_hook``;
- the result does not depend on the bucket layout (one bucket, or one per parameter);
- every compressor as a hook keeps the replicas bit-identical, the loss finite, and compresses
  from iteration 0 on, with its state kept under parameter names (never bucket indices);
- the error-feedback invariant holds over the whole run, across DDP's bucket rebuild after
  the first iteration: sum of applied gradients + mean residual == sum of mean raw gradients;
- checkpoint -> resume continues bit-identically (hook, model and optimizer state);
- threshold whose payloads are empty on every rank (nothing reaches tau) decodes to zeros,
  fp32 and bf16, on the bucket's agreed layout;
- the fp16 cast wrapper composes with a gradcomp hook, a bf16 model trains, and residuals
  stay fp32 in both.
"""
from __future__ import annotations

import io

import pytest
import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from _training_helpers import batch, flat_params, mlp, teacher_data
from ranks import run_ranks
from gradcomp.compress import ErrorFeedback, available_compressors

STEPS = 6
OPTIONS = {"powersgd": {"rank": 1}}  # rank 1, so that the 4x64 output layer shrinks too
EF_CHECKED = ("topk", "powersgd", "efsignsgd", "onebit")
QUIET = (torch.float32, torch.bfloat16)
RESUMED = {  # compressor -> hook options; each keeps a different kind of state
    "powersgd": {"rank": 2},  # warm-start Q and residuals
    "powersgd unnamed": {"rank": 2, "named": False},  # names param{i} in the order first seen
    "topk": {"ratio": 0.05},  # residuals
    "signum": {},  # momentum inside the compressor
    "randomk": {"ratio": 0.1},  # step counters seed the shared positions
    "dgc": {"ratio": 0.05, "error_feedback": "dgc"},  # velocity and accumulation
    "int8": {"error_feedback": "ef21"},  # EF21 estimates, local and aggregate
}


def _ddp_run(me, compressor, steps, *, start=0, checkpoint=None, save_at=None, wrap=None, seed=0,
             dtype=torch.float32, named=True, bucket_cap_mb=None, torch_hook=None, **options):
    """Train the MLP with DDP (a gradcomp hook unless ``compressor`` is None, or PyTorch's
    ``torch_hook``); returns (model, hook state, losses, saved checkpoint bytes)."""
    from gradcomp.training import ddp_comm_hook

    x, y = teacher_data(512, 20, 4)
    x = x.to(dtype)
    model = mlp(20, 64, 4, seed=seed).to(dtype)
    ddp = DDP(model, bucket_cap_mb=bucket_cap_mb)
    state = None
    if torch_hook is not None:
        ddp.register_comm_hook(None, torch_hook)
    if compressor is not None:
        state, hook = ddp_comm_hook(compressor, model=model if named else None, min_numel=0, **options)
        ddp.register_comm_hook(state, wrap(hook) if wrap else hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    if checkpoint is not None:
        ck = torch.load(io.BytesIO(checkpoint), weights_only=True)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        state.load_state_dict(ck["hook"])
    losses, saved = [], None
    for step in range(start, start + steps):
        xb, yb = batch(x, y, 16, me, step)
        loss = torch.nn.functional.cross_entropy(ddp(xb), yb)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        if save_at == step + 1:
            buf = io.BytesIO()
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "hook": state.state_dict()}, buf)
            saved = buf.getvalue()
    return model, state, losses, saved


def _keys(sd) -> set:
    """Every string key inside a codec state_dict's per-key tables."""
    out = set()
    for k, v in sd.items():
        if isinstance(v, dict):
            if k in ("state", "steps", "q", "velocity", "aggregate"):
                out |= set(v)
            else:
                out |= _keys(v)
    return out


def _ef_invariant(rank, name):
    """Per parameter: sum_t raw grad + (-residual_T) on this rank, and sum_t applied grad."""
    from gradcomp.training import ddp_comm_hook

    x, y = teacher_data(512, 20, 4)
    model = mlp(20, 64, 4)
    ddp = DDP(model)
    state, hook = ddp_comm_hook(name, model=model, min_numel=0, compress_1d=True, **OPTIONS.get(name, {}))
    names = {id(p): n for n, p in model.named_parameters()}
    raw = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in model.named_parameters()}
    applied = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in model.named_parameters()}

    def capturing(st, bucket):  # the local gradients, before the hook averages them
        for p, g in zip(bucket.parameters(), bucket.gradients()):
            raw[names[id(p)]] += g.double()
        return hook(st, bucket)

    ddp.register_comm_hook(state, capturing)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for step in range(STEPS):
        xb, yb = batch(x, y, 16, rank, step)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(xb), yb).backward()
        for n, p in model.named_parameters():
            applied[n] += p.grad.double()
        opt.step()
    codec = state.policy.codecs()["*"]
    assert isinstance(codec, ErrorFeedback)
    return {n: (raw[n] - codec.residual(n).double(), applied[n]) for n in raw}


def _hooks_rank(rank, world):
    from gradcomp.training import cast_wrapper

    out = {}
    plain, *_ = _ddp_run(rank, None, STEPS)
    none, *_ = _ddp_run(rank, "none", STEPS)
    out["plain"], out["none hook"] = flat_params(plain), flat_params(none)
    theirs, *_ = _ddp_run(rank, None, STEPS, torch_hook=default_hooks.fp16_compress_hook)
    ours, *_ = _ddp_run(rank, "fp16", STEPS, compress_1d=True)
    out["torch fp16"], out["fp16 everything"] = flat_params(theirs), flat_params(ours)

    for name in available_compressors():
        model, state, losses, _ = _ddp_run(rank, name, 1, **OPTIONS.get(name, {}))
        after_first = _keys(state.state_dict()["codecs"]["*"])
        model, state, losses, _ = _ddp_run(rank, name, STEPS, **OPTIONS.get(name, {}))
        out[name] = {"params": flat_params(model), "losses": losses, "first": after_first,
                     "keys": _keys(state.state_dict()["codecs"]["*"]), "iteration": state.iteration}

    for name in ("powersgd", "topk", "fp16"):  # one bucket per parameter: the same bits
        model, *_ = _ddp_run(rank, name, STEPS, bucket_cap_mb=1e-4, **OPTIONS.get(name, {}))
        out["buckets:" + name] = flat_params(model)

    for name in EF_CHECKED:
        out["ef:" + name] = _ef_invariant(rank, name)

    for label, options in RESUMED.items():
        name = label.split()[0]
        straight, _, _, saved = _ddp_run(rank, name, 2 * 3, save_at=3, **options)
        resumed, *_ = _ddp_run(rank, name, 3, start=3, checkpoint=saved, seed=7, **options)
        out["resume:" + label] = (flat_params(straight), flat_params(resumed))

    for dtype in QUIET:  # threshold, every |gradient + residual| under tau on every rank: empty payloads everywhere
        model, state, _, _ = _ddp_run(rank, "threshold", STEPS, dtype=dtype, tau=1e3, compress_1d=True)
        out[f"quiet {dtype}"] = (flat_params(model), flat_params(mlp(20, 64, 4).to(dtype)), state.iteration)

    for label, dtype, wrap in (("cast wrapper", torch.float32, cast_wrapper), ("bf16 model", torch.bfloat16, None)):
        model, state, losses, _ = _ddp_run(rank, "topk", STEPS, wrap=wrap, dtype=dtype, ratio=0.05)
        codec = state.policy.codecs()["*"]
        out[label] = {"params": flat_params(model), "losses": losses,
                      "residual_dtype": codec.residual("0.weight").dtype}
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_ranks(_hooks_rank, 2, tmp_path_factory.mktemp("hooks"), timeout_s=120)


def test_none_hook_equals_plain_ddp(results):
    for r in results:
        assert torch.equal(r["none hook"], r["plain"])


def test_fp16_hook_on_every_tensor_equals_pytorch_fp16_hook(results):
    for r in results:
        assert torch.equal(r["fp16 everything"], r["torch fp16"])


@pytest.mark.parametrize("name", available_compressors())
def test_every_compressor_as_hook(results, name):
    r0, r1 = results[0][name], results[1][name]
    assert torch.equal(r0["params"], r1["params"]), "replicas differ"
    assert all(torch.isfinite(torch.tensor(r["losses"])).all() for r in (r0, r1))
    assert r0["iteration"] == STEPS
    if name != "none":  # 'none' never shrinks a tensor, so the policy sends it dense
        # compressed from iteration 0, under parameter names: the weights (biases stay dense)
        assert {"0.weight", "2.weight"} <= r0["first"]
        assert r0["keys"] <= {"0.weight", "2.weight"}, f"state not keyed by parameter name: {r0['keys']}"


@pytest.mark.parametrize("name", ["powersgd", "topk", "fp16"])
def test_result_does_not_depend_on_bucket_layout(results, name):
    # one bucket per parameter (several buckets in flight: PyTorch's powerSGD_hook can
    # mismatch its collectives there on gloo) gives exactly the one-bucket result
    for r in results:
        assert torch.equal(r["buckets:" + name], r[name]["params"])


@pytest.mark.parametrize("name", EF_CHECKED)
def test_error_feedback_survives_bucket_rebuild(results, name):
    for pname in results[0]["ef:" + name]:
        (lhs0, applied0), (lhs1, applied1) = results[0]["ef:" + name][pname], results[1]["ef:" + name][pname]
        assert torch.equal(applied0, applied1)
        torch.testing.assert_close((lhs0 + lhs1) / 2, applied0, rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", sorted(RESUMED))
def test_resume_is_bit_identical(results, name):
    for r in results:
        straight, resumed = r["resume:" + name]
        assert torch.equal(straight, resumed)


@pytest.mark.parametrize("dtype", QUIET)
def test_threshold_with_every_payload_empty(results, dtype):
    # DDP's rebuilt bucket: checked at iteration 1, then on its agreed layout (sized, bounded)
    # with no value reaching tau on any rank: the means are zeros, nothing moves
    for r in results:
        params, initial, iteration = r[f"quiet {dtype}"]
        assert iteration == STEPS and torch.equal(params, initial)


@pytest.mark.parametrize("case", ["cast wrapper", "bf16 model"])
def test_16_bit_gradients_keep_fp32_residuals(results, case):
    r0, r1 = results[0][case], results[1][case]
    assert torch.equal(r0["params"], r1["params"])
    assert torch.isfinite(torch.tensor(r0["losses"])).all()
    assert r0["residual_dtype"] == torch.float32
