"""The native engine behind a rollout server (`python -m qerl.rollout_server --engine native`): qerl/rollout/server.py's
ServerEngine, as VLLMEngine is, sampling each round as the colocated native backend does.

The server loads the trainer's base as the trainer loads it (NVFP4Linear layers), its norm scales in FP32 (as the vLLM
engine's FP32 norms: AQN's small noise would round away in BF16). The first adapter the trainer sends wraps it in a
peft LoRA of the adapter's own settings; every adapter after is copied into that LoRA, the trained norms into the
norms. A round runs `NativeRollout` on that policy: the same BF16 LoRA buffers (the LoRA arrives in BF16, the values
the colocated engine rounds its FP32 masters to) and the same FP32 norm scales, refreshed from the policy, on which
the server has drawn the round's noise. On an H200 the engine decodes the 1.5B with LoRA r16 at batch 64 in 3.38 ms
a step, vLLM in 5.39 (docs/multi_gpu.md).
"""

from __future__ import annotations

import contextlib
import json
from typing import Any

import torch
from peft import PeftConfig, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
from transformers import GenerationConfig

from qerl import base_model
from qerl.errors import UsageError
from qerl.norms import find_norms
from qerl.nvfp4.linear import NVFP4Linear
from qerl.rollout.base import NativeSettings, RolloutSetup, copy_norms, no_noise
from qerl.rollout.native import NativeRollout

# The sampling settings a round carries (vLLM's SamplingParams, qerl.rollout.vllm.sampling_kwargs) that the engine
# is built with; max_tokens is read every round (n, logprobs and detokenize are vLLM's alone).
ENGINE_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "stop_token_ids")
ACTIVATIONS = torch.bfloat16  # the base's compute dtype, and the LoRA buffers' the engine samples with


class NativeServerEngine:
    """A rollout server's ServerEngine on the native engine: `model` (the base, LoRA injected by the first adapter)
    holds the norms the server perturbs; `load_lora`, `load_norms` and `generate` as VLLMEngine's."""

    def __init__(self, model_path: str, device: torch.device, seed: int, kv_cache_gib: float | None = None):
        torch.manual_seed(seed)  # the sampler draws from the default generators (CPU and every GPU)
        self.model = base_model.load_base_model(model_path, dtype=ACTIVATIONS, device=device)
        self.model.eval().requires_grad_(False)
        with torch.no_grad():
            for norm in find_norms(self.model).select(include_final=True, include_heads=True).values():
                norm.weight.data = norm.weight.data.float()
        self.params = dict(self.model.named_parameters())  # the norms under transformers' names, which are vLLM's
        self.model_path, self.device = model_path, torch.device(device)
        # the trainer's defaults: live rows compacted on an NVFP4 base (where the GEMMs' rows are what costs), the KV
        # cache sized each round from free memory (or `kv_cache_gib`) and kept between rounds where it fits
        nvfp4 = any(isinstance(module, NVFP4Linear) for module in self.model.modules())
        self.native = NativeSettings(kv_cache_gib=kv_cache_gib, compact_rows=nvfp4)
        generation = self.model.generation_config
        self.pad_token_id = generation.pad_token_id if generation.pad_token_id is not None else 0
        self.policy = None  # the peft model around self.model, made by the first adapter
        self.settings: dict[str, Any] | None = None
        self.rollout: NativeRollout | None = None
        self.sampling: str | None = None  # ENGINE_SAMPLING's values the rollout was built with, as JSON

    @torch.no_grad()
    def load_lora(self, tensors: dict[str, torch.Tensor], settings: dict[str, Any]) -> None:
        if self.policy is None:
            self.policy = get_peft_model(self.model, PeftConfig.from_peft_type(**settings))  # wraps self.model in place
            self.settings = settings
        elif settings != self.settings:
            raise UsageError(
                f"this rollout server serves a LoRA of rank {self.settings['r']} on {self.settings['target_modules']}; "
                f"the trainer sent rank {settings['r']} on {settings['target_modules']}: restart the server"
            )
        result = set_peft_model_state_dict(self.policy, {n: t.to(self.device) for n, t in tensors.items()})
        missing = [n for n in result.missing_keys if ".lora_" in n]
        if result.unexpected_keys or missing:
            raise UsageError(
                f"the adapter sent does not fit the server's LoRA: unexpected {result.unexpected_keys[:3]}, "
                f"missing {missing[:3]}"
            )

    def lora_held(self, names: list[str]) -> dict[str, torch.Tensor]:
        """The LoRA tensors `names` as the engine samples with them: the policy's (peft keeps them in FP32 beside an
        NVFP4 base) in the activations' dtype, as each round's refresh gathers them into the engine's buffers."""
        held = get_peft_model_state_dict(self.policy)
        return {name: held[name].to(ACTIVATIONS) for name in names}

    def load_norms(self, norms: dict[str, torch.Tensor]) -> None:
        copy_norms(self.params, norms, f"the server's {type(self.model).__name__}")

    def generate(self, prompt_ids: list[list[int]], sampling: dict[str, Any]) -> list[tuple[list[int], list[float]]]:
        """The round's completions and sampled-token log-probs, under the noise the server has drawn on the norms."""
        rollout = self._rollout_for(sampling)
        rollout.generation_config.max_new_tokens = int(sampling["max_tokens"])
        out = rollout.generate(prompt_ids, no_noise)
        return list(zip(out.completion_ids, out.logprobs, strict=True))

    def _rollout_for(self, sampling: dict[str, Any]) -> NativeRollout:
        """The engine, built at the first round (on the peft policy: the LoRA buffers are laid out once) and kept
        while the rounds' sampling settings stay those it was built with."""
        key = json.dumps({name: sampling.get(name) for name in ENGINE_SAMPLING})
        if self.rollout is not None and key != self.sampling:
            raise UsageError(f"this rollout server samples with {self.sampling}; a round asked for {key}: restart it")
        if self.rollout is None:
            setup = RolloutSetup(
                generation_config=generation_config(sampling),
                eos_token_ids=list(sampling["stop_token_ids"]),
                pad_token_id=self.pad_token_id,
                open_policy=lambda: contextlib.nullcontext(self.policy),
                device=self.device,
                model_path=self.model_path,
                native=self.native,
            )
            self.rollout, self.sampling = NativeRollout(setup), key
        return self.rollout


def generation_config(sampling: dict[str, Any]) -> GenerationConfig:
    """transformers' settings for a round's vLLM sampling settings (sampling_kwargs' inverse)."""
    if float(sampling.get("repetition_penalty", 1.0)) != 1.0:
        raise UsageError("the native rollout server samples without a repetition penalty; use --engine vllm")
    temperature = float(sampling["temperature"])
    return GenerationConfig(
        do_sample=temperature > 0,
        temperature=temperature if temperature > 0 else 1.0,
        top_p=float(sampling.get("top_p", 1.0)),
        top_k=int(sampling.get("top_k", 0)) or None,
        min_p=float(sampling.get("min_p", 0.0)) or None,
        max_new_tokens=int(sampling["max_tokens"]),
    )
