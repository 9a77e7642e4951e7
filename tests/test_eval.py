"""eval/gsm8k.py: whole-answer scoring on the real GSM8K gold solutions, and a run with and without a LoRA."""

import json
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model

from eval import gsm8k
from qerl.policy import load_base_model
from qerl.rewards import gsm8k_gold
from qerl.tiny import save_tiny_checkpoints

GSM8K_TEST = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k" / "test.jsonl"


@pytest.mark.skipif(not GSM8K_TEST.is_file(), reason=f"GSM8K data not found at {GSM8K_TEST}")
def test_gold_answers_score_and_near_misses_do_not():
    rows = [json.loads(line) for line in GSM8K_TEST.read_text().splitlines()]
    for row in rows:
        gold = gsm8k_gold(row["answer"])
        reasoning = row["answer"].split("####")[0]
        assert gsm8k.score(f"<think>{reasoning}</think> <answer>{gold}</answer>", gold) == {
            "correct": True,
            "flexible": True,
        }
        assert gsm8k.score(f"{reasoning} So the answer is {gold}.", gold) == {"correct": False, "flexible": True}
        wrong = str(int(float(gold)) + 10)  # same first character as the gold for most answers
        assert gsm8k.score(f"<answer>{wrong}</answer>", gold) == {"correct": False, "flexible": False}
        # a wrong tagged answer is wrong even when the right number appears earlier in the text
        assert not gsm8k.score(f"{gold} ... <answer>{wrong}</answer>", gold)["flexible"]


def test_runs_on_nvfp4_base_and_applies_the_adapter(tmp_path):
    _, nvfp4_dir = save_tiny_checkpoints(tmp_path / "ckpt")
    data = tmp_path / "gsm8k.jsonl"
    data.write_text(
        "".join(
            json.dumps({"question": f"What is {a} plus {a}?", "answer": f"{a}+{a}={2 * a}\n#### {2 * a}"}) + "\n"
            for a in (3, 11, 40)
        )
    )
    base = load_base_model(nvfp4_dir, precision="nvfp4", device="cpu")
    torch.manual_seed(0)
    adapter = get_peft_model(
        base, LoraConfig(r=4, lora_alpha=64, target_modules=["q_proj", "down_proj"], init_lora_weights=False)
    )
    adapter.save_pretrained(tmp_path / "adapter")

    results = {}
    for name, extra in (("base", []), ("lora", ["--adapter", str(tmp_path / "adapter")])):
        out = tmp_path / f"{name}.jsonl"
        gsm8k.main(
            [
                "--model",
                nvfp4_dir,
                "--load",
                "nvfp4",
                "--data",
                str(data),
                "--split",
                "test",
                "--max-new-tokens",
                "6",
                "--batch-size",
                "2",
                "--device",
                "cpu",
                "--out",
                str(out),
                *extra,
            ]
        )
        lines = [json.loads(line) for line in out.read_text().splitlines()]
        summary, rows = lines[0], lines[1:]
        assert summary["examples"] == 3 and len(rows) == 3 and 0.0 <= summary["accuracy_flexible"] <= 1.0
        assert [r["gold"] for r in rows] == ["6", "22", "80"]
        results[name] = [r["completion"] for r in rows]
    assert results["base"] != results["lora"]  # the adapter reached generation
