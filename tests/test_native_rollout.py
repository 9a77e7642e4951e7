"""The native rollout engine against the policy's own forward (CPU; the GPU path is tests/test_native_gpu.py).

A tiny Qwen2 (and Qwen3: per-head q/k norms, a head_dim that is not hidden / heads; Gemma-3: (1 + w) norms, four
per layer, scaled tied embeddings, GELU-tanh, local layers with a window of 8 shorter than the prompts and global ones
with their own rotary) in float32 with a LoRA adapter and trainable norms whose values are far from their initial
ones, so that a LoRA or norm the engine failed to apply would change the tokens. Sliding windows on Mistral and Qwen2
too."""

import contextlib
import logging
import re

import pytest
import torch
from peft import get_peft_model
from transformers import GenerationConfig

from qerl import aqn, lora, norms
from qerl.nvfp4.quantize import quantize_model
from qerl.rollout.native.decoder import Decoder
from qerl.rollout.native.engine import NativeEngine
from qerl.rollout.native.sampling import Sampler
from qerl.tiny import build_tiny, build_tiny_tokenizer

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


@ARCHITECTURES
def test_greedy_tokens_equal_a_plain_forward_loop(arch):
    model, tokenizer = _policy(**arch)
    prompts = _prompts(tokenizer)
    engine = _engine(model, [-1], tokenizer.pad_token_id)  # no EOS: every sequence runs to the limit
    engine.decoder.refresh()
    ids, logprobs = engine.generate(prompts, 12)
    assert ids == [_hf_greedy(model, p, 12) for p in prompts]
    assert all(len(row) == 12 for row in logprobs)


@torch.no_grad()
def _logprob_differences(model, prompts, ids, logprobs, temperature) -> torch.Tensor:
    """|engine log-prob - the trainer's recomputation| of every sampled token (TRL: logits / temperature)."""
    diffs = []
    for prompt, completion, lps in zip(prompts, ids, logprobs, strict=True):
        logits = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1] / temperature
        expected = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(completion)[:, None])[:, 0]
        diffs.append((torch.tensor(lps) - expected).abs())
    return torch.cat(diffs)


@ARCHITECTURES
def test_sampled_logprobs_equal_the_trainers_recomputation(seed, arch):
    model, tokenizer = _policy(**arch)
    prompts = _prompts(tokenizer)
    engine = _engine(model, [-1], tokenizer.pad_token_id, temperature=0.7)
    engine.decoder.refresh()
    ids, logprobs = engine.generate(prompts, 10)
    assert _logprob_differences(model, prompts, ids, logprobs, 0.7).max() < 1e-4


@ARCHITECTURES
def test_nvfp4_base_in_bf16_samples_close_to_the_trainer(seed, arch):
    """An NVFP4 base in BF16, as rollouts run: the engine's fused projections and the policy's NVFP4Linear round
    differently, nothing more (measured on this model: mean 1.6-1.9e-3, max 4.4-6.4e-3 per token)."""
    model, tokenizer = _policy(torch.bfloat16, nvfp4=True, **arch)
    prompts = _prompts(tokenizer)
    engine = _engine(model, [-1], tokenizer.pad_token_id, temperature=0.7)
    engine.decoder.refresh()
    assert all(p.nvfp4 for p in engine.decoder.projections())
    ids, logprobs = engine.generate(prompts, 10)
    differences = _logprob_differences(model, prompts, ids, logprobs, 0.7)
    assert differences.mean() < 6e-3 and differences.max() < 3e-2


def test_llama3_rope_scaling_is_the_models_own(seed):
    """Llama-3.x's rope scaling (`llama3`: low frequencies stretched by 8 beyond the original context) comes from
    the model's own rotary module: prompts past the original 64 positions sample the trainer's log-probs."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = build_tiny_tokenizer()
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}  # fmt: skip
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rope_parameters=rope,
    )
    model = LlamaForCausalLM(config).eval()
    assert model.model.rotary_emb.rope_type == "llama3"
    prompts = _prompts(tokenizer, lengths=(70, 130, 5))
    engine = _engine(model, [-1], tokenizer.pad_token_id, temperature=0.7)
    engine.decoder.refresh()
    ids, logprobs = engine.generate(prompts, 10)
    assert _logprob_differences(model, prompts, ids, logprobs, 0.7).max() < 1e-4


def _windowed(kind):
    """Tiny sliding-window models, GQA, a window of 6 shorter than most prompts: Mistral's (every layer, head_dim
    16 on a hidden size of 48) and Qwen2's use_sliding_window (layers from max_window_layers on; layer 0 full)."""
    from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

    tokenizer = build_tiny_tokenizer()
    sizes = dict(
        vocab_size=len(tokenizer),
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=3,
        num_key_value_heads=1,
        sliding_window=6,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    if kind == "mistral":
        model = MistralForCausalLM(MistralConfig(**sizes))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**sizes, use_sliding_window=True, max_window_layers=1))
        assert model.config.layer_types == ["full_attention", "sliding_attention", "sliding_attention"]
    return _with_lora(model.eval()), tokenizer


@pytest.mark.parametrize("kind", ["mistral", "qwen2"])
def test_sliding_window_shorter_than_the_prompt_is_transformers_own(seed, kind):
    """Greedy tokens and sampled log-probs against transformers' forward, whose mask drops keys a window back:
    prompts of 1 to 20 tokens against a window of 6, and 12 decode steps past it."""
    model, tokenizer = _windowed(kind)
    decoder = Decoder(model)
    windows = [layer.window for layer in decoder.layers]
    assert windows == ([6, 6, 6] if kind == "mistral" else [None, 6, 6])
    prompts = _prompts(tokenizer, lengths=(5, 11, 1, 20, 6))
    engine = NativeEngine(decoder, Sampler(GenerationConfig(do_sample=False)), [-1], tokenizer.pad_token_id)
    decoder.refresh()
    assert engine.generate(prompts, 12)[0] == [_hf_greedy(model, p, 12) for p in prompts]
    engine = _engine(model, [-1], tokenizer.pad_token_id, temperature=0.7)
    engine.decoder.refresh()
    ids, logprobs = engine.generate(prompts, 12)
    assert _logprob_differences(model, prompts, ids, logprobs, 0.7).max() < 1e-4


def test_final_logit_softcapping_is_transformers_own(seed):
    """Gemma-3 configs may carry Gemma 2's final logit softcapping (cap * tanh(logits / cap)); a cap of 0.3 bends
    this model's logits (|logit| up to ~0.5; ignoring it moves log-probs by ~0.15), and the sampled log-probs still
    equal the trainer's."""
    model, tokenizer = build_tiny(num_layers=2, **GEMMA3)
    model.config.final_logit_softcapping = 0.3
    model = _with_lora(model.eval())
    prompts = _prompts(tokenizer)
    engine = _engine(model, [-1], tokenizer.pad_token_id, temperature=0.7)
    engine.decoder.refresh()
    ids, logprobs = engine.generate(prompts, 10)
    assert _logprob_differences(model, prompts, ids, logprobs, 0.7).max() < 1e-4


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


def test_early_eos_stops_each_sequence_at_its_own_step():
    model, tokenizer = _policy()
    prompts = _prompts(tokenizer)
    pad = tokenizer.pad_token_id
    engine = _engine(model, [-1], pad)
    engine.decoder.refresh()
    free_ids, free_lps = engine.generate(prompts, 12)
    eos = free_ids[1][3]  # a token of the second sequence becomes EOS
    engine = _engine(model, [eos], pad)
    engine.decoder.refresh()
    ids, lps = engine.generate(prompts, 12)
    for free, row, free_lp, lp in zip(free_ids, ids, free_lps, lps, strict=True):
        stop = free.index(eos) + 1 if eos in free else len(free)
        assert row[:stop] == free[:stop] and lp[:stop] == pytest.approx(free_lp[:stop], abs=1e-5)
        assert all(t == pad for t in row[stop:])  # after EOS: padding (truncate_at_eos cuts it)
    assert ids[1].index(eos) <= 3


def test_waves_and_prefill_chunks_give_the_same_tokens():
    model, tokenizer = _policy()
    prompts = _prompts(tokenizer, (5, 11, 2, 8, 3))
    engine = _engine(model, [-1], tokenizer.pad_token_id)
    engine.decoder.refresh()
    whole, _ = engine.generate(prompts, 6)
    assert engine.last_waves == 1
    engine.kv_cache_bytes = 2 * engine._kv_bytes_per_sequence(11 + 6)  # two sequences per wave
    engine.prefill_tokens = 12  # one or two prompts per prefill chunk
    assert engine.generate(prompts, 6)[0] == whole and engine.last_waves == 3
    engine.kv_cache_bytes = engine._kv_bytes_per_sequence(11 + 6) - 1
    with pytest.raises(RuntimeError, match="KV cache of one sequence"):
        engine.generate(prompts, 6)


def test_engine_shares_the_policys_weights_and_sees_each_new_adapter():
    model, tokenizer = _policy()
    before = {n: t.data_ptr() for n, t in model.named_parameters() if not t.requires_grad}
    bytes_before = sum(t.numel() * t.element_size() for t in model.parameters())
    decoder = Decoder(model)
    layer = model.base_model.model.model.layers[0]
    q, k, v = (getattr(layer.self_attn, n).base_layer.weight for n in ("q_proj", "k_proj", "v_proj"))
    fused = decoder.layers[0].qkv.weight
    assert q.data_ptr() == fused.data_ptr() and v.data_ptr() + v.numel() * v.element_size() == (
        fused.data_ptr() + fused.numel() * fused.element_size()
    )
    assert k.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr()
    assert sum(t.numel() * t.element_size() for t in model.parameters()) == bytes_before
    assert before.keys() == {n for n, t in model.named_parameters() if not t.requires_grad}

    engine = NativeEngine(decoder, Sampler(GenerationConfig(do_sample=False)), [-1], tokenizer.pad_token_id)
    prompts = _prompts(tokenizer)
    decoder.refresh()
    first, _ = engine.generate(prompts, 8)
    with torch.no_grad():  # an optimizer step, as far as the engine can tell
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(-3.0)
    decoder.refresh()
    second, _ = engine.generate(prompts, 8)
    assert second == [_hf_greedy(model, p, 8) for p in prompts] and second != first


@pytest.mark.parametrize("arch", [{}, GEMMA3], ids=["qwen2", "gemma3"])
def test_aqn_reaches_the_engine_and_is_undone(arch):
    """The engine's norm scales in the policy's order (so the same draw perturbs the same norm on every backend);
    Gemma-3's are its four (1 + w) norms per layer, holding w as the policy does."""
    model, tokenizer = _policy(**arch)
    prompts = _prompts(tokenizer)
    engine = _engine(model, [-1], tokenizer.pad_token_id, temperature=1.0)
    decoder = engine.decoder
    decoder.refresh()
    sites = norms.find_norms(decoder.norms)
    roles = [re.search(r"layers\.\d+\.(\w+)", p).group(1) for p in norms.find_norms(model).layer_norms]
    assert len(sites.layer_norms) == len(roles) == (12 if arch else 6) and len(sites.final_norms) == 1
    assert [p.rsplit(".", 1)[-1] for p in sites.layer_norms] == roles
    clean = [h.weight.clone() for h, _ in decoder.norms.pairs]

    def logprobs(sigma):
        torch.manual_seed(1)
        with aqn.noisy_norms(decoder.norms, sigma, torch.Generator().manual_seed(2), fp32_compute=False) as stats:
            return engine.generate(prompts, 4)[1], stats

    base, _ = logprobs(0.0)
    noisy, stats = logprobs(1e-2)
    assert stats.num_norms == len(roles) and stats.changed_fraction == 1.0
    assert noisy != base
    assert all(torch.equal(h.weight, c) for (h, _), c in zip(decoder.norms.pairs, clean, strict=True))
    assert logprobs(0.0)[0] == base


@pytest.mark.parametrize("arch", [QWEN3, GEMMA3], ids=["qwen3", "gemma3"])
def test_aqn_on_head_norms_reaches_the_engine_only_when_asked(arch):
    """include_head_norms: the per-head q/k scales are perturbed too (in the engine's holders, laid out into the
    scales the step reads), after the layer norms, whose draws stay what they were; off, the heads stay clean."""
    model, tokenizer = _policy(**arch)
    prompts = _prompts(tokenizer)
    engine = _engine(model, [-1], tokenizer.pad_token_id, temperature=1.0)
    decoder = engine.decoder
    decoder.refresh()
    decoder.lay_out_head_norms()
    sites = norms.find_norms(decoder.norms)
    assert [p.rsplit(".", 1)[-1] for p in sites.head_norms] == ["q_norm", "k_norm"] * 3
    policy_heads = norms.find_norms(model).head_norms
    assert list(sites.head_norms) == [re.search(r"layers\.\d+\.", p)[0] + p[-6:] for p in policy_heads]
    clean = [
        (h.weight.clone(), layer.head_norms.scale.clone())
        for h, layer in zip([decoder.norms.layers[i]["q_norm"] for i in range(3)], decoder.layers, strict=True)
    ]

    def run(include):
        torch.manual_seed(1)
        with aqn.noisy_norms(
            decoder.norms, 1e-2, torch.Generator().manual_seed(2), fp32_compute=False, include_head_norms=include
        ) as stats:
            layer_noise = torch.cat([m.weight.flatten() for m in sites.layer_norms.values()])
            lps = engine.generate(prompts, 4)[1]
            heads = [layer.head_norms.scale.clone() for layer in decoder.layers]
        return lps, stats, layer_noise, heads

    plain, plain_stats, plain_noise, plain_heads = run(False)
    with_heads, stats, noise, heads = run(True)
    assert stats.num_norms == plain_stats.num_norms + 6 and torch.equal(noise, plain_noise)
    assert all(torch.equal(h, c) for h, (_, c) in zip(plain_heads, clean, strict=True))
    assert all(not torch.equal(h, c) for h, (_, c) in zip(heads, clean, strict=True))
    assert with_heads != plain
    decoder.lay_out_head_norms()  # the next round's: clean again
    assert all(torch.equal(layer.head_norms.scale, c) for layer, (_, c) in zip(decoder.layers, clean, strict=True))


def test_unsupported_models_are_refused_by_name():
    model, _ = build_tiny(num_layers=1)
    model.model.layers[0].self_attn.q_norm = torch.nn.RMSNorm(16)  # a query norm without its key norm
    with pytest.raises(ValueError, match="layer 0 attention is not supported"):
        Decoder(model)
    model, _ = build_tiny(num_layers=1, **QWEN3)
    model.model.layers[0].self_attn.k_norm = torch.nn.RMSNorm(12)
    with pytest.raises(ValueError, match=r"q/k norms of 32/12 elements, not one scale per head dimension \(32\)"):
        Decoder(model)
    from transformers import GemmaConfig, GemmaForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM

    sizes = dict(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    )
    with pytest.raises(ValueError, match="GemmaForCausalLM: model_type 'gemma'; the engine runs llama, mistral"):
        Decoder(GemmaForCausalLM(GemmaConfig(**sizes)))  # same module names, but (1 + w) norms, GELU, scaled embeddings
    moe = Qwen2MoeForCausalLM(Qwen2MoeConfig(**sizes, num_experts=4, moe_intermediate_size=32))
    with pytest.raises(ValueError, match=r"model_type 'qwen2_moe' \(mixture of experts\)"):
        Decoder(moe)
    model, _ = build_tiny(num_layers=1)
    model.config.hidden_act = "gelu"
    with pytest.raises(ValueError, match="hidden_act 'gelu'; the engine's MLP gates are silu, gelu_pytorch_tanh"):
        Decoder(model)
    model, _ = build_tiny(num_layers=1, **GEMMA3)
    model.config.attn_logit_softcapping = 50.0  # Gemma 2's; transformers' Gemma-3 would apply it: refused
    with pytest.raises(ValueError, match=r"Gemma3ForCausalLM: attention logit softcapping \(50.0\) is not supported"):
        Decoder(model)
    model, _ = build_tiny(num_layers=1, architecture="qwen3", head_dim=24)
    with pytest.raises(ValueError, match="Qwen3ForCausalLM: head_dim 24: the engine's attention takes powers of two"):
        Decoder(model)


def test_auto_picks_native_on_a_gpu_and_falls_back_where_native_cannot_run(monkeypatch, caplog):
    from qerl import rollout

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(rollout, "vllm_available", lambda: False)
    assert rollout.resolve_backend("auto", torch.device("cuda")) == "native"
    assert rollout.resolve_backend("auto", torch.device("cpu")) == "transformers"

    # A model native refuses (here: a plain GELU MLP): auto goes on to the next engine, a named backend fails with
    # the reason.
    monkeypatch.setattr(rollout, "vllm_available", lambda: False)
    model, tokenizer = build_tiny(num_layers=1)
    model.config.hidden_act = "gelu"
    setup = rollout.RolloutSetup(
        generation_config=GenerationConfig(do_sample=True, max_new_tokens=4),
        eos_token_ids=[tokenizer.eos_token_id],
        pad_token_id=tokenizer.pad_token_id,
        open_policy=lambda: contextlib.nullcontext(model),
        device=torch.device("cuda"),
    )
    with caplog.at_level(logging.WARNING):
        assert rollout.create_backend("auto", setup).name == "transformers"
    reason = "the native engine cannot run Qwen2ForCausalLM: hidden_act 'gelu'; the engine's MLP gates are silu"
    assert any(
        m.startswith(f"rollout_backend auto: {reason}") and m.endswith("; using transformers") for m in caplog.messages
    )
    refusal = rf"^rollout_backend native: {re.escape(reason)}.*; rollout_backend auto would use transformers$"
    with pytest.raises(rollout.Unsupported, match=refusal):
        rollout.create_backend("native", setup)
    # Under FSDP2 / ZeRO-3 a BF16 base's weights are what is sharded: native refuses, auto takes the next engine.
    setup.open_policy = lambda: contextlib.nullcontext(build_tiny(num_layers=1)[0])
    setup.sharding = "fsdp2"
    with pytest.raises(rollout.Unsupported, match="BF16 base's weights are sharded"):
        rollout.create_backend("native", setup)
    assert rollout.create_backend("auto", setup).name == "transformers"
