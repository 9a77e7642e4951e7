"""An evaluation's completions, through the rollout engines training uses (qerl.rollout): the native engine or
transformers' generate on the policy (base + adapter, LoRA unmerged, its norms), or vLLM on the checkpoint folder with
the saved adapter pushed from memory (RolloutSetup.for_checkpoint: no policy loaded beside vLLM's copy). auto: native
on a CUDA device, vLLM or transformers where native cannot run the model (rollout.with_auto_fallback, as in
training), transformers on CPU.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

from eval.protocols import Sampling


@dataclass(frozen=True)
class ModelSpec:
    model: str
    load: str  # auto | nvfp4 | bf16
    adapter: str | None
    device: str
    kv_cache_gib: float | None = None  # native backend: the KV cache's memory budget (default: 80% of what is free)
    rollout_backend: str = "auto"  # field_rules.ROLLOUT_BACKENDS
    batch_size: int = 32  # transformers backend: prompts per generate() call


def generate(spec: ModelSpec, prompts: list[list[dict]], sampling: Sampling) -> list[str]:
    """Completions (text, special tokens dropped) of the chat prompts under `sampling`, all prompts in one round."""
    import torch

    from qerl import rollout
    from qerl.base_model import load_tokenizer

    tokenizer = load_tokenizer(spec.model)
    build = functools.partial(_backend, spec, sampling, tokenizer, functools.cache(lambda: _policy(spec)))
    if spec.rollout_backend == "auto":
        report = lambda error, fallback: print(f"eval: {error}; using {fallback}")  # noqa: E731
        backend = rollout.with_auto_fallback(spec.device, build, report)
    else:
        backend = build(spec.rollout_backend)
    ids = [tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=True)["input_ids"] for p in prompts]
    torch.manual_seed(sampling.seed)
    output = backend.generate(ids, rollout.no_noise)
    return tokenizer.batch_decode(output.completion_ids, skip_special_tokens=True)


def _backend(spec: ModelSpec, sampling: Sampling, tokenizer, policy, name: str):
    """The engine `name` on the checkpoint (vllm) or on the policy (`policy()`: loaded once, should auto fall back from
    one engine on it to another)."""
    from qerl import rollout

    config = generation_config(sampling)
    eos, pad = generation_eos(spec.model, tokenizer), tokenizer.pad_token_id
    if name == "vllm":  # the whole card but what its graphs need: nothing else of the evaluation is on it
        settings = rollout.VLLMSettings(gpu_memory_utilization=0.85, sleep=False, seed=sampling.seed)
        setup = rollout.RolloutSetup.for_checkpoint(spec.model, spec.adapter, config, eos, pad, vllm=settings)
    else:
        setup = rollout.RolloutSetup.for_model(
            policy(),
            config,
            eos,
            pad,
            native=rollout.NativeSettings(kv_cache_gib=spec.kv_cache_gib),
            transformers=rollout.TransformersSettings(batch_size=spec.batch_size),
        )
    return rollout.build_backend(name, setup)


def generation_config(sampling: Sampling):
    """The GenerationConfig of `sampling`: top_k 0 (none) when sampling, as the reference samples; greedy decoding
    sets no sampling flag (transformers warns of each one set beside do_sample False)."""
    from transformers import GenerationConfig

    return GenerationConfig(
        do_sample=sampling.do_sample,
        temperature=sampling.temperature if sampling.do_sample else None,
        top_p=sampling.top_p,
        top_k=0 if sampling.do_sample else None,
        max_new_tokens=sampling.max_new_tokens,
    )


def _policy(spec: ModelSpec):
    """Base + adapter in eval mode, as training loads them."""
    from peft import PeftModel

    from qerl.base_model import load_base_model
    from qerl.dense_weights import DenseWeights

    model = load_base_model(spec.model, precision=spec.load, device=spec.device)
    if model.device.type == "cpu":  # decoded once, as training samples on the CPU (QeRLTrainer._generate_single_turn)
        DenseWeights(model).materialize()
    if spec.adapter:
        model = PeftModel.from_pretrained(model, spec.adapter)
    return model.eval()


def generation_eos(model: str, tokenizer) -> list[int]:
    """Stop tokens: the checkpoint's generation_config.json and the tokenizer's."""
    from transformers import GenerationConfig

    eos = []
    if os.path.isfile(os.path.join(model, "generation_config.json")):
        configured = GenerationConfig.from_pretrained(model).eos_token_id
        eos = [configured] if isinstance(configured, int) else list(configured or [])
    return sorted({*eos, tokenizer.eos_token_id} - {None})
