"""Shared fixtures: a fixed seed for every test (tests draw data, compressors never use it)."""
import random
import signal

import numpy as np
import pytest
import torch


def pytest_configure(config):
    # A suite started in the background by a shell without job control inherits SIGINT ignored
    # and hands that to every child; the tests that press Ctrl-C on a benchmark need it to arrive
    # (a handler, unlike an ignored signal, is not inherited: the children get the default).
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped without one)")
    config.addinivalue_line("markers", "slow: longer than a few seconds")


@pytest.fixture(autouse=True)
def _seed():
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    yield


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; none is available here")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
