"""as_codec: every rule of what a compressor argument becomes, every error; ``.base`` everywhere."""
from __future__ import annotations

import pytest

from gradcomp.compress import (EF21, Compressor, DGCMomentum, ErrorFeedback, as_codec, available_compressors,
                               get_compressor)


@pytest.mark.parametrize("name, wrapped", [
    ("topk", True), ("threshold", True), ("powersgd", True), ("efsignsgd", True), ("int8", True),
    ("randomk", False), ("qsgd", False), ("fp16", False), ("bf16", False), ("none", False),
    ("signsgd", False), ("signum", False),
])
def test_auto_error_feedback(name, wrapped):
    codec = as_codec(name)
    assert isinstance(codec, ErrorFeedback) == wrapped
    assert isinstance(codec, Compressor) != wrapped
    assert codec.base.name == name


def test_explicit_error_feedback_kinds():
    ef = as_codec("randomk", {"ratio": 0.1}, error_feedback="ef")
    assert isinstance(ef, ErrorFeedback) and ef.base.config.ratio == 0.1
    assert isinstance(as_codec("int8", error_feedback="ef21"), EF21)
    assert isinstance(as_codec("topk", error_feedback=True), ErrorFeedback)
    dgc = as_codec("dgc", error_feedback="dgc", ef_options={"momentum": 0.5, "masking": False})
    assert isinstance(dgc, DGCMomentum) and dgc.momentum == 0.5 and dgc.masking is False
    for off in (False, None, "none"):
        assert type(as_codec("topk", error_feedback=off)).__name__ == "TopK"
    assert as_codec("powersgd", error_feedback="ef").base.multi_round  # residual feedback takes multi-round


def test_instances_are_used_as_they_are():
    topk = get_compressor("topk", ratio=0.2)
    assert as_codec(topk, error_feedback="none") is topk
    assert as_codec(topk, {}).base is topk  # empty options are no options
    assert as_codec(topk, wrappers="refuse", error_feedback="none") is topk
    for wrapper in (ErrorFeedback(topk), EF21(topk), DGCMomentum(topk, momentum=0.3)):
        for ef in ("auto", "none", False, None, wrapper.kind):
            assert as_codec(wrapper, error_feedback=ef) is wrapper
    assert as_codec("none").base.name == "none"  # the identity compressor
    assert as_codec("topk").base is not as_codec("topk").base  # a fresh compressor per call with a name


def test_base_is_the_compressor_that_decodes():
    for name in available_compressors():
        c = get_compressor(name)
        assert c.base is c
    c = get_compressor("topk")
    for wrapper in (ErrorFeedback(c), EF21(c), DGCMomentum(c)):
        assert wrapper.base is c and wrapper.base is wrapper.compressor


@pytest.mark.parametrize("args, kwargs, match", [
    (("powersgd",), {"error_feedback": "ef21"}, r"^compressor: error_feedback='ef21' needs a single-round"),
    (("powersgd",), {"error_feedback": "dgc"}, r"^compressor: .*multi-round, use error_feedback='ef' or 'none'"),
    (("topk",), {"error_feedback": "sometimes"}, r"^compressor: error_feedback='sometimes' is not allowed; use 'auto'"),
    (("topk",), {"error_feedback": ["ef"]}, r"^compressor: error_feedback=\['ef'\] is not allowed"),
    (("topk",), {"error_feedback": "ef", "ef_options": {"momentum": 0.5}}, r"^compressor: .*error_feedback='dgc'"),
    (("topk",), {"error_feedback": "none", "ef_options": {"momentum": 0.5}}, r"^compressor: .*error feedback is off"),
    (("topk",), {"ef_options": {"momentum": 0.5}}, r"^compressor: .*error_feedback='dgc', not 'ef'"),
    (("topk",), {"error_feedback": "dgc", "ef_options": {"moment": 0.5}}, r"^compressor: unknown ef_options \['moment'\]"),
    (("topk",), {"error_feedback": "dgc", "ef_options": {"momentum": 1.5}}, r"^compressor: DGCMomentum: momentum=1.5"),
    ((get_compressor("topk"), {"ratio": 0.1}), {}, r"^compressor: options \['ratio'\] .*pass the compressor by name"),
    (("topk", {"bogus": 1}), {}, r"^compressor: topk: unknown option\(s\) bogus; allowed: "),
    (("topk", {"ratio": 7}), {}, r"^compressor: topk: option ratio=7.0 is not allowed"),
    (("nosuch",), {}, r"^compressor: unknown compressor 'nosuch'.*available: "),
    (("TopK",), {}, r"did you mean 'topk'"),
    ((3,), {}, r"^compressor must be a registered name, a Compressor or an error-feedback wrapper .*got int"),
    ((None,), {}, r"^compressor must be .*got NoneType"),
    ((3,), {"wrappers": "refuse"}, r"^compressor must be a registered name or a Compressor, got int"),
    (("topk",), {"wrappers": "sometimes"}, r"^compressor: wrappers='sometimes' is not allowed; use 'keep' or 'refuse'"),
])
def test_errors(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        as_codec(*args, **kwargs)


def test_errors_name_the_callers_argument():
    with pytest.raises(ValueError, match=r"^grad_codec: unknown compressor 'nosuch'"):
        as_codec("nosuch", what="grad_codec")
    with pytest.raises(ValueError, match=r"^weight_compressor must be a registered name"):
        as_codec(2.0, what="weight_compressor")


@pytest.mark.parametrize("kwargs", [
    {"options": {"ratio": 0.1}}, {"error_feedback": "ef21"}, {"error_feedback": "dgc"},
    {"ef_options": {"momentum": 0.5}},
])
def test_a_wrapper_takes_no_other_configuration(kwargs):
    wrapper = ErrorFeedback(get_compressor("topk"))
    options = kwargs.pop("options", None)
    with pytest.raises(ValueError, match=r"^compressor: .*already wrapped in error feedback \(ef\); pass no "
                                         r"compressor options.*or pass the bare compressor"):
        as_codec(wrapper, options, **kwargs)


class _Duck:  # the feedback protocol's shape without being one of compress's wrappers
    def accumulate(self, tensor, key):
        return tensor


@pytest.mark.parametrize("wrapper", [ErrorFeedback("topk"), EF21("topk"), DGCMomentum("topk"), _Duck()])
def test_refuse_wrappers(wrapper):
    with pytest.raises(ValueError, match=rf"^OneBitAdam: got a {type(wrapper).__name__}, but the caller adds its "
                                         rf"own error feedback; pass the compressor itself"):
        as_codec(wrapper, error_feedback="none", wrappers="refuse", what="OneBitAdam")


def test_keep_does_not_take_a_duck_typed_wrapper():
    with pytest.raises(ValueError, match=r"^compressor must be .*got _Duck"):
        as_codec(_Duck())


def test_auto_is_refused_with_where_it_is_offered():
    import pytest

    from gradcomp.compress import as_codec

    with pytest.raises(ValueError, match="unknown compressor 'auto'.*ddp_comm_hook or CompressedOptimizer"):
        as_codec("auto")
