"""The compressed-momentum optimizers take a compressor by as_codec's rules, refusing wrappers
(they add their own error feedback on both sides); every message names the optimizer."""
from __future__ import annotations

import pytest
import torch

from gradcomp.compress import EF21, ErrorFeedback, get_compressor
from gradcomp.optim import OneBitAdam, ZeroOneAdam


def _params():
    return torch.nn.Linear(4, 3).parameters()


@pytest.mark.parametrize("opt", [OneBitAdam, ZeroOneAdam])
def test_wrappers_and_mixed_arguments_are_refused(opt):
    for wrapper in (ErrorFeedback("topk"), EF21("int8")):
        with pytest.raises(ValueError, match=rf"^{opt.display_name}: got a {type(wrapper).__name__}, but the caller adds its "
                                             rf"own error feedback; pass the compressor itself"):
            opt(_params(), compressor=wrapper)
    with pytest.raises(ValueError, match=rf"^{opt.display_name}: options \['ratio'\] were given with a Compressor instance"):
        opt(_params(), compressor=get_compressor("topk"), compressor_options={"ratio": 0.1})
    with pytest.raises(ValueError, match=rf"^{opt.display_name} must be a registered name or a Compressor, got int"):
        opt(_params(), compressor=3)


def test_names_and_instances_are_taken_bare():
    topk = get_compressor("topk", ratio=0.25)
    opt = OneBitAdam(_params(), compressor=topk)
    assert all(e.compressor is topk for e in opt.exchanges.values())  # the instance itself, no feedback of its own
    named = OneBitAdam(_params(), compressor="topk", compressor_options={"ratio": 0.25})
    assert repr(next(iter(named.exchanges.values())).compressor) == repr(topk)
