import json
import os

import pytest
from datasets import Dataset

from benchmarks.launch import SHARED_GSM8K
from qerl import data, rewards
from qerl.tiny import build_tiny_tokenizer

GSM8K_DIR = SHARED_GSM8K


def _write_jsonl(path, rows):
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return str(path)


def _gsm8k_test_file():
    path = os.path.join(GSM8K_DIR, "test.jsonl")
    if not os.path.exists(path):
        pytest.skip(f"GSM8K test set not found at {os.path.normpath(path)} (expected ../shared beside the repo)")
    return path


def _follow_the_prompt(prompt, reasoning: str, final: str) -> str:
    """A completion written the way the prompt asks (reading the instructions from the prompt itself)."""
    instructions = " ".join(message["content"] for message in prompt)
    if "<answer>" in instructions:
        return f"<think>\n{reasoning}\n</think>\n<answer>\n{final}\n</answer>"
    assert '"####"' in instructions and "<think>" in instructions
    return f"<think>\n{reasoning}\n</think>\n#### {final}"


@pytest.mark.parametrize("fmt,full_marks", [("gsm8k", 2.2), ("gsm8k_hash", 1.2)])
def test_gsm8k_prompt_asks_for_what_its_rewards_pay(fmt, full_marks):
    """The whole path on real GSM8K rows: load, prompt, a completion that does what the prompt says, rewards."""
    path = _gsm8k_test_file()
    task = data.load_task(path, dataset_format=fmt, num_examples=200)
    with open(path) as f:
        raw = [json.loads(next(f)) for _ in range(200)]
    assert task.format == fmt and len(task.train) == 200
    completions, wrong = [], []
    for row, source in zip(task.train, raw, strict=True):
        assert source["question"] in row["prompt"][-1]["content"]
        reasoning = source["answer"].split("####")[0].strip()
        for batch, final in ((completions, row["answer"]), (wrong, "-1")):
            batch.append([{"role": "assistant", "content": _follow_the_prompt(row["prompt"], reasoning, final)}])

    def totals(batch):
        scores = [f(completions=batch, answer=task.train["answer"]) for f in task.reward_funcs]
        return [sum(s) for s in zip(*scores, strict=True)]

    assert totals(completions) == [pytest.approx(full_marks)] * 200
    assert totals(wrong) == [pytest.approx(0.2)] * 200  # the format only


def test_local_gsm8k_file_in_reference_format():
    task = data.load_task(_gsm8k_test_file(), num_examples=50)
    assert task.format == "gsm8k" and len(task.train) == 50
    row = task.train[0]
    assert row["prompt"][0] == {"role": "system", "content": data.THINK_ANSWER_SYSTEM_PROMPT}
    assert row["prompt"][1]["role"] == "user" and row["answer"] == "18"
    assert task.reward_funcs == [rewards.think_answer_format_reward, rewards.gsm8k_correctness_reward]
    hashed = data.load_task(_gsm8k_test_file(), dataset_format="gsm8k_hash", num_examples=1).train[0]
    assert hashed["prompt"] == [
        {"role": "user", "content": row["prompt"][1]["content"] + " " + data.GSM8K_HASH_INSTRUCTION}
    ]


def test_formats_by_columns(tmp_path):
    dapo = _write_jsonl(tmp_path / "d.jsonl", [{"source_prompt": [{"role": "user", "content": "q"}], "solution": "3"}])
    task = data.load_task(dapo)
    assert task.format == "dapomath" and task.train[0]["prompt"] == [{"role": "user", "content": "q"}]
    assert task.reward_funcs == [rewards.dapo_answer_reward]

    big = _write_jsonl(
        tmp_path / "b.jsonl", [{"prompt": "q", "solution": "3"}, {"prompt": "x" * 2000, "solution": "1"}]
    )
    task = data.load_task(big)
    assert task.format == "bigmath" and len(task.train) == 1  # the reference drops prompts over 1024 chars
    assert task.train[0]["prompt"][0]["role"] == "system" and task.train[0]["prompt"][1]["content"] == "q"
    assert task.train[0]["answer"] == "3"

    plain = _write_jsonl(tmp_path / "p.jsonl", [{"prompt": "1+1=", "answer": 2}])
    task = data.load_task(plain)
    assert task.format == "arithmetic" and task.train[0]["answer"] == "2"


def test_parquet(tmp_path):
    from datasets import Dataset

    path = str(tmp_path / "g.parquet")
    Dataset.from_dict({"question": ["q"], "answer": ["so #### 1,000"]}).to_parquet(path)
    assert data.load_task(path).train[0]["answer"] == "1000"


def test_bad_input_messages(tmp_path):
    with pytest.raises(ValueError, match=", ".join(data.KNOWN_DATASETS)):
        data.load_task("gsm9k")
    odd = _write_jsonl(tmp_path / "odd.jsonl", [{"query": "q", "answer": "1"}])
    with pytest.raises(ValueError, match="cannot tell the dataset format.*query"):
        data.load_task(odd)
    with pytest.raises(ValueError, match="needs a column 'question', which is missing"):
        data.load_task(odd, dataset_format="gsm8k")
    with pytest.raises(ValueError, match="unsupported file type"):
        data.load_task(_write_jsonl(tmp_path / "x.txt", []))


def test_arithmetic_task():
    task = data.load_task("arithmetic", num_examples=200, seed=3)
    assert len(task.train) == 200
    for row in task.train:
        a, op, b = (
            row["prompt"][0]["content"][:-1].partition("+")
            if "+" in row["prompt"][0]["content"]
            else row["prompt"][0]["content"][:-1].partition("-")
        )
        assert int(row["answer"]) == (int(a) + int(b) if op == "+" else int(a) - int(b)) >= 0
    again = data.load_task("arithmetic", num_examples=200, seed=3)
    assert again.train["answer"] == task.train["answer"]
    assert data.load_task("arithmetic", split="test", num_examples=200, seed=3).train["prompt"] != task.train["prompt"]


def test_drop_long_prompts():
    tok = build_tiny_tokenizer()
    ds = data.arithmetic_dataset(50, max_operand=999)
    lengths = [len(tok.apply_chat_template(p, add_generation_prompt=True)["input_ids"]) for p in ds["prompt"]]
    limit = max(lengths) - 1
    kept = data.drop_long_prompts(ds, tok, limit)
    assert len(kept) == sum(n <= limit for n in lengths) and 0 < len(kept) < 50
    assert data.drop_long_prompts(ds, tok, None) is ds


def test_keep_last_prompt_tokens_on_real_gsm8k_rows():
    """--long-prompts keep_last, the reference's truncation: every row stays; a prompt over the cap becomes the end
    of its chat-templated text (the question's end and the generation prompt), the cap's tokens exactly; a prompt
    that fits becomes that text whole, which tokenizes to the ids the chat template gives."""
    tok = build_tiny_tokenizer()
    task = data.load_task(_gsm8k_test_file(), dataset_format="gsm8k", num_examples=100)
    whole = [tok.apply_chat_template(p, add_generation_prompt=True, tokenize=False) for p in task.train["prompt"]]
    lengths = [len(tok(text)["input_ids"]) for text in whole]
    cap = sorted(lengths)[len(lengths) // 2]
    kept = data.fit_prompts(task.train, tok, cap, "keep_last")
    assert len(kept) == len(task.train) and kept["answer"] == task.train["answer"]
    for text, full, n, messages in zip(kept["prompt"], whole, lengths, task.train["prompt"], strict=True):
        if n <= cap:
            assert text == full
            assert tok(text)["input_ids"] == tok.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
        else:
            assert tok(text)["input_ids"] == tok(full)["input_ids"][-cap:] and text.endswith("<|assistant|>")
    assert len(data.fit_prompts(task.train, tok, cap)) == sum(n <= cap for n in lengths) < len(kept)  # drop
    assert data.fit_prompts(task.train, tok, None, "keep_last") is task.train
    with pytest.raises(ValueError, match="drop, keep_last"):
        data.fit_prompts(task.train, tok, cap, "truncate")


def test_keep_last_prompt_tokens_with_a_tokenizer_that_adds_bos():
    """A tokenizer that puts BOS before plain text itself (Llama-3) while its chat template writes BOS too: the
    text prompt leaves the template's out, so a prompt that fits has one BOS, as the chat ids; a cut one has BOS
    and the last tokens, the cap in all."""
    from tokenizers import processors

    from qerl.tiny import CHAT_TEMPLATE

    tok = build_tiny_tokenizer()
    tok.add_special_tokens({"bos_token": "<bos>"})
    tok._tokenizer.post_processor = processors.TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", tok.bos_token_id)]
    )
    tok.chat_template = "{{ bos_token }}" + CHAT_TEMPLATE
    short, long = [{"role": "user", "content": "2+2="}], [{"role": "user", "content": "What is 12 times 12? " * 3}]
    rows = data.fit_prompts(Dataset.from_dict({"prompt": [short, long], "answer": ["4", "144"]}), tok, 20, "keep_last")
    chat = tok.apply_chat_template(short, add_generation_prompt=True)["input_ids"]
    assert chat.count(tok.bos_token_id) == 1 and tok(rows["prompt"][0])["input_ids"] == chat
    cut = tok(rows["prompt"][1])["input_ids"]
    full = tok.apply_chat_template(long, add_generation_prompt=True)["input_ids"]
    assert len(cut) == 20 and cut == [tok.bos_token_id, *full[-19:]]
