"""The warm-up / layer policy and the one-process paths (no process group); codec construction:
tests/compress/test_as_codec.py."""
from __future__ import annotations

import pytest
import torch

from gradcomp.compress import ErrorFeedback, get_compressor
from gradcomp.training import CompressedOptimizer, Policy, Runtime, cast_wrapper


def test_routing_rules():
    policy = Policy("topk", ratio=0.01, start_iter=2, min_numel=100)
    w, b, tiny = torch.zeros(64, 32), torch.zeros(64), torch.zeros(4, 4)
    assert policy.route("w", w, 1) is None  # warm-up
    assert policy.route("w", w, 2) is policy.default.codec
    assert policy.route("b", b, 5) is None  # 1-D
    assert policy.route("t", tiny, 5) is None  # fewer than min_numel
    assert Policy("topk", compress_1d=True, min_numel=0).route("b", b, 0) is not None
    # the rate is judged per shape: PowerSGD at rank 4 cannot shrink a 4x64 matrix twofold
    psgd = Policy("powersgd", rank=4, min_numel=0)
    assert psgd.route("head", torch.zeros(4, 64), 0) is None
    assert psgd.route("body", torch.zeros(64, 64), 0) is not None
    assert psgd.default.codec.compressor.config.min_compression_rate == 2.0  # the policy's value reaches it
    assert Policy("fp16", min_numel=0).route("w", w, 0) is not None  # exactly 2x
    assert Policy("fp16", min_numel=0, min_compression_rate=2.5).route("w", w, 0) is None
    assert Policy("none", min_numel=0).route("w", w, 0) is None  # never shrinks: sent dense


def test_layer_overrides():
    policy = Policy("topk", ratio=0.01, min_numel=0, layers={
        "embed.*": "dense", "head.*": {"ratio": 0.2, "compress_1d": True},
        "*.weight": {"compressor": "fp16"}, "head.bias": "dense"})
    w = torch.zeros(16, 16)
    assert policy.route("embed.weight", w, 0) is None
    head = policy.route("head.weight", w, 0)
    assert head.compressor.config.ratio == 0.2 and head is not policy.default.codec
    assert policy.route("head.bias", torch.zeros(16), 0) is head  # first match wins, 1-D allowed there
    assert policy.route("body.weight", w, 0).name == "fp16"
    assert policy.route("body.other", w, 0) is policy.default.codec
    assert set(policy.codecs()) == {"head.*", "*.weight", "*"}
    with pytest.raises(ValueError, match="dense"):
        Policy("topk", layers={"x": 3})
    with pytest.raises(ValueError, match="unknown keyword"):
        Policy("topk", layers={"x": {"bogus": 1}})
    with pytest.raises(ValueError, match="policy keywords"):
        Policy("topk", ratios=0.1)
    with pytest.raises(ValueError, match="instance"):
        Policy(get_compressor("topk"), layers={"x": {"ratio": 0.5}})
    copy = Policy(ErrorFeedback(get_compressor("topk")), layers={"x": {"start_iter": 3}}).rule("x").codec
    assert isinstance(copy, ErrorFeedback)  # a fresh copy: it must not share residuals


@pytest.mark.parametrize("kwargs, match", [
    ({"start_iter": -1}, "start_iter"), ({"min_numel": 1.5}, "min_numel"),
    ({"compress_1d": 1}, "compress_1d"), ({"min_compression_rate": float("inf")}, "min_compression_rate"),
    ({"layers": ["x"]}, "mapping"),
])
def test_policy_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Policy("topk", **kwargs)


def test_one_process_exchange_keeps_the_error_feedback_invariant():
    compression = Runtime(Policy("topk", ratio=0.1, min_numel=0))
    grads = [torch.randn(32, 8), torch.randn(8)]
    avg = compression.submit(["w", "b"], grads).wait()
    torch.testing.assert_close(avg[1], grads[1], rtol=0, atol=0)  # 1-D: dense, exact
    res = compression.policy.default.codec.residual("w")
    torch.testing.assert_close(avg[0] + res, grads[0])
    assert int((avg[0] != 0).sum()) == 26  # ceil(10% of 256)
    state = compression.state_dict()
    fresh = Runtime(Policy("topk", ratio=0.1, min_numel=0))
    fresh.load_state_dict(state)
    assert torch.equal(fresh.policy.default.codec.residual("w"), res)
    with pytest.raises(ValueError, match="saved with another configuration; resume with the same compressor, options and policy"):
        Runtime(Policy("topk", layers={"x": {"ratio": 0.5}})).load_state_dict(state)
    with pytest.raises(ValueError, match="version"):
        fresh.load_state_dict({"iteration": 0})


def _sgd_run(wrap: bool, steps: int = 4):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if wrap:
        opt = CompressedOptimizer(opt, "none")
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(4, 8, generator=g)).square().mean().backward()
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]), opt


def test_wrapper_without_process_group_is_the_inner_optimizer():
    plain, _ = _sgd_run(False)
    wrapped, opt = _sgd_run(True)
    assert torch.equal(plain, wrapped)
    assert "gradcomp" in opt.state_dict() and opt.state_dict()["gradcomp"]["iteration"] == 4
    assert "momentum_buffer" in next(iter(opt.state.values()))


def test_wrapper_errors():
    model = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match="torch.optim.Optimizer"):
        CompressedOptimizer(model, "topk")
    opt = CompressedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), "topk", min_numel=0)
    with pytest.raises(ValueError, match="already"):
        CompressedOptimizer(opt)
    with pytest.raises(ValueError, match="bucket_mb"):
        CompressedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), bucket_mb=0)
    model(torch.randn(2, 4)).sum().backward()
    with pytest.raises(ValueError, match="no_sync"):  # a second backward after the bucket left
        model(torch.randn(2, 4)).sum().backward()


def test_cast_wrapper_dtype():
    with pytest.raises(ValueError, match="float16"):
        cast_wrapper(lambda state, bucket: None, torch.float32)


def test_a_layers_pattern_that_matches_nothing_is_warned_about():
    """A typo in ``layers`` would send those parameters with the default rule without a word."""
    import warnings

    from gradcomp.training import CompressedOptimizer, ddp_comm_hook

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    for make in (lambda layers: CompressedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), "topk",
                                                     model=model, layers=layers),
                 lambda layers: ddp_comm_hook("topk", model=model, layers=layers)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            make({"0.*": "dense"})  # matches 0.weight and 0.bias
        assert not [w for w in caught if "matches no parameter" in str(w.message)]
        with pytest.warns(UserWarning, match=r"layers pattern 'encoder\.\*' matches no parameter"):
            make({"encoder.*": "dense"})


def test_an_unknown_compressor_name_suggests_the_closest():
    from gradcomp.compress import get_compressor

    with pytest.raises(ValueError, match=r"unknown compressor 'TopK' \(did you mean 'topk'\?\)"):
        get_compressor("TopK")
    with pytest.raises(ValueError, match=r"unknown compressor 'powersdg' \(did you mean 'powersgd'\?\)"):
        get_compressor("powersdg")


def test_a_hook_made_before_the_process_group_registers_later(monkeypatch):
    """A framework (PyTorch Lightning) builds the hook in each launched process before it
    starts the process group: creating it must not fail, and registration waits for use."""
    from gradcomp.training import ddp_comm_hook

    monkeypatch.setenv("WORLD_SIZE", "2")
    model = torch.nn.Linear(8, 4)
    state, _ = ddp_comm_hook("topk", model=model, ratio=0.5)
    assert not state.compression.started
    assert [n for n, _ in state.compression.deferred] == ["weight", "bias"]
    with pytest.raises(ValueError, match="WORLD_SIZE=2"):  # used without a process group: refused, as before
        state.compression.start()


def test_the_launching_process_defers_too(monkeypatch):
    """Lightning's launching process is rank 0 but has no ``WORLD_SIZE`` yet when the hook is
    made: it must defer like its children, or it would count one rank and skip the agreement
    check the others wait in (a hang), then average nothing."""
    from gradcomp.training import ddp_comm_hook

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    state, _ = ddp_comm_hook("topk", model=torch.nn.Linear(8, 4), ratio=0.5)
    assert not state.compression.started and state.compression._world is None
