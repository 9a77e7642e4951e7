import os
import sys

import pytest
import torch

# Tests import helpers from this folder (reference.py, tiny.py).
sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture
def seed():
    torch.manual_seed(int.from_bytes(os.urandom(4), "little"))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
