"""The compressor contract (``gradcomp.compress.base``) holds for every registered compressor and
is enforced at registration: capabilities are declared in one place, options are typed config
fields that cannot collide with capabilities or methods, ``_compress`` has one signature, and
the optional fast paths are detected from what a class overrides."""
from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

from gradcomp.compress import (Capabilities, Compressor, CompressorConfig, Encoded, ErrorFeedback,
                               available_compressors, compressor_class, get_compressor, option, register)
from gradcomp.compress.base import CAPABILITIES
from gradcomp.compress.none import NoCompression
from gradcomp.compress.topk import TopK

NAMES = available_compressors()
ONE_SIGNATURE = ("self", "flat", "shape", "key", "step", "want_decoded")


def _own(cls: type) -> list:
    """The classes of ``cls``'s MRO below ``Compressor``: where a compressor declares things."""
    return list(cls.__mro__[:cls.__mro__.index(Compressor)])


@pytest.mark.parametrize("name", NAMES)
def test_capabilities_are_declared_in_one_place(name):
    cls = compressor_class(name)
    own = _own(cls)
    assert any("capabilities" in vars(k) for k in own), f"{name} declares no capabilities"
    assert not [(k.__name__, cap) for k in own for cap in CAPABILITIES if cap in vars(k)], \
        f"{name} sets a capability outside capabilities"
    c = get_compressor(name)
    assert isinstance(c.capabilities, Capabilities)
    assert [getattr(c, cap) for cap in CAPABILITIES] == list(dataclasses.astuple(c.capabilities))
    ef = ErrorFeedback(c)
    assert ef.capabilities == dataclasses.replace(c.capabilities, unbiased=False)
    with pytest.raises(AttributeError):
        c.native = True  # a read-only view of capabilities: nothing outside sets it


@pytest.mark.parametrize("name", NAMES)
def test_options_are_typed_config_fields_that_collide_with_nothing(name):
    cls = compressor_class(name)
    c = get_compressor(name)
    assert isinstance(c.config, cls.Config) and isinstance(c.config, CompressorConfig)
    assert list(c.options) == [f.name for f in dataclasses.fields(c.config)]
    for oname, opt in c.options.items():
        assert not hasattr(c, oname) or (oname in CAPABILITIES and opt.capability), \
            f"{name}: option {oname} is also an attribute of the compressor"
        assert oname in CAPABILITIES or not opt.capability
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(c.config, oname, opt.default)
    assert c.state_dict()["config"] == c.config.as_dict()


def test_an_option_that_is_a_capability_is_reported_as_it():
    # int8's stochastic is declared option(..., capability=True): capabilities follow it
    assert get_compressor("int8").options["stochastic"].capability
    for value in (False, True):
        caps = get_compressor("int8", stochastic=value).capabilities
        assert caps.stochastic is value and caps.unbiased is value


@pytest.mark.parametrize("name", NAMES)
def test_compress_has_the_one_signature_and_returns_encoded(name):
    cls = compressor_class(name)
    assert tuple(inspect.signature(cls._compress).parameters) == ONE_SIGNATURE
    c = get_compressor(name)
    t = torch.randn(8, 16)
    out = c._compress(t.reshape(-1), tuple(t.shape), "k", 0, True)
    assert isinstance(out, Encoded) and isinstance(out.tensors, list) and isinstance(out.meta, dict)
    assert out.decoded is None or out.decoded.numel() == t.numel()


@pytest.mark.parametrize("name", NAMES)
def test_fast_paths_are_detected_from_overrides(name):
    cls = compressor_class(name)
    overrides = cls._compress_residual is not Compressor._compress_residual
    assert get_compressor(name).compresses_in_place is overrides
    if "_decode_runs_into" in inspect.getsource(cls):
        assert cls._decode is not Compressor._decode, f"{name} decodes in runs without a _decode"


def test_in_place_support_is_detected_from_the_override():
    class Plain(NoCompression):
        name = "plain"

    class InPlace(NoCompression):
        name = "in-place"

        def _compress_residual(self, flat, key, step):
            sent = flat.clone()
            flat.zero_()
            return Encoded([sent], {})

    assert not Plain().compresses_in_place and InPlace().compresses_in_place
    g = torch.randn(10)
    assert not ErrorFeedback(Plain()).keeps_residual_in_place(g)
    assert ErrorFeedback(InPlace()).keeps_residual_in_place(g)
    assert not ErrorFeedback(InPlace()).keeps_residual_in_place(g.half())  # a cast in between
    acc = g.clone()
    InPlace().compress_residual(acc)
    assert torch.equal(acc, torch.zeros(10))
    with pytest.raises(NotImplementedError, match="_decode"):
        Plain()._decode_runs_into(Plain().compress(g), torch.zeros(10), 1, 1.0, True)


def _sketch(**body):
    """A compressor class like ``none`` with the class body ``body`` (unregistered)."""
    return type("Sketch", (NoCompression,), body)


def _config(**fields):
    return dataclasses.make_dataclass("Config", [(n, kind, spec) for n, (kind, spec) in fields.items()],
                                      bases=(CompressorConfig,), frozen=True)


@pytest.mark.parametrize("field,message", [
    ("native", "named like the capability 'native'"),
    ("stochastic", "named like the capability 'stochastic'"),
    ("compress", "named like an attribute or method"),
    ("name", "named like an attribute or method"),
])
def test_registration_refuses_an_option_named_like_a_capability_or_method(field, message):
    cls = _sketch(Config=_config(**{field: (bool, option(False, "a colliding option"))}))
    with pytest.raises(TypeError, match=message):
        register(f"sketch-{field}")(cls)
    assert f"sketch-{field}" not in available_compressors()


def test_registration_refuses_a_capability_option_the_class_does_not_report():
    cls = _sketch(Config=_config(stochastic=(bool, option(False, "draw", capability=True))))
    with pytest.raises(TypeError, match="capabilities property"):
        register("sketch-unreported")(cls)
    cls = _sketch(Config=_config(speed=(bool, option(False, "fast", capability=True))))
    with pytest.raises(TypeError, match="no capability 'speed'"):
        register("sketch-no-such-capability")(cls)


def test_registration_refuses_flags_outside_capabilities_and_other_signatures():
    with pytest.raises(TypeError, match="declare it once"):
        register("sketch-flag")(_sketch(native=False))

    def old_compress(self, flat, key, step):
        return Encoded([flat.clone()], {})

    with pytest.raises(TypeError, match="_compress.* must have the signature"):
        register("sketch-arity")(_sketch(_compress=old_compress))

    class Loose(CompressorConfig):  # not a frozen dataclass
        pass

    with pytest.raises(TypeError, match="frozen"):
        register("sketch-loose")(_sketch(Config=Loose))


def test_an_options_table_is_refused():
    with pytest.raises(TypeError, match="Config dataclass"):
        _sketch(options={"ratio": 0.1})


def test_registration_needs_declared_capabilities():
    class Bare(Compressor):
        def _compress(self, flat, shape, key, step, want_decoded):
            return Encoded([flat.clone()], {})

        def _decompress(self, payload):
            return payload.tensors[0]

        def _wire_bytes(self, numel):
            return 4.0 * numel

        @classmethod
        def _check_tensors(cls, payload):
            pass

    with pytest.raises(TypeError, match="declare its capabilities"):
        register("sketch-bare")(Bare)


def test_a_subclass_config_extends_its_parents():
    # dgc is topk with more options: its Config is a TopK.Config, so TopK's code reads it
    c = get_compressor("dgc")
    assert isinstance(c, TopK) and isinstance(c.config, TopK.Config)
    assert (c.config.ratio, list(c.options)) == (0.001, ["ratio", "sample_ratio", "seed"])
