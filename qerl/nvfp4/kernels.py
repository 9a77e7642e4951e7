"""NVFP4 x BF16 compute: y = x @ W^T and its input gradient, with W stored packed.

This is the reference torch path (dequantize, then matmul); the Triton kernels plug in behind the same
functions, so NVFP4Linear does not change when they do.
"""

from __future__ import annotations

import torch

from qerl.nvfp4 import codec


def dequantize(packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor, dtype=torch.bfloat16):
    return codec.dequantize(packed, scale, global_scale, dtype)


class _NVFP4Matmul(torch.autograd.Function):
    """x @ W^T with a frozen packed W: gradients flow to x only."""

    @staticmethod
    def forward(ctx, x, packed, scale, global_scale):
        ctx.save_for_backward(packed, scale, global_scale)
        return x @ dequantize(packed, scale, global_scale, x.dtype).t()

    @staticmethod
    def backward(ctx, grad_out):
        packed, scale, global_scale = ctx.saved_tensors
        grad_x = grad_out @ dequantize(packed, scale, global_scale, grad_out.dtype)
        return grad_x, None, None, None


def nvfp4_linear(x, packed, scale, global_scale, bias=None):
    y = _NVFP4Matmul.apply(x, packed, scale, global_scale)
    return y if bias is None else y + bias
