"""The TRL internals QeRL relies on ("THE TRL SEAM" in qerl/trainer.py and qerl/trainer_rollouts.py), pinned one by
one against the installed TRL: an upgrade that renames, re-signs or rewires one of them fails here, naming it, rather
than somewhere in a training run."""

import inspect
import re
from collections import defaultdict

import pytest
import torch
from fakes import make_trainer
from torch.nn.parallel import DistributedDataParallel
from trl import GRPOConfig, GRPOTrainer

from qerl.config import QeRLConfig, batch_error_fix
from qerl.trainer import QeRLTrainer
from qerl.trainer_rollouts import RolloutRounds


def _params(function) -> list[str]:
    return list(inspect.signature(function).parameters)


def _source(function) -> str:
    return inspect.getsource(function)


@pytest.fixture(scope="module")
def trainer(checkpoints, tmp_path_factory):
    _, nvfp4_dir = checkpoints
    args = QeRLConfig(
        str(tmp_path_factory.mktemp("seam")),
        use_cpu=True,
        report_to=[],
        per_device_train_batch_size=4,
        num_generations=4,
        lora_rank=4,
        rollout_backend="transformers",
    )
    return make_trainer(nvfp4_dir, args, num_examples=8)


def test_overridden_methods_keep_trl_signatures():
    assert _params(GRPOTrainer._generate_single_turn) == [
        "self",
        "prompt_ids",
        "images",
        "multimodal_fields",
        "num_generations",
        "has_tool_images",
    ]
    assert _params(GRPOTrainer._generate_and_score_completions) == ["self", "inputs"]
    assert _params(GRPOTrainer._compute_loss) == ["self", "model", "inputs"]
    rewards = ["self", "inputs", "prompts", "completions", "completion_ids_list"]
    assert _params(GRPOTrainer._calculate_rewards) == rewards
    for name in ("_generate_single_turn", "_generate_and_score_completions", "_calculate_rewards", "_compute_loss"):
        assert _params(getattr(QeRLTrainer, name)) == _params(getattr(GRPOTrainer, name)), name
    logps = _params(GRPOTrainer._get_per_token_logps_and_entropies)
    assert logps[:6] == ["self", "model", "input_ids", "attention_mask", "logits_to_keep", "batch_size"]
    # Our wrapper passes whatever TRL passes; TRL returns (logps, entropies, aux_loss).
    assert "return logps, entropies, aux_loss" in _source(GRPOTrainer._get_per_token_logps_and_entropies)


def test_generation_round_returns_ids_and_logprobs_to_trl():
    """TRL samples a round through _generate_single_turn and takes (completion ids, log-probs) back."""
    assert "completion_ids, logprobs = self._generate_single_turn(" in _source(GRPOTrainer._generate)


def test_batch_keys_read_and_written():
    source = _source(GRPOTrainer._generate_and_score_completions)
    for key in (
        "prompt_ids",
        "prompt_mask",
        "completion_ids",
        "completion_mask",
        "old_per_token_logps",
        "sampling_per_token_logps",
        "tool_mask",
    ):
        assert re.search(rf'output\["{key}"\] = |"{key}": {key},', source), key
    # Old log-probs only when generation and optimizer steps are misaligned, or for the correction.
    assert "old_per_token_logps = None" in source
    assert "self.args.gradient_accumulation_steps % generate_every != 0" in source


def test_an_added_per_sample_key_reaches_the_loss():
    """aqn_noisy_logps rides in the batch dict: TRL's shuffling and splitting must carry any per-sample tensor."""
    from trl.trainer.utils import shuffle_sequence_dict, split_tensor_dict

    assert "shuffle_sequence_dict(generation_batch)" in _source(GRPOTrainer._prepare_inputs)
    batch = {"completion_ids": torch.arange(4)[:, None], "aqn_noisy_logps": torch.arange(4)[:, None] * 10.0}
    for part in split_tensor_dict(shuffle_sequence_dict(batch), 2):
        assert torch.equal(part["aqn_noisy_logps"], part["completion_ids"] * 10.0)


def test_rewards_are_gathered_per_function_before_the_advantages():
    """_calculate_rewards returns every rank's rows (gathered), one column per reward function; TRL's advantages and
    its logged reward come from that tensor after the call, weighted by reward_weights, and a truncated completion
    is one whose last id is neither EOS nor padding: what the extension reads and may change."""
    assert "rewards_per_func = gather(rewards_per_func)" in _source(GRPOTrainer._calculate_rewards)
    score = _source(GRPOTrainer._generate_and_score_completions)
    call = score.index("rewards_per_func = self._calculate_rewards(")
    assert call < score.index("advantages = rewards - mean_grouped_rewards")
    assert "self.reward_weights.to(device).unsqueeze(0)" in score
    assert "ids[-1] not in eos_and_pad" in _source(GRPOTrainer._generate)


def test_use_vllm_gates_the_correction_and_nothing_else_we_run():
    gate = "self.use_vllm and self.vllm_importance_sampling_correction"
    assert gate in _source(GRPOTrainer._generate_and_score_completions)
    assert gate in _source(GRPOTrainer._compute_loss)
    readers = {
        name
        for name, member in inspect.getmembers(GRPOTrainer, inspect.isfunction)
        if "self.use_vllm" in _source(member)
    }
    # __init__ reads it before QeRLTrainer sets it; _generate reads it only for rollout_func and _tool_call_loop
    # only for tools, both refused by QeRLTrainer; _generate_single_turn is overridden.
    assert readers == {
        "__init__",
        "_generate",
        "_tool_call_loop",
        "_generate_single_turn",
        "_generate_and_score_completions",
        "_compute_loss",
    }
    assert "if self.rollout_func is not None:" in _source(GRPOTrainer._generate)


def test_private_state_the_trainer_reads(trainer):
    assert isinstance(trainer._metrics["train"], defaultdict) and "self._metrics[mode]" in _source(GRPOTrainer.log)
    assert trainer._tokenizer.pad_token_id is not None and trainer.eos_token_ids
    assert hasattr(trainer, "pad_to_multiple_of")
    assert trainer.generation_config.max_new_tokens == trainer.args.max_completion_length
    assert trainer.use_vllm is False  # the correction is off by default
    assert GRPOTrainer._tag_names and GRPOTrainer._name == "GRPO"


def test_micro_batch_bookkeeping_the_trainer_reads(trainer):
    """What _prepare_inputs and the nonfinite dump read of TRL's micro-steps: TRL generates when _step is a multiple
    of steps_per_generation * num_iterations (or nothing is buffered), splits into _buffered_inputs and hands out
    _buffered_inputs[_step % steps_per_generation]; training_step advances _step after the step."""
    prepare = _source(GRPOTrainer._prepare_inputs)
    assert "generate_every = self.args.steps_per_generation * self.num_iterations" in prepare
    assert "if self._step % generate_every == 0 or self._buffered_inputs is None:" in prepare
    assert "split_tensor_dict(generation_batch, self.args.steps_per_generation)" in prepare
    assert "inputs = self._buffered_inputs[self._step % self.args.steps_per_generation]" in prepare
    step = _source(GRPOTrainer.training_step)
    assert step.index("super().training_step(") < step.index("self._step += 1")
    assert _params(QeRLTrainer._prepare_inputs) == _params(GRPOTrainer._prepare_inputs)
    assert isinstance(trainer._step, int) and isinstance(trainer.num_iterations, int)
    from transformers import Trainer  # sets it for each accumulation window of the training loop

    assert "self.current_gradient_accumulation_steps = len(batch_samples)" in _source(Trainer)
    assert trainer.temperature == trainer.args.temperature and trainer.loss_type == trainer.args.loss_type
    assert trainer._entropy_bonus_enabled is False  # the recipes add no entropy bonus
    assert "if self._entropy_bonus_enabled:" in _source(GRPOTrainer._compute_loss)


def test_copied_sampling_metrics_are_trls(trainer):
    """The mismatch metrics logged with the correction off carry the names TRL logs with it on."""
    mask = torch.ones(2, 3)
    batch = {"completion_mask": mask, "sampling_per_token_logps": torch.full((2, 3), -1.0)}
    trainer._metrics["train"].clear()
    trainer.model.train()
    trainer._log_rollout_mismatch(torch.full((2, 3), -1.5), batch)
    names = [name for name in trainer._metrics["train"] if name.startswith("sampling/")]
    assert len(names) == 5
    source = _source(GRPOTrainer._generate_and_score_completions)
    for name in names:
        assert f'"{name}"' in source, name
    trainer._metrics["train"].clear()


def test_batch_error_text_is_matched():
    with pytest.raises(ValueError, match="divisible by num_generations") as info:
        GRPOConfig("out", per_device_train_batch_size=6, num_generations=4, use_cpu=True, report_to=[])
    assert batch_error_fix(info.value, QeRLConfig("out", use_cpu=True, report_to=[])) is not None
    assert GRPOConfig("out", per_device_train_batch_size=4, num_generations=4, use_cpu=True).generation_batch_size == 4


def test_ddp_ignore_list(trainer):
    ignored = trainer.model._ddp_params_and_buffers_to_ignore
    buffers = ("weight_packed", "weight_scale", "weight_global_scale", "splitk_counters")  # NVFP4Linear's, all of them
    assert len(ignored) == 4 * 14 and all(n.endswith(buffers) for n in ignored)
    assert all(b._ddp_ignored for n, b in trainer.model.named_buffers() if n in ignored)
    assert "_ddp_params_and_buffers_to_ignore" in _source(DistributedDataParallel.__init__)


def test_trl_helpers_we_import():
    from trl.extras.profiling import profiling_context
    from trl.models import unwrap_model_for_generation
    from trl.trainer.utils import ensure_master_addr_port, pad, split_tensor_dict

    assert _params(profiling_context) == ["trainer", "name"]
    assert {"gather_deepspeed3_params", "gradient_checkpointing_kwargs"} <= set(_params(unwrap_model_for_generation))
    assert {"padding_value", "padding_side", "pad_to_multiple_of"} <= set(_params(pad))
    assert _params(ensure_master_addr_port)[:2] == ["addr", "port"]
    assert _params(split_tensor_dict) == ["tensor_dict", "num_chunks"]


def test_transformers_trainer_internals():
    """transformers' Trainer, TRL's base: the checkpoint save QeRLTrainer wraps (trainer_state.json, the mark of a
    whole checkpoint, written last) and the EOS alignment that KeepModelEos undoes (before the first on_train_begin)."""
    from transformers import Trainer

    assert _params(Trainer._save_checkpoint) == ["self", "model", "trial"]
    assert _params(QeRLTrainer._save_checkpoint) == _params(Trainer._save_checkpoint)
    save = _source(Trainer._save_checkpoint)
    written = [
        save.index(call)
        for call in (
            "self.save_model(",
            "self._save_optimizer_and_scheduler(",
            "self._save_rng_state(",
            "TRAINER_STATE_NAME",
        )
    ]
    assert written == sorted(written)
    train = _source(Trainer.train)
    assert train.index("align_special_tokens(self.model, self.processing_class)") < train.index("inner_training_loop(")
    assert "self.callback_handler.on_train_begin(" in _source(Trainer._inner_training_loop)


# The TRL internals the seams list: no line of either trainer module above its seam touches one.
TRL_INTERNALS = ("_generate_single_turn", "_generate_and_score_completions", "_get_per_token_logps_and_entropies",
                 "_calculate_rewards", "_compute_loss", "use_vllm", "_metrics", "_tokenizer", "eos_token_ids",
                 "pad_to_multiple_of", "generation_config", "reward_weights", "_tag_names", "_name",
                 "_get_train_sampler", "_tokenize_prompts")  # fmt: skip


def test_every_trl_internal_is_used_in_a_seam_and_nowhere_above():
    """qerl/trainer.py (the loss side) and qerl/trainer_rollouts.py (the rollout side) each have a seam."""
    seams = []
    for module in (inspect.getmodule(QeRLTrainer), inspect.getmodule(RolloutRounds)):
        above, seam = inspect.getsource(module).split("# THE TRL SEAM", 1)
        used_above = sorted({name for name in TRL_INTERNALS if re.search(rf"\bself\.{name}\b", above)})
        helpers_above = [h for h in ("profiling_context(", "unwrap_model_for_generation(") if h in above]
        assert not used_above and not helpers_above, f"{module.__name__}, above its seam: {used_above + helpers_above}"
        seams.append(seam)
    seam = "\n".join(seams)
    assert all(re.search(rf"\bself\.{name}\b|def {name}\b|^\s+{name} = ", seam, re.M) for name in TRL_INTERNALS)
