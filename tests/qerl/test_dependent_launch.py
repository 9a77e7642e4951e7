"""qerl.dependent_launch: when the decode kernels launch with programmatic dependent launch (the GPU side is in
tests/qerl/rollout/native/test_engine_gpu.py: the same samples with and without it)."""

import torch

from qerl import dependent_launch


def test_pdl_only_on_cuda_and_never_when_switched_off(monkeypatch):
    assert not dependent_launch.pdl_enabled(torch.device("cpu"))
    monkeypatch.setenv("QERL_PDL", "0")
    assert not dependent_launch.pdl_enabled(torch.device("cuda", 0))  # decided before any CUDA call: safe without a GPU
