"""How `python -m qerl.train` reads its settings before any config is built: the parser (TRL's TrlParser, with
one-line errors), recipe files (YAML, extending other recipes through `base:`), the range of every numeric setting
(RANGES, one table for flags and recipes alike), and the short --help (QUICK_HELP).
"""

from __future__ import annotations

import os
import textwrap
from collections.abc import Callable

import yaml
from trl import TrlParser

from qerl import cli
from qerl.errors import UsageError, nearest, one_line
from qerl.input_checks import check_file

# Every numeric field of QeRLScriptArguments and QeRLConfig (TRL's and transformers' included) and the values it
# accepts (None: any), checked on the flags and recipe before the configs are built (TRL's __post_init__ divides by
# some of them). tests/test_bad_input.py fails on a numeric field missing here, so a new one cannot be forgotten.
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


# `python -m qerl.train --help`: these first; `--help-all` lists every field of TRL and transformers.
QUICK_HELP = {
    "Model": ("model_name", "precision", "dtype"),
    "Data": ("dataset", "dataset_split", "dataset_format", "num_examples"),
    "Lengths and batch": ("max_prompt_length", "max_completion_length", "num_generations",
                          "per_device_train_batch_size", "gradient_accumulation_steps"),
    "RL": ("loss_type", "beta", "epsilon_high", "learning_rate", "max_steps", "num_train_epochs", "temperature",
           "soft_overlong_cache", "vllm_importance_sampling_correction"),
    "LoRA": ("lora_rank", "lora_alpha", "lora_target_modules", "trainable_norms"),
    "AQN": ("aqn", "sigma_start", "sigma_end", "num_stages", "aqn_final_norm"),
    "Rollout": ("rollout_backend", "rollout_kv_cache_gib", "rollout_kv_cache_dtype"),
    "Output": ("output_dir", "save_steps", "resume_from_checkpoint", "overwrite_output_dir", "metrics_jsonl",
               "logging_steps", "report_to", "seed", "use_cpu", "bf16", "dump_nonfinite_grads"),
}  # fmt: skip
# Where TRL's help text is a poor fit for the short list.
QUICK_HELP_TEXT = {
    "max_steps": "Optimizer steps of the run (-1: as many as --num-train-epochs make)",
    "resume_from_checkpoint": "true: continue from the newest complete checkpoint in --output-dir; or a checkpoint "
    "folder",
    "output_dir": "Where checkpoints, the final adapter and metrics.jsonl go",
}


class RecipeParser(cli.ParserErrors, TrlParser):
    """TrlParser of the given dataclasses (flags and a --config recipe), whose errors are one line."""

    def __init__(self, dataclass_types):
        super().__init__(dataclass_types)
        for action in self._actions:  # HfArgumentParser gives --no_X the help of --X, which says the opposite
            if action.option_strings and action.option_strings[0].startswith("--no_"):
                action.help = f"Turn --{action.dest.replace('_', '-')} off."


def quick_help(parser: RecipeParser) -> str:
    actions = {}
    for action in parser._actions:
        actions.setdefault(action.dest, action)
    lines = [
        "usage: python -m qerl.train [--config RECIPE.yaml] --model-name CHECKPOINT [--flag VALUE ...]",
        "",
        "GRPO/DAPO with LoRA on an NVFP4 (or BF16) base and Adaptive Quantization Noise. Flags override the recipe;",
        "recipes are in configs/. The most used flags (--help-all: every TRL/transformers option; --debug: show the",
        "traceback of an input error):",
        "",
        "  --config RECIPE.yaml".ljust(40) + "YAML file of flag values (keys are flag names with underscores; base:",
        " " * 40 + "other recipes it extends).",
    ]
    for group, dests in QUICK_HELP.items():
        lines.append(f"{group}:")
        for dest in dests:
            action = actions[dest]
            flags = ", ".join(f for f in action.option_strings if "_" not in f)  # the dashed name and its aliases
            text = QUICK_HELP_TEXT.get(dest) or (action.help or "").replace("%%", "%").split(". ")[0].rstrip(".")
            if action.default is not None and action.default != "":
                text += f" (default: {action.default})"
            if len(flags) > 37:  # the help starts on the next line
                lines.append(f"  {flags}")
            indent = " " * 40 if len(flags) > 37 else f"  {flags:<38}"
            lines += textwrap.wrap(text, 118, initial_indent=indent, subsequent_indent=" " * 40)
    return "\n".join(lines)


def load_recipe(path: str, parser: RecipeParser, named_by: str = "--config", _extending: tuple[str, ...] = ()) -> dict:
    """A recipe's settings: first those of the files its `base:` names (one path or a list, relative to the recipe;
    a later file overrides an earlier one), then its own. Every key must be a flag's name (or `env`)."""
    where = f"{named_by} {path}"
    check_file(path, named_by)
    try:
        with open(path) as f:
            recipe = yaml.safe_load(f)
    except yaml.YAMLError as err:
        raise UsageError(f"{where}: not valid YAML ({one_line(err)})") from None
    if not isinstance(recipe, dict):
        raise UsageError(f"{where}: expected a mapping of flag names to values")
    known = {action.dest for action in parser._actions} | {"env", "base"}
    for key in recipe:
        if key not in known:
            raise UsageError(f"{where}: unknown key {key!r}{nearest(str(key), sorted(known))}")
    bases = recipe.pop("base", [])
    bases = [bases] if isinstance(bases, str) else bases
    if not isinstance(bases, list) or not all(isinstance(base, str) for base in bases):
        raise UsageError(f"{where}: base must be a file name or a list of them")
    if not isinstance(recipe.get("env", {}), dict):
        raise UsageError(f"{where}: env must be a mapping of variable names to values")
    extending = (*_extending, os.path.realpath(path))
    settings: dict = {"env": {}}
    for base in bases:
        base_path = os.path.join(os.path.dirname(path), base)
        if os.path.realpath(base_path) in extending:
            raise UsageError(f"{where}: base {base} extends itself")
        inherited = load_recipe(base_path, parser, f"{path}: base", extending)
        settings = {**settings, **inherited, "env": {**settings["env"], **inherited["env"]}}
    return {**settings, **recipe, "env": {**settings["env"], **recipe.get("env", {})}}
