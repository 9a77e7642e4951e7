"""The sampling filters of a GenerationConfig as transformers' own warpers (temperature, top-k, top-p, min-p), in
generate()'s order: what the transformers backend applies in its log-prob recorder and the native engine's sampler
applies on the GPU, so that both sample from, and score under, the same distribution.
"""

from __future__ import annotations

from transformers import GenerationConfig, LogitsProcessorList
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

# Sampling knobs the backends do not apply themselves; others would make the recorded log-probs wrong, so refuse them.
_UNSUPPORTED_SAMPLING = ("typical_p", "epsilon_cutoff", "eta_cutoff", "top_h", "watermarking_config")


def sampling_warpers(config: GenerationConfig) -> LogitsProcessorList:
    """transformers' own warpers for temperature, top-k, top-p, min-p, in generate()'s order."""
    for name in _UNSUPPORTED_SAMPLING:
        value = getattr(config, name, None)
        if value is not None and not (name == "typical_p" and value >= 1.0):
            raise ValueError(f"generation option {name}={value!r} is not supported by the rollout backends")
    warpers = LogitsProcessorList()
    if config.temperature is not None and config.temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(config.temperature))
    if config.top_k is not None and config.top_k != 0:
        warpers.append(TopKLogitsWarper(top_k=config.top_k))
    if config.top_p is not None and config.top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p=config.top_p))
    if config.min_p is not None:
        warpers.append(MinPLogitsWarper(min_p=config.min_p))
    return warpers
