"""`python -m qerl.train`: QeRL training from a YAML recipe and/or flags (TRL's TrlParser).

    python -m qerl.train --config configs/dapo_gsm8k_nvfp4.yaml --model-name /models/Qwen2.5-7B-NVFP4
    accelerate launch --config_file configs/accelerate/zero2.yaml -m qerl.train --config ... (several GPUs)

A recipe may extend others (`base: [parts/dapo.yaml, ...]`, see recipes.load_recipe); flags override it. Flags keep the
QeRL reference's names (--model-name, --dataset, --lora-rank, --lora-alpha, --ln, --sigma-start, --sigma-end,
--num-stages, --max-prompt-length, --random-state, and every GRPOConfig field).
`--resume-from-checkpoint true` continues from the newest complete checkpoint in --output-dir; a path picks one.
Flags, recipe and input files are checked before anything loads: a mistake is one line (see qerl.cli).

Here: the script's own arguments, parsing, the checks, building the trainer, the run. Recipes, numeric ranges and
the short --help are in qerl/recipes.py; the output folder's rules (resume, overwrite, the run lock) in
qerl/run_dir.py.
"""

from __future__ import annotations

import logging
import os
import shlex
import sys
import warnings
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING

from qerl import cli, data, input_checks, recipes, rewards
from qerl.errors import UsageError, nearest
from qerl.field_rules import DTYPES, PRECISIONS, check_choices, check_ranges
from qerl.run_dir import RunLock, prepare_output_dir, where_to_resume

if TYPE_CHECKING:  # torch, TRL and the model code load after the flags are read: --help takes no seconds
    from qerl.config import QeRLConfig
    from qerl.trainer import QeRLTrainer

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
        default=None, metadata={"help": "Checkpoint folder (NVFP4 compressed-tensors or BF16) or hub id (required)."}
    )
    precision: str = field(
        default="auto",
        metadata={"help": "Base precision: auto (from the checkpoint), nvfp4 or bf16.", "choices": list(PRECISIONS)},
    )
    dtype: str = field(
        default="bfloat16",
        metadata={"help": "Compute dtype of the base (float32 for CPU runs).", "choices": list(DTYPES)},
    )
    dataset: str = field(
        default="gsm8k",
        metadata={"help": f"{', '.join(data.KNOWN_DATASETS)}, or a local .jsonl/.json/.parquet/.csv file."},
    )
    dataset_split: str = field(default="train", metadata={"help": "Dataset split to train on."})
    dataset_format: str = field(
        default="auto", metadata={"help": f"Local files: {', '.join(data.FORMAT_COLUMNS)} or auto (from columns)."}
    )
    num_examples: int | None = field(default=None, metadata={"help": "Use only the first N examples (default: all)."})
    long_prompts: str = field(
        default="drop",
        metadata={
            "help": f"A prompt over --max-prompt-length: {' or '.join(data.LONG_PROMPTS)}. drop: left out (TRL "
            "1.16 does not truncate); keep_last: its last tokens kept, as the QeRL reference's TRL 0.21 did (the "
            "system prompt and the question's start are cut)."
        },
    )
    soft_overlong_cache: int = field(
        default=0, metadata={"help": "DAPO soft overlong punishment over the last N completion tokens (0: off)."}
    )
    overwrite_output_dir: bool = field(
        default=False,
        metadata={
            "help": "Start over in an --output-dir that holds an earlier run: its checkpoint-* folders and "
            "adapter are deleted (its metrics.jsonl is kept as metrics.N.jsonl)."
        },
    )
    fast_inference: bool | None = field(default=None, metadata={"help": f"Ignored: {IGNORED_FLAGS['fast_inference']}."})
    max_seq_length: int | None = field(default=None, metadata={"help": f"Ignored: {IGNORED_FLAGS['max_seq_length']}."})


def flag_table() -> list[dict]:
    """Every flag TRL's parser makes of QeRLScriptArguments and QeRLConfig, described (qerl/train_flags.json holds
    it, so that reading the flags imports neither TRL nor torch)."""
    from trl import TrlParser

    from qerl.config import QeRLConfig

    return recipes.describe(TrlParser((QeRLScriptArguments, QeRLConfig)))


def write_flag_table() -> None:
    """Run after a change to the settings' fields or to TRL (tests/qerl/test_recipes.py fails until then):
    python -c "from qerl import train; train.write_flag_table()"."""
    recipes.FLAG_TABLE.write_text(recipes.table(flag_table()))


def build_parser() -> recipes.RecipeParser:
    return recipes.build_parser(flag_table)


def read_settings(argv: list[str] | None = None) -> tuple[dict, set[str]]:
    """The settings of a run, flags over recipe over defaults, checked against field_rules, and the names of those
    given as flags; nothing heavy imported. -h/--help prints the short help, --help-all every flag, and exits."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        print(recipes.quick_help(parser))
        raise SystemExit(0)
    if "--help-all" in argv:
        parser.print_help()
        raise SystemExit(0)
    argv = cli.attach_negative_numbers(argv)
    recipe, recipe_path = {}, None
    if "--config" in argv:  # the recipe sets the defaults, flags override them
        index = argv.index("--config")
        if index + 1 == len(argv):
            raise UsageError("--config needs a YAML file")
        recipe_path = argv.pop(index + 1)
        recipe = recipes.load_recipe(recipe_path, parser)
        argv.pop(index)
        for name, value in recipe.pop("env").items():
            os.environ[name] = str(value)
        parser.set_defaults_with_config(**recipe)
    flags = parser._option_string_actions
    given = {flags[arg.split("=", 1)[0]].dest for arg in argv if arg.split("=", 1)[0] in flags}

    def named(name: str) -> str:  # as the user wrote it: a flag, or a recipe's key
        if name in recipe and name not in given:
            return f"--config {recipe_path}: {name}"
        return f"--{name.replace('_', '-')}"

    settings = vars(parser.parse_args(argv))
    check_choices(settings, named)  # argparse checks the flags' choices, not a recipe's
    check_ranges(settings, named)
    return settings, given


# `--help`'s "float32 for CPU runs": BF16 matmuls are slow on a CPU without native BF16.
CPU_SETTINGS = {"use_cpu": True, "bf16": False, "dtype": "float32"}
# transformers' bitsandbytes optimizers (trainer_optimizer._BITSANDBYTES_OPTIMIZERS, pinned in tests/qerl/test_train.py)
BITSANDBYTES_OPTIMIZERS = (
    "adamw_bnb_8bit", "adamw_8bit", "paged_adamw_32bit", "paged_adamw_8bit", "ademamix", "ademamix_8bit",
    "paged_ademamix_32bit", "paged_ademamix_8bit", "lion_32bit", "lion_8bit", "paged_lion_32bit", "paged_lion_8bit",
    "rmsprop_bnb", "rmsprop_bnb_8bit", "rmsprop_bnb_32bit",
)  # fmt: skip
# Of those, the AdamW ones: torch's AdamW makes the same update, with FP32 moments.
BITSANDBYTES_ADAMW = ("adamw_bnb_8bit", "adamw_8bit", "paged_adamw_32bit", "paged_adamw_8bit")


def fit_the_machine(settings: dict, given: set[str]) -> None:
    """Settings a recipe chose for a GPU machine with bitsandbytes, fitted to this one where the flags leave them open,
    each change said in one line: without CUDA (or with --use-cpu True) the CPU settings; without bitsandbytes,
    torch's AdamW for the recipes' 8-bit one. What the flags ask for and this machine cannot do is one line."""
    import torch
    from transformers.utils import is_bitsandbytes_available

    cuda = torch.cuda.is_available()
    if settings["use_cpu"] or not cuda:
        taken = {name: value for name, value in CPU_SETTINGS.items() if name not in given and settings[name] != value}
        settings.update(taken)
        if taken:
            flags = " ".join(f"--{name.replace('_', '-')} {value}" for name, value in taken.items())
            where = "" if cuda else " (no CUDA device here)"
            logger.warning("training on the CPU%s: taking %s (give a flag to choose otherwise)", where, flags)
        if settings["bf16"] and not settings["use_cpu"]:  # both given: transformers would say "assign use_cpu"
            raise UsageError("--bf16 True --use-cpu False: no CUDA device here; pass --use-cpu True or --bf16 False")
    optim = settings["optim"]
    if optim in BITSANDBYTES_OPTIMIZERS and not is_bitsandbytes_available():
        if "optim" in given or optim not in BITSANDBYTES_ADAMW:
            raise UsageError(
                f"--optim {optim} needs bitsandbytes, which is not installed here: pip install bitsandbytes, or "
                "pass --optim adamw_torch"
            )
        settings["optim"] = "adamw_torch"
        logger.warning(
            "bitsandbytes is not installed: taking --optim adamw_torch for the recipe's %s (the same AdamW update, "
            "FP32 moments; pip install bitsandbytes for the 8-bit one)",
            optim,
        )


def parse_args(argv: list[str] | None = None) -> tuple[QeRLScriptArguments, QeRLConfig]:
    settings, given = read_settings(argv)
    if not settings["model_name"]:
        raise UsageError("--model-name is required (a checkpoint folder or hub id)")
    recipes.check_installed()
    if settings["deepspeed"]:  # TrainingArguments' own --deepspeed, beside accelerate's DeepSpeed configs
        cli.allow_deepspeed()
    fit_the_machine(settings, given)
    from qerl.config import QeRLConfig

    own = {f.name for f in fields(QeRLScriptArguments)}
    script_args = QeRLScriptArguments(**{name: settings.pop(name) for name in own})
    try:
        config = QeRLConfig(**settings)
    except ValueError as err:  # raised while building the config from the settings: the settings are at fault
        raise UsageError(str(err)) from err
    for name, reason in IGNORED_FLAGS.items():
        if getattr(script_args, name) is not None:
            warnings.warn(f"ignoring --{name.replace('_', '-')}: {reason}", stacklevel=2)
    return script_args, config


def _check_dataset(name: str, dataset_format: str) -> str:
    """The dataset's format, once its name, its columns or its hub's reach are checked."""
    columns = input_checks.check_dataset(name, data.KNOWN_DATASETS, "--dataset")
    if name in data.HUB_DATASETS:
        source = data.HUB_DATASETS[name]
        rows = data.GSM8K_DATA / "train_sample.jsonl" if source.path == "openai/gsm8k" else None
        input_checks.check_hub_dataset(source.path, "--dataset", name, rows)
        return source.format
    if columns is None:
        return name  # built in
    fmt = dataset_format
    if fmt == "auto":
        try:
            fmt = data.detect_format(columns, name)
        except ValueError as err:
            raise UsageError(str(err)) from None
    input_checks.require_columns(name, columns, data.FORMAT_COLUMNS[fmt], f"format {fmt!r}")
    return fmt


def validate(script_args: QeRLScriptArguments, config: QeRLConfig) -> str:
    """Every check that needs no model or dataset loaded, so that a mistake costs seconds, not a 7B load. Returns the
    dataset's format (data.FORMAT_COLUMNS)."""
    if os.path.exists(config.output_dir) and not os.path.isdir(config.output_dir):
        raise UsageError(f"--output-dir {config.output_dir}: is a file")
    input_checks.check_model(script_args.model_name, "--model-name")
    from qerl.nvfp4.checkpoint import is_nvfp4_checkpoint

    # A folder quantized some other way than NVFP4A16 is refused here, by name.
    if is_nvfp4_checkpoint(script_args.model_name) and script_args.precision == "bf16":
        raise UsageError(f"--model-name {script_args.model_name} is an NVFP4 checkpoint; use --precision auto")
    formats = ("auto", *data.FORMAT_COLUMNS)
    if script_args.dataset_format not in formats:
        raise UsageError(
            f"--dataset-format {script_args.dataset_format!r}{nearest(script_args.dataset_format, formats)}: "
            f"use one of {', '.join(formats)}"
        )
    if script_args.long_prompts not in data.LONG_PROMPTS:
        raise UsageError(f"--long-prompts {script_args.long_prompts!r}: use one of {', '.join(data.LONG_PROMPTS)}")
    cache, cap = script_args.soft_overlong_cache, config.max_completion_length
    if not 0 <= cache <= cap:  # a recipe's cache outlives a --max-completion-length shrunk below it
        raise UsageError(
            f"--soft-overlong-cache {cache}: the punishment ramps over the last N tokens before the cap, "
            f"--max-completion-length {cap}; give 0 (off) to {cap}"
        )
    return _check_dataset(script_args.dataset, script_args.dataset_format)


def prompts_and_rewards(script_args: QeRLScriptArguments, config: QeRLConfig, tokenizer):
    """The run's training prompts (under the prompt cap) and reward functions. Shared with benchmarks.trl_baseline,
    which runs the same task."""
    task = data.load_task(
        script_args.dataset,
        script_args.dataset_split,
        script_args.dataset_format,
        script_args.num_examples,
        seed=config.seed,
    )
    train_dataset = data.fit_prompts(task.train, tokenizer, config.max_prompt_length, script_args.long_prompts)
    if len(train_dataset) == 0:
        raise UsageError(f"no prompt of {script_args.dataset} fits --max-prompt-length {config.max_prompt_length}")
    reward_funcs = list(task.reward_funcs)
    if script_args.soft_overlong_cache:
        reward_funcs.append(
            rewards.soft_overlong_punishment(config.max_completion_length, script_args.soft_overlong_cache)
        )
    logger.info(
        "task %s (%s format): %d prompts, rewards %s",
        task.name,
        task.format,
        len(train_dataset),
        [getattr(f, "__name__", type(f).__name__) for f in reward_funcs],
    )
    return train_dataset, reward_funcs


def build_trainer(script_args: QeRLScriptArguments, config: QeRLConfig, model=None) -> QeRLTrainer:
    """The trainer of a run; `model`: a base already built in memory (benchmarks), instead of loading model_name."""
    import torch

    from qerl import base_model
    from qerl.trainer import QeRLTrainer

    dtype = getattr(torch, script_args.dtype)
    tokenizer = base_model.load_tokenizer(script_args.model_name)
    if model is None:
        model = base_model.load_base_model(script_args.model_name, script_args.precision, dtype, device=config.device)
    train_dataset, reward_funcs = prompts_and_rewards(script_args, config, tokenizer)
    return QeRLTrainer(model, reward_funcs, args=config, train_dataset=train_dataset, processing_class=tokenizer)


def eval_command(script_args: QeRLScriptArguments, config: QeRLConfig, task_format: str) -> str:
    """The command that scores the run's adapter greedily at its completion cap, on held-out problems of its task,
    asked as it was trained: GSM8K's test set (the hub's, or the rows a clone carries when the run trained on a local
    file), competition math (MATH-500) for Big-Math and DAPO-Math, the arithmetic task's own problems."""
    if task_format in ("bigmath", "dapomath"):
        argv = ["python", "-m", "eval.competition_math"]
    else:
        argv = ["python", "-m", "eval.gsm8k"]
        if task_format == "arithmetic":
            argv += ["--data", "arithmetic"]
        elif script_args.dataset not in data.HUB_DATASETS:
            argv += ["--data", str(data.GSM8K_DATA / "test_sample.jsonl")]
        if task_format in ("gsm8k_hash", "gsm8k_lenient"):
            argv += ["--format", "gsm8k_hash"]
    model = script_args.model_name
    model = os.path.abspath(model) if os.path.isdir(model) else model  # a hub id stays one
    argv += ["--protocol", "greedy", "--max-new-tokens", str(config.max_completion_length), "--model", model]
    return shlex.join([*argv, "--adapter", os.path.abspath(config.output_dir)])


def report(script_args: QeRLScriptArguments, config: QeRLConfig, task_format: str) -> None:
    """The run's closing lines, as the demo's: the metrics (plotted beside them), the adapter, the eval command."""
    from qerl import plotting
    from qerl.callbacks import say_outputs

    metrics, plot = os.path.abspath(os.path.join(config.output_dir, "metrics.jsonl")), None
    if not config.metrics_jsonl:
        metrics = "not written (--metrics-jsonl false)"
    elif plotting.read_metrics(metrics):
        title = f"qerl.train: {os.path.basename(os.path.normpath(script_args.model_name))}, {script_args.dataset}"
        plot = plotting.plot_metrics(metrics, metrics.replace("metrics.jsonl", "metrics.png"), title=title)
    adapter = os.path.abspath(config.output_dir)
    say_outputs(print, metrics, plot, adapter, script_args.model_name, eval_command(script_args, config, task_format))


def main(argv: list[str] | None = None) -> QeRLTrainer:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    script_args, config = parse_args(argv)
    task_format = validate(script_args, config)
    lock = RunLock(config.output_dir) if config.process_index == 0 else None  # the other ranks share rank 0's
    resume = prepare_output_dir(config, script_args.model_name, script_args.overwrite_output_dir, lock)
    try:
        trainer = build_trainer(script_args, config)
        from transformers import PrinterCallback, ProgressCallback

        from qerl.callbacks import CompactProgress

        # A line per logging step instead of transformers' progress bar and dict of every key (metrics.jsonl has them).
        trainer.remove_callback(PrinterCallback)
        trainer.remove_callback(ProgressCallback)
        trainer.add_callback(CompactProgress(say=logger.info))
        try:
            trainer.train(resume_from_checkpoint=resume)
        except KeyboardInterrupt:
            logger.warning("stopped at step %d: %s", trainer.state.global_step, where_to_resume(config.output_dir))
            raise
        with cli.signals_deferred():  # the final adapter is written whole
            trainer.save_model(config.output_dir)  # the LoRA adapter (and trained norms), not the frozen base
    finally:
        if lock is not None:
            lock.release()
    import torch  # loaded by the trainer already; not at the top, so that reading the flags imports no torch

    if torch.distributed.is_initialized():
        # Tear the process group down before the interpreter does: left to exit, gloo's threads were seen destroyed
        # unjoined on one rank ("terminate called without an active exception", exit -6) after a finished run.
        trainer.accelerator.wait_for_everyone()
        torch.distributed.destroy_process_group()
    if config.process_index == 0:
        report(script_args, config, task_format)
    return trainer


def run(argv: list[str] | None = None) -> int:
    """The command line (`python -m qerl.train`, `qerl-train`): input errors in one line, exit code 2."""
    return cli.run_cli(main, "qerl.train", argv)


if __name__ == "__main__":
    sys.exit(run())
