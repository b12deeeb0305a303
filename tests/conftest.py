import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

# Two CPU cores on the dev and CI machines: keep torch from oversubscribing them.
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture
def swap_dir(tmp_path):
    path = tmp_path / "swap"
    path.mkdir()
    return str(path)
