"""`python -m qerl.train`: QeRL training from a YAML recipe and/or flags (TRL's TrlParser).

    python -m qerl.train --config configs/dapo_gsm8k_nvfp4.yaml --model-name /models/Qwen2.5-7B-NVFP4
    accelerate launch --config_file configs/accelerate/zero2.yaml -m qerl.train --config ... (several GPUs)

Flags keep the QeRL reference's names (--model-name, --dataset, --lora-rank, --lora-alpha, --ln,
--sigma-start, --sigma-end, --num-stages, --max-prompt-length, --random-state, and every GRPOConfig field).
`--resume-from-checkpoint true` continues from the newest checkpoint in --output-dir; a path picks one.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from dataclasses import dataclass, field

import torch
from transformers.trainer_utils import get_last_checkpoint
from trl import TrlParser

from qerl import data, policy, rewards
from qerl.trainer import QeRLConfig, QeRLTrainer

logger = logging.getLogger("qerl.train")

# Reference flags with another name here, and reference flags that configure tools we do not use.
FLAG_ALIASES = {
    "--random-state": "--seed",
    "--random_state": "--seed",
    "--warmup-ratio": "--warmup-steps",  # transformers 5 reads a warmup_steps below 1 as a ratio
    "--warmup_ratio": "--warmup-steps",
}
IGNORED_FLAGS = {
    "--fast-inference": "it selected the reference's unsloth/vLLM engine; see --rollout-backend",
    "--max-seq-length": "it sized the reference's unsloth engine; prompt and completion limits suffice here",
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
        default=None, metadata={"help": "Drop prompts longer than this many tokens (TRL 1.16 does not truncate)."}
    )
    soft_overlong_cache: int = field(
        default=0, metadata={"help": "DAPO soft overlong punishment over the last N completion tokens (0: off)."}
    )


def _rewrite_reference_flags(argv: list[str]) -> list[str]:
    out, i = [], 0
    while i < len(argv):
        flag = argv[i].split("=", 1)[0]
        if flag in IGNORED_FLAGS:
            warnings.warn(f"ignoring {flag}: {IGNORED_FLAGS[flag]}", stacklevel=2)
            i += 1 if "=" in argv[i] or i + 1 == len(argv) or argv[i + 1].startswith("--") else 2
            continue
        out.append(FLAG_ALIASES.get(flag, flag) + argv[i][len(flag) :])
        i += 1
    return out


def resolve_resume(value: str | None, output_dir: str) -> str | bool | None:
    """'true' -> newest checkpoint in output_dir (None if there is none yet); a path -> that checkpoint."""
    if value is None or str(value).lower() in ("", "false", "no", "0", "none"):
        return None
    if str(value).lower() in ("true", "yes", "1", "auto", "last"):
        last = get_last_checkpoint(output_dir) if os.path.isdir(output_dir) else None
        if last is None:
            logger.warning("no checkpoint in %s yet: starting from scratch", output_dir)
        return last
    if not os.path.isdir(value):
        raise FileNotFoundError(f"--resume-from-checkpoint {value}: no such checkpoint folder")
    return value


def parse_args(argv: list[str] | None = None) -> tuple[QeRLScriptArguments, QeRLConfig]:
    parser = TrlParser((QeRLScriptArguments, QeRLConfig))
    argv = _rewrite_reference_flags(list(sys.argv[1:] if argv is None else argv))
    script_args, config = parser.parse_args_and_config(args=argv)
    if not script_args.model_name:
        parser.error("--model-name is required (a checkpoint folder or hub id)")
    return script_args, config


def build_trainer(script_args: QeRLScriptArguments, config: QeRLConfig) -> QeRLTrainer:
    dtype = getattr(torch, script_args.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"--dtype {script_args.dtype!r} is not a torch dtype (bfloat16, float16, float32)")
    tokenizer = policy.load_tokenizer(script_args.model_name)
    model = policy.load_base_model(script_args.model_name, script_args.precision, dtype, device=config.device)
    task = data.load_task(
        script_args.dataset, script_args.dataset_split, script_args.dataset_format, script_args.num_examples,
        seed=config.seed,
    )  # fmt: skip
    train_dataset = data.drop_long_prompts(task.train, tokenizer, script_args.max_prompt_length)
    if len(train_dataset) == 0:
        raise ValueError(f"no prompt of {script_args.dataset} fits --max-prompt-length {script_args.max_prompt_length}")
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
    trainer = build_trainer(script_args, config)
    trainer.train(resume_from_checkpoint=resolve_resume(config.resume_from_checkpoint, config.output_dir))
    trainer.save_model(config.output_dir)  # the LoRA adapter (and trained norms), not the frozen base
    return trainer


if __name__ == "__main__":
    main()
