"""The policy's parameters where a sharding engine splits them across ranks, as qerl reads and perturbs them.

Under FSDP2 (torch's `fully_shard`, what accelerate's FSDP plugin runs with fsdp_version 2) every parameter of the
policy is a DTensor of which each rank holds one shard; FSDP all-gathers the whole value for each forward. The
packed NVFP4 weights are buffers, which FSDP leaves whole on every rank. Outside a forward two things touch
parameters: the native rollout engine reads whole values once a round (`whole`), and AQN adds noise to the norm
scales on the shard each rank holds (`local_part`). DeepSpeed ZeRO-3 needs nothing here: qerl touches its
parameters only inside TRL's gather (`ds3_gather_for_generation`), where they are whole tensors.
"""

from __future__ import annotations

import torch
from torch import nn


def is_sharded(tensor: torch.Tensor) -> bool:
    """Whether `tensor` is a DTensor (a parameter FSDP2 shards)."""
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """The whole value of a policy tensor: a DTensor all-gathered (a collective: every rank calls it, in the same
    order), any other tensor as it is."""
    return tensor.full_tensor() if is_sharded(tensor) else tensor


def local_part(value: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """This rank's part of `value`, a tensor that every rank holds whole with the same values, split as the DTensor
    `like` is (no communication)."""
    from torch.distributed.tensor import distribute_tensor

    part = distribute_tensor(value.to(like.device), like.device_mesh, like.placements, src_data_rank=None)
    return part.to_local()


def reshard(model: nn.Module) -> None:
    """Every FSDP2 unit of `model` back to its shards. A forward without gradients leaves units built with
    reshard_after_forward=False (accelerate's tail: final norm, LM head) whole until the next backward; reading or
    perturbing their parameters then would miss or outlive the all-gathered copy that the next forward uses."""
    if not torch.distributed.is_available():
        return
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


# The packed NVFP4 base of an NVFP4Linear: frozen buffers, loaded from the base checkpoint and never trained.
FROZEN_BASE_BUFFERS = ("weight_packed", "weight_scale", "weight_global_scale")


def keep_base_out_of_checkpoints(model: nn.Module) -> int:
    """Leave the packed NVFP4 base out of `model`'s state dict (its buffers made non-persistent); returns how many
    layers. DeepSpeed's checkpoints (`exclude_frozen_parameters`) and FSDP2's (accelerate's adapter_only: frozen
    parameters ignored) drop frozen parameters but keep every persistent buffer: each checkpoint of a 7B run held the
    4.9 GB base, ZeRO-3 once per rank, and an FSDP2 resume broadcast it from rank 0. Loading such an older checkpoint
    still works: both load non-strictly, and the base's keys are then unexpected ones, skipped."""
    from qerl.nvfp4.linear import NVFP4Linear

    layers = [m for m in model.modules() if isinstance(m, NVFP4Linear)]
    for module in layers:
        module._non_persistent_buffers_set.update(FROZEN_BASE_BUFFERS)
    return len(layers)
