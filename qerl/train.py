"""`python -m qerl.train`: QeRL training from a YAML recipe and/or flags (TRL's TrlParser).

    python -m qerl.train --config configs/dapo_gsm8k_nvfp4.yaml --model-name /models/Qwen2.5-7B-NVFP4
    accelerate launch --config_file configs/accelerate/zero2.yaml -m qerl.train --config ... (several GPUs)

A recipe may extend others (`base: [parts/dapo.yaml, ...]`, see load_recipe); flags override it. Flags keep the
QeRL reference's names (--model-name, --dataset, --lora-rank, --lora-alpha, --ln, --sigma-start, --sigma-end,
--num-stages, --max-prompt-length, --random-state, and every GRPOConfig field).
`--resume-from-checkpoint true` continues from the newest complete checkpoint in --output-dir; a path picks one.
Flags, recipe and input files are checked before anything loads: a mistake is one line (see qerl.cli).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import sys
import textwrap
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml
from trl import TrlParser

from qerl import cli, data, policy, rewards
from qerl.nvfp4.checkpoint import is_nvfp4_checkpoint
from qerl.run_lock import RunLock
from qerl.trainer import QeRLConfig, QeRLTrainer

logger = logging.getLogger("qerl.train")

# Reference flags that configured tools we do not use: accepted (fields below), warned about, ignored. The
# reference's other names are aliases of the fields they mean (QeRLConfig: --ln, --random-state, ...).
IGNORED_FLAGS = {
    "fast_inference": "it selected the reference's unsloth/vLLM engine; see --rollout-backend",
    "max_seq_length": "it sized the reference's unsloth engine; prompt and completion limits suffice here",
}


@dataclass
class QeRLScriptArguments:
    model_name: str = field(
        default=None, metadata={"help": "Checkpoint folder (NVFP4 compressed-tensors or BF16) or hub id."}
    )
    precision: str = field(
        default="auto", metadata={"help": "Base precision: auto (from the checkpoint), nvfp4 or bf16."}
    )
    dtype: str = field(
        default="bfloat16", metadata={"help": "Compute dtype of the base (bfloat16; float32 for CPU runs)."}
    )
    dataset: str = field(
        default="gsm8k",
        metadata={"help": f"{', '.join(data.KNOWN_DATASETS)}, or a local .jsonl/.json/.parquet/.csv file."},
    )
    dataset_split: str = field(default="train", metadata={"help": "Dataset split to train on."})
    dataset_format: str = field(
        default="auto", metadata={"help": f"Local files: {', '.join(data.FORMAT_COLUMNS)} or auto (from columns)."}
    )
    num_examples: int | None = field(default=None, metadata={"help": "Use only the first N examples."})
    max_prompt_length: int | None = field(
        default=None, metadata={"help": "Prompts longer than this many tokens are dropped, or cut (--long-prompts)."}
    )
    long_prompts: str = field(
        default="drop",
        metadata={"help": f"A prompt over --max-prompt-length: {' or '.join(data.LONG_PROMPTS)}. drop: left out (TRL "
                  "1.16 does not truncate); keep_last: its last tokens kept, as the QeRL reference's TRL 0.21 did (the "
                  "system prompt and the question's start are cut)."},
    )  # fmt: skip
    soft_overlong_cache: int = field(
        default=0, metadata={"help": "DAPO soft overlong punishment over the last N completion tokens (0: off)."}
    )
    overwrite_output_dir: bool = field(
        default=False,
        metadata={"help": "Start over in an --output-dir that holds an earlier run: its checkpoint-* folders and "
                  "adapter are deleted (its metrics.jsonl is kept as metrics.N.jsonl)."},
    )  # fmt: skip
    fast_inference: bool | None = field(default=None, metadata={"help": f"Ignored: {IGNORED_FLAGS['fast_inference']}."})
    max_seq_length: int | None = field(default=None, metadata={"help": f"Ignored: {IGNORED_FLAGS['max_seq_length']}."})


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
    "max_seq_length": None,  # ignored (IGNORED_FLAGS)
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
            raise cli.UsageError(f"{named(name)} {problem}")


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
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


class _Parser(cli.ParserErrors, TrlParser):
    pass


def _parser() -> _Parser:
    parser = _Parser((QeRLScriptArguments, QeRLConfig))
    for action in parser._actions:  # HfArgumentParser gives --no_X the help of --X, which says the opposite
        if action.option_strings and action.option_strings[0].startswith("--no_"):
            action.help = f"Turn --{action.dest.replace('_', '-')} off."
    return parser


def quick_help(parser: _Parser) -> str:
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


def load_recipe(path: str, parser: _Parser, named_by: str = "--config", _extending: tuple[str, ...] = ()) -> dict:
    """A recipe's settings: first those of the files its `base:` names (one path or a list, relative to the recipe;
    a later file overrides an earlier one), then its own. Every key must be a flag's name (or `env`)."""
    where = f"{named_by} {path}"
    cli.check_file(path, named_by)
    try:
        with open(path) as f:
            recipe = yaml.safe_load(f)
    except yaml.YAMLError as err:
        raise cli.UsageError(f"{where}: not valid YAML ({cli.one_line(err)})") from None
    if not isinstance(recipe, dict):
        raise cli.UsageError(f"{where}: expected a mapping of flag names to values")
    known = {action.dest for action in parser._actions} | {"env", "base"}
    for key in recipe:
        if key not in known:
            raise cli.UsageError(f"{where}: unknown key {key!r}{cli.nearest(str(key), sorted(known))}")
    bases = recipe.pop("base", [])
    bases = [bases] if isinstance(bases, str) else bases
    if not isinstance(bases, list) or not all(isinstance(base, str) for base in bases):
        raise cli.UsageError(f"{where}: base must be a file name or a list of them")
    if not isinstance(recipe.get("env", {}), dict):
        raise cli.UsageError(f"{where}: env must be a mapping of variable names to values")
    extending = (*_extending, os.path.realpath(path))
    settings: dict = {"env": {}}
    for base in bases:
        base_path = os.path.join(os.path.dirname(path), base)
        if os.path.realpath(base_path) in extending:
            raise cli.UsageError(f"{where}: base {base} extends itself")
        inherited = load_recipe(base_path, parser, f"{path}: base", extending)
        settings = {**settings, **inherited, "env": {**settings["env"], **inherited["env"]}}
    return {**settings, **recipe, "env": {**settings["env"], **recipe.get("env", {})}}


def parse_args(argv: list[str] | None = None) -> tuple[QeRLScriptArguments, QeRLConfig]:
    parser = _parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        print(quick_help(parser))
        raise SystemExit(0)
    if "--help-all" in argv:
        parser.print_help()
        raise SystemExit(0)
    argv = cli.attach_negative_numbers(argv)
    recipe, recipe_path = {}, None
    if "--config" in argv:  # the recipe sets the defaults, flags override them
        index = argv.index("--config")
        if index + 1 == len(argv):
            raise cli.UsageError("--config needs a YAML file")
        recipe_path = argv.pop(index + 1)
        recipe = load_recipe(recipe_path, parser)
        argv.pop(index)
        for name, value in recipe.pop("env").items():
            os.environ[name] = str(value)
        parser.set_defaults_with_config(**recipe)
    cli.reject_unknown_flags(argv, parser.known_flags())
    flags = parser._option_string_actions
    given = {flags[arg.split("=", 1)[0]].dest for arg in argv if arg.split("=", 1)[0] in flags}

    def named(name: str) -> str:  # as the user wrote it: a flag, or a recipe's key
        if name in recipe and name not in given:
            return f"--config {recipe_path}: {name}"
        return f"--{name.replace('_', '-')}"

    check_ranges(vars(parser.parse_known_args(argv)[0]), named)
    try:
        script_args, config = parser.parse_args_and_config(args=argv)
    except ValueError as err:  # raised while building the configs from flags: the flags are at fault
        raise cli.UsageError(str(err)) from err
    if not script_args.model_name:
        raise cli.UsageError("--model-name is required (a checkpoint folder or hub id)")
    for name, reason in IGNORED_FLAGS.items():
        if getattr(script_args, name) is not None:
            warnings.warn(f"ignoring --{name.replace('_', '-')}: {reason}", stacklevel=2)
    return script_args, config


def _check_dataset(name: str, dataset_format: str) -> None:
    if name in data.KNOWN_DATASETS:
        return
    if not os.path.exists(name) and not name.lower().endswith(cli.DATA_EXTENSIONS) and os.sep not in name:
        raise cli.UsageError(
            f"--dataset {name}: unknown dataset{cli.nearest(name, data.KNOWN_DATASETS)}; known datasets are "
            f"{', '.join(data.KNOWN_DATASETS)}, or give a local {' / '.join(cli.DATA_EXTENSIONS)} file"
        )
    columns = cli.data_file_columns(name, "--dataset")
    fmt = dataset_format
    if fmt == "auto":
        try:
            fmt = data.detect_format(columns, name)
        except ValueError as err:
            raise cli.UsageError(str(err)) from None
    cli.require_columns(name, columns, data.FORMAT_COLUMNS[fmt], f"format {fmt!r}")


def validate(script_args: QeRLScriptArguments, config: QeRLConfig) -> None:
    """Every check that needs no model or dataset loaded, so that a mistake costs seconds, not a 7B load."""
    if os.path.exists(config.output_dir) and not os.path.isdir(config.output_dir):
        raise cli.UsageError(f"--output-dir {config.output_dir}: is a file")
    cli.check_model(script_args.model_name, "--model-name")
    if script_args.precision not in policy.PRECISIONS:
        raise cli.UsageError(f"--precision {script_args.precision!r}: use one of {', '.join(policy.PRECISIONS)}")
    # A folder quantized some other way than NVFP4A16 is refused here, by name.
    if is_nvfp4_checkpoint(script_args.model_name) and script_args.precision == "bf16":
        raise cli.UsageError(f"--model-name {script_args.model_name} is an NVFP4 checkpoint; use --precision auto")
    if not isinstance(getattr(torch, script_args.dtype, None), torch.dtype):
        raise cli.UsageError(f"--dtype {script_args.dtype!r} is not a torch dtype (bfloat16, float16, float32)")
    formats = ("auto", *data.FORMAT_COLUMNS)
    if script_args.dataset_format not in formats:
        raise cli.UsageError(
            f"--dataset-format {script_args.dataset_format!r}{cli.nearest(script_args.dataset_format, formats)}: "
            f"use one of {', '.join(formats)}"
        )
    if script_args.long_prompts not in data.LONG_PROMPTS:
        raise cli.UsageError(f"--long-prompts {script_args.long_prompts!r}: use one of {', '.join(data.LONG_PROMPTS)}")
    _check_dataset(script_args.dataset, script_args.dataset_format)


def _is_complete(checkpoint: Path) -> bool:
    """transformers writes trainer_state.json last: a checkpoint without it was cut short."""
    try:
        json.loads((checkpoint / "trainer_state.json").read_text())
    except (OSError, ValueError):
        return False
    return True


def _checkpoints(output_dir: Path) -> list[Path]:
    """checkpoint-N folders, newest first."""
    found = [p for p in output_dir.iterdir() if p.is_dir() and _CHECKPOINT.match(p.name)] if output_dir.is_dir() else []
    return sorted(found, key=lambda p: int(_CHECKPOINT.match(p.name).group(1)), reverse=True)


def resolve_resume(value: str | None, output_dir: str) -> str | None:
    """'true' -> the newest complete checkpoint in output_dir (None if there is none yet); a path -> that one."""
    if value is None or str(value).lower() in ("", "false", "no", "0", "none"):
        return None
    if str(value).lower() in ("true", "yes", "1", "auto", "last"):
        for checkpoint in _checkpoints(Path(output_dir)):
            if _is_complete(checkpoint):
                return str(checkpoint)
            logger.warning("skipping %s: incomplete (no trainer_state.json; the run stopped while saving it)",
                           checkpoint)  # fmt: skip
        logger.warning("no complete checkpoint in %s yet: starting from scratch", output_dir)
        return None
    if not os.path.isdir(value):
        raise cli.UsageError(f"--resume-from-checkpoint {value}: no such checkpoint folder")
    if not _is_complete(Path(value)):
        raise cli.UsageError(f"--resume-from-checkpoint {value}: incomplete (no readable trainer_state.json)")
    return value


def _where_to_resume(output_dir: str) -> str:
    newest = next((c.name for c in _checkpoints(Path(output_dir)) if _is_complete(c)), None)
    if newest is None:
        return "no checkpoint saved yet"
    return f"{newest} is the newest complete checkpoint; --resume-from-checkpoint true continues from it"


_ADAPTER_FILES = ("adapter_model.safetensors", "adapter_config.json")


def prepare_output_dir(script_args: QeRLScriptArguments, config: QeRLConfig, lock: RunLock | None) -> str | None:
    """The checkpoint to resume from (None: a fresh start), with the folder's `lock` taken. A fresh start never
    lands on an earlier run's checkpoints or adapter unless --overwrite-output-dir says to delete them."""
    output_dir = Path(config.output_dir)
    if lock is not None:
        lock.check()  # a run in progress there comes first; nothing is written before the last refusal
    resume = resolve_resume(config.resume_from_checkpoint, config.output_dir)
    earlier = []
    if resume is not None:
        if script_args.overwrite_output_dir:
            raise cli.UsageError("--overwrite-output-dir and --resume-from-checkpoint contradict each other: pick one")
        cli.check_adapter(resume, "--resume-from-checkpoint", script_args.model_name, "--model-name", config.lora_rank)
        with open(os.path.join(resume, "trainer_state.json")) as f:
            step = json.load(f)["global_step"]
        total = config.max_steps if config.max_steps > 0 else "the epochs asked for"
        logger.info("resuming from %s, step %d of %s", os.path.basename(os.path.normpath(resume)), step, total)
    else:
        earlier = _checkpoints(output_dir) + [output_dir / f for f in _ADAPTER_FILES if (output_dir / f).exists()]
        if earlier and not script_args.overwrite_output_dir:
            raise cli.UsageError(
                f"--output-dir {output_dir} holds an earlier run ({', '.join(p.name for p in earlier[:3])}): pass "
                "--resume-from-checkpoint true to continue it, or --overwrite-output-dir to start over (deleting them)"
            )
    if lock is not None:
        lock.acquire()
    if earlier and config.process_index == 0:
        for path in earlier:
            shutil.rmtree(path) if path.is_dir() else path.unlink()
        logger.info("--overwrite-output-dir: deleted %s of the earlier run in %s",
                    ", ".join(p.name for p in earlier), output_dir)  # fmt: skip
    return resume


def build_trainer(script_args: QeRLScriptArguments, config: QeRLConfig, model=None) -> QeRLTrainer:
    """The trainer of a run; `model`: a base already built in memory (benchmarks), instead of loading model_name."""
    dtype = getattr(torch, script_args.dtype)
    tokenizer = policy.load_tokenizer(script_args.model_name)
    if model is None:
        model = policy.load_base_model(script_args.model_name, script_args.precision, dtype, device=config.device)
    task = data.load_task(
        script_args.dataset, script_args.dataset_split, script_args.dataset_format, script_args.num_examples,
        seed=config.seed,
    )  # fmt: skip
    train_dataset = data.fit_prompts(task.train, tokenizer, script_args.max_prompt_length, script_args.long_prompts)
    if len(train_dataset) == 0:
        raise cli.UsageError(
            f"no prompt of {script_args.dataset} fits --max-prompt-length {script_args.max_prompt_length}"
        )
    if config.vllm_max_model_length is None and script_args.max_prompt_length:
        # The rollout engine's context: the longest prompt kept plus a full completion (the reference's
        # max_seq_length), rather than the model's whole context window.
        config.vllm_max_model_length = script_args.max_prompt_length + config.max_completion_length
    reward_funcs = list(task.reward_funcs)
    if script_args.soft_overlong_cache:
        reward_funcs.append(
            rewards.soft_overlong_punishment(config.max_completion_length, script_args.soft_overlong_cache)
        )
    logger.info("task %s (%s format): %d prompts, rewards %s", task.name, task.format, len(train_dataset),
                [getattr(f, "__name__", type(f).__name__) for f in reward_funcs])  # fmt: skip
    return QeRLTrainer(model, reward_funcs, args=config, train_dataset=train_dataset, processing_class=tokenizer)


def main(argv: list[str] | None = None) -> QeRLTrainer:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    script_args, config = parse_args(argv)
    validate(script_args, config)
    lock = RunLock(config.output_dir) if config.process_index == 0 else None  # the other ranks share rank 0's
    resume = prepare_output_dir(script_args, config, lock)
    try:
        trainer = build_trainer(script_args, config)
        try:
            trainer.train(resume_from_checkpoint=resume)
        except KeyboardInterrupt:
            logger.warning("stopped at step %d: %s", trainer.state.global_step, _where_to_resume(config.output_dir))
            raise
        with cli.signals_deferred():  # the final adapter is written whole
            trainer.save_model(config.output_dir)  # the LoRA adapter (and trained norms), not the frozen base
    finally:
        if lock is not None:
            lock.release()
    return trainer


def run(argv: list[str] | None = None) -> int:
    """The command line (`python -m qerl.train`, `qerl-train`): input errors in one line, exit code 2."""

    def train_and_exit_zero(args: list[str]) -> int:
        main(args)
        return 0

    return cli.run_cli(train_and_exit_zero, "qerl.train", argv)


if __name__ == "__main__":
    sys.exit(run())
