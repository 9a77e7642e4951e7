"""What each setting of `python -m qerl.train` accepts, in one place: the choices of the settings that name something
(CHOICES: rollout backends, KV-cache dtypes, AQN dtype rules, precisions) and the range of every numeric setting
(RANGES). The command line checks the flags and recipe against them before any config is built, naming the flag or
recipe key; QeRLConfig checks its own fields against them for a config built in Python. Nothing here imports torch.
"""

from __future__ import annotations

from collections.abc import Callable

from qerl import cli
from qerl.errors import UsageError, nearest

ROLLOUT_BACKENDS = ("auto", "transformers", "vllm", "native", "server")  # qerl.rollout.BACKENDS, read without torch
# The native engine's KV cache. auto: the model's dtype; fp8: E4M3 with a scale per token and KV head.
KV_CACHE_DTYPES = ("auto", "fp8")
AQN_DTYPES = ("fp32", "bf16")  # where AQN's noise meets the norm scales (qerl.aqn.DTYPE_RULES)
PRECISIONS = ("auto", "nvfp4", "bf16")  # of a base checkpoint (auto: from the checkpoint)
DTYPES = ("bfloat16", "float16", "float32")  # a base's compute dtype, and what the quantizer reads weights in
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CHOICES: dict[str, tuple[str, ...]] = {
    "rollout_backend": ROLLOUT_BACKENDS,
    "rollout_kv_cache_dtype": KV_CACHE_DTYPES,
    "aqn_dtype": AQN_DTYPES,
    "precision": PRECISIONS,
    "dtype": DTYPES,
}

# Every numeric field of QeRLScriptArguments and QeRLConfig (TRL's and transformers' included) and the values it
# accepts (None: any), checked on the flags and recipe before the configs are built (TRL's __post_init__ divides by
# some of them). A test fails on a numeric field missing here (tests/qerl/test_field_rules.py), so a new one cannot be
# forgotten.
RANGES: dict[str, cli.Range | None] = {
    **dict.fromkeys((
        "num_examples", "max_prompt_length", "max_completion_length", "per_device_train_batch_size",
        "per_device_eval_batch_size", "gradient_accumulation_steps", "eval_accumulation_steps", "generation_batch_size",
        "steps_per_generation", "num_iterations", "lora_rank", "lora_alpha", "save_total_limit", "pad_to_multiple_of",
        "torch_empty_cache_steps", "dataloader_prefetch_factor", "ddp_bucket_cap_mb", "ddp_timeout",
        "vllm_max_model_length", "vllm_tensor_parallel_size", "ref_model_sync_steps", "max_tool_calling_iterations",
    ), cli.COUNT),
    **dict.fromkeys(("soft_overlong_cache", "top_k", "dataloader_num_workers", "num_completions_to_print"),
                    cli.COUNT_OR_ZERO),
    **dict.fromkeys((
        "learning_rate", "warmup_steps", "weight_decay", "max_grad_norm", "beta", "epsilon", "epsilon_high",
        "neftune_noise_alpha", "eval_delay", "router_aux_loss_coef", "entropy_coef", "entropy_coef_min",
        "entropy_coef_max", "entropy_coef_delta", "entropy_target", "vllm_importance_sampling_clip_min",
        "off_policy_mask_threshold", "vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg",
    ), cli.NON_NEGATIVE),
    **dict.fromkeys((
        "temperature", "num_train_epochs", "logging_steps", "save_steps", "eval_steps", "adam_epsilon",
        "repetition_penalty", "delta", "sapo_temperature_neg", "sapo_temperature_pos", "vllm_server_timeout",
        "vllm_importance_sampling_clip_max", "vllm_importance_sampling_cap", "rollout_kv_cache_gib",
        "rollout_server_timeout",
    ), cli.POSITIVE),
    **dict.fromkeys(("min_p", "label_smoothing_factor", "ref_model_mixup_alpha", "top_entropy_quantile"), cli.FRACTION),
    **dict.fromkeys(("top_p", "vllm_gpu_memory_utilization"), cli.Range(float, 0, 1, low_open=True)),
    **dict.fromkeys(("adam_beta1", "adam_beta2", "lora_dropout"), cli.Range(float, 0, 1, high_open=True)),
    **dict.fromkeys(("sigma_start", "sigma_end"), cli.Range(float, 0, low_open=True, why="AQN's geometric schedule")),
    **dict.fromkeys(("seed", "data_seed"), cli.SEED),
    **dict.fromkeys(("vllm_server_port", "vllm_group_port"), cli.Range(int, 1, 65535)),
    **dict.fromkeys(("num_generations", "num_generations_eval"),
                    cli.Range(int, 2, why="GRPO compares the completions of one prompt")),
    "num_stages": cli.Range(int, 3, why="AQN: one noise-free stage and two noise levels"),
    "rollout_max_staleness": cli.Range(int, 0, 1, why="the trainer samples one round ahead at most"),
    "max_steps": cli.Range(int, 1, special=(-1,), why="-1: --num-train-epochs decides"),
    "local_rank": cli.Range(int, -1),  # set by launchers; -1: not distributed
    "max_seq_length": None,  # ignored (train.IGNORED_FLAGS)
}  # fmt: skip


def check_ranges(settings: dict, named: Callable[[str], str]) -> None:
    """The numeric settings against RANGES; `named(field)` says where a setting came from (a flag, a recipe)."""
    for name, rule in RANGES.items():
        value = settings.get(name)
        if rule is None or value is None:
            continue
        if isinstance(value, str):  # a TRL setting that takes a number or a word (pad_to_multiple_of: auto)
            try:
                value = rule.kind(value)
            except ValueError:
                continue
        problem = rule.problem(value)
        if problem:
            raise UsageError(f"{named(name)} {problem}")


def check_choices(settings: dict, named: Callable[[str], str]) -> None:
    """The settings that name something against CHOICES, said with the nearest choice."""
    for name, choices in CHOICES.items():
        value = settings.get(name)
        if value is not None and value not in choices:
            raise UsageError(f"{named(name)} {value!r}{nearest(str(value), choices)}: use one of {', '.join(choices)}")
