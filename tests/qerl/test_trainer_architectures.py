"""AQN on the architectures whose norms differ (CPU, tiny policies quantized by our quantizer, DAPO steps at the
recipe's rate): Qwen3's per-head q/k norms (left alone, or perturbed with aqn_head_norms), Gemma-3's four (1 + w)
norms a layer on the native engine."""

import torch
from fakes import make_trainer, recipe_config

from qerl import norms
from qerl.nvfp4.linear import NVFP4Linear
from qerl.tiny import build_tiny, save_tiny_checkpoints


def _nvfp4_checkpoint(tmp_path, architecture: str) -> str:
    """qerl.tiny's model of `architecture` (head_dim 32) saved and quantized by our quantizer: its NVFP4 folder."""
    model, tokenizer = build_tiny(architecture=architecture, head_dim=32)
    return save_tiny_checkpoints(str(tmp_path / architecture), model, tokenizer)[1]


def _head_norms(model) -> dict:
    """A copy of the per-head q/k norm scales, by parameter name."""
    heads = ("q_norm.weight", "k_norm.weight")
    return {n: p.detach().clone() for n, p in model.named_parameters() if n.endswith(heads)}


def test_qwen3_nvfp4_dapo_steps_perturb_only_the_layer_norms(tmp_path):
    """A Qwen3 (per-head q/k norms, head_dim 32 on a hidden size of 64) quantized by our quantizer: DAPO steps at
    the recipe's rate with AQN. The noise goes on the two hidden-size norms per layer only (the paper's rule: noise
    that folds into the next projections' input channels); the per-head norms stay frozen and untouched."""
    nvfp4_dir = _nvfp4_checkpoint(tmp_path, "qwen3")
    trainer = make_trainer(nvfp4_dir, recipe_config(tmp_path, trainable_norms=True, max_steps=3, num_stages=3))
    policy_model = trainer.model
    head_norms = _head_norms(policy_model)
    assert len(head_norms) == 4 and not any(policy_model.get_parameter(n).requires_grad for n in head_norms)
    sites = norms.find_norms(policy_model)
    assert (
        sorted(path.split(".")[-3] for path in sites.layer_norms)
        == ["input_layernorm"] * 2 + ["post_attention_layernorm"] * 2
    )
    lora_b = {n: p for n, p in policy_model.named_parameters() if "lora_B" in n}
    trainer.train()
    assert trainer.last_noise.num_norms == 4 and trainer.last_noise.sigma > 0
    assert any(p.abs().max() > 0 for p in lora_b.values())
    assert all(torch.equal(policy_model.get_parameter(n), v) for n, v in head_norms.items())


def test_aqn_head_norms_perturbs_qwen3s_per_head_norms_in_rollout_and_shift_forward(tmp_path):
    """aqn_head_norms: the round's noise covers the per-head q/k norms too (2 layer norms + 2 head norms per layer),
    on the native engine and in the training forward that measures AQN's shift; the clean norms come back."""
    nvfp4_dir = _nvfp4_checkpoint(tmp_path, "qwen3")
    args = recipe_config(
        tmp_path,
        max_steps=2,
        num_stages=3,
        sigma_start=0.1,
        sigma_end=0.05,
        rollout_backend="native",
        aqn_head_norms=True,
        aqn_log_shift=True,
    )
    trainer = make_trainer(nvfp4_dir, args)
    head_norms = _head_norms(trainer.model)
    trainer.train()
    assert trainer.last_noise.sigma > 0 and trainer.last_noise.num_norms == 8
    assert any(h["aqn/logprob_shift"] > 0 for h in trainer.state.log_history if "aqn/logprob_shift" in h)
    assert all(torch.equal(trainer.model.get_parameter(n), v) for n, v in head_norms.items())


def test_gemma3_nvfp4_dapo_steps_on_the_native_engine_with_aqn(tmp_path):
    """A Gemma-3 text model (tiny: (1 + w) norms, four per layer, q/k norms, tied scaled embeddings, GELU-tanh,
    local and global layers) quantized by our quantizer, DAPO steps with AQN on the native engine: the noise goes on
    w of the four hidden-size norms per layer (w + Z scales by 1 + w + Z, the same shift), reaches the engine's
    scales at every noisy round, and leaves the per-head norms alone. (Live-row compaction and the wave kept between
    rounds on: the flags reach the engine, and the last round replays the round before's wave.)"""
    nvfp4_dir = _nvfp4_checkpoint(tmp_path, "gemma3")
    args = recipe_config(
        tmp_path,
        trainable_norms=True,
        max_steps=3,
        num_stages=3,
        rollout_backend="native",
        rollout_compact_rows=True,
        rollout_keep_between_rounds=True,
    )
    trainer = make_trainer(nvfp4_dir, args)
    policy_model = trainer.model
    engine = trainer.rollout.engine
    assert trainer.rollout.name == "native" and trainer.is_nvfp4 and engine.compact_rows and engine.keep_between_rounds
    assert isinstance(
        policy_model.get_submodule("base_model.model.model.layers.0.mlp.down_proj.base_layer"), NVFP4Linear
    )
    sites = norms.find_norms(policy_model)
    assert sorted({path.split(".")[-3] for path in sites.layer_norms}) == [
        "input_layernorm",
        "post_attention_layernorm",
        "post_feedforward_layernorm",
        "pre_feedforward_layernorm",
    ]
    head_norms = _head_norms(policy_model)
    engine_noise, perturb_of = [], trainer.rollout.generate

    def watched(prompt_ids, perturb):
        def spy(scales):  # the engine's norm scales, as the sampler's kernels read them
            cm = perturb(scales)

            class Spy:
                def __enter__(self):
                    stats = cm.__enter__()
                    noise = torch.cat(
                        [
                            (h.weight - n.weight.float()).flatten()
                            for h, n in scales.pairs[:-1]
                            if h.weight.numel() == 64
                        ]
                    )  # the hidden-size norms (not the per-head ones)
                    engine_noise.append((stats.sigma, noise.std().item()))
                    return stats

                def __exit__(self, *exc):
                    return cm.__exit__(*exc)

            return Spy()

        return perturb_of(prompt_ids, spy)

    trainer.rollout.generate = watched
    lora_b = {n: p for n, p in policy_model.named_parameters() if "lora_B" in n}
    trainer.train()
    assert trainer.last_noise.num_norms == 8 and trainer.last_noise.sigma > 0
    noisy = [(sigma, std) for sigma, std in engine_noise if sigma > 0]
    assert noisy and all(0.5 * sigma < std < 2 * sigma for sigma, std in noisy)
    assert all(std == 0 for sigma, std in engine_noise if sigma == 0)
    assert any(p.abs().max() > 0 for p in lora_b.values())
    assert all(torch.equal(policy_model.get_parameter(n), v) for n, v in head_norms.items())
    assert engine.last_kept_wave_reused  # the last round replayed the round before's wave
