"""How `python -m qerl.train` reads its settings before any config is built, TRL and torch not imported: the parser,
rebuilt from qerl/train_flags.json (the flags TRL's parser makes of the settings' dataclasses, written by
train.write_flag_table; one-line errors), recipe files (YAML, extending other recipes through `base:`) and the short
--help (QUICK_HELP). What each setting accepts is in qerl/field_rules.py.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import textwrap
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import yaml

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
           "mask_truncated_completions", "fail_truncated_completions", "soft_overlong_cache",
           "vllm_importance_sampling_correction"),
    "LoRA": ("lora_rank", "lora_alpha", "lora_target_modules", "trainable_norms"),
    "AQN": ("aqn", "sigma_start", "sigma_end", "num_stages", "aqn_final_norm"),
    "Rollout": ("rollout_backend", "rollout_kv_cache_gib", "rollout_kv_cache_dtype"),
    "Output": ("output_dir", "save_steps", "resume_from_checkpoint", "overwrite_output_dir", "metrics_jsonl",
               "logging_steps", "report_to", "seed", "use_cpu", "bf16", "dump_nonfinite_grads"),
}  # fmt: skip
# Where the field's help text is a poor fit for the short list.
QUICK_HELP_TEXT = {
    "gradient_accumulation_steps": "Micro-batches per optimizer step",
    "vllm_importance_sampling_correction": "Correct the rollout/training mismatch with TRL's truncated importance "
    "sampling (default: off; on with --rollout-max-staleness 1)",
    "mask_truncated_completions": "Completions cut at the cap left out of the loss",
    "fail_truncated_completions": "Completions cut at the cap earn 0",
    "soft_overlong_cache": "DAPO overlong punishment, last N tokens (0: off)",
    "max_steps": "Optimizer steps (-1: as many as --num-train-epochs make)",
    "epsilon_high": "Upper bound of the clipped ratio, DAPO's clip-higher (default: --epsilon's value)",
    "rollout_kv_cache_gib": "Native engine: GPU memory (GiB) for a round's KV cache; more sequences than fit run in "
    "waves (default: 80% of what is free)",
    "output_dir": "Where checkpoints, the final adapter and metrics.jsonl go (default: trainer_output)",
    "resume_from_checkpoint": "true: continue from the newest complete checkpoint in --output-dir; or a checkpoint "
    "folder (default: a new run)",
    "overwrite_output_dir": "Start over in an --output-dir that holds an earlier run (its checkpoints are deleted)",
    "metrics_jsonl": "Write every log line to <output_dir>/metrics.jsonl",
    "bf16": "BF16 mixed precision (default: on unless --fp16)",
    "dump_nonfinite_grads": "Save the first micro-batch that makes a gradient non-finite, for `python -m "
    "experiments.nonfinite`",
}

FLAG_TABLE = Path(__file__).with_name("train_flags.json")
RECIPES = Path(__file__).resolve().parents[1] / "configs"  # in a checkout; the short --help says what they set
# What the table was made with: another version of either makes other flags.
MADE_WITH = ("trl", "transformers")


def installed(name: str) -> str | None:
    """The installed version of the distribution `name`, or None."""
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def check_installed() -> None:
    """A run needs TRL and transformers (--help does not: the table describes their flags)."""
    missing = [name for name in MADE_WITH if installed(name) is None]
    if missing:
        raise UsageError(
            f"{' and '.join(missing)} not installed in this Python ({sys.executable}): `make setup` (or `pip install "
            "-e .`) installs QeRL with its dependencies"
        )


def _boolean(text: str) -> bool:
    """What TRL's parser (string_to_bool) gives bool fields."""
    if isinstance(text, bool):
        return text
    if text.lower() in ("yes", "true", "t", "y", "1"):
        return True
    if text.lower() in ("no", "false", "f", "n", "0"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false (yes/no, t/f, y/n, 1/0), got {text!r}")


def _recipe_only(text: str):
    """A field that takes a structure (a dict, a config object): no flag parses it."""
    raise argparse.ArgumentTypeError(f"takes a structure, not {text!r}: set it in a --config recipe")


TYPES: dict[str, Callable] = {"str": str, "int": int, "float": float, "bool": _boolean, "recipe_only": _recipe_only}
OR_NONE = " or none"  # a `T | None` field: TRL's parser reads none or null as None


def _converter(kind: str) -> Callable:
    convert = TYPES[kind.removesuffix(OR_NONE)]
    if not kind.endswith(OR_NONE):
        return convert

    def parse(text: str):
        return None if text.lower() in ("none", "null") else convert(text)

    parse.__name__ = convert.__name__  # argparse names the type in its errors
    return parse


class RecipeParser(cli.ParserErrors, argparse.ArgumentParser):
    """The flags of `python -m qerl.train` (a --config recipe's keys too), as TRL's parser makes them of the settings'
    dataclasses; errors are one line."""

    def __init__(self, flags: list[dict]):
        super().__init__(prog="python -m qerl.train", formatter_class=cli.HelpFormatter, allow_abbrev=False)
        for flag in flags:
            kwargs = {key: value for key, value in flag.items() if key != "flags"}
            if "type" in kwargs:
                kwargs["type"] = _converter(kwargs["type"])
            self.add_argument(*flag["flags"], **kwargs)

    def set_defaults_with_config(self, **settings) -> None:
        """A recipe's settings become the defaults (TrlParser's rule: a setting given is no longer required)."""
        for action in self._actions:
            if action.dest in settings:
                action.default = settings[action.dest]
                action.required = False


def describe(parser: argparse.ArgumentParser) -> list[dict]:
    """Each flag of TRL's parser (a TrlParser of the settings' dataclasses) as RecipeParser rebuilds it."""
    flags = []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        flag = {"flags": action.option_strings, "dest": action.dest}
        if isinstance(action, argparse._StoreFalseAction):
            # HfArgumentParser gives --no_X the help of --X, which says the opposite
            flags.append({**flag, "action": "store_false", "default": action.default,
                          "help": f"Turn --{action.dest.replace('_', '-')} off."})  # fmt: skip
            continue
        assert type(action) is argparse._StoreAction, f"{action.dest}: {type(action).__name__}"
        choices = list(action.choices) if action.choices is not None else None
        name = getattr(action.type, "__name__", "")  # TRL's wrapper of a `T | None` field's type keeps T's name
        if name in TYPES:
            kind = name
        elif name == "string_to_bool":
            kind = "bool"
        elif choices and all(isinstance(choice, str) for choice in choices):
            kind = "str"  # a Literal's or an Enum's values: TRL's choice type maps each to itself
        else:
            kind = "recipe_only"
        if "_accept_none" in getattr(action.type, "__qualname__", ""):
            kind += OR_NONE
        assert json.loads(json.dumps(action.default)) == action.default, f"{action.dest}: {action.default!r}"
        described = {"type": kind, "nargs": action.nargs, "const": action.const, "default": action.default,
                     "choices": choices, "required": action.required or None, "help": action.help}  # fmt: skip
        flags.append({**flag, **{key: value for key, value in described.items() if value is not None}})
    return flags


def table(flags: list[dict]) -> str:
    """The text of qerl/train_flags.json: what it was made with, then one flag a line."""
    made_with = json.dumps({name: version(name) for name in MADE_WITH})
    lines = ",\n  ".join(json.dumps(flag) for flag in flags)
    return f'{{"made_with": {made_with},\n "flags": [\n  {lines}\n]}}\n'


def build_parser(live: Callable[[], list[dict]]) -> RecipeParser:
    """The parser from the flag table; from `live()` (TRL's parser described now: seconds, as it imports TRL and
    torch) where TRL or transformers is another version than the table was made with. Where one is not installed
    the table is all there is: --help answers, a run is refused (check_installed)."""
    written = json.loads(FLAG_TABLE.read_text())
    current = all(installed(name) in (made, None) for name, made in written["made_with"].items())
    return RecipeParser(written["flags"] if current else live())


def recipe_settings(parser: RecipeParser) -> dict[str, list]:
    """For each setting the recipes in configs/ set: the values they set, each once (none outside a checkout)."""
    values: dict[str, list] = {}
    for path in sorted(glob.glob(str(RECIPES / "*.yaml"))):
        for dest, value in load_recipe(path, parser).items():
            if dest != "env" and value not in values.setdefault(dest, []):
                values[dest].append(value)
    return values


def quick_help(parser: RecipeParser) -> str:
    actions = {}
    for action in parser._actions:
        actions.setdefault(action.dest, action)
    recipes = recipe_settings(parser)
    lines = [
        "usage: python -m qerl.train [--config RECIPE.yaml] --model-name CHECKPOINT [--flag VALUE ...]",
        "",
        "    python -m qerl.train --config configs/dapo_gsm8k_nvfp4.yaml --model-name ckpt/qwen2.5-7b-nvfp4",
        "",
        "GRPO/DAPO with LoRA on an NVFP4 (or BF16) base and Adaptive Quantization Noise. Flags override the recipe;",
        "recipes are in configs/. The most used flags, with what the recipes set (--help-all: every TRL/transformers",
        "option; --debug: show the traceback of an input error):",
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
            if "(default" not in text and "(required)" not in text:
                text += f" (default: {action.default})"
            if dest in recipes and recipes[dest] != [action.default]:
                text += f" (recipes: {', '.join(str(value) for value in recipes[dest])})"
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
