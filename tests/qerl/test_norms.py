"""Finding the RMSNorms of any model (qerl.norms), and running one in FP32."""

import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from qerl import norms
from qerl.tiny import build_tiny


class NamelessNorm(nn.Module):
    """An RMSNorm whose class name says nothing: found by its behaviour."""

    def __init__(self, n, eps=1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.rand(n) + 0.5)
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class GemmaStyle(NamelessNorm):
    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1 + self.weight)


def test_is_rmsnorm_by_behaviour(seed):
    assert norms.is_rmsnorm(NamelessNorm(32))
    assert norms.is_rmsnorm(GemmaStyle(32))
    assert norms.is_rmsnorm(nn.RMSNorm(32))
    assert not norms.is_rmsnorm(nn.LayerNorm(32))
    assert not norms.is_rmsnorm(nn.LayerNorm(32, bias=False))  # has eps and a 1-D weight, but centres x
    assert not norms.is_rmsnorm(nn.Linear(32, 32))
    assert not norms.is_rmsnorm(NamelessNorm(32), hidden_size=64)


def _norm_paths(model):
    sites = norms.find_norms(model)
    return sorted(sites.layer_norms), sorted(sites.final_norms)


def test_find_norms_qwen2_llama_qwen3():
    model, _ = build_tiny()
    layer, final = _norm_paths(model)
    assert layer == [f"model.layers.{i}.{n}" for i in range(2) for n in ("input_layernorm", "post_attention_layernorm")]
    assert final == ["model.norm"]

    tiny = dict(vocab_size=50, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2)
    llama = LlamaForCausalLM(LlamaConfig(**tiny, num_hidden_layers=3))
    layer, final = _norm_paths(llama)
    assert len(layer) == 6 and final == ["model.norm"]

    # Qwen3's per-head q_norm/k_norm are RMSNorms too, but of head size: not the scales QeRL perturbs by default,
    # kept apart (AQN's include_head_norms adds them).
    qwen3 = Qwen3ForCausalLM(Qwen3Config(**tiny, num_hidden_layers=2, head_dim=16))
    layer, final = _norm_paths(qwen3)
    assert all(p.endswith(("input_layernorm", "post_attention_layernorm")) for p in layer) and len(layer) == 4
    sites = norms.find_norms(qwen3)
    assert list(sites.head_norms) == [f"model.layers.{i}.self_attn.{n}" for i in range(2) for n in ("q_norm", "k_norm")]
    assert list(sites.select(False, include_heads=True)) == list(sites.layer_norms) + list(sites.head_norms)


def test_find_norms_gemma3_and_noise_on_w_shifts_its_unit_offset_scale(seed):
    """Gemma3RMSNorm (its own class, not Llama's; scale 1 + w in FP32): four per layer and the final one are found,
    the per-head q/k norms are not; AQN's w + Z then scales by 1 + w + Z, the same shift as on 1 + w."""
    from qerl import aqn

    model, _ = build_tiny(architecture="gemma3", num_layers=2, head_dim=32)
    layer, final = _norm_paths(model)
    roles = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")
    assert layer == sorted(f"model.layers.{i}.{r}" for i in range(2) for r in roles) and final == ["model.norm"]
    norm = model.model.layers[0].pre_feedforward_layernorm
    with torch.no_grad():
        norm.weight.normal_(0, 0.3)
    x = torch.randn(3, 64)
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps)
    clean = norm.weight.detach().clone()
    with aqn.noisy_norms(model, 0.1, torch.Generator().manual_seed(0)):
        shift = norm.weight.detach() - clean
        assert shift.abs().min() > 0
        torch.testing.assert_close(norm(x), normed * (1 + clean + shift))
    assert torch.equal(norm.weight, clean)


def test_find_norms_foreign_classes(seed):
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.pre = NamelessNorm(32)
            self.proj = nn.Linear(32, 32)
            self.ln = nn.LayerNorm(32)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([Block(), Block()])
            self.out_norm = NamelessNorm(32)

    layer, final = _norm_paths(Net())
    assert layer == ["blocks.0.pre", "blocks.1.pre"] and final == ["out_norm"]


def test_fp32_scale_in_a_bf16_model_hands_bf16_on(seed):
    """A trainable (FP32) norm in a BF16 model: BF16 out, one rounding of the FP32 product, gradients reach w."""
    model, _ = build_tiny(dtype=torch.bfloat16)
    norm = model.model.layers[0].input_layernorm
    norm.weight.data = norm.weight.data.float() + 1e-3  # an update far below a BF16 ulp of 1
    compute = norms.FP32Compute(norm)
    x = torch.randn(3, 64, dtype=torch.bfloat16, requires_grad=True)
    y = norm(x)
    xf = x.float()
    expected = (norm.weight * xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)).bfloat16()
    assert y.dtype == torch.bfloat16 and torch.equal(y, expected)
    y.float().sum().backward()
    assert norm.weight.grad.dtype == torch.float32 and x.grad.dtype == torch.bfloat16
    model(input_ids=torch.tensor([[5, 6, 7]]))  # the BF16 projections accept what the norm hands on
    compute.remove()
    assert not norms.computes_in_fp32(norm) and norm(x).dtype == torch.float32  # transformers' own behaviour
