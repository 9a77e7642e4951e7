"""NVFP4Linear: a frozen Linear whose weight lives packed (4.5 bits per weight), never as BF16 at rest."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from qerl.nvfp4 import codec, ops


class NVFP4Linear(nn.Linear):
    """y = x W^T (+ b) with W in compressed-tensors' NVFP4 layout, held as buffers.

    It subclasses nn.Linear (without a `weight` parameter) so that peft's LoRA wraps it like any Linear,
    as it does bitsandbytes' 4-bit layers. The base is frozen: gradients reach the input, never W.
    Buffer names match the checkpoint keys (`weight_packed`, `weight_scale`, `weight_global_scale`).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        device: torch.device | str | None = None,
        compute_dtype: torch.dtype = torch.bfloat16,
    ):
        nn.Module.__init__(self)
        if in_features % codec.GROUP_SIZE != 0:
            raise ValueError(
                f"NVFP4Linear: in_features={in_features} is not divisible by the group size {codec.GROUP_SIZE}"
            )
        self.in_features = in_features
        self.out_features = out_features
        self.compute_dtype = compute_dtype  # also what peft reads to pick the LoRA adapters' dtype
        self.register_parameter("weight", None)
        self.register_buffer(
            "weight_packed", torch.zeros(out_features, in_features // 2, dtype=torch.uint8, device=device)
        )
        self.register_buffer(
            "weight_scale",
            torch.zeros(out_features, in_features // codec.GROUP_SIZE, dtype=torch.float8_e4m3fn, device=device),
        )
        self.register_buffer("weight_global_scale", torch.ones(1, dtype=torch.float32, device=device))
        # Scratch of the fused kernel (ops.splitk_counters), not part of the checkpoint.
        self.register_buffer("splitk_counters", ops.splitk_counters(out_features, device), persistent=False)
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features, dtype=compute_dtype, device=device), requires_grad=False)
        else:
            self.register_parameter("bias", None)
        # The weight decoded to compute_dtype while the training passes share it (keep_dense_weight / drop_dense_weight,
        # which qerl/dense_weights.py calls around each rollout); a plain attribute, not a buffer: never saved, moved,
        # broadcast or gathered.
        self.dense_weight: torch.Tensor | None = None

    @property
    def qweight(self) -> torch.Tensor:
        """The packed weight under the name peft looks for to place adapters on the base layer's device."""
        return self.weight_packed

    @classmethod
    def from_quantized(cls, weight: codec.NVFP4Weight, bias: torch.Tensor | None = None, compute_dtype=None):
        out_features, in_features = weight.shape
        compute_dtype = compute_dtype or (bias.dtype if bias is not None else torch.bfloat16)
        layer = cls(in_features, out_features, bias is not None, weight.packed.device, compute_dtype)
        layer.weight_packed.copy_(weight.packed)
        layer.weight_scale.copy_(weight.scale)
        layer.weight_global_scale.copy_(weight.global_scale.reshape(1))
        if bias is not None:
            layer.bias.data.copy_(bias.detach())
        return layer

    @classmethod
    def from_linear(cls, linear: nn.Linear, global_scale: torch.Tensor | None = None, name: str = "weight"):
        """Quantize an nn.Linear; pass the fused group's global scale for q/k/v and gate/up members."""
        quantized = codec.quantize(linear.weight.detach(), global_scale, name=name)
        return cls.from_quantized(quantized, linear.bias, compute_dtype=linear.weight.dtype)

    def process_weights_after_loading(self) -> None:
        """A loader calls this once the checkpoint's tensors are in place (as vLLM calls its hook of this name): the
        layer builds what the checkpoint does not hold, the fused kernel's split-K scratch, next to its weight."""
        self.splitk_counters = ops.splitk_counters(self.out_features, self.weight_packed.device)

    def dequantize_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return ops.dequantize(
            self.weight_packed, self.weight_scale, self.weight_global_scale, dtype or self.compute_dtype
        )

    @torch.no_grad()
    def keep_dense_weight(self) -> None:
        """Decode the weight once and compute with that copy (F.linear) until drop_dense_weight; the packed weight
        stays what checkpoints and the rollout engines read."""
        self.dense_weight = self.dequantize_weight()

    def drop_dense_weight(self) -> None:
        """Free the dense copy: forward decodes the packed weight per call again."""
        self.dense_weight = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.compute_dtype)
        if self.dense_weight is not None:
            return F.linear(x, self.dense_weight, self.bias)
        return ops.nvfp4_linear(
            x, self.weight_packed, self.weight_scale, self.weight_global_scale, self.bias, self.splitk_counters
        )

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, nvfp4"
