import os

import pytest
import torch

# tests are small; two threads keep them steady on a shared 2-core machine
torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
