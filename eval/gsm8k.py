"""GSM8K accuracy of a base model (NVFP4 or BF16), optionally with a trained LoRA adapter.

    python -m eval.gsm8k --model ckpt/qwen2.5-7b-nvfp4 --load nvfp4 --adapter runs/dapo/checkpoint-500
    python -m eval.gsm8k --model Qwen/Qwen2.5-7B-Instruct --load bf16 --data ../shared/data/gsm8k/test.jsonl

Prompts are built exactly as in training (qerl.data's gsm8k format, the tokenizer's chat template), decoding
is greedy, and an answer counts when its whole number equals the gold one: `strict` reads the number inside
<answer>...</answer> (what the training reward checks), `flexible` falls back to the last number of the
completion. The reference's script compared the first character only and never applied the adapter.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import torch
from tqdm.auto import tqdm

from qerl import rewards
from qerl.data import load_task
from qerl.policy import load_base_model, load_tokenizer

_LAST_NUMBER = re.compile(r"[-+]?\$?\d[\d,]*(?:\.\d+)?")


def score(completion: str, gold: str) -> dict[str, bool]:
    """strict: the <answer> tag's number equals gold; flexible: that, or else the last number in the text."""
    expected = rewards.parse_number(gold)
    tagged = rewards.parse_number(rewards.extract_answer_tag(completion))
    numbers = _LAST_NUMBER.findall(completion)
    last = rewards.parse_number(numbers[-1].replace("$", "")) if numbers else None
    strict = tagged is not None and tagged == expected
    return {"strict": strict, "flexible": strict or (tagged is None and last is not None and last == expected)}


@torch.no_grad()
def generate(model, tokenizer, prompts: list, batch_size: int, max_new_tokens: int) -> list[str]:
    completions = []
    for start in tqdm(range(0, len(prompts), batch_size), desc="GSM8K", unit="batch"):
        texts = [
            tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=False)
            for p in prompts[start : start + batch_size]
        ]
        batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
        out = model.generate(
            **batch, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id
        )
        completions += tokenizer.batch_decode(out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
    return completions


def evaluate(args) -> dict:
    task = load_task(args.data, split=args.split, num_examples=args.limit)
    if task.format != "gsm8k":
        raise ValueError(f"{args.data}: expected GSM8K rows (question, answer), got format {task.format!r}")
    model = load_base_model(args.model, precision=args.load, device=args.device)
    if args.adapter:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, args.adapter)
    model.eval()
    tokenizer = load_tokenizer(args.model)
    completions = generate(model, tokenizer, task.train["prompt"], args.batch_size, args.max_new_tokens)
    rows = [
        {"question": p[-1]["content"], "gold": gold, "completion": c, **score(c, gold)}
        for p, gold, c in zip(task.train["prompt"], task.train["answer"], completions, strict=True)
    ]
    result = {
        "model": str(args.model),
        "load": args.load,
        "adapter": args.adapter,
        "examples": len(rows),
        "accuracy_strict": sum(r["strict"] for r in rows) / len(rows),
        "accuracy_flexible": sum(r["flexible"] for r in rows) / len(rows),
    }
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(out, "w") as f:
            f.write(json.dumps(result) + "\n")
            f.writelines(json.dumps(r) + "\n" for r in rows)
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="base model folder or hub id")
    parser.add_argument("--load", choices=("auto", "nvfp4", "bf16"), default="auto", help="precision of the base")
    parser.add_argument("--adapter", help="LoRA adapter folder (a training checkpoint or its final save)")
    parser.add_argument("--data", default="gsm8k", help="'gsm8k' (openai/gsm8k) or a local JSONL/parquet file")
    parser.add_argument("--split", default="test")
    parser.add_argument("--limit", type=int, help="evaluate the first N examples only")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=1024)
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    parser.add_argument("--out", help="write the summary and every completion as JSONL here")
    result = evaluate(parser.parse_args(argv))
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
