"""Activations kept instead of recomputed where they fit (qerl/kept_activations.py): the bytes a token's pass saves,
counted on a short forward, are what one more decoder layer adds to autograd's saved tensors; the rule turns the
layers' checkpointing off only when the largest micro-batch fits its share; and a training step that keeps them gets
the gradient of the step that recomputes them."""

import pytest
import torch
from fakes import digit_share_reward, make_trainer, recipe_config
from peft import get_peft_model
from transformers import TrainerCallback

from qerl import base_model, kept_activations, lora
from qerl.dense_weights import DenseWeights
from qerl.kept_activations import KeptActivations, saved_bytes_per_token
from qerl.tiny import build_tiny_model, build_tiny_tokenizer


def _policy(architecture: str, layers: int):
    model = build_tiny_model(
        build_tiny_tokenizer(), hidden_size=128, intermediate_size=352, num_layers=layers, num_heads=4,
        num_kv_heads=2, dtype=torch.bfloat16, architecture=architecture, head_dim=48,
    )  # fmt: skip
    return get_peft_model(model, lora.lora_config(model, rank=16, alpha=16)).train()


def _all_saved_bytes(model, tokens: int) -> int:
    """Every tensor autograd saves in one forward, by storage, less the model's own parameters and buffers."""
    own = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    saved = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in own:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=torch.randint(5, 40, (1, tokens)), use_cache=False, logits_to_keep=1)
    return sum(saved.values())


@pytest.mark.parametrize("architecture", ["qwen2", "qwen3", "gemma3"])
def test_the_probe_counts_what_each_decoder_layer_adds_to_the_saved_tensors(architecture):
    """The probe's bytes per token are the decoder layers' alone: what a model of three layers saves beyond one of two
    (the same embedding, head and final norm), per layer, times the layers; BF16 with LoRA r16, as runs train."""
    two, three = _policy(architecture, 2), _policy(architecture, 3)
    tokens = kept_activations.PROBE_TOKENS
    per_layer = (_all_saved_bytes(three, tokens) - _all_saved_bytes(two, tokens)) / tokens
    layers = base_model.decoder_layers(three)
    probed = saved_bytes_per_token(three, list(layers), torch.device("cpu"))
    assert per_layer > 0 and probed == pytest.approx(3 * per_layer, rel=0.02)
    # the layers' flags and hooks are as they were
    assert not any(layer.gradient_checkpointing for layer in layers)
    assert not any(layer._forward_pre_hooks or layer._forward_hooks for layer in layers)


def test_the_probe_does_not_count_the_dense_training_weights_that_the_passes_save(checkpoints):
    """F.linear saves its weight for the input gradient: the dense copies (plain attributes of the NVFP4 layers) are
    held by the model, not by a token. Counted, the 1.5B's 3 GB made every round recompute on the H200."""
    _, nvfp4_dir = checkpoints
    base = base_model.load_base_model(nvfp4_dir, dtype=torch.bfloat16, device="cpu")
    model = get_peft_model(base, lora.lora_config(base, rank=16, alpha=16)).train()
    layers, cpu = list(base_model.decoder_layers(model)), torch.device("cpu")
    per_call = saved_bytes_per_token(model, layers, cpu)
    dense = DenseWeights(model, enabled=True)
    dense.materialize()
    assert dense.active and per_call > 0
    assert saved_bytes_per_token(model, layers, cpu) == per_call


def _checkpointed_policy():
    model = _policy("qwen2", 2)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def test_the_rule_keeps_a_micro_batch_that_fits_its_share_and_recomputes_one_that_does_not(monkeypatch):
    model = _checkpointed_policy()
    layers = list(base_model.decoder_layers(model))
    kept = KeptActivations(model, enabled=None, checkpointing=True, processes=1)
    available = {"bytes": 0}
    monkeypatch.setattr(kept_activations, "available_bytes", lambda device: available["bytes"])
    cpu = torch.device("cpu")
    per_token = saved_bytes_per_token(model, layers, cpu)
    available["bytes"] = int(1000 * per_token / kept_activations.KEEP_SHARE) + 1  # 1,000 tokens fit exactly
    assert kept.decide(1000, cpu) and kept.per_token == per_token
    assert not any(layer.gradient_checkpointing for layer in layers)
    # the flags stay off through a rollout (TRL turns on only what it found on); the rule turns them on again
    assert not kept.decide(1001, cpu) and all(layer.gradient_checkpointing for layer in layers)
    assert kept.rounds == 1
    # true: always kept, whatever the memory; false: the recipe's checkpointing decides alone
    assert KeptActivations(model, enabled=True, checkpointing=True, processes=1).decide(10**9, cpu)
    assert not any(layer.gradient_checkpointing for layer in layers)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    for never in (
        KeptActivations(model, enabled=False, checkpointing=True, processes=1),
        KeptActivations(model, enabled=None, checkpointing=True, processes=2),  # ranks could decide apart
        KeptActivations(model, enabled=True, checkpointing=False, processes=1),  # nothing recomputed to save
    ):
        assert not never.decide(1, cpu) and all(layer.gradient_checkpointing for layer in layers)


class GradientsBeforeTheStep(TrainerCallback):
    def __init__(self, model):
        self.model, self.grads = model, None

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.grads = {n: p.grad.detach().clone() for n, p in self.model.named_parameters() if p.grad is not None}
        layers = base_model.decoder_layers(self.model)
        self.checkpointed = [layer.gradient_checkpointing for layer in layers] + [self.model.is_gradient_checkpointing]


def _one_step(checkpoint, tmp_path, keep):
    args = recipe_config(tmp_path / str(keep), per_device_train_batch_size=4, gradient_accumulation_steps=2,
                         num_generations=4, max_completion_length=12, max_steps=1, gradient_checkpointing=True,
                         keep_activations=keep)  # fmt: skip
    trainer = make_trainer(checkpoint, args, reward=digit_share_reward)
    watch = GradientsBeforeTheStep(trainer.model)
    trainer.add_callback(watch)
    torch.manual_seed(0)
    trainer.train()
    return watch.grads, watch.checkpointed, trainer.kept_activations


def test_a_step_that_keeps_its_activations_gets_the_recomputing_steps_gradient(checkpoints, tmp_path):
    """One DAPO step of the tiny NVFP4 model in BF16 (the recipe's optimizer settings) with gradient checkpointing,
    its activations kept against recomputed: the same rollouts and the same gradient; by memory (the default, whose
    probe runs inside the trainer: TRL's fused LM head on the model, the dense copies made), kept."""
    _, nvfp4_dir = checkpoints
    recomputed, checkpointed, never = _one_step(nvfp4_dir, tmp_path, keep=False)
    kept, not_checkpointed, always = _one_step(nvfp4_dir, tmp_path, keep=True)
    by_memory = _one_step(nvfp4_dir, tmp_path, keep=None)  # the default: the probe runs inside the trainer
    assert never.rounds == 0 and always.rounds == 1
    assert by_memory[2].rounds == 1 and by_memory[2].per_token > 0 and not any(by_memory[1])  # a tiny step fits
    assert all(torch.equal(by_memory[0][name], grad) for name, grad in kept.items())
    assert all(checkpointed) and not any(not_checkpointed) and len(checkpointed) == 3  # through the passes
    assert kept.keys() == recomputed.keys() and len(kept) > 0
    a = torch.cat([g.flatten().double() for g in kept.values()])
    b = torch.cat([g.flatten().double() for g in recomputed.values()])
    assert (a - b).norm() <= 1e-3 * b.norm() and b.norm() > 0


@pytest.mark.gpu
def test_on_the_gpu_the_probe_predicts_what_a_forward_leaves_allocated():
    """On CUDA (its attention kernels, its allocator) the probe's bytes per token times a micro-batch's tokens are what
    the allocator holds after that micro-batch's forward with gradients: the saved tensors (the output is one
    position's logits)."""
    device = torch.device("cuda")
    model = build_tiny_model(
        build_tiny_tokenizer(), hidden_size=512, intermediate_size=1792, num_layers=4, num_heads=8, num_kv_heads=2,
        dtype=torch.bfloat16,
    )  # fmt: skip
    model = get_peft_model(model.to(device), lora.lora_config(model, rank=16, alpha=16)).train()
    per_token = saved_bytes_per_token(model, list(base_model.decoder_layers(model)), device)
    ids = torch.randint(5, 40, (4, 512), device=device)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated(device)
    out = model(input_ids=ids, use_cache=False, logits_to_keep=1)
    held = torch.cuda.memory_allocated(device) - before
    assert out.logits.shape[1] == 1
    assert held == pytest.approx(per_token * ids.numel(), rel=0.15)
