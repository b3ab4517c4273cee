"""Error-feedback wrappers used on their own: the default key is one tensor's state.

Invariant protected: ``ErrorFeedback.compress`` without ``key=`` keeps one residual; a second
tensor alive beside the first is warned about once (it would share that residual), a gradient
made anew each step is not.
"""
from __future__ import annotations

import warnings

import torch

from gradcomp.compress import EF21, ErrorFeedback, get_compressor


def test_compress_without_key_warns_once_when_two_tensors_share_a_residual():
    a, b = torch.randn(64), torch.randn(64)
    for wrapper in (ErrorFeedback, EF21):
        ef = wrapper(get_compressor("topk"))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(3):
                ef.compress(torch.randn(64))  # a new gradient each step: the old one is gone
                ef.compress(a, key="a")
                ef.compress(b, key="b")
            assert not caught, [str(w.message) for w in caught]
            for _ in range(3):
                ef.compress(a)
                ef.compress(b)
        messages = [str(w.message) for w in caught]
        assert len(messages) == 1 and "pass key= naming each tensor" in messages[0], messages
        assert caught[0].filename == __file__, "the warning should point at the caller"
