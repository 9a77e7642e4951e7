import os
import sys

import pytest
import torch

# Tests import helpers from this folder (reference.py, tiny.py).
sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture
def seed():
    """A fresh random seed per test, printed so that a failure can be replayed (pytest shows it on failure)."""
    value = int.from_bytes(os.urandom(4), "little")
    print(f"torch seed {value}")
    torch.manual_seed(value)
    return value


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """(bf16_dir, nvfp4_dir): the tiny Qwen2 as a BF16 checkpoint and its NVFP4 quantization by our quantizer.
    Shared by the whole suite: tests read these folders and never write into them."""
    from qerl.tiny import save_tiny_checkpoints

    return save_tiny_checkpoints(str(tmp_path_factory.mktemp("tiny")))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
