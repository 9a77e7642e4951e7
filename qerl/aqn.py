"""Adaptive Quantization Noise (AQN): a decaying Gaussian perturbation of the rollout policy's RMSNorm scales.

QeRL (paper Eq. 10) samples rollouts from RMSNorm_noise(x) = (w + Z) * x / rms(x), Z ~ N(0, sigma_k^2), with a
fresh Z every generation round, so that the q/k/v projections share one noise vector (input_layernorm) and
gate/up another (post_attention_layernorm). The training forward sees the clean scales.

Gemma-3's norms scale by (1 + w) (computed in FP32) and its checkpoints store w: the noise goes on w, and
(1 + (w + Z)) = ((1 + w) + Z), so the scale the activations see moves by exactly the paper's Z. Its four norms per
layer are all perturbed: input (q/k/v) and pre-feedforward (gate/up) precede quantized projections as in Eq. 10,
post-attention and post-feedforward scale the o and down projections' outputs before the residual add. (Under the
"bf16" rule the rounding happens on w, not on 1 + w: finer where |w| < 1.)

This module knows nothing about trainers: it gives the schedule and perturbs the norms that qerl.norms finds,
inside a context manager that restores the exact clean values on exit.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass

import torch
from torch import nn

from qerl.norms import FP32Compute, NormSites, computes_in_fp32, find_norms, noise_seed
from qerl.sharding import is_sharded, local_part

# ----------------------------------------------------------------------------------------------------------
# Schedule


def sigma_trend(sigma_start: float, sigma_end: float, num_stages: int) -> list[float]:
    """The K-1 noise levels of stages 1..K-1: geometric from sigma_start to sigma_end (reference formula)."""
    if num_stages < 3:
        raise ValueError(f"AQN needs num_stages >= 3 (one noise-free stage and two noise levels), got {num_stages}")
    if sigma_start <= 0 or sigma_end <= 0:
        raise ValueError(f"AQN sigmas must be positive, got sigma_start={sigma_start}, sigma_end={sigma_end}")
    ratio = sigma_end / sigma_start
    return [sigma_start * ratio ** (i / (num_stages - 2)) for i in range(num_stages - 1)]


def sigma_at(step: int, total_steps: int, sigma_start: float, sigma_end: float, num_stages: int) -> float:
    """sigma for the generation of optimizer step `step` (0-based) of `total_steps`.

    The run is cut into num_stages equal intervals; the first is noise-free, interval i >= 1 uses
    sigma_trend[i - 1]; steps at or beyond the end stay on the last level. Same arithmetic as the reference
    (`get_sigma_by_step`), evaluated where the reference does: its counter (`update_step`) is advanced before
    each step's generation, so step k samples with the counter at k + 1.
    """
    trend = sigma_trend(sigma_start, sigma_end, num_stages)
    if total_steps <= 0:
        raise ValueError(f"AQN needs the total number of training steps, got {total_steps}")
    counter = min(step + 1, total_steps)
    steps_per_interval = total_steps / (len(trend) + 1)
    interval = int(counter // steps_per_interval)
    if interval == 0:
        return 0.0
    return trend[min(interval - 1, len(trend) - 1)]


# ----------------------------------------------------------------------------------------------------------
# Applying the noise

# How the noise meets the scale. "fp32": added in FP32 to an FP32 copy of the scale, so that every level of the
# schedule survives (Eq. 10: w + Z). "bf16": the reference code's: the noise is cast to the BF16 scale's dtype and
# added there, so noise below half a BF16 ulp of the scale rounds away (on scales near 1: sigma 1e-3 moves ~3%
# of the entries, 1e-4 none).
DTYPE_RULES = {"fp32": torch.float32, "bf16": torch.bfloat16}  # field_rules.AQN_DTYPES names them


def round_seed(seed: int, step: int, round_in_step: int) -> int:
    """The seed of one generation round's noise, from the run's seed, the optimizer step and the round within it
    (a hash of ints: the same in every process, unlike a str's)."""
    return hash((seed, step, round_in_step))


@dataclass
class NoiseStats:
    sigma: float = 0.0
    num_norms: int = 0
    num_elements: int = 0
    changed_fraction: float = 0.0  # share of scale entries that the noise moved in the rule's dtype


@contextlib.contextmanager
def noisy_norms(
    model: nn.Module,
    sigma: float,
    generator: torch.Generator | None = None,
    include_final: bool = False,
    sites: NormSites | None = None,
    dtype_rule: str = "fp32",
    fp32_compute: bool = True,
    include_head_norms: bool = False,
):
    """Add fresh N(0, sigma^2) noise to the model's RMSNorm scales for the duration of the block.

    The round's seed is one draw of `generator` (the global RNG's without one); each norm's noise is drawn in
    float32 on the CPU from that seed and the norm's noise key (qerl.norms.noise_keys: its layer and its name),
    so a norm gets the same noise on any device, rank and backend, whatever the order or nesting of the model's
    modules and whichever other norms are included. It then meets each scale in the dtype of `dtype_rule` (see
    DTYPE_RULES).
    A scale stored in that dtype or in FP32 is perturbed in place (engines that captured its address, as CUDA
    graphs do, see the noise); a BF16 scale under the fp32 rule gets a perturbed FP32 Parameter for the duration,
    and the original Parameter object back on exit. Either way the clean scales come back bit for bit:
    subtracting the noise would not undo the rounding.
    A scale that FSDP2 shards (a DTensor) is perturbed in place on the shard this rank holds, with that shard's
    part of the same whole-tensor draw, so that FSDP's all-gather hands every rank the noisy scale one process
    would have; it cannot be swapped for an FP32 copy (FSDP gathers its own parameter), so a BF16 shard takes the
    bf16 rule, and the statistics count this rank's shard.
    With the fp32 rule and `fp32_compute`, the perturbed norms also run in FP32 (FP32Compute) so that the noise
    survives until their output is rounded once; engines whose norms take an FP32 scale themselves (or whose
    forward runs in CUDA graphs, where hooks do not run) pass False. `include_head_norms` adds the per-head q/k
    norms (Qwen3, Gemma-3), leaving the others' draws as they were (each norm's is its own); see
    QeRLConfig.aqn_head_norms. Yields NoiseStats.
    """
    if dtype_rule not in DTYPE_RULES:
        raise ValueError(f"unknown AQN dtype rule {dtype_rule!r}; known: {', '.join(DTYPE_RULES)}")
    stats = NoiseStats(sigma=float(sigma))
    if sigma <= 0:
        yield stats
        return
    dtype = DTYPE_RULES[dtype_rule]
    norms = (sites or find_norms(model)).keyed(include_final, include_head_norms)
    seed = int(torch.randint(2**62, (1,), generator=generator))  # the round's; each norm's follows from it
    undo = []
    changed = 0
    try:
        with torch.no_grad():
            for key, module in norms.items():
                weight = module.weight
                draw = torch.Generator().manual_seed(noise_seed(seed, key))
                noise = torch.randn(weight.shape, generator=draw, dtype=torch.float32) * sigma
                sharded = is_sharded(weight)
                if sharded:  # in place on this rank's shard, in its dtype when FP32 cannot hold the rule's
                    noise, weight = local_part(noise, weight), weight.to_local()
                rule = weight.dtype if sharded and weight.dtype != torch.float32 else dtype
                noise = noise.to(device=weight.device, dtype=rule)
                clean = weight.detach().to(rule)
                noisy = clean + noise
                changed += int((noisy != clean).sum())
                if weight.dtype in (rule, torch.float32):  # FP32 holds every BF16 value
                    saved = weight.detach().clone()
                    undo.append(lambda weight=weight, saved=saved: weight.copy_(saved))
                    weight.copy_(noisy)
                else:
                    undo.append(lambda module=module, weight=weight: module._parameters.__setitem__("weight", weight))
                    module._parameters["weight"] = nn.Parameter(noisy, requires_grad=False)
                stats.num_elements += weight.numel()
                if dtype_rule == "fp32" and fp32_compute and not sharded and not computes_in_fp32(module):
                    undo.append(FP32Compute(module).remove)
        stats.num_norms = len(norms)
        stats.changed_fraction = changed / max(stats.num_elements, 1)
        yield stats
    finally:
        with torch.no_grad():
            for step in reversed(undo):
                step()


class RoundNoise:
    """The AQN noise of a run's generation rounds, with the run's settings: `of_round(model, sigma, (step, k))` is
    round k of optimizer step `step` on `model`'s norms, the answer to "where does a round's noise come from". The
    rollout samples under it and the shift forward replays it; each norm's draw depends only on the round and the
    norm's key (qerl.norms.noise_keys), so the policy and every backend's model agree, on every rank."""

    def __init__(
        self, seed: int, include_final: bool, dtype_rule: str, include_head_norms: bool, required: bool = True
    ):
        self.seed, self.include_final, self.dtype_rule = seed, include_final, dtype_rule
        self.include_head_norms, self.required = include_head_norms, required
        # by model, weakly: a model gone takes its entry along (an id would be reused by the next model)
        self._sites: weakref.WeakKeyDictionary[nn.Module, NormSites] = weakref.WeakKeyDictionary()

    def sites(self, model: nn.Module) -> NormSites:
        """The norms of `model`, found once (a module tree does not change during training); with `required`, a
        model without them is an error."""
        if model not in self._sites:
            sites = self._sites[model] = find_norms(model)
            if self.required and not sites.layer_norms:
                raise RuntimeError(f"AQN found no RMSNorm in {type(model).__name__}")
            if self.required and self.include_head_norms and not sites.head_norms:
                raise RuntimeError(f"aqn_head_norms: {type(model).__name__} has no per-head q/k norms")
        return self._sites[model]

    def of_round(self, model: nn.Module, sigma: float, noise_round: tuple[int, int], fp32_compute: bool = True):
        """noisy_norms on `model` at `sigma` for round (optimizer step, round within it)."""
        generator = torch.Generator().manual_seed(round_seed(self.seed, *noise_round))
        return noisy_norms(
            model,
            sigma,
            generator,
            self.include_final,
            self.sites(model) if sigma > 0 else None,
            self.dtype_rule,
            fp32_compute=fp32_compute,
            include_head_norms=self.include_head_norms,
        )


@dataclass(frozen=True)
class NoisyRound:
    """A generation round's AQN, handed to the rollout backend as its `perturb`: called on the module a backend samples
    from, the round's noise on its norms (RoundNoise.of_round); read by a backend that samples elsewhere (a rollout
    server draws the same noise from these fields). `policy`: the training policy, whose transformers norms need
    FP32Compute to use an FP32 scale (an engine's own model applies its FP32 scales itself)."""

    noise: RoundNoise
    sigma: float
    round: tuple[int, int]  # (optimizer step, round within it)
    policy: nn.Module | None = None

    def __call__(self, model: nn.Module):
        return self.noise.of_round(model, self.sigma, self.round, fp32_compute=model is self.policy)
