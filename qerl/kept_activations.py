"""Activations kept for the backward instead of recomputed, round by round, where the memory allows (keep_activations).

Recipes checkpoint activations (gradient_checkpointing) so that several runs share a GPU: the 1.5B recipe packs six
to nine arms runs on one H200. Alone on that card, the backward recomputed every layer's forward for nothing: keeping
the activations took the real 1.5B's step from 3.56 to 2.44 s (NVFP4) and from 3.11 to 2.40 s (BF16), at a peak of 41
GiB against 7.8 (docs/benchmarks.md, "The speed lease on commit e497ac2"). So each round, once the rollout is over and
the dense training weights are made, the activations of the round's largest micro-batch (its rows times the round's
longest row, times the bytes a token's pass saves, counted once on a short forward) are kept (checkpointing off on
the decoder layers) when they take at most KEEP_SHARE of the memory available, else recomputed as the recipe asks.

The rule holds only for runs that own their GPU: each of several runs sharing one sees the others' memory as
free while they sample. Runs packed on a GPU pass keep_activations false (experiments.arms does); under several
processes the ranks could decide apart, so there the default keeps the recipe's checkpointing.
"""

from __future__ import annotations

import itertools
import logging

import torch
from torch import nn
from transformers.modeling_layers import GradientCheckpointingLayer

from qerl.device_facts import MemoryRule, available_bytes

logger = logging.getLogger(__name__)

KEEP_SHARE = 0.6  # of the memory available after the rollout and the dense copy; the rest: logits, optimizer, margin
PROBE_TOKENS = 64


def held_tensors(model: nn.Module):
    """Every tensor the model's modules hold: parameters, buffers, and tensors set as plain attributes."""
    yield from itertools.chain(model.parameters(), model.buffers())
    for module in model.modules():
        yield from (value for value in vars(module).values() if isinstance(value, torch.Tensor))


def saved_bytes_per_token(model: nn.Module, layers: list[nn.Module], device: torch.device) -> int:
    """Bytes the decoder `layers` save for the backward per token, counted on one forward of PROBE_TOKENS random
    tokens through `model` as the training passes run it (its dtype, adapter, attention kernels, the dense copies),
    with checkpointing off and any compiled layer run eagerly (what it saves is at most that). What the model holds
    anyway is not counted: its parameters, buffers and plain tensor attributes (the dense training weights, which
    F.linear saves for the input gradient: counted as 64 tokens' worth, the 1.5B's 3 GB refused every round)."""
    own = {t.untyped_storage().data_ptr() for t in held_tensors(model)}
    saved: dict[int, int] = {}  # by storage: views of one tensor count once
    inside = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if inside[0] and storage.data_ptr() not in own:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    def enter(*_):
        inside[0] += 1

    def leave(*_):
        inside[0] -= 1

    hooks = [
        h for layer in layers for h in (layer.register_forward_pre_hook(enter), layer.register_forward_hook(leave))
    ]
    flags = [layer.gradient_checkpointing for layer in layers]
    try:
        for layer in layers:
            layer.gradient_checkpointing = False
        generator = torch.Generator(device).manual_seed(0)  # the run's own random streams stay untouched
        vocab = model.config.get_text_config().vocab_size
        ids = torch.randint(0, vocab, (1, PROBE_TOKENS), device=device, generator=generator)
        with torch.enable_grad(), torch.compiler.set_stance("force_eager"):
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                model(input_ids=ids, use_cache=False, logits_to_keep=1)  # the graph goes with the output
    finally:
        for layer, flag in zip(layers, flags, strict=True):
            layer.gradient_checkpointing = flag
        for hook in hooks:
            hook.remove()
    return sum(saved.values()) // PROBE_TOKENS


class KeptActivations:
    """Turns the decoder layers' checkpointing off for a round whose activations fit. `enabled`: True always, False
    never (the recipe's gradient_checkpointing decides alone), None by memory (one process only)."""

    def __init__(self, model: nn.Module, enabled: bool | None, checkpointing: bool, processes: int):
        # The decoder layers, and the modules around them transformers flags too (the decoder model): TRL reads a model
        # with any flag on as checkpointed, and turns every layer's on again after its no-grad passes.
        self.flagged = [m for m in model.modules() if hasattr(m, "gradient_checkpointing")]
        self.enabled = enabled if checkpointing else False  # nothing is recomputed to save
        if self.enabled is None and processes > 1:
            self.enabled = False
        self.model = model
        self.per_token: int | None = None  # saved_bytes_per_token, counted at the first round that asks
        self._checkpointed: list[nn.Module] = []  # those the recipe turned on (every_n_layers may skip layers)
        self.rounds = 0  # rounds whose passes kept their activations
        self.rule = MemoryRule(
            logger, "activations of the largest micro-batch", KEEP_SHARE, "keep_activations", "kept",
            "recomputed (gradient checkpointing)",
        )  # fmt: skip

    def decide(self, micro_batch_tokens: int, device) -> bool:
        """Before a round's training passes, whose largest micro-batch runs `micro_batch_tokens` tokens (rows x
        longest row): keep its activations or recompute them. Sets the layers' flags either way, since TRL's rollout
        context turns checkpointing back on only where it found it on. Nothing before Trainer.train has turned it
        on."""
        on = [module for module in self.flagged if module.gradient_checkpointing is True]
        if on:  # as the recipe set them: TRL turns them back on after each rollout where it found one on
            self._checkpointed = on
        if self.enabled is False or not self._checkpointed:
            return False
        if self.enabled is None and self.per_token is None:
            layers = [m for m in self._checkpointed if isinstance(m, GradientCheckpointingLayer)]
            self.per_token = saved_bytes_per_token(self.model, layers, device)
        keep = self.enabled or self.rule(micro_batch_tokens * self.per_token, available_bytes(device))
        for module in self._checkpointed:
            module.gradient_checkpointing = not keep
        self.rounds += keep
        return keep
