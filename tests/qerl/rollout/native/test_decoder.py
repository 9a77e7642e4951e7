"""The native engine's decoder (qerl/rollout/native/decoder.py) on the CPU: an NVFP4 base's fused projections, the
model's own rope scaling, sliding windows (Mistral, Qwen2) and logit softcapping, weights shared with the policy and
each new adapter seen, AQN's noise on its norm scales, and the models it refuses by name. On the tiny policies of
tests/helpers/native_policies.py."""

import re

import pytest
import torch
from native_policies import (
    ARCHITECTURES,
    GEMMA3,
    QWEN3,
    _engine,
    _hf_greedy,
    _logprob_differences,
    _policy,
    _prompts,
    _with_lora,
)
from transformers import GenerationConfig

from qerl import aqn, norms
from qerl.rollout.native.decoder import Decoder
from qerl.rollout.native.engine import NativeEngine
from qerl.rollout.native.sampling import Sampler
from qerl.tiny import build_tiny, build_tiny_tokenizer


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


def test_engine_shares_the_policys_weights_and_sees_each_new_adapter():
    model, tokenizer = _policy()
    before = {n: t.data_ptr() for n, t in model.named_parameters() if not t.requires_grad}
    bytes_before = sum(t.numel() * t.element_size() for t in model.parameters())
    values_before = {n: t.detach().clone() for n, t in model.state_dict().items()}
    ids = torch.randint(0, model.config.vocab_size, (2, 7))
    with torch.no_grad():
        logits_before = model(input_ids=ids).logits
    decoder = Decoder(model)
    # What building the engine does to the policy (projection.fuse_as_views): nothing a user can observe.
    assert all(torch.equal(values_before[n], t) for n, t in model.state_dict().items())
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, logits_before)
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


@ARCHITECTURES
def test_the_engine_draws_each_norms_noise_as_the_policy_does(arch):
    """One round's AQN noise, the final and per-head norms included, on the policy (peft's trainable copies; Qwen3's
    and Gemma-3's q/k norms under self_attn) and on the engine's own FP32 holders (flat, per layer): the same keys
    and, norm by norm, the same noise."""
    model, _ = _policy(**arch)
    decoder = Decoder(model)
    decoder.refresh()
    noise = aqn.RoundNoise(seed=9, include_final=True, dtype_rule="fp32", include_head_norms=bool(arch))

    def drawn(target):
        keyed = noise.sites(target).keyed(True, bool(arch))
        clean = {k: m.weight.detach().float().clone() for k, m in keyed.items()}
        with noise.of_round(target, 1e-2, (3, 1), fp32_compute=False):
            return {k: m.weight.detach().float() - clean[k] for k, m in keyed.items()}

    policy, engine = drawn(model), drawn(decoder.norms)
    per_layer = 4 if arch == GEMMA3 else 2
    assert sorted(policy) == sorted(engine) and len(policy) == 3 * (per_layer + 2 * bool(arch)) + 1
    assert all(torch.equal(policy[k], engine[k]) for k in policy)
