"""NVFP4 x BF16 compute: y = x @ W^T and its input gradient, with W stored packed, as torch custom ops that choose
the kernel (the kernels themselves: triton_kernels.py, cuda_gemm.py).

Public functions (NVFP4Linear, the native engine and the rest of the package call these four):
  dequantize(packed, scale, global_scale, dtype)   -> W [N, K], bit-exact with codec.dequantize
  nvfp4_linear(x, packed, scale, global_scale, bias, splitk_counters)
                                                      -> x @ W^T + bias, differentiable w.r.t. x (and bias)
  nvfp4_linear_lora(x, packed, scale, global_scale, bias, splitk_counters, lora_a, lora_b)
                                                      -> the same plus a LoRA adapter's term, without autograd
  splitk_counters(out_features, device, lora_rank)   -> the scratch a weight's calls share

The first two are torch custom ops (`qerl::nvfp4_dequantize`, `qerl::nvfp4_linear`) with fake kernels and, for the
linear, a registered autograd formula, so torch.compile traces them without graph breaks and CUDA graphs
capture them. In eager mode without autograd (rollouts) nvfp4_linear calls the same implementation directly,
skipping the op's dispatch (host time). Dispatch, inside the ops:
  * BF16 CUDA x of 1-16 rows, K a multiple of 128 (decode): the CUDA decode GEMM (cuda_gemm.py, decode_gemm.cu);
    33-64 rows on an H100/H200 (with a LoRA only where it pays: cuda_gemm.supported): the CUDA wgmma GEMM.
  * CUDA tensors (or CPU tensors under TRITON_INTERPRET=1): Triton kernels (triton_kernels.py);
    rows <= FUSED_MAX_M: the fused W4A16 GEMM (reads the packed weight once);
    more rows: the dequant kernel, then cuBLAS (compute bound there; the dequant is ~10% at M=2048).
    The input gradient grad_out @ W always takes dequant + cuBLAS.
  * anything else (CPU without the interpreter, float64, no Triton): the torch reference path.
"""

from __future__ import annotations

import os

import torch

from qerl.device_facts import triton_runs_on
from qerl.nvfp4 import codec, cuda_gemm

try:  # Triton is Linux-only; the torch path keeps everything working without it.
    from qerl.nvfp4 import triton_kernels as _tk
except ImportError:  # pragma: no cover - depends on the platform
    _tk = None

# Above this many rows the fused kernel stops winning over dequant + cuBLAS (see docs/kernel_notes.md).
FUSED_MAX_M = int(os.environ.get("QERL_NVFP4_FUSED_MAX_M", "64"))


def _triton_ok(t: torch.Tensor) -> bool:
    return _tk is not None and triton_runs_on(t)


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


def _linear_2d(x2, packed, scale, global_scale, bias, splitk_counters=None, lora=None):
    """The dispatch ladder (the module's docstring) for a 2-D x, with a LoRA (A, B) or none: the fused kernels
    compute the adapter in the same launch, dequant + cuBLAS adds it after."""
    rank = 0 if lora is None else lora[0].shape[0]
    if cuda_gemm.supported(x2, x2.shape[1], rank, packed.shape[0]):
        return cuda_gemm.gemm(x2, packed, scale, global_scale, bias, counters=splitk_counters, lora=lora)
    if _triton_ok(x2) and x2.dtype in _tk.GEMM_DTYPES and x2.shape[0] <= FUSED_MAX_M:
        return _tk.gemm(x2, packed, scale, global_scale, bias, counters=splitk_counters, lora=lora)
    y = torch.nn.functional.linear(x2, _dequantize_op(packed, scale, global_scale, x2.dtype), bias)
    return y if lora is None else y.addmm_(x2 @ lora[0].t(), lora[1].t())


def _linear_impl(x, packed, scale, global_scale, bias, splitk_counters):
    y = _linear_2d(x.reshape(-1, x.shape[-1]), packed, scale, global_scale, bias, splitk_counters)
    return y.reshape(*x.shape[:-1], packed.shape[0])


# splitk_counters is scratch the fused kernel writes and leaves zeroed again, so it is not declared as mutated:
# as far as any caller can see, the op does not change it.
@torch.library.custom_op("qerl::nvfp4_linear", mutates_args=())
def _linear_op(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    global_scale: torch.Tensor,
    bias: torch.Tensor | None,
    splitk_counters: torch.Tensor | None,
) -> torch.Tensor:
    return _linear_impl(x, packed, scale, global_scale, bias, splitk_counters)


@_linear_op.register_fake
def _(x, packed, scale, global_scale, bias, splitk_counters):
    return x.new_empty((*x.shape[:-1], packed.shape[0]))


def _linear_setup_context(ctx, inputs, output):
    x, packed, scale, global_scale, bias, _ = inputs
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
    return grad_x, None, None, None, grad_bias, None


_linear_op.register_autograd(_linear_backward, setup_context=_linear_setup_context)


# ------------------------------------------------------------------------------------------- public API


def dequantize(packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor, dtype=torch.bfloat16):
    """W [N, K] = dtype(value(code) * (fp32(scale) / global_scale)), bit-exact with codec.dequantize."""
    return _dequantize_op(packed, scale, global_scale, dtype)


def splitk_counters(out_features: int, device=None, lora_rank: int = 0) -> torch.Tensor:
    """Scratch to keep beside a weight of `out_features` rows and pass to every `nvfp4_linear` (or `_lora`) call on
    it: the fused kernels' arrival counters (two for a LoRA computed in the same launch, then split-K's, one per N
    tile), then, for a LoRA of up to `lora_rank` (as padded for the GEMM), the CUDA kernel's slots for s = x @ A^T.
    Every call leaves it as it found it. Allocate it before any CUDA-graph capture: it saves a memset launch per
    call."""
    return cuda_gemm.new_counters(out_features, lora_rank, device)


def nvfp4_linear(x, packed, scale, global_scale, bias=None, splitk_counters=None):
    """x @ W^T (+ bias), W packed NVFP4 [N, K/2]; gradients reach x (and bias if it requires them).

    splitk_counters: optional, from `splitk_counters(N, device)`, reused across calls on this weight (never by
    two calls at once)."""
    if bias is not None and bias.dtype != x.dtype:
        bias = bias.to(x.dtype)
    if _needs_op(x, bias):
        return _linear_op(x, packed, scale, global_scale, bias, splitk_counters)
    # Eager without autograd (rollouts): the op's dispatch costs ~30 us of host time per call (H200 machine),
    # more than the 7B kernels themselves, so the implementation is called directly.
    return _linear_impl(x, packed, scale, global_scale, bias, splitk_counters)


@torch.no_grad()
def nvfp4_linear_lora(x, packed, scale, global_scale, bias, splitk_counters, lora_a, lora_b):
    """x @ W^T (+ bias) + (x @ lora_a^T) @ lora_b^T for a 2-D x, without autograd (rollouts): a LoRA adapter (A [R, K],
    B [N, R], x's dtype, R a power of two >= 16) on the frozen NVFP4 weight. Few rows take the fused kernel, which
    computes the adapter in the same launch; other rows add it after the GEMM."""
    if bias is not None and bias.dtype != x.dtype:
        bias = bias.to(x.dtype)
    return _linear_2d(x, packed, scale, global_scale, bias, splitk_counters, lora=(lora_a, lora_b))


def _needs_op(x, bias) -> bool:
    """The custom op is needed under torch.compile (tracing), on meta tensors and when gradients must flow."""
    if torch.compiler.is_compiling() or x.is_meta:
        return True
    return torch.is_grad_enabled() and (x.requires_grad or (bias is not None and bias.requires_grad))
