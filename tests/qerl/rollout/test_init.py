"""The rollout backends' registry (qerl/rollout/__init__.py): which backend auto picks (native on a GPU, vLLM where it
is installed, transformers on the CPU) and its fallback where native cannot run the model; truncate_at_eos."""

import contextlib
import logging
import re

import pytest
import torch
from transformers import GenerationConfig

from qerl import rollout
from qerl.rollout import truncate_at_eos
from qerl.tiny import build_tiny


def test_truncate_at_eos():
    out = truncate_at_eos([[5, 2, 7, 2], [5, 6]], [[-1.0, -2.0, -3.0, -4.0], [-1.0, -2.0]], [2])
    assert out.completion_ids == [[5, 2], [5, 6]] and out.logprobs == [[-1.0, -2.0], [-1.0, -2.0]]


def test_auto_backend_on_a_machine_without_vllm_is_transformers(monkeypatch):
    monkeypatch.setattr(rollout, "vllm_available", lambda: False)
    assert rollout.resolve_backend("auto") == "transformers"
    monkeypatch.setattr(rollout, "vllm_available", lambda: True)
    assert rollout.resolve_backend("auto") == "vllm"
    assert rollout.resolve_backend("auto", torch.device("cpu")) == "transformers"  # a CPU run on a GPU machine
    assert rollout.resolve_backend("transformers") == "transformers"
    with pytest.raises(ValueError, match="unknown rollout_backend 'sglang'"):
        rollout.resolve_backend("sglang")


def _setup(model, tokenizer, device, **settings):
    """A rollout setup of `model` that samples 4 tokens."""
    return rollout.RolloutSetup(
        generation_config=GenerationConfig(do_sample=True, max_new_tokens=4),
        eos_token_ids=[tokenizer.eos_token_id],
        pad_token_id=tokenizer.pad_token_id,
        open_policy=lambda: contextlib.nullcontext(model),
        device=device,
        **settings,
    )


def test_auto_picks_native_on_a_gpu_and_falls_back_where_native_cannot_run(monkeypatch, caplog):
    from qerl import rollout

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(rollout, "vllm_available", lambda: False)
    assert rollout.resolve_backend("auto", torch.device("cuda")) == "native"
    assert rollout.resolve_backend("auto", torch.device("cpu")) == "transformers"

    # A model native refuses (here: a plain GELU MLP): auto goes on to the next engine, a named backend fails with
    # the reason.
    monkeypatch.setattr(rollout, "vllm_available", lambda: False)
    model, tokenizer = build_tiny(num_layers=1)
    model.config.hidden_act = "gelu"
    setup = _setup(model, tokenizer, torch.device("cuda"))
    with caplog.at_level(logging.WARNING):
        assert rollout.create_backend("auto", setup).name == "transformers"
    reason = "the native engine cannot run Qwen2ForCausalLM: hidden_act 'gelu'; the engine's MLP gates are silu"
    assert any(
        m.startswith(f"rollout_backend auto: {reason}") and m.endswith("; using transformers") for m in caplog.messages
    )
    refusal = rf"^rollout_backend native: {re.escape(reason)}.*; rollout_backend auto would use transformers$"
    with pytest.raises(rollout.Unsupported, match=refusal):
        rollout.create_backend("native", setup)
    # Under FSDP2 / ZeRO-3 a BF16 base's weights are what is sharded: native refuses, auto takes the next engine.
    setup.open_policy = lambda: contextlib.nullcontext(build_tiny(num_layers=1)[0])
    setup.sharding = "fsdp2"
    with pytest.raises(rollout.Unsupported, match="BF16 base's weights are sharded"):
        rollout.create_backend("native", setup)
    assert rollout.create_backend("auto", setup).name == "transformers"


def test_keeping_rounds_refuses_a_sharded_policy_in_one_line():
    """rollout_keep_between_rounds under FSDP2 / ZeRO-3: the gathered weights are new tensors every round, which a
    kept decode graph would not read; the engine says so as the backend builds it, before any round."""
    from qerl.errors import UsageError
    from qerl.nvfp4.quantize import quantize_model

    model, tokenizer = build_tiny(num_layers=1)
    quantize_model(model)
    setup = _setup(
        model, tokenizer, torch.device("cpu"), sharding="fsdp2", native=rollout.NativeSettings(keep_between_rounds=True)
    )
    with pytest.raises(UsageError, match=r"^rollout_keep_between_rounds: the policy is sharded \(FSDP2 or ZeRO-3\)"):
        rollout.create_backend("native", setup)
