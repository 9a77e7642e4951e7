"""The trainable policy (qerl/lora.py: lora_config, FP32 masters) on a frozen NVFP4 base, as QeRLTrainer makes it:
LoRA and the norms asked for train, nothing else moves, and gradient checkpointing gives the same gradients."""

import pytest
import torch
from lora_policy import _policy

from qerl import base_model


def _batch(tokenizer):
    ids = tokenizer(["12+7=19", "3-1=2xx"], return_tensors="pt")
    return ids["input_ids"], ids["attention_mask"]


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
