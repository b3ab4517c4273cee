"""BucketLauncher (one process): buckets start in order as their gradients arrive, no_sync,
the re-accumulation error, drain, and hooks that let a dropped owner go."""
from __future__ import annotations

import gc
import weakref

import pytest
import torch

from gradcomp.training.buckets import BucketLauncher


class _Done:
    def __init__(self, value, error=None):
        self.value, self.error = value, error

    def wait(self):
        if self.error is not None:
            raise self.error
        return self.value


class _Owner:
    def __init__(self, params, buckets, fail=()):
        self.params, self.started, self.fail = params, [], set(fail)
        self._launcher = BucketLauncher()
        self._launcher.plan(buckets, {i: f"p{i}" for i in range(len(params))})
        self._launcher.watch(params, self._grad_ready)

    def _grad_ready(self, param):
        self._launcher.ready(next(i for i, p in enumerate(self.params) if p is param), self._launch)

    def _launch(self, b):
        self.started.append(b)
        return _Done(f"bucket{b}", ValueError(f"bucket {b} failed") if b in self.fail else None)


def _params(n):
    return [torch.zeros(2, requires_grad=True) for _ in range(n)]


def _backward(params, which):
    for i in which:
        (params[i] * 1.0).sum().backward()


def test_buckets_start_in_order_once_complete():
    ps = _params(4)
    owner = _Owner(ps, [[3, 2], [1], [0]])
    _backward(ps, [1])  # bucket 1 is complete but bucket 0 is not: nothing starts
    assert owner.started == []
    _backward(ps, [3, 3])  # accumulated twice before its bucket left: counted once
    assert owner.started == []
    _backward(ps, [2])
    assert owner.started == [0, 1]
    launcher = owner._launcher
    assert launcher.in_flight and launcher.futures[2] is None
    launcher.launch_rest(owner._launch)  # parameter 0 got no gradient
    assert owner.started == [0, 1, 2]
    assert launcher.wait() == (["bucket0", "bucket1", "bucket2"], None)
    with pytest.raises(ValueError, match=r"^the gradient of 'p2' was accumulated again after its bucket was sent; "
                                         r"call step\(\) between backward passes, or run .*no_sync"):
        _backward(ps, [2])
    launcher.reset()
    assert not launcher.in_flight
    _backward(ps, [3, 2])
    assert owner.started == [0, 1, 2, 0]


def test_no_sync_wait_errors_and_drain():
    ps = _params(2)
    owner = _Owner(ps, [[1], [0]], fail={0})
    launcher = owner._launcher
    with launcher.no_sync():
        assert launcher.paused
        _backward(ps, [1, 0])
    assert not launcher.paused and owner.started == [] and not launcher.drain()
    _backward(ps, [1, 0])
    results, error = launcher.wait()
    assert results == [None, "bucket1"] and str(error) == "bucket 0 failed"  # every bucket waited for
    assert launcher.drain() and not launcher.in_flight and launcher.futures == [None, None]


def test_a_dropped_owner_is_freed_and_its_hooks_removed():
    ps = _params(2)
    owner = _Owner(ps, [[1, 0]])
    assert all(len(p._post_accumulate_grad_hooks) == 1 for p in ps)
    ref = weakref.ref(owner)
    gc.disable()  # freed by its reference count alone: the launcher holds no reference to its owner
    try:
        del owner
        assert ref() is None
    finally:
        gc.enable()
    _backward(ps, [0, 1])  # the hooks are gone (or inert)
    assert all(not p._post_accumulate_grad_hooks for p in ps)
