"""QeRLTrainer: TRL's GRPOTrainer with an NVFP4 + LoRA policy and Adaptive Quantization Noise on its rollouts.

Everything RL (advantages, GRPO/DAPO losses, clipping, importance sampling, logging, checkpoints) is TRL's.
QeRL changes one thing, the generation hook: every generation round samples from the policy with fresh
Gaussian noise on its RMSNorm scales (sigma from the AQN schedule), and returns the log-probability of each
sampled token under that noisy policy. The loss then runs on clean norms.

What this relies on inside TRL is listed, and used, in one section of QeRLTrainer: "THE TRL SEAM" (and its rollout
side's in qerl/trainer_rollouts.py, where the rounds are sampled). As in TRL, the config (QeRLConfig and its checks) is
apart, in qerl/config.py, and so are the callbacks (qerl/callbacks.py).
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings

import torch
from accelerate.utils import is_peft_model
from torch.nn.attention import SDPBackend, sdpa_kernel
from trl import GRPOTrainer

from qerl import base_model, cli, lora, micro_batches, rewards, rounds_ahead, sharding, unpadded_forward
from qerl.callbacks import JsonlMetrics, KeepModelEos
from qerl.config import QeRLConfig
from qerl.dense_weights import DenseWeights
from qerl.importance_correction import LossForwardTap, from_loss_forward, mismatch_stats, scored
from qerl.kept_activations import KeptActivations
from qerl.nonfinite_dump import dump_if_nonfinite, loss_settings
from qerl.nvfp4.linear import NVFP4Linear
from qerl.trainer_rollouts import RolloutRounds
from qerl.truncation import TruncationWatch

logger = logging.getLogger(__name__)
# Attention kernels the training forward and backward may use: all but cuDNN's. Its backward (torch's first choice
# for SDPA on H100/H200; seen with torch 2.11 + cuDNN 9.19) returns NaN dQ when a mask is passed, the padded length
# is 64 mod 128 and a query row is fully masked, as every left-padded prompt row is (pytorch/pytorch#196678,
# trl#7181). It turned 7 of 9 SmolLM2 runs NaN at the steps whose prompt + completion length was 448
# (experiments/nonfinite.py found it).
TRAINING_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


class QeRLTrainer(RolloutRounds, GRPOTrainer):
    """GRPOTrainer whose rollouts come from the AQN-perturbed policy through a rollout backend.

    `model` is the frozen base as base_model.load_base_model loads it (or a peft model). Without a peft model or
    `peft_config`, LoRA is applied from the config's lora_* fields (and trainable_norms).
    """

    def __init__(self, model, reward_funcs=None, args: QeRLConfig | None = None, peft_config=None, **kwargs):
        for unsupported in ("tools", "rollout_func", "environment_factory"):
            if kwargs.get(unsupported) is not None:
                raise ValueError(f"QeRLTrainer does not support {unsupported}: its rollouts go through AQN + a backend")
        if args is None:
            args = QeRLConfig("qerl-output")
        if not isinstance(args, QeRLConfig):
            raise TypeError(f"QeRLTrainer needs a QeRLConfig, got {type(args).__name__}")
        if isinstance(model, (str, os.PathLike)):  # TRL would load it with transformers, blind to NVFP4
            raise TypeError(
                "QeRLTrainer takes a loaded model: base_model.load_base_model(path, precision, dtype, device)"
            )
        self.is_nvfp4 = base_model.is_nvfp4_model(model)
        self.aqn_enabled = self.is_nvfp4 if args.aqn is None else args.aqn
        if self.aqn_enabled and not self.is_nvfp4:
            warnings.warn(
                "AQN is on for a BF16 base. QeRL adds it to NVFP4 policies, whose quantization noise it extends; "
                "on a BF16 base it is plain parameter noise (set aqn=False for the paper's BF16 baseline).",
                stacklevel=2,
            )
        if peft_config is None and not is_peft_model(model):
            peft_config = lora.lora_config(
                model,
                args.lora_rank,
                args.lora_alpha,
                args.lora_target_modules,
                args.lora_dropout,
                args.trainable_norms,
            )
        if args.rollout_max_staleness:  # each round's rows numbered, to find the next round's in the sampler's order
            kwargs["train_dataset"] = rounds_ahead.number_rows(kwargs.get("train_dataset"))
        super().__init__(model=model, reward_funcs=reward_funcs, args=args, peft_config=peft_config, **kwargs)
        # ZeRO keeps FP32 masters of its own (and gathers parameters of one dtype); accelerate's FSDP2 upcasts the
        # trainable parameters to FP32 masters itself and all-gathers them in its mixed precision's dtype.
        if args.deepspeed_plugin is None and not self.is_fsdp_enabled:
            lora.keep_fp32_masters(self.model)
        else:  # their checkpoints save every persistent buffer: the frozen NVFP4 base too
            sharding.keep_base_out_of_checkpoints(self.model)

        self._adapt_trl_internals()
        if args.compile_layers:
            for layer in base_model.decoder_layers(self.model):
                layer.compile(dynamic=True)
        self._warn_eos_mismatch()
        self.add_callback(KeepModelEos(self.model))
        self._init_rounds(args)  # the rollout backend, the rounds' noise (qerl/trainer_rollouts.py)
        # The training passes' BF16 copy of the frozen NVFP4 weights: made after each rollout, dropped before the next.
        self.dense_weights = DenseWeights(self.model, args.dense_training_weights)
        # Activations kept instead of recomputed, round by round, where they fit beside the dense copy.
        self.kept_activations = KeptActivations(
            self.model, args.keep_activations, args.gradient_checkpointing, self.accelerator.num_processes
        )
        self._loss_tap: LossForwardTap | None = None  # open only inside _tapping_loss_forward
        self.ratio_from_loss_forward = from_loss_forward(args)
        self._micro_batch: dict | None = None  # the loss's inputs, kept for dump_nonfinite_grads
        self.nonfinite_dump: str | None = None
        self.truncation_watch = TruncationWatch(
            args.max_completion_length, args.mask_truncated_completions, quiet=not self.accelerator.is_main_process
        )
        self.add_callback(self.truncation_watch)
        self.group_by_length = args.group_micro_batches_by_length
        if self.group_by_length and (why := micro_batches.split_free(args, self._entropy_bonus_enabled)):
            self.group_by_length = False
            if self.accelerator.is_main_process:
                logger.info("micro-batches: TRL's random split, not grouped by length (%s)", why)
        if args.metrics_jsonl:
            self.add_callback(JsonlMetrics(os.path.join(args.output_dir, "metrics.jsonl")))

    def train(self, *args, **kwargs):
        try:
            return super().train(*args, **kwargs)
        finally:
            self.dense_weights.release()  # nothing of the run's passes stays on the GPU after it

    # ======================================================================================================
    # THE TRL SEAM (trl 1.16). Every TRL internal the trainer relies on is used below and nowhere above;
    # tests/qerl/test_trainer_trl_seam.py pins each one (and the two TRL utilities the rollout backends import: pad,
    # ensure_master_addr_port), so that a TRL upgrade that moves one fails there, by name.
    #
    # (The rollout side's seam, _generate_single_turn and the rounds sampled ahead: qerl/trainer_rollouts.py.)
    #
    # Private methods, overridden or called:
    #   _generate_and_score_completions(inputs) -> batch dict: extended. Reads its keys prompt_ids, prompt_mask,
    #       completion_ids, completion_mask, old_per_token_logps, sampling_per_token_logps, tool_mask; adds
    #       aqn_noisy_logps, one row per sample, which TRL's shuffling and splitting carry to _compute_loss.
    #   _get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep, batch_size)
    #       -> (logps, entropies, aux_loss): called under the round's noise (aqn/logprob_shift), wrapped to keep the
    #       loss forward's log-probs, and replaced for text-only batches by the unpadded forward, which calls the
    #       fused LM head TRL's __init__ puts on the model (add_fused_lm_head): model(input_ids, labels,
    #       fused_lm_head=True) -> .log_probs / .entropy per position, 0 where the label is -100.
    #   _calculate_rewards(inputs, prompts, completions, completion_ids_list) -> rewards_per_func, (completions of
    #       every rank) x (reward functions), gathered: extended. Each round's truncated completions and what they
    #       earned go to the TruncationWatch; with fail_truncated_completions their rows are set to 0 before TRL's
    #       advantages.
    #   _compute_loss(model, inputs): wrapped. TRL computes old_per_token_logps only when generation and
    #       optimizer steps are misaligned (or for the correction); otherwise its loss forward runs the very
    #       parameters that sampled, so its log-probs are the clean side of sampling/* and aqn/logprob_shift, and
    #       the correction's ratio: put in inputs["importance_sampling_ratio"] before TRL's loss reads it
    #       (qerl/importance_correction.py), where TRL's generation ran without the correction.
    #   _prepare_inputs(generation_batch): wrapped. On the micro-step that generates, TRL shuffles the batch,
    #       splits it into a new _buffered_inputs list (split_tensor_dict) and returns the step's element of it;
    #       qerl.micro_batches regroups that list by length and the step takes the same position in the new one.
    # Private state:
    #   use_vllm: re-used to mean "apply the importance-sampling correction". After __init__ TRL reads it to gate
    #       that correction (the old_per_token_logps forward, the ratio, its loss factor, the sampling/* metrics),
    #       in _generate_single_turn (overridden) and on the tools / rollout_func paths (refused in __init__). Off
    #       during _generate_and_score_completions where the ratio comes from the loss forward.
    #   _metrics[mode][name]: the lists TRL averages and logs; aqn/*, sampling/* and completions/*_reward_mean go there.
    #   reward_weights: TRL's weight of each reward function (a tensor), for the earned reward of a completion.
    #   _tokenizer, eos_token_ids: TRL's stop tokens, for its own test of a truncated completion (_calculate_rewards)
    #       and the EOS warning (_warn_eos_mismatch).
    #   _tag_names, _name: the model card's tags and trainer name.
    #   _buffered_inputs (_prepare_inputs); _step (micro-steps so far, advanced after each training_step) and
    #       current_gradient_accumulation_steps: which micro-batch a step is (the nonfinite dump).
    #   temperature, loss_type: as TRL's loss uses them (the nonfinite dump records them).
    #   _entropy_bonus_enabled: whether TRL's loss adds its entropy bonus (a mean per micro-batch).
    # TRL's helpers: split_tensor_dict (qerl/micro_batches.py).
    # Copied: the sampling/* metric names and formulas (_log_rollout_mismatch), from TRL's correction block,
    #   so that the rollout/training mismatch is logged under TRL's names with the correction off too.
    # transformers' Trainer (TRL's base class):
    #   _save_checkpoint(model, trial): wrapped, so that SIGINT/SIGTERM wait until a checkpoint is whole (it writes
    #       trainer_state.json last: qerl.train resumes only from a checkpoint that has it).
    #   align_special_tokens, called in Trainer.train before the first on_train_begin: undone there
    #       (callbacks.KeepModelEos).
    # Matched by text, in qerl/config.py: GRPOConfig.__post_init__'s "... must be divisible by num_generations"
    #   (batch_error_fix).
    # torch's private DistributedDataParallel._set_params_and_buffers_to_ignore_for_model (_adapt_trl_internals).

    _tag_names = ["trl", "grpo", "qerl"]
    _name = "QeRL"

    def _adapt_trl_internals(self):
        from torch.nn.parallel import DistributedDataParallel

        # TRL applies its importance-sampling correction only when `use_vllm` is set, i.e. when a separate engine
        # samples. Our backends are such samplers (noisy norms at least), so declare it when the correction is asked.
        self.use_vllm = bool(self.args.vllm_importance_sampling_correction)
        # DDP broadcasts every buffer from rank 0 when it wraps the model (and, by default, before every forward).
        # The packed NVFP4 weights are frozen buffers that every rank loads identically; broadcasting them is
        # wasted bandwidth, and gloo cannot send float8 at all.
        packed = [
            f"{module_name}.{buffer_name}"
            for module_name, module in self.model.named_modules()
            if isinstance(module, NVFP4Linear)
            for buffer_name, _ in module.named_buffers(recurse=False)
        ]
        if packed:
            DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(self.model, packed)

    def _warn_eos_mismatch(self):
        mismatch = base_model.eos_mismatch(self._tokenizer, self.model.generation_config)
        if mismatch:
            warnings.warn(
                f"{mismatch}. Rollouts end at any of them (TRL adds the tokenizer's EOS); the model's own "
                'EOS ids are kept (transformers\' "Updated tokens" notice as training starts is undone '
                "before the first step).",
                stacklevel=3,
            )

    def _save_checkpoint(self, model, trial):
        with cli.signals_deferred():
            super()._save_checkpoint(model, trial)

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        device = rewards_per_func.device
        ends = {*self.eos_token_ids, self._tokenizer.pad_token_id}  # TRL's own test of a truncated completion
        truncated = torch.tensor([ids[-1] not in ends for ids in completion_ids_list], device=device, dtype=torch.int)
        truncated = self.accelerator.gather(truncated).bool()
        # What each completion earned from the task: length rules (the soft overlong punishment) left out.
        task = torch.tensor([not rewards.is_length_rule(f) for f in self.reward_funcs], device=device)
        task_rewards = rewards_per_func[:, task] * self.reward_weights.to(device)[task]
        earned = task_rewards.nansum(dim=1).masked_fill(torch.isnan(task_rewards).all(dim=1), float("nan"))
        mode = "train" if self.model.training else "eval"
        if mode == "train":
            step = self.state.global_step + 1  # the step these completions train, as metrics.jsonl numbers it
            for name, value in self.truncation_watch.observe(step, truncated.tolist(), earned.tolist()).items():
                self._metrics[mode][name].append(value)
        if self.args.fail_truncated_completions:
            rewards_per_func[truncated] = 0.0
        return rewards_per_func

    def _generate_and_score_completions(self, inputs):
        if self.rounds_ahead is not None and self.model.training:
            self.rounds_ahead.taken(inputs)
        correction, self.use_vllm = self.use_vllm, self.use_vllm and not self.ratio_from_loss_forward
        try:  # no old log-probs forward and no ratio here when the loss forward gives them
            output = super()._generate_and_score_completions(inputs)
        finally:
            self.use_vllm = correction
        # With the correction on, TRL logs sampling/* itself (unless the loss forward gives the ratio). When it
        # computed the clean log-probs anyway (generation and optimizer steps misaligned), measure against those;
        # otherwise see _compute_loss.
        if not self.use_vllm and output.get("old_per_token_logps") is not None:
            self._log_rollout_mismatch(output["old_per_token_logps"], output)
        if self.model.training and self.args.aqn_log_shift and self.last_noise.sigma > 0:
            output["aqn_noisy_logps"] = self._noisy_logps(output)
        return output

    @torch.no_grad()
    def _noisy_logps(self, output) -> torch.Tensor:
        """Log-probs of the sampled tokens in the training forward under the very noise the round sampled with
        (round_noise.of_round of the same round): against the clean ones they give AQN's own movement. The
        forward runs on the policy as the rollout opens it (ZeRO-3: gathered, where the norms are whole)."""
        input_ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
        attention_mask = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
        with self._open_policy() as model, self.round_noise.of_round(model, self.last_noise.sigma, self._noise_round):
            logps, _, _ = self._get_per_token_logps_and_entropies(
                model,
                input_ids,
                attention_mask,
                output["completion_ids"].size(1),
                self.args.per_device_train_batch_size,
            )
        return logps

    def _get_per_token_logps_and_entropies(
        self,
        model,
        input_ids,
        attention_mask,
        logits_to_keep,
        batch_size=None,
        compute_entropy=False,
        compute_aux_loss=False,
        **multimodal,
    ):
        batch = (model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy)
        if self.args.unpadded_forward and not compute_aux_loss and all(v is None for v in multimodal.values()):
            compiled = self.args.compile_layers
            logps, entropies = unpadded_forward.completion_logps(*batch, self.accelerator.autocast, compiled)
            result = logps, entropies, None
        else:
            result = super()._get_per_token_logps_and_entropies(*batch, compute_aux_loss, **multimodal)
        if self._loss_tap is not None:
            self._loss_tap.take(result[0])
        return result

    def _compute_loss(self, model, inputs):
        # Without old log-probs, TRL's loss forward runs the clean policy with the parameters that sampled the
        # batch (TRL skips old log-probs exactly then): its log-probs measure the rollout/training mismatch and
        # AQN's shift at no extra forward.
        old = inputs.get("old_per_token_logps")
        sampled = "sampling_per_token_logps" in inputs
        ratio_here = self.use_vllm and self.ratio_from_loss_forward and sampled and old is None
        mismatch = (not self.use_vllm or ratio_here) and old is None and sampled
        shift = "aqn_noisy_logps" in inputs
        if self.args.dump_nonfinite_grads:
            self._micro_batch = inputs
        with self._tapping_loss_forward(mismatch or (shift and old is None), inputs if ratio_here else None) as tap:
            loss = super()._compute_loss(model, inputs)
        clean = old if old is not None or tap is None or not tap.logps else tap.logps[0]
        if mismatch and clean is not None:
            self._log_rollout_mismatch(clean, inputs, inputs.get("importance_sampling_ratio") if ratio_here else None)
        if shift and clean is not None:
            mask = inputs["completion_mask"].bool()
            delta = (clean - inputs["aqn_noisy_logps"]).abs()[mask]
            value = delta.mean() if delta.numel() else torch.tensor(0.0, device=delta.device)
            self._metrics["train"]["aqn/logprob_shift"].append(self.accelerator.gather(value).mean().item())
        return loss

    @contextlib.contextmanager
    def _tapping_loss_forward(self, wanted: bool, ratio_into: dict | None = None):
        """A LossForwardTap on TRL's loss forward while this is open, if `wanted` (else None), putting the
        correction's ratio into `ratio_into` (the loss's inputs) when given."""
        a = self.args
        ratio = (
            a.vllm_importance_sampling_mode,
            a.vllm_importance_sampling_clip_min,
            a.vllm_importance_sampling_clip_max,
        )
        self._loss_tap = LossForwardTap(ratio_into, *ratio) if wanted else None
        try:
            yield self._loss_tap
        finally:
            self._loss_tap = None

    def _prepare_inputs(self, generation_batch):
        buffered = self._buffered_inputs
        inputs = super()._prepare_inputs(generation_batch)
        if self.group_by_length and self._buffered_inputs is not buffered:  # TRL split a new batch at random
            index = next(i for i, batch in enumerate(self._buffered_inputs) if batch is inputs)
            self._buffered_inputs = micro_batches.by_length(self._buffered_inputs)
            inputs = self._buffered_inputs[index]
        return inputs

    def training_step(self, model, inputs, num_items_in_batch=None):
        with sdpa_kernel(TRAINING_SDPA_BACKENDS):  # the backward runs inside too; see TRAINING_SDPA_BACKENDS
            loss = super().training_step(model, inputs, num_items_in_batch)
        if self.args.dump_nonfinite_grads and self.nonfinite_dump is None:
            self.nonfinite_dump = dump_if_nonfinite(
                self.accelerator.unwrap_model(self.model),
                self.args.output_dir,
                step=self.state.global_step + 1,
                micro=(self._step - 1) % self.current_gradient_accumulation_steps,
                batch=self._micro_batch,
                loss_settings=loss_settings(self.args, self.temperature, self.loss_type),
            )
        return loss

    @torch.no_grad()
    def _log_rollout_mismatch(self, clean_logps: torch.Tensor, batch, factor: torch.Tensor | None = None):
        """TRL's sampling/* metrics: how far the rollout log-probs are from the clean training policy's (and the
        correction's `factor`, where the loss forward gave it). Without another source of mismatch,
        sampling_logp_difference/mean is the mean |logprob(noisy) - logprob(clean)| of the sampled tokens: how far
        AQN moved the policy that sampled."""
        mode = "train" if self.model.training else "eval"
        stats = mismatch_stats(clean_logps, batch["sampling_per_token_logps"], scored(batch), factor)
        for name, (value, how) in stats.items():
            self._metrics[mode][name].append(getattr(self.accelerator.gather(value), how)().item())

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        # Steps that reuse an earlier generation (num_iterations > 1) still report the schedule's sigma.
        if self.model.training and "loss" in logs and not self._metrics["train"].get("aqn/sigma"):
            self._metrics["train"]["aqn/sigma"].append(self.current_sigma())
        if "train_runtime" in logs:  # the run's closing line: how many rounds were (nearly) all truncated
            logs = {**logs, **self.truncation_watch.summary()}
        super().log(logs, start_time)
