import numpy as np
import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from qerl import aqn
from qerl.tiny import build_tiny


# The reference (NVlabs/QeRL trl_trainer/noise_scheduler.py + grpo_trainer.py), transcribed as the oracle.
def reference_sigma(step, total_steps, sigma_start, sigma_end, num_stages):
    trend = (sigma_start * (sigma_end / sigma_start) ** (np.arange(num_stages - 1) / (num_stages - 2))).tolist()
    step = min(step, total_steps)
    steps_per_interval = total_steps / (len(trend) + 1)
    interval_id = int(step // steps_per_interval)
    if interval_id == 0:
        return 0
    return trend[min(interval_id - 1, len(trend) - 1)]


def reference_run(total_steps, sigma_start, sigma_end, num_stages):
    """The sigma each optimizer step samples with in the reference: its trainer loop (replacement/trainer.py)
    advances `update_step` before the step, and the weight sync of that step's generation reads it."""
    sigmas, update_step = [], 0
    for _ in range(total_steps):
        update_step += 1
        sigmas.append(reference_sigma(update_step, total_steps, sigma_start, sigma_end, num_stages))
    return sigmas


@pytest.mark.parametrize("total", [1, 7, 10, 100, 333, 1000])
@pytest.mark.parametrize("start,end,stages", [(1e-2, 1e-4, 10), (5e-2, 5e-4, 10), (1e-2, 1e-3, 4)])
def test_schedule_matches_reference(total, start, end, stages):
    ours = [aqn.sigma_at(step, total, start, end, stages) for step in range(total)]
    assert ours == reference_run(total, start, end, stages)
    # Past the end (a resumed run with a larger step count) the last level holds, as in the reference.
    assert aqn.sigma_at(total + 2, total, start, end, stages) == reference_sigma(total, total, start, end, stages)


def test_schedule_shape():
    sigmas = [aqn.sigma_at(s, 100, 1e-2, 1e-4, 10) for s in range(100)]
    assert sigmas[:9] == [0.0] * 9  # the counter reaches the second tenth at step 9 (counter 10)
    assert sigmas[9] == 1e-2 and sigmas[99] == pytest.approx(1e-4)
    assert all(a >= b for a, b in zip(sigmas[9:-1], sigmas[10:], strict=True))  # decays monotonically
    with pytest.raises(ValueError):
        aqn.sigma_trend(1e-2, 1e-4, 2)


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


def test_is_rmsnorm_by_behaviour():
    assert aqn.is_rmsnorm(NamelessNorm(32))
    assert aqn.is_rmsnorm(GemmaStyle(32))
    assert aqn.is_rmsnorm(nn.RMSNorm(32))
    assert not aqn.is_rmsnorm(nn.LayerNorm(32))
    assert not aqn.is_rmsnorm(nn.LayerNorm(32, bias=False))  # has eps and a 1-D weight, but centres x
    assert not aqn.is_rmsnorm(nn.Linear(32, 32))
    assert not aqn.is_rmsnorm(NamelessNorm(32), hidden_size=64)


def _norm_paths(model):
    sites = aqn.find_norms(model)
    return sorted(sites.layer_norms), sorted(sites.final_norms)


def test_find_norms_qwen2_llama_qwen3():
    model, _ = build_tiny()
    layer, final = _norm_paths(model)
    assert layer == [f"model.layers.{i}.{n}" for i in range(2) for n in ("input_layernorm", "post_attention_layernorm")]
    assert final == ["model.norm"]

    llama = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=50,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
    )
    layer, final = _norm_paths(llama)
    assert len(layer) == 6 and final == ["model.norm"]

    # Qwen3's per-head q_norm/k_norm are RMSNorms too, but of head size: not the scales QeRL perturbs.
    qwen3 = Qwen3ForCausalLM(
        Qwen3Config(
            vocab_size=50,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
        )
    )
    layer, final = _norm_paths(qwen3)
    assert all(p.endswith(("input_layernorm", "post_attention_layernorm")) for p in layer) and len(layer) == 4


def test_find_norms_foreign_classes():
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_noise_applied_and_restored_bit_exactly(dtype):
    model, _ = build_tiny(dtype=dtype)
    with torch.no_grad():  # non-trivial scales, so that a subtract-based restore would round
        for p in model.parameters():
            if p.dim() == 1:
                p.copy_(torch.rand_like(p) * 3)
    clean = {k: v.clone() for k, v in model.state_dict().items()}
    sigma = 0.05
    with aqn.noisy_norms(model, sigma, torch.Generator().manual_seed(1)) as stats:
        state = model.state_dict()
        diffs = []
        for k, v in state.items():
            if "layernorm" in k:
                diffs.append((v.float() - clean[k].float()).flatten())
            else:
                assert torch.equal(v, clean[k]), k  # final norm untouched by default, everything else too
        diffs = torch.cat(diffs)
        assert diffs.std().item() == pytest.approx(sigma, rel=0.3)
        assert stats.num_norms == 4 and stats.changed_fraction > 0.9
    for k, v in model.state_dict().items():
        assert torch.equal(v, clean[k]), k


def test_noise_is_fresh_reproducible_and_optional_final_norm():
    model, _ = build_tiny()

    def noisy_copy(seed, include_final=False):
        with aqn.noisy_norms(model, 0.1, torch.Generator().manual_seed(seed), include_final=include_final):
            return {k: v.clone() for k, v in model.state_dict().items() if "norm" in k}

    a, b, a2 = noisy_copy(0), noisy_copy(1), noisy_copy(0)
    assert all(torch.equal(a[k], a2[k]) for k in a)
    assert not torch.equal(a["model.layers.0.input_layernorm.weight"], b["model.layers.0.input_layernorm.weight"])
    assert torch.equal(a["model.norm.weight"], torch.ones(64))
    assert not torch.equal(noisy_copy(0, include_final=True)["model.norm.weight"], torch.ones(64))


def test_restored_after_exception_and_zero_sigma_is_noop():
    model, _ = build_tiny()
    clean = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(RuntimeError):
        with aqn.noisy_norms(model, 0.1):
            raise RuntimeError("generation failed")
    assert all(torch.equal(v, clean[k]) for k, v in model.state_dict().items())
    with aqn.noisy_norms(model, 0.0) as stats:
        assert stats.num_norms == 0
        assert all(torch.equal(v, clean[k]) for k, v in model.state_dict().items())


def test_trainable_norms_perturb_the_active_copy():
    model, _ = build_tiny()
    names = aqn.layer_norm_names(model)
    assert names == ["input_layernorm", "post_attention_layernorm"]
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=4, target_modules=["q_proj"], modules_to_save=names))
    sites = aqn.find_norms(peft_model)
    assert len(sites.layer_norms) == 4
    assert all(".modules_to_save.default" in p for p in sites.layer_norms)
    wrapper = peft_model.base_model.model.model.layers[0].input_layernorm
    original = wrapper.original_module.weight.clone()
    x = torch.randn(3, 64)
    clean_out = wrapper(x)
    with aqn.noisy_norms(peft_model, 0.1):
        assert torch.equal(wrapper.original_module.weight, original)  # frozen original left alone
        assert not torch.allclose(wrapper(x), clean_out)  # the forward sees the noise
    assert torch.equal(wrapper(x), clean_out)
    # With adapters disabled the original module runs, so that is the one to perturb.
    with peft_model.disable_adapter():
        assert all(".original_module" in p for p in aqn.find_norms(peft_model).layer_norms)
