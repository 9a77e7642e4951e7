"""Rollout throughput of the transformers backend: BF16 vs NVFP4 weights at Qwen2.5 shapes, on one GPU.

    python -m benchmarks.rollout --size 7b --batch 8 --prompt-len 256 --new-tokens 256 [--out runs/rollout.json]

Builds a Qwen2.5-shaped model with random weights on the GPU (no download), samples `new-tokens` tokens for
`batch` random prompts with `generate` (what the trainer's `transformers` rollout backend runs), then
quantizes the same model to NVFP4 in place and samples again. Before timing NVFP4 it checks the quantized
model's logits against a BF16 model holding the dequantized weights. Weights memory is what the model's
tensors occupy on the GPU. Tokens/s counts generated tokens of the whole batch.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

from qerl.nvfp4.linear import NVFP4Linear
from qerl.nvfp4.quantize import quantize_model

# (hidden, intermediate, layers, heads, kv heads) of Qwen2.5-{3,7,14,32}B; vocab 151936 (3B) / 152064.
QWEN25 = {
    "3b": (2048, 11008, 36, 16, 2, 151936),
    "7b": (3584, 18944, 28, 28, 4, 152064),
    "14b": (5120, 13824, 48, 40, 8, 152064),
    "32b": (5120, 27648, 64, 40, 8, 152064),
}


def build(size: str, device="cuda") -> Qwen2ForCausalLM:
    hidden, inter, layers, heads, kv, vocab = QWEN25[size]
    config = Qwen2Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=4096, tie_word_embeddings=False,
    )  # fmt: skip
    with torch.device(device):  # made in BF16 directly: a 32B model in fp32 would not fit
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    return model.eval()


def weights_gb(model) -> float:
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}.values()
    return sum(t.numel() * t.element_size() for t in tensors) / 1e9


@torch.no_grad()
def tokens_per_second(model, prompts: torch.Tensor, new_tokens: int, static_cache: bool) -> tuple[float, float]:
    kwargs = dict(do_sample=True, temperature=1.0, top_k=0, pad_token_id=0, eos_token_id=None)
    if static_cache:  # transformers then compiles the decode step (torch.compile, CUDA graphs)
        kwargs["cache_implementation"] = "static"
    # Warm-up (kernels, compile, cache) at the timed length: a static cache is sized by it, and a new size
    # recompiles the decode step, which would land in the timed run.
    warm = new_tokens if static_cache else 8
    model.generate(prompts, max_new_tokens=warm, min_new_tokens=warm, **kwargs)
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = model.generate(prompts, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kwargs)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    generated = (out.shape[1] - prompts.shape[1]) * prompts.shape[0]
    return generated / seconds, 1e3 * seconds / (out.shape[1] - prompts.shape[1])


@torch.no_grad()
def dequantized_copy_error(model, size: str, prompts: torch.Tensor) -> float:
    """Relative error of the NVFP4 model's logits against a BF16 model holding its dequantized weights."""
    packed = ("weight_packed", "weight_scale", "weight_global_scale")
    state = {k: v for k, v in model.state_dict().items() if not k.endswith(packed)}
    for name, module in model.named_modules():
        if isinstance(module, NVFP4Linear):
            state[f"{name}.weight"] = module.dequantize_weight(torch.bfloat16)
    reference = build(size, prompts.device)
    reference.load_state_dict(state, strict=True)
    ours = model(prompts[:2, :64]).logits.float()
    ref = reference(prompts[:2, :64]).logits.float()
    del reference
    torch.cuda.empty_cache()
    return ((ours - ref).norm() / ref.norm()).item()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(QWEN25), default="7b")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--static-cache", action="store_true",
                        help="static KV cache, which makes transformers compile the decode step into CUDA graphs")
    parser.add_argument("--out", default="runs/rollout.json")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.rollout needs a CUDA GPU")

    torch.manual_seed(0)
    model = build(args.size)
    prompts = torch.randint(1, model.config.vocab_size, (args.batch, args.prompt_len), device="cuda")
    rows = {}
    rows["bf16"] = (weights_gb(model), *tokens_per_second(model, prompts, args.new_tokens, args.static_cache))
    quantize_model(model)
    torch.cuda.empty_cache()
    error = dequantized_copy_error(model, args.size, prompts)
    rows["nvfp4"] = (weights_gb(model), *tokens_per_second(model, prompts, args.new_tokens, args.static_cache))

    cache = "static cache + compiled decode" if args.static_cache else "dynamic cache"
    print(f"Qwen2.5-{args.size} shapes, random weights, batch {args.batch}, prompt {args.prompt_len}, "
          f"{args.new_tokens} new tokens, {cache}, {torch.cuda.get_device_name()}")  # fmt: skip
    print(f"NVFP4 logits vs BF16 with the dequantized weights: relative error {error:.2e}")
    print(f"{'weights':8s} {'GB':>7s} {'tok/s':>8s} {'ms/step':>8s}")
    for name, (gb, tps, ms) in rows.items():
        print(f"{name:8s} {gb:7.2f} {tps:8.0f} {ms:8.2f}")
    print(f"NVFP4 / BF16 throughput: {rows['nvfp4'][1] / rows['bf16'][1]:.2f}x")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    result = {"args": vars(args), "device": torch.cuda.get_device_name(), "logits_rel_error": error,
              **{k: {"weights_gb": v[0], "tokens_per_s": v[1], "ms_per_step": v[2]} for k, v in rows.items()}}
    Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
