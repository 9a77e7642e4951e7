"""The frozen base (qerl/base_model.py): an NVFP4 checkpoint loads as NVFP4Linear layers, a BF16 one as BF16, with
its tokenizer; the precision asked for must be the checkpoint's."""

import pytest
import torch
from lora_policy import _policy

from qerl import base_model
from qerl.nvfp4.checkpoint import is_nvfp4_checkpoint
from qerl.nvfp4.linear import NVFP4Linear
from qerl.tiny import build_tiny


def test_nvfp4_checkpoint_loads_as_nvfp4_linear(checkpoints):
    bf16_dir, nvfp4_dir = checkpoints
    assert is_nvfp4_checkpoint(nvfp4_dir) and not is_nvfp4_checkpoint(bf16_dir)
    base = base_model.load_base_model(nvfp4_dir, dtype=torch.float32, device="cpu")
    quantized = [n for n, m in base.named_modules() if isinstance(m, NVFP4Linear)]
    assert len(quantized) == 2 * 7 and not isinstance(base.lm_head, NVFP4Linear)
    assert not any(p.requires_grad for p in base.parameters())
    bf16 = base_model.load_base_model(bf16_dir, dtype=torch.float32, device="cpu")
    assert not base_model.is_nvfp4_model(bf16) and base_model.is_nvfp4_model(base)
    with pytest.raises(ValueError, match="quantized checkpoint"):
        base_model.load_base_model(nvfp4_dir, precision="bf16")
    with pytest.raises(ValueError, match="not a quantized checkpoint"):
        base_model.load_base_model(bf16_dir, precision="nvfp4")


def test_bf16_policy_and_tokenizer_roundtrip(checkpoints, tmp_path):
    bf16_dir, _ = checkpoints
    model = _policy(bf16_dir, tmp_path, dtype=torch.bfloat16)
    assert not base_model.is_nvfp4_model(model)
    assert all(p.dtype == torch.bfloat16 for n, p in model.named_parameters() if "lora_" not in n)
    tokenizer = base_model.load_tokenizer(bf16_dir)
    _, reference = build_tiny()
    assert tokenizer("a b\n7")["input_ids"] == reference("a b\n7")["input_ids"]
    assert tokenizer.eos_token == reference.eos_token and tokenizer.padding_side == "left"
