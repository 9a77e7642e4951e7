"""BF16 copies of a policy's frozen NVFP4 weights, decoded once per generation round for the training passes.

Every training pass needs each frozen weight in BF16: the log-prob forwards, gradient checkpointing's recomputed
forward and the backward's input gradient. Decoded per call, that is three dequantizations per linear per micro-batch
and, at small models, as many custom-op dispatches and kernel launches more on the host, where the passes are
launch-bound already (docs/benchmarks.md, "The whole step, phase by phase"). The weights do not change between rounds:
the trainer decodes them once after each rollout (`materialize`), the passes read the copies through F.linear as a
BF16 base's passes read theirs (same dequantization, same GEMM: the same numbers as the per-call path above 64 rows),
and the copies go before the next rollout (`release`), so the engine's KV cache gets its memory back and the rollout
still samples from the 4-bit weights. On the CPU, where an NVFP4 linear is this very dequantization then F.linear, the
copies stay for the rollout too (QeRLTrainer._generate_single_turn): the same numbers, no decoding at every token.

The copy costs 2 bytes per frozen weight while the passes run: 2.6 GB at Qwen2.5-1.5B, 13 GB at 7B, 62 GB at 32B.
`enabled=None` (auto) takes it when it is at most AUTO_SHARE of the memory available after the round (the device's
free memory plus what torch's allocator holds unused): on at 1.5B and 7B, off at 32B on an 80 GB card (~55 GiB
available) and on a 141 GB one (~115 GiB), so the 32B recipe keeps its 4-bit footprint (at half, it would have been a
1% margin on the larger card).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from qerl.device_facts import MemoryRule, available_bytes
from qerl.nvfp4.linear import NVFP4Linear

logger = logging.getLogger(__name__)

AUTO_SHARE = 0.4


def nvfp4_layers(model: nn.Module) -> list[NVFP4Linear]:
    return [module for module in model.modules() if isinstance(module, NVFP4Linear)]


def copy_bytes(layers: list[NVFP4Linear]) -> int:
    """Bytes of the dense copies of these layers' weights, in their compute dtype."""
    return sum(
        layer.out_features * layer.in_features * torch.empty((), dtype=layer.compute_dtype).element_size()
        for layer in layers
    )


class DenseWeights:
    """The dense copies of one model's NVFP4 layers. `enabled`: True always, False never, None by free memory."""

    def __init__(self, model: nn.Module, enabled: bool | None = None):
        self.layers = nvfp4_layers(model)
        self.enabled = enabled
        self.nbytes = copy_bytes(self.layers)
        self.active = False
        self.rounds = 0  # rounds whose passes ran on the copies
        self.rule = MemoryRule(
            logger, "dense training weights (the BF16 copy of the frozen NVFP4 weights)", AUTO_SHARE,
            "dense_training_weights", "on", "off",
        )  # fmt: skip

    def wanted(self) -> bool:
        if not self.layers or self.enabled is False:
            return False
        if self.enabled:
            return True
        return self.rule(self.nbytes, available_bytes(self.layers[0].weight_packed.device))

    @torch.no_grad()
    def materialize(self) -> None:
        """Decode every frozen weight for the passes to come (nothing when not wanted or already there)."""
        if self.active or not self.wanted():
            return
        for layer in self.layers:
            layer.keep_dense_weight()
        self.active = True
        self.rounds += 1

    def release(self) -> None:
        """Drop the copies: the layers decode per call again (what the rollout engines read is the packed weight)."""
        for layer in self.layers:
            layer.drop_dense_weight()
        self.active = False
