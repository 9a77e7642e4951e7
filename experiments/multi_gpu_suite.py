"""Issue 34's measurements on one machine of several GPUs, in one command that can be started again after a loss:

    python -m experiments.multi_gpu_suite run --out runs/issue34 [--gguf QWEN2.5-CODER-1.5B.gguf]
    python -m experiments.multi_gpu_suite summarize --out runs/issue34 [--bundle DIR]
    python -m experiments.multi_gpu_suite run --dry-run --out /tmp/suite     # CPU: gloo, the tiny model, the wiring

Phases, each a list of jobs that run side by side on disjoint GPUs (a job starts, in list order, as soon as the GPUs
it needs are free; a job whose result file exists is skipped, so a second start redoes only what was lost):
  prep  the random-init Qwen2.5-7B NVFP4 checkpoint (benchmarks.multi_gpu.random_nvfp4_checkpoint)
  a     benchmarks.multi_gpu at 7B: DDP, FSDP2, ZeRO-2, ZeRO-3 on 1 and 2 GPUs; DDP as two machines of one GPU
        (--simulate-nodes); DDP and FSDP2 on 4 GPUs. --a-steps steps of --a-batch completions per GPU of <= --a-tokens.
  b     experiments.resume_check under FSDP2 and ZeRO-3 on 2 GPUs each (7B, save at step N, resume step N+1, then
        eval.gsm8k on the saved adapter); beside them, untimed: the 32B NVFP4 checkpoint, layer by layer, and (with
        --gguf) the real model's BF16 conversion and NVFP4 quantization
  c     benchmarks.multi_gpu at 32B: DDP, FSDP2, ZeRO-3 on 2 GPUs, DDP on 1 GPU (the one-GPU figure); with --gguf,
        on the GPU left free, the real model's one-GPU run of phase d
  d     (--gguf) Qwen2.5-Coder-1.5B-Instruct NVFP4, configs/qwen2.5_coder_1.5b_gsm8k_hash.yaml for --d-steps steps,
        one GPU (8 prompts x 8 samples: 4 micro-batches of 16) and DDP on 4 GPUs with the same global batch (2 prompts
        per GPU, one micro-batch), same seed: the first step's reward and loss side by side
Timed rows of one phase may share the machine with other jobs on other GPUs (the one-GPU rows of a run side by
side); each row's JSON says which GPUs it had. Results: OUT/results/<job>.json; logs: OUT/logs/ and the
benchmark's workdirs under OUT/. `summarize` turns them into docs/benchmarks.md rows (OUT/summary.md); --bundle
writes summary.md, results.json and logs.tar.gz (the last lines of every log) to DIR, for a runner that can bring
back only a few files.

This module holds the jobs, the phases they form and the command line; the runner that places a phase's jobs on GPUs
is experiments/multi_gpu_runner.py, the summary and the bundle experiments/multi_gpu_summary.py.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shlex
import subprocess
import sys
from pathlib import Path

from benchmarks import multi_gpu
from benchmarks.launch import GSM8K_SAMPLE, RECIPES, REPO, child_env, free_port, gpu_count, run_or_raise
from experiments import resume_check
from experiments.multi_gpu_runner import Job, estimate, run_phase, say
from experiments.multi_gpu_summary import summarize

REAL_MODEL = "qwen2.5-coder-1.5b-instruct"
# Seconds each kind of job took or is guessed to take on 4 H100s (the estimate printed before the run).
GUESS = {"build-7b": 60, "build-32b": 150, "bench-7b": 60, "bench-32b": 110, "resume": 200, "real-prep": 150,
         "real-run": 70}  # fmt: skip


# ----------------------------------------------------------------------------------------------------------
# Jobs


def bench_args(args, size: str, model: str | None) -> argparse.Namespace:
    steps, batch, tokens = (
        (args.a_steps, args.a_batch, args.a_tokens) if size == "7b" else (args.c_steps, args.c_batch, args.c_tokens)
    )
    if args.dry_run:  # as benchmarks.multi_gpu --dry-run: a few tokens of the tiny model
        steps, batch, tokens = min(steps, 3), min(batch, 4), min(tokens, 8)
    workdir = Path(args.out) / f"bench-{size}"
    workdir.mkdir(parents=True, exist_ok=True)
    return argparse.Namespace(
        model=model,
        size="tiny" if args.dry_run else size,
        steps=steps,
        batch=batch,
        new_tokens=tokens,
        rollout_backend="native" if args.dry_run else "auto",
        no_profile=False,
        dry_run=args.dry_run,
        timeout=args.timeout_7b if size == "7b" else args.timeout_32b,
        workdir=str(workdir),
    )


def build_job(args, size: str, gpus: int, share: int = 0) -> Job:
    def work(gpu_ids):
        return {"model": multi_gpu.build_model(bench_args(args, size, None), gpu_ids[0])}

    return Job(
        f"build-{size}",
        gpus,
        work,
        GUESS[f"build-{size}"],
        share,
        holds=lambda result: (Path(result["model"]) / "config.json").is_file(),
    )


def model_of(args, size: str) -> str:
    result = json.loads((Path(args.out) / "results" / f"build-{size}.json").read_text())
    if "error" in result:
        raise RuntimeError(f"no {size} model: {result['error']}")
    return result["model"]


def bench_job(args, size: str, config: str, gpus: int, nodes: int = 1) -> Job:
    def work(gpu_ids):
        b = bench_args(args, size, model_of(args, size))
        row = multi_gpu.launch(b, config, gpus, nodes=nodes, gpu_ids=gpu_ids)
        return {**row, "size": size, "model": b.model, "steps": b.steps, "batch": b.batch, "new_tokens": b.new_tokens}

    name = f"{size}-{config}-{gpus}gpu" + (f"-{nodes}nodes" if nodes > 1 else "")
    return Job(name, gpus, work, GUESS[f"bench-{size}"])


def resume_job(args, config: str) -> Job:
    def work(gpu_ids):
        r = argparse.Namespace(
            config=config,
            model=model_of(args, "7b"),
            gpu_ids=",".join(map(str, gpu_ids)),
            steps=args.b_steps,
            batch=args.b_batch,
            new_tokens=args.b_tokens,
            seed=2025,
            rollout_backend="native" if args.dry_run else None,
            eval_problems=args.b_eval_problems,
            timeout=args.timeout_resume,
            dry_run=args.dry_run,
            out=str(Path(args.out) / f"resume-{config}"),
        )
        result = resume_check.run_check(r)
        say("\n" + resume_check.report(result))
        return result

    return Job(f"resume-{config}", 2, work, GUESS["resume"])


def logged(args, cmd: list[str], log: Path, gpu_ids: list[int], timeout: float) -> None:
    env = child_env(threads=1) if args.dry_run else child_env(CUDA_VISIBLE_DEVICES=",".join(map(str, gpu_ids)))
    run_or_raise(cmd, log, env=env, timeout=timeout)


def real_prep_job(args, share: int) -> Job:
    """The GGUF converted to BF16 (qerl.models fetch) and quantized to NVFP4 beside it."""
    ckpt = Path(args.out) / "ckpt"

    def work(gpu_ids):
        logs = Path(args.out) / "logs"
        bf16 = ckpt / REAL_MODEL
        fetch = [sys.executable, "-m", "qerl.models", "fetch", REAL_MODEL, "--output", str(bf16), "--gguf", args.gguf]
        logged(args, fetch, logs / "real-fetch.log", gpu_ids, 1200)
        device = "cpu" if args.dry_run else "cuda"
        code = f"from qerl.models.fetch import bf16_and_nvfp4; bf16_and_nvfp4({str(bf16)!r}, {str(ckpt)!r}, {device!r})"
        logged(args, [sys.executable, "-c", code], logs / "real-quantize.log", gpu_ids, 900)
        return {"bf16": str(bf16), "nvfp4": str(ckpt / f"{REAL_MODEL}-nvfp4")}

    return Job(
        "real-prep",
        0,
        work,
        GUESS["real-prep"],
        share,
        holds=lambda result: (Path(result["nvfp4"]) / "config.json").is_file(),
    )


def real_run_job(args, gpus: int) -> Job:
    def work(gpu_ids):
        prep = json.loads((Path(args.out) / "results" / "real-prep.json").read_text())
        if "error" in prep:
            raise RuntimeError(f"no real model: {prep['error']}")
        run_dir = Path(args.out) / f"real-{gpus}gpu"
        flags = [
            "--config", str(RECIPES[REAL_MODEL]), "--model-name", prep["nvfp4"], "--dataset",
            str(GSM8K_SAMPLE), "--dataset-format", "gsm8k_hash",
            "--max-steps", str(args.d_steps), "--seed", str(args.d_seed), "--output-dir", str(run_dir),
            "--overwrite-output-dir", "true", "--save-strategy", "no", "--logging-steps", "1", *args.d_flags,
        ]  # fmt: skip
        # The resume check's worker: qerl.train recording each rank's prompts and samples (the recipe's rewards).
        if gpus == 1:
            cmd = [sys.executable, "-m", "experiments.resume_check", "--worker", *flags]  # 4 micro-batches of 16
        else:  # the same 64 completions per step: 16 per GPU, one micro-batch each
            per_gpu = 64 // gpus
            cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                   str(REPO / "configs" / "accelerate" / "ddp.yaml"), "--num_processes", str(gpus),
                   "--main_process_port", str(free_port()), *(["--mixed_precision", "no"] if args.dry_run
                   else []), "-m", "experiments.resume_check", "--worker", *flags,
                   "--per-device-train-batch-size", str(per_gpu), "--gradient-accumulation-steps", "1"]  # fmt: skip
        logged(args, cmd, Path(args.out) / "logs" / f"real-{gpus}gpu.log", gpu_ids, args.timeout_real)
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
        return {
            "gpus": gpus,
            "steps": [r for r in rows if "loss" in r],
            "first_step_prompts": resume_check.prompts(run_dir, 1),
        }

    return Job(f"real-{gpus}gpu", gpus, work, GUESS["real-run"])


def plan(args) -> list[tuple[str, list[Job]]]:
    g = args.gpus
    phases = [("prep", [build_job(args, "7b", 1)])]
    a = [bench_job(args, "7b", c, 1) for c in args.configs]
    if g >= 2:
        a += [bench_job(args, "7b", c, 2) for c in args.configs]
        a.append(bench_job(args, "7b", "ddp", 2, nodes=2))
    if g >= 4:
        a += [bench_job(args, "7b", c, 4) for c in ("ddp", "fsdp") if c in args.configs]
    phases.append(("a", [j for j in a if not (args.dry_run and "-fsdp-" in j.name)]))  # FSDP runs on GPUs only
    b = [resume_job(args, c) for c in (("zero3",) if args.dry_run else ("fsdp", "zero3"))] if g >= 2 else []
    if not args.dry_run and not args.skip_32b:
        b.append(build_job(args, "32b", 0, share=0))
    if args.gguf:
        b.append(real_prep_job(args, share=min(2, g - 1)))
    phases.append(("b", b))
    c = []
    if not args.dry_run and not args.skip_32b and g >= 2:
        c = [bench_job(args, "32b", cfg, 2) for cfg in ("ddp", "fsdp", "zero3")] + [bench_job(args, "32b", "ddp", 1)]
    if args.gguf:  # its one-GPU run takes a GPU that phase c leaves free
        c.append(real_run_job(args, 1))
    phases.append(("c", c))
    if args.gguf and g >= 4:
        phases.append(("d", [real_run_job(args, 4)]))
    return phases


def restore(args) -> None:
    """The results of an earlier machine (a bundle's results.json) put back, so that only what it did not finish runs
    again (the models it built are rebuilt: they went with it)."""
    results = Path(args.out) / "results"
    results.mkdir(parents=True, exist_ok=True)
    for name, result in json.loads(Path(args.restore).read_text()).items():
        if not (results / f"{name}.json").exists() and ("error" not in result or not args.retry_failed):
            (results / f"{name}.json").write_text(json.dumps(result, indent=2))


def check_deepspeed() -> None:
    """Refuse to start when deepspeed is installed but does not import: transformers and accelerate import it in
    every run once it is installed, so each launch (FSDP and DDP too) would fail seconds in. Seen on the GPU machine:
    deepspeed 0.19.8 from a carried sdist without pydantic, which the machine's image lacks."""
    code = "import deepspeed.runtime.zero.config"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if result.returncode != 0:
        error = (result.stderr.strip().splitlines() or ["no error text"])[-1]
        raise SystemExit(
            f"deepspeed is installed but does not import ({error}); install what it names (pydantic: "
            "pydantic, pydantic-core, annotated-types, typing-inspection) or uninstall deepspeed"
        )


def run(args) -> None:
    Path(args.out).mkdir(parents=True, exist_ok=True)
    if args.restore:
        restore(args)
    if importlib.util.find_spec("deepspeed") is not None:
        check_deepspeed()
    phases = plan(args)
    say(
        f"{args.gpus} GPU(s); estimated wall time {estimate(phases, args.gpus) / 60:.1f} min on 4 H100s (guesses: "
        f"{GUESS}), less what earlier starts finished"
    )
    for name, jobs in phases:
        if args.only and name not in args.only:
            continue
        run_phase(args, name, jobs, args.gpus)
    summarize(args)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=("run", "summarize", "estimate"))
    parser.add_argument("--out", default="runs/issue34")
    parser.add_argument("--gpus", type=int, default=None, help="GPUs of the machine (default: all it has; dry run 4)")
    parser.add_argument("--gguf", help="Qwen2.5-Coder-1.5B-Instruct's GGUF: adds phase d (the real model)")
    parser.add_argument("--configs", default="ddp,fsdp,zero2,zero3", help="phase a's accelerate configs")
    parser.add_argument("--only", default="", help="phases to run (prep,a,b,c,d; default all)")
    parser.add_argument("--skip-32b", action="store_true", help="no 32B checkpoint, no phase c")
    parser.add_argument("--restore", help="run: an earlier machine's results.json (from --bundle); its jobs are kept")
    parser.add_argument("--retry-failed", action="store_true", help="run again the jobs whose result is an error")
    parser.add_argument("--a-steps", type=int, default=4)
    parser.add_argument("--a-batch", type=int, default=8)
    parser.add_argument("--a-tokens", type=int, default=512)
    parser.add_argument("--b-steps", type=int, default=2, help="resume check: checkpoint-N saved, step N+1 compared")
    parser.add_argument("--b-batch", type=int, default=8)
    parser.add_argument("--b-tokens", type=int, default=128)
    parser.add_argument("--b-eval-problems", type=int, default=4)
    parser.add_argument("--c-steps", type=int, default=4)
    parser.add_argument("--c-batch", type=int, default=8)
    parser.add_argument("--c-tokens", type=int, default=128)
    parser.add_argument("--d-steps", type=int, default=3)
    parser.add_argument("--d-seed", type=int, default=2025)
    parser.add_argument("--d-flags", default="", help="more qerl.train flags for phase d's runs (one string)")
    parser.add_argument("--timeout-7b", type=int, default=420, help="seconds one 7B launch may take")
    parser.add_argument("--timeout-32b", type=int, default=600)
    parser.add_argument("--timeout-resume", type=int, default=420)
    parser.add_argument("--timeout-real", type=int, default=420)
    parser.add_argument("--dry-run", action="store_true", help="CPU: gloo, the tiny model, the wiring only")
    parser.add_argument("--bundle", help="summarize: also write summary.md, results.json, logs.tar.gz here")
    args = parser.parse_args(argv)
    args.configs = [c for c in args.configs.split(",") if c]
    args.only = [p for p in args.only.split(",") if p]
    args.d_flags = shlex.split(args.d_flags)
    if args.gguf:
        args.gguf = str(Path(args.gguf).resolve())
    if args.gpus is None:
        args.gpus = 4 if args.dry_run else gpu_count()
    if args.gpus < 1:
        raise SystemExit("no GPU visible (--dry-run runs the wiring on the CPU)")
    if args.dry_run:
        args.skip_32b = True
        args.a_steps, args.b_tokens, args.b_eval_problems = min(args.a_steps, 3), 8, min(args.b_eval_problems, 2)
    if args.command == "estimate":
        print(f"{estimate(plan(args), args.gpus) / 60:.1f} min")
    elif args.command == "run":
        run(args)
    else:
        summarize(args)


if __name__ == "__main__":
    main()
