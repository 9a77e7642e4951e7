"""NVFP4Linear: forward/backward against a plain Linear holding the dequantized weight; peft LoRA on top."""

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch import nn

from qerl.nvfp4 import codec
from qerl.nvfp4.linear import NVFP4Linear


def _pair(n_in=64, n_out=48, bias=True, dtype=torch.float32):
    src = nn.Linear(n_in, n_out, bias=bias).to(torch.bfloat16)
    q = NVFP4Linear.from_linear(src)
    q.compute_dtype = dtype
    ref = nn.Linear(n_in, n_out, bias=bias)
    with torch.no_grad():
        ref.weight.copy_(q.dequantize_weight(torch.float64).float())
        if bias:
            ref.bias.copy_(src.bias.float())
    return q, ref


def test_holds_packed_buffers_only(seed):
    q, _ = _pair(bias=False)
    assert q.weight is None and list(q.parameters()) == []
    buffers = dict(q.named_buffers())
    assert buffers["weight_packed"].dtype == torch.uint8 and buffers["weight_packed"].shape == (48, 32)
    assert buffers["weight_scale"].dtype == torch.float8_e4m3fn and buffers["weight_scale"].shape == (48, 4)
    assert buffers["weight_global_scale"].shape == (1,)


@pytest.mark.parametrize("bias", [False, True])
def test_forward_and_input_grad_match_dequantized_linear(seed, bias):
    q, ref = _pair(bias=bias)
    x = torch.randn(3, 5, 64, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    y, y_ref = q(x), ref(x_ref)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    g = torch.randn_like(y)
    y.backward(g)
    y_ref.backward(g)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-5)
    assert all(not b.requires_grad for b in q.buffers())


def test_rejects_in_features_not_multiple_of_16():
    with pytest.raises(ValueError, match="in_features=24"):
        NVFP4Linear(24, 8)


class _MLP(nn.Module):
    def __init__(self, make):
        super().__init__()
        self.norm = nn.Parameter(torch.ones(64))  # like a real model, not every parameter is a Linear
        self.up_proj = make(64, 96)
        self.down_proj = make(96, 32)

    def forward(self, x):
        return self.down_proj(torch.relu(self.up_proj(x * self.norm)))


def test_peft_lora_wraps_it_and_gradients_match(seed):
    src = _MLP(lambda i, o: nn.Linear(i, o, bias=False).to(torch.bfloat16))
    quant = _MLP(lambda i, o: NVFP4Linear(i, o, compute_dtype=torch.float32))
    plain = _MLP(lambda i, o: nn.Linear(i, o, bias=False))
    for name in ("up_proj", "down_proj"):
        q = NVFP4Linear.from_linear(getattr(src, name))
        q.compute_dtype = torch.float32
        setattr(quant, name, q)
        getattr(plain, name).weight.data.copy_(q.dequantize_weight(torch.float32))

    config = dict(r=4, lora_alpha=8, target_modules=["up_proj", "down_proj"], init_lora_weights=False)
    peft_quant = get_peft_model(quant, LoraConfig(**config))
    peft_plain = get_peft_model(plain, LoraConfig(**config))
    peft_plain.load_state_dict(peft_quant.state_dict(), strict=False)  # same random LoRA A and B
    for name, p in peft_quant.named_parameters():
        assert p.requires_grad == ("lora_" in name), name

    x = torch.randn(6, 64)
    peft_quant(x).square().sum().backward()
    peft_plain(x).square().sum().backward()
    grads_q = {n: p.grad for n, p in peft_quant.named_parameters() if p.requires_grad}
    grads_p = {n: p.grad for n, p in peft_plain.named_parameters() if p.requires_grad}
    assert grads_q.keys() == grads_p.keys() and len(grads_q) == 4
    for n in grads_q:
        torch.testing.assert_close(grads_q[n], grads_p[n], rtol=1e-4, atol=1e-5)
    base = peft_quant.base_model.model.up_proj.base_layer
    assert isinstance(base, NVFP4Linear) and all(b.grad is None for b in base.buffers())


def test_codec_round_trip_through_layer(seed):
    w = torch.randn(32, 64, dtype=torch.bfloat16)
    layer = NVFP4Linear.from_quantized(codec.quantize(w))
    assert torch.equal(layer.dequantize_weight(), codec.quantize(w).dequantize())
