"""Which of a model's Linears cost most when rounded to NVFP4, and what keeping the worst in BF16 buys (issue 49 item
3c: "the most sensitive layers kept in BF16"), on GSM8K train text, before any training.

    python -m experiments.layer_sensitivity --bf16 ckpt/M --solutions 64 --keep 1,2,4,8

Each group of Linears that share a global scale in one decoder layer (q/k/v, o, gate/up, down) is rounded to NVFP4
alone (round to nearest, as `qerl.quantize`), the rest of the model left in BF16, and scored by its KL(BF16 || that
model) per answer token, teacher-forced on the first --solutions solutions of --data (GSM8K's train split by default:
a base chosen here is chosen without the test set). Then the whole model rounded except the k worst groups, for each
k of --keep (0: every group rounded, the base every 4-bit run trains on): its KL, the memory the kept groups add, and
the `qerl.quantize --ignore` list that writes that base. Means with 95% t intervals over the solutions.
Writes results/layer_sensitivity/NAME.json and .md (the card, the commit and every figure).
"""

from __future__ import annotations

import sys
import time
from contextlib import contextmanager

from benchmarks.launch import REPO
from benchmarks.quant_quality import DEFAULT_DATA, iter_token_logprobs, kl_per_token, read_gsm8k, solution_sequences
from experiments.arms_results import base_record, current_commit, write_report
from experiments.arms_stats import mean_interval
from qerl import cli, input_checks

RESULTS = REPO / "results" / "layer_sensitivity"
NVFP4_BYTES_PER_WEIGHT = 0.5 + 1 / 16  # an E2M1 code and a sixteenth of an FP8 group scale


def sibling_groups(model) -> list[tuple[str, ...]]:
    """The quantized Linears of each decoder layer, in model order, grouped as they share a global scale."""
    from qerl.base_model import decoder_layers
    from qerl.nvfp4.quantize import fused_groups, quantization_targets

    targets = set(quantization_targets(model))
    names = {module: name for name, module in model.named_modules()}
    return [
        group
        for layer in decoder_layers(model)
        for group in fused_groups(names[m] for m in layer.modules() if names.get(m) in targets)
    ]


@contextmanager
def rounded(model, groups: list[tuple[str, ...]]):
    """The Linears of `groups` holding their NVFP4 values for the duration, rounded as `qerl.quantize` rounds them
    (to nearest, from the weights read in BF16, each group's shared global scale), whatever dtype the model computes
    in; their weights back, bit for bit, on exit."""
    import torch

    from qerl.nvfp4 import codec
    from qerl.nvfp4.quantize import global_scales

    modules = dict(model.named_modules())
    saved = {}
    try:
        with torch.no_grad():
            for group in groups:
                read = {name: modules[name].weight.detach().to(torch.bfloat16) for name in group}
                scales = global_scales(read)
                for name in group:
                    weight = modules[name].weight
                    saved[name] = weight.detach().clone()
                    weight.copy_(codec.quantize(read[name], scales[name], name=name).dequantize(weight.dtype))
        yield
    finally:
        with torch.no_grad():
            for name, weight in saved.items():
                modules[name].weight.copy_(weight)


def kl_per_solution(model, sequences, reference, pad: int, batch_size: int) -> list[float]:
    """KL(reference || model) per answer token, one mean per solution; the model's log-probs one batch at a time."""
    ours = iter_token_logprobs(model, sequences, pad, batch_size)
    return [kl_per_token(p.to(q.device), q) for p, q in zip(reference, ours, strict=True)]


def bf16_extra_bytes(model, groups: list[tuple[str, ...]], bf16_bytes: int = 2) -> dict[tuple[str, ...], int]:
    """What keeping each group in BF16 adds to an NVFP4 base."""
    modules = dict(model.named_modules())
    return {
        g: round(sum(modules[name].weight.numel() for name in g) * (bf16_bytes - NVFP4_BYTES_PER_WEIGHT))
        for g in groups
    }


def measure(
    model, tokenizer, rows: list[dict], keep: list[int], batch_size: int, groups=None, progress: bool = True
) -> dict:
    """Every group (sibling_groups, unless given) rounded alone, ranked by KL; then the model rounded but for the top
    k groups, for each k."""
    import torch
    from tqdm.auto import tqdm

    pad = tokenizer.pad_token_id
    sequences = solution_sequences(tokenizer, rows)
    groups = groups or sibling_groups(model)
    extra = bf16_extra_bytes(model, groups)
    with torch.no_grad():
        reference = list(iter_token_logprobs(model, sequences, pad, batch_size))  # V x tokens x 4 bytes, on device
        alone = {}
        for group in tqdm(groups, desc="groups rounded alone", unit="group", disable=not progress):
            with rounded(model, [group]):
                alone[group] = kl_per_solution(model, sequences, reference, pad, batch_size)
        ranked = sorted(groups, key=lambda g: -mean_interval(alone[g])[0])
        kept = {}
        for k in keep:
            with rounded(model, ranked[k:]):
                kept[k] = kl_per_solution(model, sequences, reference, pad, batch_size)
    return {
        "solutions": len(sequences),
        "tokens": sum(len(ids) - start for ids, start in sequences),
        "groups": [{"modules": list(g), "kl": mean_interval(alone[g]), "bf16_extra_bytes": extra[g]} for g in ranked],
        "keep": [
            {
                "k": k,
                "kl": mean_interval(kept[k]),
                "kl_per_solution": kept[k],
                "bf16_extra_bytes": sum(extra[g] for g in ranked[:k]),
                "ignore": ["lm_head", *(name for g in ranked[:k] for name in g)],
            }
            for k in keep
        ],
    }


def table(result: dict, top: int = 12) -> str:
    lines = [
        f"# NVFP4 rounding, group by group, of {result['name']} ({result['card']}, commit {result['commit'][:10]})",
        "",
        f"Teacher-forced: the first {result['solutions']} solutions of {result['data']} ({result['tokens']} answer "
        "tokens), KL(BF16 ‖ model) nats/token, 95% t intervals over the solutions.",
        "",
        f"The {min(top, len(result['groups']))} groups that cost most rounded alone (of {len(result['groups'])}):",
        "",
        "| group | KL alone | BF16 adds |",
        "|---|---|---|",
    ]

    def cells(row: dict) -> str:
        return f"{row['kl'][0]:.5f} ± {row['kl'][1]:.5f} | {row['bf16_extra_bytes'] / 2**20:.0f} MiB |"

    lines += [f"| {', '.join(g['modules'])} | {cells(g)}" for g in result["groups"][:top]]
    lines += ["", "| groups kept in BF16 | KL | BF16 adds |", "|---|---|---|"]
    lines += [f"| {row['k']} | {cells(row)}" for row in result["keep"]]
    for row in result["keep"]:
        if row["k"]:
            lines.append(f"\nk = {row['k']}: `python -m qerl.quantize ... --ignore {' '.join(row['ignore'])}`")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    parser = cli.ArgumentParser(prog="python -m experiments.layer_sensitivity", description=__doc__)
    parser.add_argument("--bf16", required=True, help="the BF16 checkpoint folder")
    parser.add_argument("--data", default=str(DEFAULT_DATA), help="GSM8K JSONL (the train split)")
    parser.add_argument("--solutions", type=cli.COUNT, default=64, help="solutions teacher-forced")
    parser.add_argument(
        "--keep",
        type=lambda text: [cli.COUNT_OR_ZERO(k) for k in text.split(",") if k],
        default=[0, 1, 2, 4, 8],
        help="numbers of worst groups kept in BF16, comma-separated",
    )
    parser.add_argument("--batch-size", type=cli.COUNT, default=16)
    parser.add_argument("--device", help="(default: cuda if there is one, else cpu)")
    parser.add_argument("--dtype", default="bfloat16", help="compute dtype (float32 only to go faster on a CPU)")
    parser.add_argument("--name", help="the record's name (default: the BF16 folder's)")
    args = parser.parse_args(argv)
    input_checks.check_model(args.bf16, "--bf16")

    import torch

    from qerl import base_model

    start, commit = time.time(), current_commit()
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    tokenizer = base_model.load_tokenizer(args.bf16)
    model = base_model.load_base_model(args.bf16, "bf16", getattr(torch, args.dtype), device).eval()
    groups = sibling_groups(model)
    if max(args.keep) > len(groups):
        parser.error(f"--keep {max(args.keep)}: the model has {len(groups)} groups of Linears")
    measured = measure(model, tokenizer, read_gsm8k(args.data, args.solutions), args.keep, args.batch_size, groups)
    result = {
        **base_record(args, device, commit, "experiments.layer_sensitivity", argv),
        **measured,
        "seconds": time.time() - start,
    }
    write_report(RESULTS, result["name"], result, table(result))
    return result


if __name__ == "__main__":
    sys.exit(cli.run_cli(main, "experiments.layer_sensitivity"))
