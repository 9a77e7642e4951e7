r"""What NVFP4 costs a real model: BF16 vs our NVFP4 quantization of the same checkpoint, on GSM8K text.

    python -m benchmarks.quant_quality --model smollm2-135m-instruct    # fetches and quantizes it into ckpt/
    python -m benchmarks.quant_quality --bf16 ckpt/smollm2-135m-instruct --nvfp4 ckpt/smollm2-135m-instruct-nvfp4
    python -m benchmarks.quant_quality --model smollm2-135m-instruct --data tests/data/gsm8k/train_sample.jsonl \
        --solutions 64 --prompts 64    # 128 of the 256 GSM8K train rows a clone carries

--data is a GSM8K JSONL (default: the train split, ../shared/data/gsm8k/train.jsonl beside the checkout: a base chosen
by these measures is chosen without the test set; the first --solutions rows are teacher-forced, the next --prompts
rows sampled).

Two measurements, each policy in the trainer's compute dtype (BF16 on a GPU):
  teacher-forced  GSM8K reference solutions as the assistant turn of a chat (calculator annotations <<...>>
                  removed): per answer token, KL(BF16 || NVFP4) of the next-token distributions, top-1
                  agreement, and each model's perplexity of the reference text;
  sampled         completions at temperature 1 (no top-k/top-p) on GSM8K prompts in the gsm8k_hash format, from
                  each policy: the entropy of the policy's distribution at every sampled token (the paper's
                  entropy figure: quantization raises it), the completion length and the share rewarded by
                  gsm8k_hash; also NVFP4 with AQN noise at --aqn-sigma (fresh noise per batch, like a rollout
                  round), to compare the noise AQN adds with the noise quantization already brings.
Means come with a 95% interval over sequences (normal approximation). Prints a table; writes JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from typing import TYPE_CHECKING

from benchmarks.launch import SHARED_GSM8K
from qerl import data, quantize, rewards

if TYPE_CHECKING:  # torch and the models load after the flags are read
    import torch

DEFAULT_DATA = SHARED_GSM8K / "train.jsonl"


def _question_alone(question: str) -> list[dict]:
    return [{"role": "user", "content": question}]


def read_gsm8k(path: str, limit: int, offset: int = 0) -> list[dict]:
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return rows[offset : offset + limit]


def mean_ci(values: list[float]) -> tuple[float, float]:
    """(mean, half-width of its 95% interval) over independent values."""
    if len(values) < 2:
        return (values[0] if values else float("nan")), float("nan")
    return statistics.fmean(values), 1.96 * statistics.stdev(values) / math.sqrt(len(values))


def _padded(batch: list[list[int]], pad: int, device, left: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    import torch

    width = max(map(len, batch))
    rows = [([pad] * (width - len(x)) + x) if left else (x + [pad] * (width - len(x))) for x in batch]
    ids = torch.tensor(rows, device=device)
    mask = torch.tensor(
        [([0] * (width - len(x)) + [1] * len(x)) if left else ([1] * len(x) + [0] * (width - len(x))) for x in batch],
        device=device,
    )
    return ids, mask


def solution_sequences(tokenizer, rows: list[dict]) -> list[tuple[list[int], int]]:
    """(ids, start) of each GSM8K row's reference solution as the assistant turn after its question alone: the
    text teacher-forced here, the answer tokens from `start` on."""
    return [quantize.gsm8k_solution_ids(tokenizer, row, prompt=_question_alone) for row in rows]


def iter_token_logprobs(model, sequences: list[tuple[list[int], int]], pad: int, batch_size: int):
    """For each (ids, start), in order: FP32 log-softmax of the next-token distributions that predict ids[start:],
    [n, V], on the model's device, one batch of forwards at a time."""
    import torch.nn.functional as F

    device = next(model.parameters()).device
    for i in range(0, len(sequences), batch_size):
        chunk = sequences[i : i + batch_size]
        ids, mask = _padded([s for s, _ in chunk], pad, device)
        logits = model(input_ids=ids, attention_mask=mask).logits
        for row, (seq, start) in enumerate(chunk):
            yield F.log_softmax(logits[row, start - 1 : len(seq) - 1].float(), dim=-1)


def token_logprobs(model, sequences: list[tuple[list[int], int]], pad: int, batch_size: int) -> list[torch.Tensor]:
    """iter_token_logprobs' tensors, all of them, on the CPU."""
    return [logprobs.cpu() for logprobs in iter_token_logprobs(model, sequences, pad, batch_size)]


def kl_per_token(p: torch.Tensor, q: torch.Tensor) -> float:
    """Mean over positions of KL(P || Q), from log-probabilities [n, V]."""
    return (p.exp() * (p - q)).sum(-1).mean().item()


def teacher_forced(bf16, nvfp4, tokenizer, rows: list[dict], batch_size: int) -> dict:
    import torch

    sequences = solution_sequences(tokenizer, rows)
    pad = tokenizer.pad_token_id
    per_seq = {"kl": [], "top1": [], "nll_bf16": [], "nll_nvfp4": []}
    tokens = 0
    for (seq, start), p, q in zip(
        sequences,
        token_logprobs(bf16, sequences, pad, batch_size),
        token_logprobs(nvfp4, sequences, pad, batch_size),
        strict=True,
    ):
        target = torch.tensor(seq[start:])
        per_seq["kl"].append(kl_per_token(p, q))
        per_seq["top1"].append((p.argmax(-1) == q.argmax(-1)).float().mean().item())
        per_seq["nll_bf16"].append(-p.gather(-1, target[:, None]).mean().item())
        per_seq["nll_nvfp4"].append(-q.gather(-1, target[:, None]).mean().item())
        tokens += len(target)
    result = {"sequences": len(sequences), "tokens": tokens, "per_sequence": per_seq}
    for key, values in per_seq.items():
        result[key], result[f"{key}_ci95"] = mean_ci(values)
    for name in ("bf16", "nvfp4"):  # perplexity of the per-sequence mean NLL, as exp of its mean
        result[f"ppl_{name}"] = math.exp(result[f"nll_{name}"])
    return result


def sampled(
    model,
    tokenizer,
    prompts: list[list[int]],
    answers: list[str],
    max_new_tokens: int,
    batch_size: int,
    seed: int,
    sigma: float = 0.0,
) -> dict:
    """Sample at temperature 1, then score each completion's per-token entropy under the policy that drew it."""
    import torch

    from qerl import aqn

    device = next(model.parameters()).device
    pad, eos = tokenizer.pad_token_id, model.generation_config.eos_token_id
    entropies, lengths, rewarded = [], [], []
    torch.manual_seed(seed)
    noise_generator = torch.Generator().manual_seed(seed)
    for i in range(0, len(prompts), batch_size):
        batch = prompts[i : i + batch_size]
        with aqn.noisy_norms(model, sigma, generator=noise_generator):  # sigma 0: no noise, a no-op
            ids, mask = _padded(batch, pad, device, left=True)
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=max_new_tokens,
                pad_token_id=pad,
                eos_token_id=eos,
            )
            eos_ids = {eos} if isinstance(eos, int) else set(eos)
            sequences = []
            for prompt, row in zip(batch, out[:, ids.shape[1] :].tolist(), strict=True):
                n = next((k + 1 for k, t in enumerate(row) if t in eos_ids), len(row))
                sequences.append((prompt + row[:n], len(prompt)))
            logprobs = token_logprobs(model, sequences, pad, batch_size)
        for (seq, start), lp, gold in zip(sequences, logprobs, answers[i : i + batch_size], strict=True):
            entropies.append(-(lp.exp() * lp).sum(-1).mean().item())
            lengths.append(len(seq) - start)
            text = tokenizer.decode(seq[start:], skip_special_tokens=True)
            rewarded.append(rewards.gsm8k_hash_reward([text], [gold])[0] > 0)
    result = {"samples": len(entropies), "sigma": sigma}
    result["entropy"], result["entropy_ci95"] = mean_ci(entropies)
    result["length"], result["length_ci95"] = mean_ci([float(n) for n in lengths])
    result["rewarded"] = sum(rewarded) / len(rewarded)
    result["truncated"] = sum(n >= max_new_tokens for n in lengths) / len(lengths)
    return result


def resolve_checkpoints(args) -> tuple[str, str]:
    if args.model:
        from qerl.models.fetch import bf16_and_nvfp4

        return bf16_and_nvfp4(args.model, args.checkpoint_dir, args.device)
    if not (args.bf16 and args.nvfp4):
        raise SystemExit("give --model NAME, or both --bf16 and --nvfp4")
    return args.bf16, args.nvfp4


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a fetchable model (python -m qerl.models list): fetched and quantized")
    parser.add_argument("--checkpoint-dir", default="ckpt", help="with --model: where its folders go")
    parser.add_argument("--bf16", help="BF16 checkpoint folder")
    parser.add_argument("--nvfp4", help="its NVFP4 quantization")
    parser.add_argument("--data", default=str(DEFAULT_DATA), help="GSM8K JSONL (question, answer)")
    parser.add_argument("--solutions", type=int, default=200, help="reference solutions, teacher-forced")
    parser.add_argument("--prompts", type=int, default=128, help="prompts sampled from each policy (0: none)")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--aqn-sigma", type=float, default=1e-2, help="AQN noise of the extra NVFP4 row (0: none)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", help="(default: cuda if there is one, else cpu)")
    parser.add_argument("--dtype", default="bfloat16", help="compute dtype (float32 only to go faster on a CPU)")
    parser.add_argument("--out", default="runs/quant_quality.json")
    args = parser.parse_args(argv)
    start = time.time()
    import torch

    from qerl import base_model

    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    bf16_dir, nvfp4_dir = resolve_checkpoints(args)
    dtype = getattr(torch, args.dtype)
    tokenizer = base_model.load_tokenizer(bf16_dir)
    models = {
        "bf16": base_model.load_base_model(bf16_dir, "bf16", dtype, args.device).eval(),
        "nvfp4": base_model.load_base_model(nvfp4_dir, "nvfp4", dtype, args.device).eval(),
    }
    with torch.no_grad():  # measurements only
        forced = teacher_forced(
            models["bf16"], models["nvfp4"], tokenizer, read_gsm8k(args.data, args.solutions), args.batch_size
        )

        # Sampled prompts: rows after the teacher-forced ones, in the training prompt format.
        rows = read_gsm8k(args.data, args.prompts, offset=args.solutions)
        prompts = [data.gsm8k_hash_prompt(row["question"]) for row in rows]
        prompt_ids = [tokenizer.apply_chat_template(p, add_generation_prompt=True)["input_ids"] for p in prompts]
        answers = [rewards.gsm8k_gold(row["answer"]) for row in rows]
        runs = [("bf16", 0.0), ("nvfp4", 0.0)] + ([("nvfp4", args.aqn_sigma)] if args.aqn_sigma > 0 else [])
        runs = runs if prompt_ids else []  # --prompts 0: teacher-forced only
        policies = {}
        for name, sigma in runs:
            label = name if sigma == 0 else f"{name}+aqn"
            policies[label] = sampled(
                models[name], tokenizer, prompt_ids, answers, args.max_new_tokens, args.batch_size, args.seed, sigma
            )

    result = {"bf16": bf16_dir, "nvfp4": nvfp4_dir, "data": args.data, "dtype": args.dtype, "device": args.device,
              "device_name": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
              "teacher_forced": forced, "sampled": policies, "seconds": time.time() - start}  # fmt: skip
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)

    f_ = forced
    print(f"teacher-forced, {f_['sequences']} GSM8K solutions ({f_['tokens']} tokens):")
    print(
        f"  KL(BF16 || NVFP4) {f_['kl']:.4f} ± {f_['kl_ci95']:.4f} nats/token; top-1 agreement "
        f"{f_['top1']:.1%} ± {f_['top1_ci95']:.1%}; perplexity BF16 {f_['ppl_bf16']:.2f}, "
        f"NVFP4 {f_['ppl_nvfp4']:.2f}"
    )
    if policies:
        print(f"sampled at temperature 1, {len(prompt_ids)} GSM8K prompts (gsm8k_hash), {args.max_new_tokens} tokens:")
        print(f"  {'policy':<12} {'entropy (nats/token)':>22} {'length':>8} {'rewarded':>9} {'truncated':>10}")
    for label, r in policies.items():
        print(
            f"  {label:<12} {r['entropy']:>12.3f} ± {r['entropy_ci95']:.3f}  {r['length']:>8.1f} "
            f"{r['rewarded']:>9.1%} {r['truncated']:>10.1%}"
        )
    print(f"({time.time() - start:.0f} s on {result['device_name']}; JSON: {args.out})")
    return result


if __name__ == "__main__":
    main()
