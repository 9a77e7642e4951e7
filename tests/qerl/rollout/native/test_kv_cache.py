"""The native engine's KV cache (qerl/rollout/native/kv_cache.py): the FP8 format's math, and an FP8 cache in the
engine taking fewer bytes and sampling close to the trainer."""

import pytest
import torch
from native_policies import _logprob_differences, _policy, _prompts
from transformers import GenerationConfig

from qerl.rollout.native import kv_cache
from qerl.rollout.native.decoder import Decoder
from qerl.rollout.native.engine import NativeEngine
from qerl.rollout.native.sampling import Sampler


def test_fp8_cache_format_is_the_math(seed):
    """kv_cache.quantize_reference in float64 terms: per row a power-of-two scale putting the row's largest
    magnitude in [128, 256), and every value rounded to the nearest E4M3 step (relative error <= 2^-4; an absolute
    2^-10 * scale below E4M3's normal range); zero rows stay zero."""
    x = torch.randn(64, 16, 32, dtype=torch.float64) * torch.logspace(-6, 4, 64, dtype=torch.float64)[:, None, None]
    x[3, 5] = 0.0
    codes, scale = kv_cache.quantize_reference(x)
    assert codes.dtype == kv_cache.FP8 and scale.dtype == torch.float32 and scale.shape == x.shape[:-1]
    assert torch.equal(scale.log2(), scale.log2().round())
    amax = x.abs().amax(-1) / scale.double()
    assert ((amax >= 128) & (amax < 256))[amax > 0].all() and not codes[3, 5].float().any()
    back = kv_cache.dequantize_reference(codes, scale, torch.float64)
    bound = torch.maximum(x.abs() * 2.0**-4, scale.double()[..., None] * 2.0**-10)
    assert ((back - x.float().double()).abs() <= bound).all()


def test_fp8_kv_cache_takes_fewer_bytes_and_samples_close_to_the_trainer(seed):
    """E4M3 keys and values (a scale per token and head) on a BF16 policy, as rollouts run: (D + 4) / 2D of the BF16
    cache's bytes (D = 16 here), and log-probs off the trainer's by the cache's rounding on top of BF16's: above
    the BF16 cache's difference (measured on this model: ~1.7e-3 vs ~1.2e-2 mean), well below what a wrong key or
    value would do (the cache feeds every layer)."""
    model, tokenizer = _policy(torch.bfloat16)
    prompts = _prompts(tokenizer)
    config = GenerationConfig(do_sample=True, temperature=0.7)
    differences = {}
    for kv_dtype in ("auto", "fp8"):
        engine = NativeEngine(Decoder(model), Sampler(config), [-1], tokenizer.pad_token_id, kv_cache_dtype=kv_dtype)
        engine.decoder.refresh()
        ids, logprobs = engine.generate(prompts, 10)
        differences[kv_dtype] = _logprob_differences(model, prompts, ids, logprobs, 0.7)
        print(
            f"{kv_dtype} KV: |engine - trainer| log-prob mean {differences[kv_dtype].mean():.2e} "
            f"max {differences[kv_dtype].max():.2e}"
        )
        if kv_dtype == "auto":
            bf16_bytes = engine._kv_bytes_per_sequence(100)
    assert engine._kv_bytes_per_sequence(100) * 2 * 16 == bf16_bytes * (16 + 4)
    fp8 = differences["fp8"]
    assert fp8.mean() > 2 * differences["auto"].mean() and fp8.mean() < 3e-2 and fp8.max() < 0.2
    with pytest.raises(ValueError, match="kv_cache_dtype 'fp4': choose one of auto, fp8"):
        NativeEngine(Decoder(model), Sampler(config), [-1], 0, kv_cache_dtype="fp4")
