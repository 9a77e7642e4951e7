"""The road from a checkpoint to a trainable policy (base_model.load_base_model, then QeRLTrainer with
lora.lora_config), as training takes it."""

import pytest
import torch
from fakes import make_trainer

from qerl import base_model
from qerl.config import QeRLConfig
from qerl.nvfp4.checkpoint import is_nvfp4_checkpoint
from qerl.nvfp4.linear import NVFP4Linear
from qerl.tiny import build_tiny


def _policy(checkpoint, tmp_path, dtype=torch.float32, **config):
    """The policy QeRLTrainer trains (LoRA rank 4 unless asked otherwise)."""
    args = QeRLConfig(
        str(tmp_path / "out"),
        use_cpu=True,
        report_to=[],
        per_device_train_batch_size=4,
        num_generations=4,
        **{"lora_rank": 4, **config},
    )
    return make_trainer(checkpoint, args, dtype=dtype).model


def _batch(tokenizer):
    ids = tokenizer(["12+7=19", "3-1=2xx"], return_tensors="pt")
    return ids["input_ids"], ids["attention_mask"]


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


@pytest.mark.parametrize("trainable_norms", [False, True])
def test_only_lora_and_asked_norms_train(checkpoints, tmp_path, trainable_norms):
    _, nvfp4_dir = checkpoints
    model = _policy(nvfp4_dir, tmp_path, lora_alpha=8, trainable_norms=trainable_norms)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    lora = [n for n in trainable if "lora_" in n]
    norms = [n for n in trainable if "modules_to_save" in n]
    assert len(lora) == 2 * 7 * 2  # A and B for each of q,k,v,o,gate,up,down in both layers
    assert len(norms) == (4 if trainable_norms else 0)
    assert all("layernorm" in n for n in norms)
    assert set(trainable) == set(lora) | set(norms)
    assert model.peft_config["default"].r == 4 and model.peft_config["default"].lora_alpha == 8


def test_training_step_moves_adapters_only(checkpoints, tmp_path):
    _, nvfp4_dir = checkpoints
    tokenizer = base_model.load_tokenizer(nvfp4_dir)
    model = _policy(nvfp4_dir, tmp_path, trainable_norms=True)
    frozen = {k: v.clone() for k, v in model.state_dict().items() if "lora_" not in k and "modules_to_save" not in k}
    trainable = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    input_ids, mask = _batch(tokenizer)
    with torch.no_grad():
        before = model(input_ids=input_ids, attention_mask=mask).logits
        with model.disable_adapter():
            base_logits = model(input_ids=input_ids, attention_mask=mask).logits
    torch.testing.assert_close(before, base_logits, rtol=0, atol=0)  # LoRA B starts at zero
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(2):
        loss = model(input_ids=input_ids, attention_mask=mask, labels=input_ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    moved = [n for n, p in model.named_parameters() if p.requires_grad and not torch.equal(p, trainable[n])]
    assert len(moved) == len(trainable)
    for k, v in model.state_dict().items():
        if k in frozen:
            assert torch.equal(v, frozen[k]), k


def test_gradient_checkpointing_gives_the_same_gradients(checkpoints, tmp_path):
    _, nvfp4_dir = checkpoints
    tokenizer = base_model.load_tokenizer(nvfp4_dir)
    input_ids, mask = _batch(tokenizer)
    grads = []
    for checkpointing in (False, True):
        model = _policy(nvfp4_dir, tmp_path, gradient_checkpointing=checkpointing)  # the same seed: the same LoRA
        if checkpointing:  # what Trainer.train switches on
            model.gradient_checkpointing_enable()
        with torch.no_grad():  # non-zero B so that every adapter gets a gradient
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(n)))
        model.train()
        assert model.base_model.model.is_gradient_checkpointing == checkpointing
        model(input_ids=input_ids, attention_mask=mask, labels=input_ids).loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad})
    assert grads[0].keys() == grads[1].keys()
    for n in grads[0]:
        torch.testing.assert_close(grads[0][n], grads[1][n], rtol=1e-5, atol=1e-6)


def test_bf16_policy_and_tokenizer_roundtrip(checkpoints, tmp_path):
    bf16_dir, _ = checkpoints
    model = _policy(bf16_dir, tmp_path, dtype=torch.bfloat16)
    assert not base_model.is_nvfp4_model(model)
    assert all(p.dtype == torch.bfloat16 for n, p in model.named_parameters() if "lora_" not in n)
    tokenizer = base_model.load_tokenizer(bf16_dir)
    _, reference = build_tiny()
    assert tokenizer("a b\n7")["input_ids"] == reference("a b\n7")["input_ids"]
    assert tokenizer.eos_token == reference.eos_token and tokenizer.padding_side == "left"
