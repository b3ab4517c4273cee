"""One source of truth for what the launchers share with the kernels: block sizes, workspace
layouts and mode numbers are ``#define``s and enumerators of the ``.cu`` files, which the
launcher modules read at import (``_cupy.constants``). Checked here against what the C++
compiler makes of the same source (``emu`` fixture), so a parser slip or a constant copied by
hand shows up without a GPU."""
import re

import pytest

from gradcomp.kernels import (_cupy, _launch_bits, _launch_quant, _launch_rng, _launch_select, _launch_sign,
                              _launch_sparse)


@pytest.mark.parametrize("family", _cupy.families())
def test_parsed_constants_are_what_the_compiler_sees(emu, family):
    found = _cupy.constants(family)
    assert "BLOCK" in found  # common.cuh, included by every family
    for name, value in found.items():
        assert emu.constant(family, name) == value, f"{family}.cu: {name}"


def test_launcher_constants_are_the_defines(emu):
    shared = [
        (_launch_rng.BLOCK, "rng", "BLOCK"),
        (_launch_bits.BLOCK, "bits", "BLOCK"),
        (_launch_sparse.BLOCK, "sparse", "BLOCK"),
        (_launch_sign.BLOCK, "sign", "BLOCK"),
        (_launch_sign.NSUMS, "sign", "NSUMS"),
        (_launch_sign.PACK_STEP, "sign", "32 * WORDS_PER_STEP"),
        (_launch_quant.BLOCK, "quant", "BLOCK"),
        (_launch_quant.SEGMENT, "quant", "SEGMENT"),
        (_launch_select.BLOCK, "select", "BLOCK"),
        (_launch_select.WIDE_BLOCK, "select", "WIDE_BLOCK"),
        (_launch_select.WS_COUNTS, "select", "WS_COUNTS"),
        (_launch_select.CHUNK_WORDS, "select", "CHUNK_WORDS"),
        (_launch_select.SAMPLE, "select", "SAMPLE"),
        (_launch_select.STEP_WORDS, "select", "PASS_WORDS * BLOCK / 32"),
    ]
    shared += [(code, "sign", f"STATS_{stats.upper()}") for stats, code in _launch_sign.STATS_CODE.items()]
    for value, family, expr in shared:
        names = re.findall(r"[A-Z_]+", expr)
        got = eval(expr, {}, {n: emu.constant(family, n) for n in names})
        assert value == got, f"{family}.cu: {expr} is {got}, the launcher uses {value}"


@pytest.mark.parametrize("family", _cupy.families())
def test_every_kernel_is_bounded_by_a_shared_block_size(family):
    """A launch with more threads than ``__launch_bounds__`` fails, and several kernels rely on
    exactly that many: the bound is always one of the constants the launchers read."""
    bounds = re.findall(r"__launch_bounds__\s*\(([^)]*)\)", _cupy.source(family))
    assert bounds and set(bounds) <= {"BLOCK", "WIDE_BLOCK"}, bounds


def test_constants_parser(monkeypatch):
    text = "\n".join([
        "#define A 0x10u  // a comment",
        "#define B (A * 2 + 1)",
        "#define C B / 2",
        "#define F(x) (x + 1)",
        "#define GUARD_H",
        '#define S "text"',
        "#define CAST ((i64)A)",
        "enum Mode { P = 3, Q = P << 1, R };",
    ])
    monkeypatch.setattr(_cupy, "source", lambda family: text)
    _cupy.constants.cache_clear()
    try:
        assert _cupy.constants("fake") == {"A": 16, "B": 33, "C": 16, "P": 3, "Q": 6}
    finally:
        _cupy.constants.cache_clear()
