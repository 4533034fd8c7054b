import os

import pytest
import torch

import variants

# tests are small; two threads keep them steady on a shared 2-core machine
torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    # a library this machine lacks (xformers not installed, or built for another torch) is a fact
    # about the machine: such a test is skipped with the library's reason, never passed or failed
    try:
        return (yield)
    except variants.Unavailable as exc:
        pytest.skip(f"unavailable here: {exc}")
