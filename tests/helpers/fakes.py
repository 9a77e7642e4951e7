"""Stand-ins the tests share, and the one way they build a trainer."""

import torch


def digit_share_reward(completions, **kwargs) -> list[float]:
    """Share of digits in each completion: it varies across a random model's samples, so advantages are non-zero
    and every GRPO step updates (the real rewards would be 0 on a random model)."""
    return [sum(ch.isdigit() for ch in c[0]["content"]) / max(len(c[0]["content"]), 1) for c in completions]


def make_trainer(checkpoint, args, dtype=torch.bfloat16, reward=digit_share_reward, num_examples=64):
    """QeRLTrainer on a checkpoint folder, built as qerl.train builds it (base_model.load_base_model, then QeRLTrainer:
    LoRA through TRL, FP32 masters), on the arithmetic task. `trainer.model` is the policy training uses. `reward`: a
    reward function or a list of them."""
    from qerl import base_model, data
    from qerl.trainer import QeRLTrainer

    model = base_model.load_base_model(checkpoint, dtype=dtype, device="cpu")
    task = data.load_task("arithmetic", num_examples=num_examples)
    return QeRLTrainer(
        model,
        reward if isinstance(reward, list) else [reward],
        args=args,
        train_dataset=task.train,
        processing_class=base_model.load_tokenizer(checkpoint),
    )


def recipe_config(tmp_path, **overrides):
    """The recipes' optimizer and precision (configs/dapo_gsm8k_nvfp4.yaml) at toy batch and length."""
    from qerl.config import QeRLConfig

    kwargs = dict(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=8,
        max_steps=5,
        learning_rate=1e-5,
        adam_beta1=0.9,
        adam_beta2=0.99,
        weight_decay=0.1,
        max_grad_norm=0.2,
        logging_steps=1,
        report_to=[],
        lora_rank=4,
        lora_alpha=8,
        use_cpu=True,
        bf16=True,
        gradient_checkpointing=False,
        save_strategy="no",
        beta=0.0,
        loss_type="dapo",
        epsilon_high=0.28,
        sigma_start=1e-2,
        sigma_end=1e-4,
        num_stages=10,
        seed=3,
    )
    kwargs.update(overrides)
    return QeRLConfig(**kwargs)


def train_argv(checkpoint, output_dir, steps, *extra) -> list[str]:
    """`python -m qerl.train` flags for a short run on the tiny model (CPU, FP32, a checkpoint every step)."""
    return [
        "--model-name",
        checkpoint,
        "--dataset",
        "arithmetic",
        "--num-examples",
        "64",
        "--dtype",
        "float32",
        "--output-dir",
        output_dir,
        "--per-device-train-batch-size",
        "8",
        "--num-generations",
        "4",
        "--max-completion-length",
        "6",
        "--max-steps",
        str(steps),
        "--save-steps",
        "1",
        "--report-to",
        "none",
        "--use-cpu",
        "True",
        "--bf16",
        "False",
        "--gradient-checkpointing",
        "False",
        "--lora-rank",
        "4",
        "--ln",
        "True",
        "--learning-rate",
        "5e-3",
        "--sigma-start",
        "0.1",
        "--sigma-end",
        "0.01",
        "--num-stages",
        "3",
        "--random-state",
        "11",
        "--logging-steps",
        "1",
        *extra,
    ]
