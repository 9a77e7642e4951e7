"""qerl.pdl: when the decode kernels launch with programmatic dependent launch (the GPU side is in
test_native_gpu.py: the same samples with and without it)."""

import torch

from qerl import pdl


def test_pdl_only_on_cuda_and_never_when_switched_off(monkeypatch):
    assert not pdl.pdl_enabled(torch.device("cpu"))
    monkeypatch.setenv("QERL_PDL", "0")
    assert not pdl.pdl_enabled(torch.device("cuda", 0))  # decided before any CUDA call: safe without a GPU
