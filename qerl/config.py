"""QeRLConfig: TRL's GRPOConfig plus QeRL's knobs (AQN, LoRA, the rollout engine, metrics), and the checks that
refuse, before any model loads, what QeRL cannot run: TRL's own vLLM path, a bad AQN schedule, a batch that does not
split into groups of num_generations (said with the fix), FSDP1 and ZeRO-3 without the gather for generation.
Apart from the trainer, as TRL keeps grpo_config.py apart from grpo_trainer.py.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from trl import GRPOConfig

from qerl.field_rules import AQN_DTYPES, KV_CACHE_DTYPES, LORA_TARGETS, ROLLOUT_BACKENDS, check_choices, check_ranges


def _also_as(name: str, *aliases: str):
    """GRPOConfig's field `name` as it is (default, help), accepted on the command line under `aliases` too."""
    inherited = GRPOConfig.__dataclass_fields__[name]
    return field(default=inherited.default, metadata={**inherited.metadata, "aliases": list(aliases)})


@dataclass
class QeRLConfig(GRPOConfig):
    r"""GRPOConfig plus QeRL's knobs. Defaults follow the QeRL reference scripts where it sets them.

    AQN (Adaptive Quantization Noise): `num_stages` equal intervals over the run; the first is noise-free,
    interval i uses sigma_start * (sigma_end / sigma_start) ** ((i - 1) / (num_stages - 2)).
    """

    aqn: bool | None = field(
        default=None,
        metadata={
            "help": "Adaptive Quantization Noise on the rollout policy's RMSNorm scales (default: on for an NVFP4 "
            "base, off for a BF16 base)."
        },
    )
    sigma_start: float = field(default=1e-2, metadata={"help": "AQN noise std of the first noisy stage."})
    sigma_end: float = field(default=1e-4, metadata={"help": "AQN noise std of the last stage."})
    num_stages: int = field(default=10, metadata={"help": "AQN stages (the first is noise-free)."})
    aqn_final_norm: bool = field(
        default=False, metadata={"help": "Also perturb the final RMSNorm (the paper perturbs the per-layer norms)."}
    )
    aqn_head_norms: bool = field(
        default=False,
        metadata={
            "help": "Also perturb the per-head q/k RMSNorms (Qwen3, Gemma-3). Off by default, as the paper's "
            "rule implies: it perturbs the scales of norms that precede quantized linears, where w + Z on the "
            "norm is Z-shaped noise on the input channels of q/k/v (or gate/up), i.e. stands in for noise on "
            "their 4-bit weights. The q/k norms act after the projections, per head, on queries and keys "
            "that go into rotary and q.k, not into a quantized linear: their noise emulates no weight "
            "quantization, it rescales attention logits (one vector shared by every head, dimension d of q "
            "and k scaled by (w_q + Z_q)_d (w_k + Z_k)_d, then mixed with d + D/2 by the rotary). An "
            "exploration knob whose effect the paper does not measure. Their noise is drawn after the other "
            "norms', which keep theirs."
        },
    )
    aqn_dtype: str = field(
        default="fp32",
        metadata={
            "help": "Where AQN noise meets the scales. fp32: added in FP32 to an FP32 copy of each scale, the "
            "perturbed norms run in FP32 and round once, so every level of the schedule reaches the sampler. "
            "bf16: the arithmetic of the reference's code, noise cast to the BF16 scale and added there (noise "
            "below half a BF16 ulp rounds away: on scales near 1, sigma 1e-4 changes nothing); as its scripts "
            "run, that code never fires (docs/reference.md).",
            "choices": list(AQN_DTYPES),
        },
    )
    aqn_log_shift: bool = field(
        default=False,
        metadata={
            "help": "Log aqn/logprob_shift, the mean |logprob(noisy) - logprob(clean)| of the sampled tokens in "
            "the training forward: how far the noise moved the policy, apart from the rollout engine's own "
            "numerics. Costs one no-grad forward of the batch per noisy round (the clean side is the loss's); "
            "without it, sampling/sampling_logp_difference/mean measures the noise and the engine together."
        },
    )
    unpadded_forward: bool = field(
        default=True,
        metadata={
            "help": "Run the training forwards on each row's real tokens from column 0 (left padding removed, "
            "the micro-batch cut at its longest row, rows with nothing to score left out) under a causal mask "
            "alone, so that no compute goes to padding and attention runs FlashAttention (qerl/unpadded_forward.py). "
            "false: TRL's padded layout with a padding mask. Text-only models."
        },
    )
    group_micro_batches_by_length: bool = field(
        default=True,
        metadata={
            "help": "Split each generation batch into micro-batches of rows of similar length (sorted by real "
            "tokens) instead of TRL's random split, so that the unpadded forward cuts each micro-batch near its "
            "rows' lengths. Only where the accumulated gradient does not depend on the split "
            "(qerl/micro_batches.py: dapo/grpo-style losses, one optimizer step per generation batch, no "
            "per-micro-batch entropy statistic, the unpadded forward); elsewhere TRL's split stays, with one line "
            "saying why. false: TRL's split always."
        },
    )
    # The QeRL reference's names of two TrainingArguments fields (transformers 5 reads a warmup_steps below 1 as a
    # ratio, so the reference's --warmup-ratio is that).
    seed: int = _also_as("seed", "--random-state", "--random_state")
    warmup_steps: float = _also_as("warmup_steps", "--warmup-ratio", "--warmup_ratio")
    lora_rank: int = field(default=16, metadata={"help": "LoRA rank."})
    lora_alpha: int = field(default=16, metadata={"help": "LoRA alpha."})
    lora_dropout: float = field(default=0.0, metadata={"help": "LoRA dropout."})
    lora_target_modules: list[str] = field(
        default_factory=lambda: list(LORA_TARGETS),
        metadata={"help": "Modules that get LoRA adapters.", "aliases": ["--target-modules"]},
    )
    trainable_norms: bool = field(
        default=False,
        metadata={"help": "Train the per-layer RMSNorm scales too (the reference's `ln`).", "aliases": ["--ln"]},
    )
    # Here, not among qerl.train's script arguments (TRL 1.16's GRPOConfig has no such field), so that __post_init__
    # derives vllm_max_model_length from it for a config built in Python as for the command line's.
    max_prompt_length: int | None = field(
        default=None,
        metadata={
            "help": "Prompts longer than this many tokens are dropped, or cut (--long-prompts) (default: no limit). "
            "qerl.train applies it to the dataset; vllm_max_model_length defaults to it plus max_completion_length "
            "(the longest prompt kept and a full completion, the reference's max_seq_length) rather than the "
            "model's whole context window."
        },
    )
    rollout_backend: str = field(
        default="auto",
        metadata={
            "help": "Rollout engine. auto: native on a CUDA device (vllm or transformers where native cannot run "
            "the model, or under DeepSpeed/FSDP), transformers on CPU. native reads rollout_kv_cache_gib, "
            "rollout_kv_cache_dtype, rollout_compact_rows and rollout_keep_between_rounds; vllm reads TRL's "
            "vllm_gpu_memory_utilization, vllm_max_model_length and vllm_enable_sleep_mode; server samples on "
            "rollout servers of their own (rollout_servers).",
            "choices": list(ROLLOUT_BACKENDS),
        },
    )
    rollout_kv_cache_gib: float | None = field(
        default=None,
        metadata={
            "help": "rollout_backend native: GPU memory (GiB) the KV cache of a round may take (default: 80%% of "
            "what is free); a round that needs more runs in waves of as many sequences as fit."
        },
    )
    rollout_kv_cache_dtype: str = field(
        default="auto",
        metadata={
            "help": "rollout_backend native: the KV cache's dtype. auto: the model's; fp8: E4M3 with one scale "
            "per token and KV head (half the memory and attention reads; adds rounding to the sampled "
            "log-probs, see docs/benchmarks.md).",
            "choices": list(KV_CACHE_DTYPES),
        },
    )
    rollout_compact_rows: bool | None = field(
        default=None,
        metadata={
            "help": "rollout_backend native: once at most half of a round's completions are still running, decode "
            "only those (their KV rows moved together, a smaller CUDA graph captured). Default: on for an NVFP4 "
            "base (1.5B on an H200: the step 2.94 -> 2.83 s, the rollout ~3.0 -> ~2.0 ms a token of the longest "
            "completion), off for BF16 (not shown to gain; docs/benchmarks.md)."
        },
    )
    rollout_keep_between_rounds: bool | None = field(
        default=None,
        metadata={
            "help": "rollout_backend native: keep a round's KV cache and captured decode steps for the next round "
            "of as many completions (GRPO's rounds are), instead of allocating and capturing them again (~0.1 s a "
            "round), holding that memory through the training passes; not with a sharded policy (FSDP2, ZeRO-3). "
            "Default: on for an unsharded policy while the cache takes at most 10%% of the memory available "
            "(1.5B on an H200: the step 3.56 -> 3.23 s NVFP4, 3.11 -> 2.95 s BF16, docs/benchmarks.md; the 32B "
            "recipe's ~21 GB cache is not kept)."
        },
    )
    rollout_servers: list[str] = field(
        default_factory=list,
        metadata={
            "help": "rollout_backend server: the address of each rollout server (http://HOST:PORT), one per GPU, "
            "each started with python -m qerl.rollout_server on this run's base checkpoint and its own --seed "
            "(docs/multi_gpu.md)."
        },
    )
    rollout_server_timeout: float = field(
        default=600.0,
        metadata={
            "help": "rollout_backend server: seconds a call to a server may take, and the wait for every server to "
            "answer at the start; past it the run stops in one line naming the server."
        },
    )
    rollout_max_staleness: int = field(
        default=0,
        metadata={
            "help": "rollout_backend server: 0 samples each round when its step needs it; 1 samples the next "
            "round on the servers while a step trains, with the adapter of the step before (TRL's importance "
            "sampling then corrects for it; one training process, one round per optimizer step)."
        },
    )
    vllm_enable_sleep_mode: bool = field(
        default=True,
        metadata={
            "help": "rollout_backend vllm: put the engine to sleep between rounds (level 1: KV cache freed, "
            "weights parked in CPU memory) so that the trainer's forward and backward passes get the GPU "
            "memory. TRL's default is off; QeRL colocates, so on."
        },
    )
    vllm_importance_sampling_correction: bool | None = field(
        default=None,
        metadata={
            "help": "Correct the rollout/training mismatch (AQN makes one) with TRL's truncated importance "
            "sampling against the rollout log-probs, whatever the rollout backend. Default: off (the QeRL "
            "reference has no correction), on with rollout_max_staleness >= 1, whose rounds sample with an older "
            "adapter."
        },
    )
    fail_truncated_completions: bool = field(
        default=False,
        metadata={
            "help": "A completion cut at max_completion_length earns nothing: every reward function's payment for "
            "it is set to 0 before the advantages (the metrics completions/truncated_reward_mean and "
            "completions/finished_reward_mean keep what it earned). With mask_truncated_completions false it "
            "stays in the loss as a failure, so a run cannot drift into the cap unopposed; with masking on it only "
            "lowers its group's baseline."
        },
    )
    compile_layers: bool = field(
        default=False,
        metadata={
            "help": "torch.compile each decoder layer of the policy for the training forwards and backward "
            "(dynamic shapes: one compilation serves every layer and length), which fuses the norms, rotary, "
            "gate, LoRA's scaling and the residual adds into few kernels. Costs the compilation at the first "
            "step (~1 min at 32B). The rollout engines do not run these modules. Measured on one GPU only (not "
            "under DDP, FSDP2 or ZeRO)."
        },
    )
    dense_training_weights: bool | None = field(
        default=None,
        metadata={
            "help": "NVFP4 base: decode the frozen weights to BF16 once after each rollout and let the training "
            "passes (log-prob forwards, recomputed forward, backward) share that copy, freed before the next "
            "rollout, instead of decoding each weight in every pass (qerl/dense_weights.py). Same numbers; costs "
            "2 bytes per frozen weight while the passes run (1.5B: 2.6 GB, 7B: 13 GB, 32B: 62 GB) (default: on "
            "when the copy takes at most 40%% of the GPU memory available after the rollout: 1.5B, 7B on, 32B off)."
        },
    )
    keep_activations: bool | None = field(
        default=None,
        metadata={
            "help": "With gradient_checkpointing: keep the training passes' activations for the backward instead of "
            "recomputing them, for a round whose largest micro-batch's activations (counted on a short forward) "
            "take at most 60%% of the memory available after the rollout (default, one process only), always "
            "(true), or never (false: what runs sharing a GPU want). Same gradients; 1.5B on an H200: the step "
            "3.56 -> 2.44 s NVFP4, 3.11 -> 2.40 s BF16, the peak 7.8 -> 41 GiB (qerl/kept_activations.py)."
        },
    )
    metrics_jsonl: bool = field(
        default=True,
        metadata={
            "help": "Write every log line to <output_dir>/metrics.jsonl (a resume continues the file; a new run "
            "keeps an earlier one aside as metrics.N.jsonl)."
        },
    )

    dump_nonfinite_grads: bool = field(
        default=False,
        metadata={
            "help": "After each micro-batch's backward, check the trainable gradients (one device sync); the "
            "first micro-batch that makes one non-finite is saved with the trainable parameters it ran with "
            "to <output_dir>/nonfinite-step<N>-micro<M>.pt, for `python -m experiments.nonfinite`."
        },
    )

    def __post_init__(self):
        # A config built in Python gets the checks the command line makes on flags and recipes (qerl/field_rules.py),
        # before TRL's __post_init__, which divides by some of these fields.
        check_choices(vars(self), str)
        check_ranges(vars(self), str)
        if self.use_vllm:
            # TRL's colocate path merges the adapter into the base and pushes full weights into vLLM: a packed
            # NVFP4 base cannot be merged into, and it would sample without AQN. rollout_backend=vllm pushes the
            # unmerged LoRA tensors instead.
            raise ValueError(
                "use_vllm is TRL's own vLLM path, which would sample without AQN; QeRL picks its engine with "
                f"rollout_backend (available: {', '.join(ROLLOUT_BACKENDS)})"
            )
        if self.rollout_max_staleness and self.rollout_backend != "server":
            raise ValueError(
                f"rollout_max_staleness {self.rollout_max_staleness} samples ahead on rollout servers: it needs "
                f"rollout_backend server, not {self.rollout_backend}"
            )
        if self.vllm_importance_sampling_correction is None:
            self.vllm_importance_sampling_correction = self.rollout_max_staleness > 0
        if self.vllm_max_model_length is None and self.max_prompt_length and self.max_completion_length:
            self.vllm_max_model_length = self.max_prompt_length + self.max_completion_length
        try:
            super().__post_init__()
        except ValueError as err:
            fix = batch_error_fix(err, self)  # TRL seam, see below
            if fix is None:
                raise
            raise ValueError(f"{err} {fix}") from err
        self._check_distributed()

    def _check_distributed(self):
        """Refuse, before any model loads, the multi-GPU set-ups QeRL cannot run. `accelerate launch` hands its
        config to the processes as environment variables; TrainingArguments reads the DeepSpeed ones into
        deepspeed_plugin, not the FSDP ones."""
        if (
            os.environ.get("ACCELERATE_USE_FSDP", "false").lower() in ("1", "true")
            and os.environ.get("FSDP_VERSION", "1") != "2"
        ):
            raise ValueError(
                "FSDP version 1 is not supported: AQN and the rollout engines read and perturb parameters outside "
                "the forward, which FSDP1 keeps flattened; use fsdp_version: 2 (configs/accelerate/fsdp.yaml)"
            )
        plugin = self.deepspeed_plugin
        if plugin is not None and plugin.zero_stage == 3 and not self.ds3_gather_for_generation:
            raise ValueError(
                "ds3_gather_for_generation false is not supported: QeRL's rollouts and AQN work on the policy's whole "
                "parameters, which ZeRO-3 holds only while TRL gathers them for generation"
            )


# TRL seam: GRPOConfig.__post_init__'s error text is matched here (tests/qerl/test_trainer_trl_seam.py pins it).
def batch_error_fix(err: ValueError, config: QeRLConfig) -> str | None:
    """The fix for GRPOConfig's batch/num_generations error, recognised by its text; None for another error."""
    if "divisible by num_generations" not in str(err):
        return None
    per_round = config.generation_batch_size
    divisors = ", ".join(str(n) for n in range(2, per_round + 1) if per_round % n == 0) or "none"
    return (
        f"Each generation round samples per_device_train_batch_size x processes x steps_per_generation "
        f"= {per_round} completions, in groups of num_generations completions of one prompt. Fix: set "
        f"num_generations to a divisor of {per_round} (here: {divisors}), or raise per_device_train_batch_size "
        f"or gradient_accumulation_steps so that the product is a multiple of {config.num_generations}."
    )
