"""qerl.models' GGUF conversion (qerl/models/gguf.py): a GGUF (written with the gguf package, Q4_1 like SmolLM2's:
tests/helpers/gguf_files.py) -> BF16 checkpoint with transformers' own logits and the right special tokens, and the
whole path of such a model: convert -> NVFP4 -> DAPO -> eval."""

import json

import pytest
import torch
from fakes import digit_share_reward, make_trainer, recipe_config
from gguf_files import write_tiny_gguf

from benchmarks.launch import REPO
from eval import gsm8k
from qerl import base_model, cli
from qerl.models.gguf import convert_gguf, fix_special_tokens, load_gguf_model
from qerl.nvfp4.quantize_checkpoint import quantize_checkpoint

GSM8K_SAMPLE = REPO / "tests" / "data" / "gsm8k" / "test_sample.jsonl"


def test_conversion_gives_transformers_own_gguf_logits(tiny_gguf, converted, seed):
    from transformers import AutoModelForCausalLM

    reference = load_gguf_model(tiny_gguf, dtype=torch.bfloat16)
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
    reference = load_gguf_model(path, dtype=torch.bfloat16)
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
