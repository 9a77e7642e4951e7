"""Fixtures shared across the suite. The helpers the tests import (fakes, clis, bad_input, ...) are in tests/helpers,
on sys.path through pyproject.toml's [tool.pytest.ini_options] pythonpath."""

import pytest
import torch
from seeds import seed_torch


@pytest.fixture
def seed():
    """A fresh random seed per test (seeds.seed_torch: printed, replayed by QERL_TEST_SEED)."""
    return seed_torch()


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """(bf16_dir, nvfp4_dir): the tiny Qwen2 as a BF16 checkpoint and its NVFP4 quantization by our quantizer.
    Shared by the whole suite: tests read these folders and never write into them."""
    from qerl.tiny import save_tiny_checkpoints

    return save_tiny_checkpoints(str(tmp_path_factory.mktemp("tiny")))


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A folder as a user has it (bad_input.build_world): a BF16 model, its NVFP4 twin, an unrelated file, data files
    good and bad. What the bad-input tests of each program run in."""
    from bad_input import build_world

    return build_world(tmp_path_factory.mktemp("world"))


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """A tiny Q4_1 GGUF as llama.cpp's converter writes SmolLM2's (gguf_files.write_tiny_gguf)."""
    from gguf_files import write_tiny_gguf

    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.Q4_1.gguf")


@pytest.fixture(scope="module")
def converted(tiny_gguf, tmp_path_factory):
    """tiny_gguf converted by qerl.models to a BF16 checkpoint folder, its special tokens fixed."""
    from qerl.models.gguf import convert_gguf

    out = tmp_path_factory.mktemp("converted") / "bf16"
    convert_gguf(tiny_gguf, out, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    return out


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
