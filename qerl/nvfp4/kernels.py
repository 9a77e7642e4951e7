"""NVFP4 x BF16 compute: y = x @ W^T and its input gradient, with W stored packed.

Public functions (NVFP4Linear and the rest of the package call these two):
  dequantize(packed, scale, global_scale, dtype)   -> W [N, K], bit-exact with codec.dequantize
  nvfp4_linear(x, packed, scale, global_scale, bias) -> x @ W^T + bias, differentiable w.r.t. x (and bias)

Both are torch custom ops (`qerl::nvfp4_dequantize`, `qerl::nvfp4_linear`) with fake kernels and, for the
linear, a registered autograd formula, so torch.compile traces them without graph breaks and CUDA graphs
capture them. Dispatch, inside the ops:
  * CUDA tensors (or CPU tensors under TRITON_INTERPRET=1): Triton kernels (triton_kernels.py);
    rows <= FUSED_MAX_M: the fused W4A16 GEMM (reads the packed weight once);
    more rows: the dequant kernel, then cuBLAS (compute bound there; the dequant is ~10% at M=2048).
    The input gradient grad_out @ W always takes dequant + cuBLAS.
  * anything else (CPU without the interpreter, float64, no Triton): the torch reference path.
"""

from __future__ import annotations

import os

import torch

from qerl.nvfp4 import codec

try:  # Triton is Linux-only; the torch path keeps everything working without it.
    from qerl.nvfp4 import triton_kernels as _tk
except ImportError:  # pragma: no cover - depends on the platform
    _tk = None

# Above this many rows the fused kernel stops winning over dequant + cuBLAS (see docs/kernel_notes.md).
FUSED_MAX_M = int(os.environ.get("QERL_NVFP4_FUSED_MAX_M", "64"))


def _triton_ok(t: torch.Tensor) -> bool:
    return _tk is not None and (t.is_cuda or (_tk.INTERPRET and t.device.type == "cpu"))


# ------------------------------------------------------------------------------------------- reference


def dequantize_reference(packed, scale, global_scale, dtype=torch.bfloat16):
    return codec.dequantize(packed, scale, global_scale, dtype)


def linear_reference(x, packed, scale, global_scale, bias=None):
    w = codec.dequantize(packed, scale, global_scale, x.dtype)
    return torch.nn.functional.linear(x, w, bias)


# ------------------------------------------------------------------------------------------- custom ops


@torch.library.custom_op("qerl::nvfp4_dequantize", mutates_args=())
def _dequantize_op(
    packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    if _triton_ok(packed) and dtype in _tk.DEQUANT_DTYPES:
        return _tk.dequantize(packed, scale, global_scale, dtype)
    return codec.dequantize(packed, scale, global_scale, dtype)


@_dequantize_op.register_fake
def _(packed, scale, global_scale, dtype):
    return packed.new_empty((packed.shape[0], packed.shape[1] * 2), dtype=dtype)


def _linear_2d(x2, packed, scale, global_scale, bias):
    if _triton_ok(x2) and x2.dtype in _tk.GEMM_DTYPES and x2.shape[0] <= FUSED_MAX_M:
        return _tk.gemm(x2, packed, scale, global_scale, bias)
    w = _dequantize_op(packed, scale, global_scale, x2.dtype)
    return torch.nn.functional.linear(x2, w, bias)


@torch.library.custom_op("qerl::nvfp4_linear", mutates_args=())
def _linear_op(
    x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    n = packed.shape[0]
    y = _linear_2d(x.reshape(-1, x.shape[-1]), packed, scale, global_scale, bias)
    return y.reshape(*x.shape[:-1], n)


@_linear_op.register_fake
def _(x, packed, scale, global_scale, bias):
    return x.new_empty((*x.shape[:-1], packed.shape[0]))


def _linear_setup_context(ctx, inputs, output):
    x, packed, scale, global_scale, bias = inputs
    ctx.save_for_backward(packed, scale, global_scale)
    ctx.x_shape = x.shape
    ctx.bias_grad = bias is not None and ctx.needs_input_grad[4]


def _linear_backward(ctx, grad_out):
    packed, scale, global_scale = ctx.saved_tensors
    grad_x = grad_bias = None
    if ctx.needs_input_grad[0]:
        w = _dequantize_op(packed, scale, global_scale, grad_out.dtype)
        grad_x = (grad_out.reshape(-1, w.shape[0]) @ w).reshape(ctx.x_shape)
    if ctx.bias_grad:
        grad_bias = grad_out.reshape(-1, grad_out.shape[-1]).sum(0)
    return grad_x, None, None, None, grad_bias


_linear_op.register_autograd(_linear_backward, setup_context=_linear_setup_context)


# ------------------------------------------------------------------------------------------- public API


def dequantize(packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor, dtype=torch.bfloat16):
    """W [N, K] = dtype(value(code) * (fp32(scale) / global_scale)), bit-exact with codec.dequantize."""
    return _dequantize_op(packed, scale, global_scale, dtype)


def nvfp4_linear(x, packed, scale, global_scale, bias=None):
    """x @ W^T (+ bias), W packed NVFP4 [N, K/2]; gradients reach x (and bias if it requires them)."""
    if bias is not None and bias.dtype != x.dtype:
        bias = bias.to(x.dtype)
    return _linear_op(x, packed, scale, global_scale, bias)
