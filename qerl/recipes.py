"""How `python -m qerl.train` reads its settings before any config is built: the parser (TRL's TrlParser, with
one-line errors), recipe files (YAML, extending other recipes through `base:`) and the short --help (QUICK_HELP).
What each setting accepts is in qerl/field_rules.py.
"""

from __future__ import annotations

import os
import textwrap

import yaml
from trl import TrlParser

from qerl import cli
from qerl.errors import UsageError, nearest, one_line
from qerl.input_checks import check_file

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
