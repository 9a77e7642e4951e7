"""Which 4-bit base of a model is closest to its BF16 base (issue 49 item 3c), before any of them is trained on:
several NVFP4 quantizations of one model side by side, on GSM8K train rows none was calibrated on.

    python -m experiments.base_quality --bf16 ckpt/M --base rtn=ckpt/M-nvfp4 --base gptq=ckpt/M-gptq --prompts 128

--data: GSM8K's train split (default: ../shared/data/gsm8k/train.jsonl beside the checkout).

Teacher-forced on the first --solutions train solutions (benchmarks.quant_quality.teacher_forced): each base's
KL(BF16 || base) per token, top-1 agreement and perplexity with 95% t intervals over sequences, and every base
against the first, paired over the same sequences. Sampled (--prompts > 0, the next train rows; slow on a CPU):
each policy's share of temperature-1 samples the gsm8k_hash reward pays, the step-1 training reward of the issue.
qerl.quantize's GPTQ calibrates on the file's last rows: keep --solutions + --prompts below where they start.
Writes results/base_quality/NAME.json and .md (the card, the commit and every figure).
"""

from __future__ import annotations

import argparse
import sys
import time

from benchmarks.launch import REPO
from benchmarks.quant_quality import DEFAULT_DATA, read_gsm8k, sampled, teacher_forced
from experiments.arms_results import base_record, current_commit, write_report
from experiments.arms_stats import mean_interval
from qerl import cli, data, input_checks, rewards

RESULTS = REPO / "results" / "base_quality"
PAIRED = ("kl", "top1", "nll_nvfp4")  # per-sequence measures compared between bases


def parse_base(text: str) -> tuple[str, str]:
    name, sep, folder = text.partition("=")
    if not sep or not name or not folder:
        raise argparse.ArgumentTypeError(f"expected NAME=FOLDER, got {text!r}")
    return name, folder


def compare(bases: dict[str, dict]) -> dict[str, dict]:
    """Each base after the first minus the first, per sequence, with the paired 95% t interval of each measure."""
    first, *others = bases
    paired = {}
    for name in others:
        paired[name] = {}
        for key in PAIRED:
            a, b = bases[name]["per_sequence"][key], bases[first]["per_sequence"][key]
            paired[name][key] = mean_interval([x - y for x, y in zip(a, b, strict=True)])
    return paired


def table(result: dict) -> str:
    ppl_bf16 = next(iter(result["bases"].values()))["ppl_bf16"]
    lines = [
        f"# NVFP4 bases of {result['name']} against BF16 ({result['card']}, commit {result['commit'][:10]})",
        "",
        f"Teacher-forced: the first {result['solutions']} solutions of {result['data']} (95% t intervals over them).",
        "",
        f"| base | KL(BF16 ‖ base) nats/token | top-1 agreement | perplexity (BF16: {ppl_bf16:.3f}) |",
        "|---|---|---|---|",
    ]
    for name, r in result["bases"].items():
        kl, top1 = mean_interval(r["per_sequence"]["kl"]), mean_interval(r["per_sequence"]["top1"])
        lines.append(f"| {name} | {kl[0]:.4f} ± {kl[1]:.4f} | {top1[0]:.2%} ± {top1[1]:.2%} | {r['ppl_nvfp4']:.3f} |")
    first = next(iter(result["bases"]))
    for name, d in result["paired"].items():
        kl, top1, nll = d["kl"], d["top1"], d["nll_nvfp4"]
        lines.append(
            f"\n{name} - {first}, paired: KL {kl[0]:+.4f} ± {kl[1]:.4f}, top-1 {top1[0]:+.2%} ± {top1[1]:.2%}, "
            f"NLL {nll[0]:+.4f} ± {nll[1]:.4f} nats/token"
        )
    if result["sampled"]:
        lines += [
            "",
            f"Sampled at temperature 1: {result['prompts']} train prompts after those (gsm8k_hash format).",
            "",
        ]
        lines += ["| policy | rewarded | entropy nats/token | mean length | truncated |", "|---|---|---|---|---|"]
        for name, r in result["sampled"].items():
            lines.append(
                f"| {name} | {r['rewarded']:.1%} | {r['entropy']:.3f} ± {r['entropy_ci95']:.3f} | "
                f"{r['length']:.1f} | {r['truncated']:.1%} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    parser = cli.ArgumentParser(prog="python -m experiments.base_quality", description=__doc__)
    parser.add_argument("--bf16", required=True, help="the BF16 checkpoint folder")
    parser.add_argument(
        "--base", type=parse_base, action="append", required=True, help="NAME=FOLDER of an NVFP4 base (repeat)"
    )
    parser.add_argument("--data", default=str(DEFAULT_DATA), help="GSM8K JSONL (the train split)")
    parser.add_argument("--solutions", type=cli.COUNT, default=200, help="solutions teacher-forced")
    parser.add_argument("--prompts", type=cli.COUNT_OR_ZERO, default=0, help="prompts sampled from each policy")
    parser.add_argument("--max-new-tokens", type=cli.COUNT, default=256)
    parser.add_argument("--batch-size", type=cli.COUNT, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", help="(default: cuda if there is one, else cpu)")
    parser.add_argument("--dtype", default="bfloat16", help="compute dtype (float32 only to go faster on a CPU)")
    parser.add_argument("--name", help="the record's name (default: the BF16 folder's)")
    args = parser.parse_args(argv)
    bases = dict(args.base)
    if len(bases) != len(args.base):
        parser.error("--base: each NAME once")
    input_checks.check_model(args.bf16, "--bf16")
    for folder in bases.values():
        input_checks.check_model(folder, "--base")

    import torch

    from qerl import base_model

    start, commit = time.time(), current_commit()  # the code that runs, whatever is committed meanwhile
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype)
    tokenizer = base_model.load_tokenizer(args.bf16)
    bf16 = base_model.load_base_model(args.bf16, "bf16", dtype, device).eval()
    solutions = read_gsm8k(args.data, args.solutions)
    rows = read_gsm8k(args.data, args.prompts, offset=args.solutions)
    prompt_ids = [
        tokenizer.apply_chat_template(data.gsm8k_hash_prompt(row["question"]), add_generation_prompt=True)["input_ids"]
        for row in rows
    ]
    answers = [rewards.gsm8k_gold(row["answer"]) for row in rows]
    forced, policies = {}, {}

    def sample(name, model):
        policies[name] = sampled(model, tokenizer, prompt_ids, answers, args.max_new_tokens, args.batch_size, args.seed)

    with torch.no_grad():
        if prompt_ids:
            sample("bf16", bf16)
        for name, folder in bases.items():
            model = base_model.load_base_model(folder, "nvfp4", dtype, device).eval()
            forced[name] = teacher_forced(bf16, model, tokenizer, solutions, args.batch_size)
            if prompt_ids:
                sample(name, model)
            del model
    result = {
        **base_record(args, device, commit, "experiments.base_quality", argv),
        "solutions": args.solutions,
        "prompts": args.prompts,
        "base_folders": bases,
        "bases": forced,
        "paired": compare(forced),
        "sampled": policies,
        "seconds": time.time() - start,
    }
    write_report(RESULTS, result["name"], result, table(result))
    return result


if __name__ == "__main__":
    sys.exit(cli.run_cli(main, "experiments.base_quality"))
