"""The native rollout engine's tests share these (tests/qerl/rollout/native/test_engine.py, test_decoder.py,
test_kv_cache.py): a tiny Qwen2 (and Qwen3: per-head q/k norms, a head_dim that is not hidden / heads; Gemma-3: (1 + w)
norms, four per layer, scaled tied embeddings, GELU-tanh, local layers with a window of 8 shorter than the prompts and
global ones with their own rotary) in float32 with a LoRA adapter and trainable norms whose values are far from their
initial ones, so that a LoRA or norm the engine failed to apply would change the tokens; prompts, an engine, and what
its tokens and log-probs are held to (a plain forward loop, the trainer's recomputation)."""

import pytest
import torch
from peft import get_peft_model
from transformers import GenerationConfig

from qerl import lora
from qerl.nvfp4.quantize import quantize_model
from qerl.rollout.native.decoder import Decoder
from qerl.rollout.native.engine import NativeEngine
from qerl.rollout.native.sampling import Sampler
from qerl.tiny import build_tiny

QWEN3 = {"architecture": "qwen3", "head_dim": 32}  # 4 heads of 32 on a hidden size of 64


GEMMA3 = {"architecture": "gemma3", "head_dim": 32}  # qerl.tiny's Gemma-3: local layers with a window of 8, global


ARCHITECTURES = pytest.mark.parametrize("arch", [{}, QWEN3, GEMMA3], ids=["qwen2", "qwen3", "gemma3"])


def _policy(dtype=torch.float32, nvfp4=False, **arch):
    model, tokenizer = build_tiny(dtype=dtype, num_layers=3, **arch)
    return _with_lora(model, nvfp4), tokenizer


def _with_lora(model, nvfp4=False):
    """The model with a LoRA adapter and trainable norms, all moved off their initial values."""
    if nvfp4:
        quantize_model(model)
    peft_model = get_peft_model(model, lora.lora_config(model, rank=4, alpha=8, trainable_norms=True))
    lora.keep_fp32_masters(peft_model)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)  # peft starts B at zero: the adapter would do nothing
            elif p.requires_grad or name.endswith(("q_norm.weight", "k_norm.weight")):  # trained norms; Qwen3's
                p.add_(torch.randn_like(p) * 0.2)  # per-head norms (frozen, but not left at their initial ones)
    return peft_model.eval()


def _prompts(tokenizer, lengths=(5, 11, 2, 8)):
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(10, len(tokenizer), (n,), generator=gen).tolist() for n in lengths]


def _engine(model, eos, pad, **generation):
    config = GenerationConfig(do_sample=bool(generation), **generation)
    return NativeEngine(Decoder(model), Sampler(config), eos, pad)


@torch.no_grad()
def _hf_greedy(model, prompt, steps):
    ids = torch.tensor([prompt])
    for _ in range(steps):
        ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[0, len(prompt) :].tolist()


@torch.no_grad()
def _logprob_differences(model, prompts, ids, logprobs, temperature) -> torch.Tensor:
    """|engine log-prob - the trainer's recomputation| of every sampled token (TRL: logits / temperature)."""
    diffs = []
    for prompt, completion, lps in zip(prompts, ids, logprobs, strict=True):
        logits = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1] / temperature
        expected = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(completion)[:, None])[:, 0]
        diffs.append((torch.tensor(lps) - expected).abs())
    return torch.cat(diffs)
