"""Non-finite gradients: the training step keeps cuDNN's attention backward out (the cause of the SmolLM2 runs' NaNs),
dump_nonfinite_grads saves the micro-batch that made a gradient non-finite, and experiments.nonfinite replays it."""

import json
import math

import pytest
import torch
import torch.nn.functional as F
from fakes import make_trainer, recipe_config
from torch.nn.attention import sdpa_kernel

from experiments import nonfinite
from qerl.trainer import TRAINING_SDPA_BACKENDS


def test_training_steps_run_without_cudnn_attention(checkpoints, tmp_path):
    _, nvfp4_dir = checkpoints
    trainer = make_trainer(nvfp4_dir, recipe_config(tmp_path, max_steps=1))
    seen, compute_loss = [], trainer.compute_loss

    def spy(*args, **kwargs):
        seen.append(torch.backends.cuda.cudnn_sdp_enabled())
        return compute_loss(*args, **kwargs)

    trainer.compute_loss = spy
    trainer.train()
    assert seen and not any(seen)  # forward (and the backward after it) inside the step: no cuDNN attention
    assert torch.backends.cuda.cudnn_sdp_enabled()  # restored for everything outside the step


def test_a_micro_batch_that_makes_a_gradient_nonfinite_is_saved_and_replays(checkpoints, tmp_path):
    _, nvfp4_dir = checkpoints
    args = recipe_config(
        tmp_path, max_steps=1, gradient_accumulation_steps=2, trainable_norms=True, dump_nonfinite_grads=True
    )
    trainer = make_trainer(nvfp4_dir, args)
    poisoned = next(p for n, p in trainer.model.named_parameters() if "lora_B" in n)
    backward_calls = []

    def poison_the_second_micro_batch(grad):
        backward_calls.append(1)
        return grad * math.nan if len(backward_calls) == 2 else grad

    poisoned.register_hook(poison_the_second_micro_batch)
    trainer.train()
    assert trainer.nonfinite_dump == str(tmp_path / "out" / "nonfinite-step1-micro1.pt")
    dump = torch.load(trainer.nonfinite_dump, weights_only=False)
    name = next(n for n, p in trainer.model.named_parameters() if p is poisoned)
    assert dump["nonfinite_grads"] == [name] and dump["micro_batch"] == 1
    batch = dump["batch"]
    assert batch["prompt_ids"].shape[0] == args.per_device_train_batch_size
    assert {"completion_ids", "completion_mask", "advantages", "num_items_in_batch"} <= set(batch)
    assert dump["trainable"].keys() == {n for n, p in trainer.model.named_parameters() if p.requires_grad}

    # The replay rebuilds the policy with the dumped parameters: its loss is the loss TRL computed for that
    # micro-batch (DAPO at ratio 1), and without the poison every gradient is finite.
    out = tmp_path / "replay.json"
    nonfinite.main([trainer.nonfinite_dump, "--model", nvfp4_dir, "--attn", "sdpa", "--out", str(out)])
    report = json.loads(out.read_text())
    replayed = report["variants"]["sdpa/fused"]
    assert replayed["nonfinite_grads"] == 0 and replayed["rows_nonfinite"] == [] and replayed["anomaly"] is None
    assert report["batch"]["padded_length"] == batch["prompt_ids"].shape[1] + batch["completion_ids"].shape[1]
    logged = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(logged) == 1 and math.isfinite(replayed["loss"])


def _left_padded_attention(length: int, device: str, dtype=torch.bfloat16):
    """SmolLM2's attention shapes (9 query heads, head dim 64) on 16 left-padded rows of `length` tokens, as
    transformers' SDPA path builds them: a boolean causal mask with padded keys off, so the query rows of the
    padding see no key at all."""
    generator = torch.Generator().manual_seed(length)
    rows, heads, dim = 16, 9, 64
    padding = torch.randint(0, length // 2, (rows,), generator=generator)
    padding[0] = 0
    keys_valid = torch.arange(length)[None, :] >= padding[:, None]
    mask = torch.ones(length, length, dtype=torch.bool).tril()[None] & keys_valid[:, None, :]
    q, k, v = (torch.randn(rows, heads, length, dim, generator=generator) for _ in range(3))
    return [t.to(device, dtype).requires_grad_() for t in (q, k, v)], mask[:, None].to(device), keys_valid


@pytest.mark.gpu
def test_training_attention_backward_is_finite_where_cudnn_returns_nan():
    """pytorch/pytorch#196678: cuDNN's SDPA backward returns NaN dQ at padded lengths 64 mod 128 with fully masked
    query rows. Under the training step's backends the gradients are finite and equal float64 attention's."""
    length = 448  # 192-token prompts + 256-token completions, the SmolLM2 runs' failing steps
    (q, k, v), mask, keys_valid = _left_padded_attention(length, "cuda")
    upstream = torch.randn(q.shape, device="cuda", dtype=q.dtype) * keys_valid[:, None, :, None].cuda()
    with sdpa_kernel(TRAINING_SDPA_BACKENDS):
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask).backward(upstream)
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))

    (q64, k64, v64) = (t.detach().double().requires_grad_() for t in (q, k, v))
    scores = (q64 @ k64.transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(~mask, -math.inf)
    probs = torch.nan_to_num(scores.softmax(-1))  # a fully masked row attends to nothing: output 0
    (probs @ v64).backward(upstream.double())
    valid = keys_valid.cuda()[:, None, :, None]
    for ours, reference in ((q, q64), (k, k64), (v, v64)):
        torch.testing.assert_close((ours.grad.double() * valid), reference.grad * valid, atol=5e-2, rtol=5e-2)
