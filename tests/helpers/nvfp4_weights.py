"""NVFP4 weights for the kernel tests (tests/qerl/nvfp4/test_ops.py, test_triton_kernels.py) and what they are held
to: the codec's dequantized weight in float64."""

from __future__ import annotations

import torch

from qerl.nvfp4 import codec, ops


def _weight(n, k, device="cpu", zero_group=True):
    w = torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.05
    if zero_group:
        w[min(3, n - 1), :16] = 0  # an all-zero group takes the fp8-epsilon scale
    return codec.quantize(w)


def _bits(t):
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _rel_err(out, ref):
    return ((out.double() - ref).norm() / ref.norm()).item()


def _reference(x, q, bias=None):
    """float64 y = x @ W^T (+ b) with W the codec's dequantized weight in x's dtype."""
    w64 = codec.dequantize(q.packed, q.scale, q.global_scale, x.dtype).double()
    y = x.double() @ w64.t()
    return y if bias is None else y + bias.double()


def _check_linear_and_input_grad(q, x):
    """nvfp4_linear's output and input gradient against float64 references (x requires grad)."""
    y = ops.nvfp4_linear(x, q.packed, q.scale, q.global_scale)
    assert _rel_err(y, _reference(x.detach(), q)) < 1e-2
    g = torch.randn_like(y)
    y.backward(g)
    w64 = codec.dequantize(q.packed, q.scale, q.global_scale).double()
    assert _rel_err(x.grad, g.double() @ w64) < 1e-2
