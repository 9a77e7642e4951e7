import numpy as np
import pytest
import torch
from fakes import make_trainer
from peft import LoraConfig, get_peft_model

from qerl import aqn, norms
from qerl.config import QeRLConfig
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


@pytest.mark.parametrize("rule", ["fp32", "bf16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_noise_applied_and_restored_bit_exactly(dtype, rule):
    model, _ = build_tiny(dtype=dtype)
    with torch.no_grad():  # non-trivial scales, so that a subtract-based restore would round
        for p in model.parameters():
            if p.dim() == 1:
                p.copy_(torch.rand_like(p) * 3)
    clean = {k: v.clone() for k, v in model.state_dict().items()}
    params = dict(model.named_parameters())
    sigma = 0.05
    with aqn.noisy_norms(model, sigma, torch.Generator().manual_seed(1), dtype_rule=rule) as stats:
        state = model.state_dict()
        diffs = []
        for k, v in state.items():
            if "layernorm" in k:
                assert v.dtype in (aqn.DTYPE_RULES[rule], torch.float32)  # in place where FP32 holds the values
                diffs.append((v.float() - clean[k].float()).flatten())
            else:
                assert torch.equal(v, clean[k]), k  # final norm untouched by default, everything else too
        diffs = torch.cat(diffs)
        assert diffs.std().item() == pytest.approx(sigma, rel=0.3)
        assert stats.num_norms == 4 and stats.changed_fraction > 0.9
    for k, v in model.state_dict().items():
        assert v.dtype == clean[k].dtype and torch.equal(v, clean[k]), k
    assert all(p is params[n] for n, p in model.named_parameters())  # the same Parameter objects (optimizer refs)
    assert not any(norms.computes_in_fp32(m) for m in model.modules())  # no hook left behind


def test_noise_is_drawn_the_same_under_both_rules():
    """One seed, one noise, whatever the rule or the scales' dtype (every backend draws the same)."""
    model, _ = build_tiny(dtype=torch.float32)

    def noisy(rule):
        with aqn.noisy_norms(model, 0.1, torch.Generator().manual_seed(5), dtype_rule=rule):
            return torch.cat([m.weight.float().flatten() - 1 for m in norms.find_norms(model).layer_norms.values()])

    fp32, bf16 = noisy("fp32"), noisy("bf16")
    torch.testing.assert_close(fp32.to(torch.bfloat16).float(), bf16, atol=4e-3, rtol=0)
    with pytest.raises(ValueError, match="unknown AQN dtype rule"):
        with aqn.noisy_norms(model, 0.1, dtype_rule="fp16"):
            pass


@pytest.fixture(scope="module")
def nvfp4_bf16_policy(checkpoints, tmp_path_factory):
    """The tiny NVFP4 model in BF16 with LoRA and trainable norms: the policy QeRLTrainer trains."""
    _, nvfp4_dir = checkpoints
    args = QeRLConfig(
        str(tmp_path_factory.mktemp("run")),
        use_cpu=True,
        report_to=[],
        per_device_train_batch_size=4,
        num_generations=4,
        lora_rank=4,
        lora_alpha=8,
        trainable_norms=True,
    )
    model = make_trainer(nvfp4_dir, args, dtype=torch.bfloat16).model
    norm_copies = [p for n, p in model.named_parameters() if "modules_to_save" in n and p.requires_grad]
    assert len(norm_copies) == 4 and all(p.dtype == torch.float32 for p in norm_copies)  # FP32 masters
    with torch.no_grad():  # a trained adapter: LoRA B is zero at initialisation
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.02, generator=torch.Generator().manual_seed(len(name)))
    ids = torch.randint(7, 100, (4, 48), generator=torch.Generator().manual_seed(0))
    return model.eval(), ids


def _logprobs(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits.float().log_softmax(-1)


@pytest.mark.parametrize("sigma", aqn.sigma_trend(1e-2, 1e-4, 10))  # the default schedule's levels
def test_noise_reaches_the_rollout_logits_at_every_stage(nvfp4_bf16_policy, sigma):
    model, ids = nvfp4_bf16_policy
    params = {n: (p, p.detach().clone()) for n, p in model.named_parameters()}
    clean = _logprobs(model, ids)
    assert clean.dtype == torch.float32 and model.dtype == torch.bfloat16
    with aqn.noisy_norms(model, sigma, torch.Generator().manual_seed(11), dtype_rule="fp32") as stats:
        noisy = _logprobs(model, ids)
    assert stats.num_norms == 4 and stats.changed_fraction > 0.99
    shift = (noisy - clean).abs().mean().item()
    assert shift > 0, f"sigma {sigma:.1e}: the noise did not reach the logits"
    # The reference's rule on the same draw: BF16 rounds noise this small off a scale of 1 (sigma <= 1e-3).
    with aqn.noisy_norms(model, sigma, torch.Generator().manual_seed(11), dtype_rule="bf16") as stats:
        reference = _logprobs(model, ids)
    if sigma < 2e-4:
        assert stats.changed_fraction == 0 and torch.equal(reference, clean)
    # Clean again, bit for bit, in the same Parameter objects and dtypes.
    assert torch.equal(_logprobs(model, ids), clean)
    for name, (param, value) in params.items():
        current = model.get_parameter(name)
        assert current is param and current.dtype == value.dtype and torch.equal(current, value), name


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


def test_restored_after_exception_and_zero_sigma_is_noop(seed):
    model, _ = build_tiny()
    clean = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(RuntimeError):
        with aqn.noisy_norms(model, 0.1):
            raise RuntimeError("generation failed")
    assert all(torch.equal(v, clean[k]) for k, v in model.state_dict().items())
    with aqn.noisy_norms(model, 0.0) as stats:
        assert stats.num_norms == 0
        assert all(torch.equal(v, clean[k]) for k, v in model.state_dict().items())


def test_trainable_norms_perturb_the_active_copy(seed):
    model, _ = build_tiny()
    names = norms.layer_norm_names(model)
    assert names == ["input_layernorm", "post_attention_layernorm"]
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=4, target_modules=["q_proj"], modules_to_save=names))
    sites = norms.find_norms(peft_model)
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
        assert all(".original_module" in p for p in norms.find_norms(peft_model).layer_norms)


def _norm_tree(layers: list[dict[str, int]], final: int, reverse: bool = False) -> torch.nn.Module:
    """A bare module tree of RMSNorms, the way a rollout engine may hold them: model.layers[i].<name>, model.norm;
    `reverse` registers each layer's norms in the opposite order."""
    inner = torch.nn.Module()
    inner.layers = torch.nn.ModuleList(
        torch.nn.ModuleDict({n: torch.nn.RMSNorm(size) for n, size in (reversed(d.items()) if reverse else d.items())})
        for d in layers
    )
    inner.norm = torch.nn.RMSNorm(final)
    model = torch.nn.Module()
    model.model = inner
    return model


def test_each_norm_draws_the_same_noise_whatever_the_tree_around_it():
    """A norm's noise depends on the round's generator and the norm's layer and name alone: the policy (norms under
    self_attn and mlp siblings, inside peft), a flat engine tree whose layers list their norms in the other order,
    and either with the final norm included or not, all get the same noise on the same norm."""
    policy, _ = build_tiny()
    peft = get_peft_model(policy, LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["input_layernorm"]))
    found = norms.find_norms(peft)
    flat = _norm_tree([{"input_layernorm": 64, "post_attention_layernorm": 64}] * 2, 64, reverse=True)

    def noise(model, include_final):
        sites = norms.find_norms(model)
        keyed = sites.keyed(include_final)
        clean = {k: m.weight.detach().float().clone() for k, m in keyed.items()}
        with aqn.noisy_norms(model, 0.1, torch.Generator().manual_seed(7), include_final, fp32_compute=False):
            return {k: m.weight.detach().float() - clean[k] for k, m in keyed.items()}

    ours, engines = noise(peft, False), noise(flat, False)
    assert (
        set(ours)
        == set(engines)
        == {f"{i}.{n}" for i in (0, 1) for n in ("input_layernorm", "post_attention_layernorm")}
    )
    assert all(torch.equal(ours[k], engines[k]) for k in ours)
    assert "base_model.model.model.layers.0.input_layernorm.modules_to_save.default" in found.layer_norms
    with_final = noise(flat, True)
    assert all(torch.equal(with_final[k], engines[k]) for k in engines) and with_final["final.norm"].abs().max() > 0
    assert len({tuple(v.tolist()) for v in ours.values()}) == len(ours)  # every norm its own draw


def test_noise_keys_name_a_norm_by_layer_and_name_and_keep_every_norm_apart():
    """A norm's key is its layer (the outermost ModuleList's element it sits in, as find_norms records it) and its
    name; norms whose short keys coincide (same-named siblings in one layer, two stacks of layers, nested lists)
    are keyed by their whole paths, so no two norms ever share a draw."""
    keys = norms.noise_keys(
        {
            "base_model.model.model.layers.3.self_attn.q_norm": "3",
            "model.layers.3.input_layernorm.modules_to_save.default": "3",
            "model.norm.original_module": None,
            "blocks.1.attn.norm": "1",
            "blocks.1.mlp.norm": "1",
            "encoder.layers.0.ln": "0",
            "decoder.layers.0.ln": "0",
        }
    )
    assert keys == {
        "base_model.model.model.layers.3.self_attn.q_norm": "3.q_norm",
        "model.layers.3.input_layernorm.modules_to_save.default": "3.input_layernorm",
        "model.norm.original_module": "final.norm",
        "blocks.1.attn.norm": "blocks.1.attn.norm",
        "blocks.1.mlp.norm": "blocks.1.mlp.norm",
        "encoder.layers.0.ln": "encoder.layers.0.ln",
        "decoder.layers.0.ln": "decoder.layers.0.ln",
    }
    # find_norms records the outermost list's index: a T5-style block.3.layer.0.norm belongs to layer 3.
    block = torch.nn.Module()
    block.layer = torch.nn.ModuleList([torch.nn.ModuleDict({"norm": torch.nn.RMSNorm(8)}) for _ in range(2)])
    tree = torch.nn.Module()
    tree.block = torch.nn.ModuleList([block, block.__class__()])
    tree.block[1].layer = torch.nn.ModuleList([torch.nn.ModuleDict({"norm": torch.nn.RMSNorm(8)})])
    sites = norms.find_norms(tree, hidden_size=8)
    assert sites.layer_of == {"block.0.layer.0.norm": "0", "block.0.layer.1.norm": "0", "block.1.layer.0.norm": "1"}
    assert sorted(sites.keyed(False)) == ["1.norm", "block.0.layer.0.norm", "block.0.layer.1.norm"]
    assert norms.noise_seed(5, "3.q_norm") == norms.noise_seed(5, "3.q_norm") != norms.noise_seed(5, "3.k_norm")


def test_a_rounds_noise_is_its_own_and_replays_exactly():
    """RoundNoise.of_round: the same round gives the same noise on a second call (the shift forward's replay),
    another round or step gives other noise, and with required a model without norms is named."""
    model, _ = build_tiny()
    noise = aqn.RoundNoise(seed=3, include_final=False, dtype_rule="fp32", include_head_norms=False)
    weight = model.model.layers[0].input_layernorm.weight

    def drawn(noise_round):
        with noise.of_round(model, 0.1, noise_round, fp32_compute=False):
            return model.model.layers[0].input_layernorm.weight.detach().clone()

    first = drawn((4, 0))
    assert torch.equal(drawn((4, 0)), first) and not torch.equal(first, weight)
    assert not torch.equal(drawn((4, 1)), first) and not torch.equal(drawn((5, 0)), first)
    with pytest.raises(RuntimeError, match="AQN found no RMSNorm in Linear"):
        with noise.of_round(torch.nn.Linear(4, 4), 0.1, (0, 0)):
            pass


def test_a_round_noise_forgets_a_model_that_is_gone():
    """RoundNoise finds a model's norms once and holds them by the model, weakly: a later model that happens to get
    the same id (a freed one's address) is not given the first one's norms."""
    import gc

    noise = aqn.RoundNoise(seed=0, include_final=True, dtype_rule="fp32", include_head_norms=False)
    model, _ = build_tiny(num_layers=1)
    assert noise.sites(model) is noise.sites(model)
    del model
    gc.collect()
    assert len(noise._sites) == 0
