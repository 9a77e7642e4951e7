"""Does a run saved under a sharding engine resume exactly? One accelerate config, N+1 steps of `qerl.train`:

    python -m experiments.resume_check --config fsdp --model CKPT --gpu-ids 0,1 --out runs/resume-fsdp
    python -m experiments.resume_check --config zero3 --dry-run --out /tmp/resume-zero3     # CPU, gloo, tiny model

  A  `accelerate launch -m qerl.train` (the real entry point, through a thin harness) for N+1 steps, saving
     checkpoint-N; its step N+1 is the uninterrupted continuation.
  B  checkpoint-N copied into a fresh output folder, then the same command with `--resume-from-checkpoint true`: it
     loads the adapter, optimizer, scheduler and every rank's RNG state from disk and runs step N+1.
  C  only if B differs from A at all: B again from the same copy. B vs C is the run-to-run spread of one step on
     this machine (GPU kernels that reduce with atomics are not bitwise repeatable); A vs B must stay within it.
Both runs have max_steps N+1, so the LR and AQN schedules agree (a run of max_steps N would have other ones).
Resuming from A's own checkpoint, rather than from a second run interrupted at N, keeps the first N steps' spread
out of the comparison: what is compared is exactly "saved and resumed" against "kept going in memory".

Compared at step N+1: the loss, reward and grad norm (metrics.jsonl), the sampled completion ids of every rank (a
hash per generation round: whether the restored RNG state reproduces the rollout's sampling), and the final adapters
(largest difference, and its norm over the norm of step N+1's update, A's adapter minus checkpoint-N's). Then the
saved final adapter is loaded by `python -m eval.gsm8k --adapter` on one GPU for a few problems.

Random weights never answer right, so every reward would be 0, every advantage 0 and the update nothing but weight
decay: the harness swaps the gsm8k_hash reward for one that varies within a group (the share of digits in the
completion's text, as the multi-process tests do), so that step N+1 has a real gradient.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import shutil
import sys
import time
from pathlib import Path

from benchmarks.launch import GSM8K_SAMPLE, REPO, child_env, free_port, last_error, run_logged, run_or_raise
from benchmarks.multi_gpu_worker import DEEPSPEED_CONFIGS, MAX_PROMPT_TOKENS
from qerl.field_rules import ROLLOUT_BACKENDS

METRICS = ("loss", "reward", "grad_norm")


# ----------------------------------------------------------------------------------------------------------
# The worker: qerl.train.main with a varying reward and a record of what each rank sampled


def digit_share_reward(completions, **kwargs) -> list[float]:
    from qerl.rewards import completion_text

    texts = [completion_text(c) for c in completions]
    return [sum(ch.isdigit() for ch in t) / max(len(t), 1) for t in texts]


def worker(argv: list[str]) -> None:
    """qerl.train.main(argv) recording, per generation round and rank, a hash of the completions sampled and one per
    distinct prompt; with a first argument --varied-reward, the gsm8k_hash reward swapped for digit_share_reward."""
    from qerl import rewards, train

    if argv[:1] == ["--varied-reward"]:
        argv = argv[1:]
        rewards.gsm8k_hash_reward = digit_share_reward  # looked up when the task is built
    build = train.build_trainer

    def build_and_record(*args, **kwargs):
        trainer = build(*args, **kwargs)
        rounds: list[dict] = []
        generate = trainer.rollout.generate

        def recording(prompt_ids, perturb):
            output = generate(prompt_ids, perturb)
            ids = json.dumps([list(map(int, c)) for c in output.completion_ids]).encode()
            prompts = sorted(
                {hashlib.sha256(json.dumps(list(map(int, p))).encode()).hexdigest()[:16] for p in prompt_ids}
            )
            rounds.append(
                {
                    "step": trainer.state.global_step + 1,
                    "completions": hashlib.sha256(ids).hexdigest(),
                    "prompts": prompts,
                }
            )
            path = Path(trainer.args.output_dir) / f"samples-rank{trainer.accelerator.process_index}.json"
            path.write_text(json.dumps(rounds))  # after every round: a run that dies keeps what it sampled
            return output

        trainer.rollout.generate = recording
        return trainer

    train.build_trainer = build_and_record  # train.main looks it up when it runs
    train.main(argv)


# ----------------------------------------------------------------------------------------------------------
# The driver


def train_flags(args, output_dir: Path, resume: bool) -> list[str]:
    flags = [
        "--config", str(REPO / "configs" / "dapo_gsm8k_nvfp4.yaml"), "--model-name", args.model,
        "--dataset", str(GSM8K_SAMPLE), "--dataset-format", "gsm8k_hash", "--max-prompt-length", str(MAX_PROMPT_TOKENS),
        "--output-dir", str(output_dir), "--max-completion-length", str(args.new_tokens),
        "--per-device-train-batch-size", str(args.batch), "--num-generations", str(args.batch),
        "--gradient-accumulation-steps", "1", "--max-steps", str(args.steps + 1), "--optim", "adamw_torch",
        "--save-strategy", "steps", "--save-steps", str(args.steps), "--report-to", "none", "--logging-steps", "1",
        "--seed", str(args.seed),
        # Random weights rarely sample EOS: with the recipe's masking every completion would drop out of the loss.
        "--mask-truncated-completions", "false",
    ]  # fmt: skip
    if args.rollout_backend:
        flags += ["--rollout-backend", args.rollout_backend]
    if resume:
        flags += ["--resume-from-checkpoint", "true"]
    if args.dry_run:
        deepspeed = args.config in DEEPSPEED_CONFIGS
        cpu = ["--use-cpu", "False", "--ddp-backend", "gloo"] if deepspeed else ["--use-cpu", "True"]
        flags += ["--dtype", "float32", "--bf16", "false", "--gradient-checkpointing", "false", *cpu]
    return flags


def launch(args, output_dir: Path, resume: bool, log: Path) -> float:
    """One `accelerate launch` of the worker; its wall seconds. Raises on failure, naming the log."""
    gpu_ids = [int(g) for g in args.gpu_ids.split(",")]
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file",
        str(REPO / "configs" / "accelerate" / f"{args.config}.yaml"), "--num_processes", str(len(gpu_ids)),
        "--main_process_port", str(free_port()),
    ]  # fmt: skip
    env = child_env(threads=1 if args.dry_run else None)
    if args.dry_run:
        cmd += ["--mixed_precision", "no"]
    else:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpu_ids))
    cmd += ["-m", "experiments.resume_check", "--worker", "--varied-reward", *train_flags(args, output_dir, resume)]
    start = time.perf_counter()
    run_or_raise(cmd, log, env=env, timeout=args.timeout)
    return time.perf_counter() - start


def step_metrics(run: Path, step: int) -> dict:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    row = next((r for r in rows if r.get("step") == step and "loss" in r), None)
    if row is None:
        raise RuntimeError(f"{run}/metrics.jsonl has no step {step}")
    return {k: row.get(k) for k in METRICS}


def rounds(run: Path) -> list[list[dict]]:
    """Per rank, what the worker recorded of each generation round."""
    ranks = sorted(run.glob("samples-rank*.json"), key=lambda p: int(p.stem.removeprefix("samples-rank")))
    return [json.loads(p.read_text()) for p in ranks]


def samples(run: Path, step: int) -> list[str]:
    """Per rank, the hash of the completions it sampled in step `step`'s generation round(s)."""
    return [",".join(r["completions"] for r in rank if r["step"] == step) for rank in rounds(run)]


def prompts(run: Path, step: int) -> list[str]:
    """The distinct prompts (hashes) that step `step`'s rounds sampled, over all ranks."""
    return sorted({h for rank in rounds(run) for r in rank if r["step"] == step for h in r["prompts"]})


def adapter(folder: Path) -> dict:
    from safetensors.torch import load_file

    return {k: v.float() for k, v in load_file(str(folder / "adapter_model.safetensors")).items()}


def compare(a: Path, b: Path, checkpoint: Path, step: int) -> dict:
    """B's step `step` against A's: metrics, samples, final adapters (largest difference; its norm against the norm
    of A's last update)."""
    import torch

    ma, mb = step_metrics(a, step), step_metrics(b, step)
    wa, wb, w0 = adapter(a), adapter(b), adapter(checkpoint)
    if wa.keys() != wb.keys():
        raise RuntimeError(f"adapters hold other tensors: {sorted(wa.keys() ^ wb.keys())[:4]}")
    diff = math.sqrt(sum(float((wa[k] - wb[k]).pow(2).sum()) for k in wa))
    update = math.sqrt(sum(float((wa[k] - w0[k]).pow(2).sum()) for k in wa))
    sa, sb = samples(a, step), samples(b, step)
    return {
        "metrics_a": ma,
        "metrics_b": mb,
        "metric_diff": {k: None if ma[k] is None or mb[k] is None else abs(ma[k] - mb[k]) for k in METRICS},
        "samples_equal": [x == y for x, y in zip(sa, sb, strict=True)] if len(sa) == len(sb) else False,
        "adapter_max_abs_diff": max(float((wa[k] - wb[k]).abs().max()) for k in wa),
        "adapter_tensors_equal": sum(torch.equal(wa[k], wb[k]) for k in wa),
        "adapter_tensors": len(wa),
        "adapter_diff_over_update": diff / update if update else None,
        "update_norm": update,
    }


def exact(c: dict) -> bool:
    return (
        all(v == 0 for v in c["metric_diff"].values() if v is not None)
        and c["samples_equal"] not in (False, [])
        and all(c["samples_equal"])
        and c["adapter_tensors_equal"] == c["adapter_tensors"]
    )


def verdict(ab: dict, bc: dict | None) -> str:
    """exact: bitwise; within spread: A vs B no further apart than twice B vs C, and every rank sampled alike where
    B and C did; else DIFFERS."""
    if exact(ab):
        return "exact"
    if bc is None:
        return "DIFFERS"
    if exact(bc):
        return "DIFFERS (resume repeats itself bitwise, yet differs from the uninterrupted run)"
    samples_ok = all(x or not y for x, y in zip(ab["samples_equal"] or [], bc["samples_equal"] or [], strict=False))
    metrics_ok = all(
        ab["metric_diff"][k] is None or ab["metric_diff"][k] <= 2 * (bc["metric_diff"][k] or 0.0) for k in METRICS
    )
    adapter_ok = (ab["adapter_diff_over_update"] or 0.0) <= 2 * (bc["adapter_diff_over_update"] or 0.0)
    return "within spread" if samples_ok and metrics_ok and adapter_ok else "DIFFERS (beyond twice the spread)"


def eval_adapter(args, run: Path, log: Path) -> dict:
    """The saved adapter through eval.gsm8k on one GPU (the first of --gpu-ids): it loads and generates."""
    out = run / "eval.jsonl"
    cmd = [
        sys.executable, "-m", "eval.gsm8k", "--model", args.model, "--adapter", str(run), "--data",
        str(REPO / "tests" / "data" / "gsm8k" / "test_sample.jsonl"), "--format", "gsm8k_hash", "--protocol", "greedy",
        "--limit", str(args.eval_problems), "--max-new-tokens", "32", "--out", str(out),
    ]  # fmt: skip
    env = child_env(threads=1 if args.dry_run else None)
    if not args.dry_run:
        env["CUDA_VISIBLE_DEVICES"] = args.gpu_ids.split(",")[0]
    start = time.perf_counter()
    code = run_logged(cmd, log, env=env, timeout=args.timeout)
    result = {"exit_code": code, "wall_s": time.perf_counter() - start, "log": str(log)}
    if code == 0 and out.is_file():
        result["summary"] = json.loads(out.read_text().splitlines()[0])
    else:
        result["error"] = last_error(log)
    return result


def run_check(args) -> dict:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    step = args.steps + 1
    a, b, c = out / "A", out / "B", out / "C"
    walls = {}
    if not (a / "adapter_model.safetensors").is_file():  # A done earlier (a restarted suite): kept
        shutil.rmtree(a, ignore_errors=True)
        walls["A"] = launch(args, a, False, out / "A.log")
    checkpoint = a / f"checkpoint-{args.steps}"
    files = sorted(p.name for p in checkpoint.iterdir())
    sizes = {p.name: p.stat().st_size for p in checkpoint.rglob("*") if p.is_file()}

    def resumed(run: Path, name: str) -> None:
        if (run / "adapter_model.safetensors").is_file():
            return
        shutil.rmtree(run, ignore_errors=True)
        run.mkdir()
        shutil.copytree(checkpoint, run / checkpoint.name)
        walls[name] = launch(args, run, True, out / f"{name}.log")

    resumed(b, "B")
    ab = compare(a, b, checkpoint, step)
    bc = None
    if not exact(ab):
        resumed(c, "C")
        bc = compare(c, b, checkpoint, step)
    result = {
        "config": args.config, "gpus": len(args.gpu_ids.split(",")), "model": args.model, "steps": args.steps,
        "new_tokens": args.new_tokens, "batch": args.batch, "checkpoint_files": files,
        "checkpoint_bytes": sum(sizes.values()),
        "largest_checkpoint_files": sorted(sizes.items(), key=lambda kv: -kv[1])[:4],
        "a_vs_b": ab, "b_vs_c": bc, "verdict": verdict(ab, bc), "wall_s": walls,
    }  # fmt: skip
    if args.eval_problems:
        result["eval"] = eval_adapter(args, b, out / "eval.log")
    (out / "result.json").write_text(json.dumps(result, indent=2))
    return result


def report(result: dict) -> str:
    ab = result["a_vs_b"]
    ratio = ab["adapter_diff_over_update"]
    lines = [
        f"{result['config']} on {result['gpus']} GPU(s): {result['verdict']}; checkpoint-{result['steps']} "
        f"{result['checkpoint_bytes'] / 2**20:.1f} MiB ({', '.join(result['checkpoint_files'])})",
        f"  step {result['steps'] + 1}: A {ab['metrics_a']}  B {ab['metrics_b']}",
        f"  samples equal per rank {ab['samples_equal']}; adapter tensors equal {ab['adapter_tensors_equal']}/"
        f"{ab['adapter_tensors']}, max |A-B| {ab['adapter_max_abs_diff']:.3g}, |A-B|/|update| "
        + ("-" if ratio is None else f"{ratio:.3g}"),
    ]
    if result["b_vs_c"]:
        bc = result["b_vs_c"]
        lines.append(
            f"  spread (B vs C): metrics {bc['metric_diff']}, samples equal {bc['samples_equal']}, "
            f"|B-C|/|update| {bc['adapter_diff_over_update']}"
        )
    if "eval" in result:
        e = result["eval"]
        summary = e.get("summary", {})
        ran = (
            f"loaded and ran: {summary.get('examples')} problems, accuracy {summary.get('accuracy')} "
            f"({summary.get('device')})"
            if "summary" in e
            else f"FAILED: {e['error']}"
        )
        lines.append(f"  eval.gsm8k --adapter: {ran}")
    return "\n".join(lines)


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        worker(argv[1:])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="accelerate config: fsdp, zero3, zero2, ddp")
    parser.add_argument("--model", help="NVFP4 checkpoint (default with --dry-run: the tests' tiny model)")
    parser.add_argument("--gpu-ids", default="0,1", help="GPUs (CUDA_VISIBLE_DEVICES numbers); on the CPU: processes")
    parser.add_argument("--steps", type=int, default=2, help="N: checkpoint-N is saved and resumed for step N+1")
    parser.add_argument("--batch", type=int, default=8, help="completions per GPU per step (one prompt's group)")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--seed", type=int, default=2025)
    parser.add_argument(
        "--rollout-backend",
        choices=ROLLOUT_BACKENDS,
        default=None,
        help="rollout engine (default: the recipe's auto; dry run native)",
    )
    parser.add_argument("--eval-problems", type=int, default=4, help="eval.gsm8k problems on the adapter (0: none)")
    parser.add_argument("--timeout", type=int, default=600, help="seconds one launch may take")
    parser.add_argument("--dry-run", action="store_true", help="CPU, gloo, the tests' tiny model, 8 tokens")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    if args.dry_run:
        args.batch, args.new_tokens = min(args.batch, 4), min(args.new_tokens, 8)
        args.rollout_backend = args.rollout_backend or "native"
        if args.model is None:
            from qerl.tiny import save_tiny_checkpoints

            args.model = save_tiny_checkpoints(str(Path(args.out) / "tiny"))[1]
    if args.model is None:
        parser.error("--model is required (an NVFP4 checkpoint) unless --dry-run")
    if args.config == "fsdp" and args.dry_run:
        raise SystemExit("accelerate runs FSDP on GPUs only")
    print(report(run_check(args)))


if __name__ == "__main__":
    main()
