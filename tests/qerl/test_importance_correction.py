"""TRL's importance-sampling correction with its ratio taken from the loss forward (qerl/importance_correction.py):
the ratio's four modes against float64 math, when the loss forward may give it, and a DAPO step of the tiny NVFP4
model in BF16 that gets TRL's own step's gradient (TRL's separate old-log-probs forward) with one forward fewer."""

import math
import types

import pytest
import torch
from fakes import make_trainer, recipe_config
from transformers import TrainerCallback

from qerl.importance_correction import correction_ratio, from_loss_forward, mismatch_stats


def _logps(seed: int):
    g = torch.Generator().manual_seed(seed)
    clean = -torch.rand(4, 6, generator=g, dtype=torch.float64) * 3
    sampled = clean + torch.randn(4, 6, generator=g, dtype=torch.float64) * 0.4
    mask = torch.ones(4, 6, dtype=torch.float64)
    mask[1, 4:] = 0
    mask[3, 2:] = 0
    return clean, sampled, mask


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_each_mode_is_the_ratio_of_the_clean_and_sampled_probabilities_clamped_or_masked(seed):
    clean, sampled, mask = _logps(seed)
    for b in range(4):
        for t in range(6):
            want = math.exp((clean[b, t] - sampled[b, t]).item()) if mask[b, t] else 1.0
            got = correction_ratio(clean, sampled, mask, "token_truncate", 0.5, 1.5)[b, t].item()
            assert got == pytest.approx(min(max(want, 0.5), 1.5), rel=1e-12)
            got = correction_ratio(clean, sampled, mask, "token_mask", 0.5, 1.5)[b, t].item()
            assert got == pytest.approx(want if 0.5 <= want <= 1.5 else 0.0, rel=1e-12)
        whole = math.exp(sum((clean[b, t] - sampled[b, t]).item() for t in range(6) if mask[b, t]))
        seq = correction_ratio(clean, sampled, mask, "sequence_truncate", None, 3.0)
        assert seq.shape == (4, 1) and seq[b, 0].item() == pytest.approx(min(whole, 3.0), rel=1e-12)
        seq = correction_ratio(clean, sampled, mask, "sequence_mask", None, 3.0)
        assert seq[b, 0].item() == pytest.approx(whole if whole <= 3.0 else 0.0, rel=1e-12)


def test_a_token_the_sampler_could_not_score_counts_as_no_difference_and_a_wrong_mode_is_named():
    clean, sampled, mask = _logps(0)
    sampled[0, 2] = float("nan")
    assert correction_ratio(clean, sampled, mask, "token_truncate", None, 3.0)[0, 2] == 1.0
    stats = mismatch_stats(clean, sampled, mask)
    assert not any(torch.isnan(value) for value, _ in stats.values())
    with pytest.raises(ValueError, match="vllm_importance_sampling_mode='token'"):
        correction_ratio(clean, sampled, mask, "token", None, 3.0)


def test_the_loss_forward_gives_the_ratio_only_when_no_optimizer_step_falls_between_sampling_and_training():
    def args(**kw):
        base = dict(vllm_importance_sampling_correction=True, loss_type="dapo", gradient_accumulation_steps=4,
                    steps_per_generation=4, num_iterations=1)  # fmt: skip
        return types.SimpleNamespace(**{**base, **kw})

    assert from_loss_forward(args())
    assert from_loss_forward(args(steps_per_generation=2))  # two rounds inside one optimizer step
    assert not from_loss_forward(args(steps_per_generation=8))  # a round trains across two optimizer steps
    assert not from_loss_forward(args(num_iterations=2))  # the second pass runs updated parameters
    assert not from_loss_forward(args(loss_type="vespo"))  # VESPO reads the ratio inside its own formula
    assert not from_loss_forward(args(vllm_importance_sampling_correction=False))


class Watch(TrainerCallback):
    def __init__(self, trainer):
        self.trainer, self.grads, self.forwards = trainer, None, 0
        inner = trainer._get_per_token_logps_and_entropies

        def counted(*args, **kwargs):
            self.forwards += 1
            return inner(*args, **kwargs)

        trainer._get_per_token_logps_and_entropies = counted

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        model = self.trainer.model
        self.grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _one_step(checkpoint, tmp_path, from_loss: bool, mode: str, clip_max: float):
    args = recipe_config(tmp_path / f"{from_loss}{mode}", per_device_train_batch_size=4, gradient_accumulation_steps=2,
                         num_generations=4, max_completion_length=12, max_steps=1, sigma_start=5e-2, sigma_end=5e-2,
                         vllm_importance_sampling_correction=True, vllm_importance_sampling_mode=mode,
                         vllm_importance_sampling_clip_max=clip_max)  # fmt: skip
    trainer = make_trainer(checkpoint, args)
    trainer.ratio_from_loss_forward = from_loss
    watch = Watch(trainer)
    trainer.add_callback(watch)
    torch.manual_seed(0)
    trainer.train()
    logged = {k: v for row in trainer.state.log_history for k, v in row.items() if k.startswith("sampling/")}
    return watch, logged


@pytest.mark.parametrize(("mode", "clip_max"), [("token_truncate", 1.0), ("sequence_mask", 1.01)])
def test_a_step_with_the_ratio_from_the_loss_forward_gets_trls_gradient_with_one_forward_fewer(
    checkpoints, tmp_path, mode, clip_max
):
    """One DAPO step (two micro-batches) of the tiny NVFP4 model in BF16 under AQN, the correction on: the ratio from
    each micro-batch's loss forward against TRL's from its old-log-probs forward over the round. The bounds bite:
    token_truncate at 1.0 clamps every token the noisy policy under-sampled (unclamped, the gradient moves 0.9%),
    sequence_mask at 1.01 drops some sequences whole (without the mask, 2x the gradient's norm)."""
    _, nvfp4_dir = checkpoints
    ours, our_logs = _one_step(nvfp4_dir, tmp_path, True, mode, clip_max)
    trls, trl_logs = _one_step(nvfp4_dir, tmp_path, False, mode, clip_max)
    assert trls.forwards == ours.forwards + 1  # the old log-probs forward, once a round
    assert ours.grads.keys() == trls.grads.keys() and len(ours.grads) > 0
    a = torch.cat([g.flatten().double() for g in ours.grads.values()])
    b = torch.cat([g.flatten().double() for g in trls.grads.values()])
    assert (a - b).norm() <= 1e-3 * b.norm() and b.norm() > 0  # bit-equal on our CPUs
    assert our_logs.keys() == trl_logs.keys() and "sampling/importance_sampling_ratio/mean" in our_logs
    for name, value in trl_logs.items():
        assert our_logs[name] == pytest.approx(value, rel=2e-2, abs=2e-3), name
