"""The unpadded training forward (qerl/unpadded_forward.py, QeRLConfig.unpadded_forward) against TRL's own padded path,
on real GSM8K rows in BF16: per-token log-probs, entropies, TRL's DAPO loss and the LoRA gradients. The tolerances
come from the BF16 spread measured in the test: each path's distance to the same policy in FP32."""

import json

import pytest
import torch
from fakes import make_trainer

from benchmarks.launch import GSM8K_SAMPLE
from qerl import unpadded_forward
from qerl.config import QeRLConfig

GSM8K = GSM8K_SAMPLE


def _padded_batch(rows: list[tuple[list[int], list[int], bool]], pad: int):
    """TRL's layout of (prompt ids, completion ids, completion kept) rows: prompts left-padded, completions
    right-padded; a row not kept has a zero completion mask (DAPO's masked truncation)."""
    width_p = max(len(p) for p, _, _ in rows)
    width_c = max(len(c) for _, c, _ in rows)
    prompt_ids = torch.full((len(rows), width_p), pad)
    prompt_mask = torch.zeros_like(prompt_ids)
    completion_ids = torch.full((len(rows), width_c), pad)
    completion_mask = torch.zeros_like(completion_ids)
    for i, (p, c, kept) in enumerate(rows):
        prompt_ids[i, width_p - len(p) :], prompt_mask[i, width_p - len(p) :] = torch.tensor(p), 1
        completion_ids[i, : len(c)], completion_mask[i, : len(c)] = torch.tensor(c), int(kept)
    return prompt_ids, prompt_mask, completion_ids, completion_mask


def test_unpad_moves_real_tokens_to_the_front_and_maps_log_probs_back(seed):
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(7):
        p = torch.randint(3, 50, (int(torch.randint(1, 9, (1,), generator=gen)),), generator=gen).tolist()
        c = torch.randint(3, 50, (int(torch.randint(1, 6, (1,), generator=gen)),), generator=gen).tolist()
        rows.append((p, c, bool(torch.rand(1, generator=gen) < 0.7)))
    rows.append((rows[0][0], rows[0][1], True))  # at least one row is scored
    prompt_ids, prompt_mask, completion_ids, completion_mask = _padded_batch(rows, pad=0)
    ids, mask = torch.cat([prompt_ids, completion_ids], 1), torch.cat([prompt_mask, completion_mask], 1)
    batch = unpadded_forward.unpad(ids, mask, completion_ids.size(1))

    kept = [i for i, (_, _, k) in enumerate(rows) if k]
    assert batch.rows.tolist() == kept
    assert batch.input_ids.size(1) == max(len(rows[i][0]) + len(rows[i][1]) for i in kept)
    for r, i in enumerate(kept):
        p, c, _ = rows[i]
        assert batch.input_ids[r, : len(p) + len(c)].tolist() == p + c
        scored = batch.labels[r] != unpadded_forward.IGNORE
        assert batch.labels[r, scored].tolist() == c and scored.nonzero().min() == len(p)
    # A stand-in head that "scores" each position with the next token's id: mapped back, it is the completion.
    next_token = batch.labels[:, 1:].clamp(min=0).float()
    assert torch.equal(
        unpadded_forward.to_completion_layout(next_token, batch), (completion_ids * completion_mask).float()
    )


def test_unpad_keeps_one_row_when_no_row_is_scored():
    prompt_ids, prompt_mask, completion_ids, completion_mask = _padded_batch([([5, 6], [7], False)] * 2, pad=0)
    ids, mask = torch.cat([prompt_ids, completion_ids], 1), torch.cat([prompt_mask, completion_mask], 1)
    batch = unpadded_forward.unpad(ids, mask, 1)
    assert batch.rows.tolist() == [0] and batch.input_ids.tolist() == [[5, 6]]
    assert unpadded_forward.to_completion_layout(torch.ones(1, 1), batch).tolist() == [[0.0], [0.0]]


def test_unpad_for_compiled_layers_adds_a_row_and_columns_that_score_nothing():
    """compile_layers runs unpad with compiled=True: torch.compile specializes a batch of one row and a width's
    alignment to 8, so a micro-batch with one row to score (or none) runs a second row with every label IGNORE, and
    the width is padded up to a multiple of 8; what they add reads back as zeros."""
    rows = [([5, 6], [7], False), ([8], [9, 10], True), ([11, 12, 13], [14], False)]
    prompt_ids, prompt_mask, completion_ids, completion_mask = _padded_batch(rows, pad=0)
    ids, mask = torch.cat([prompt_ids, completion_ids], 1), torch.cat([prompt_mask, completion_mask], 1)
    assert unpad_rows(ids, mask, completion_ids.size(1), compiled=False) == [1]
    assert ids.size(1) < unpadded_forward.COMPILED_WIDTH_MULTIPLE  # the rounded width is past the batch's columns
    batch = unpadded_forward.unpad(ids, mask, completion_ids.size(1), compiled=True)
    assert batch.rows.tolist() == [0, 1] and (batch.labels[0] == unpadded_forward.IGNORE).all()
    assert batch.input_ids.shape == (2, unpadded_forward.COMPILED_WIDTH_MULTIPLE)
    assert batch.input_ids[1, :3].tolist() == [8, 9, 10] and (batch.labels[1, 3:] == unpadded_forward.IGNORE).all()
    next_token = batch.labels[:, 1:].clamp(min=0).float()
    assert torch.equal(
        unpadded_forward.to_completion_layout(next_token, batch), (completion_ids * completion_mask).float()
    )
    nothing_scored = torch.cat([prompt_mask, torch.zeros_like(completion_mask)], 1)
    assert unpad_rows(ids, nothing_scored, completion_ids.size(1), compiled=True) == [0, 1]


def unpad_rows(ids, mask, width, compiled) -> list[int]:
    return unpadded_forward.unpad(ids, mask, width, compiled=compiled).rows.tolist()


def _gsm8k_rows(tokenizer, count: int, gen: torch.Generator):
    """Chat-formatted GSM8K questions, each answered by its own solution cut at a random length (a fifth of the rows
    truncated and masked, as DAPO masks a completion that hit the length cap)."""
    lines = [json.loads(line) for line in GSM8K.read_text().splitlines()[:count]]
    rows = []
    for k, row in enumerate(lines):
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": row["question"]}], add_generation_prompt=True
        )["input_ids"]
        answer = tokenizer(row["answer"])["input_ids"]
        length = int(torch.randint(8, min(len(answer), 96) + 1, (1,), generator=gen))
        rows.append((prompt, answer[:length], k % 5 != 4))
    return rows


def _grads_and_outputs(trainer, inputs):
    """Per-token log-probs and entropies of the loss forward, TRL's DAPO loss, and the trainable gradients."""
    model = trainer.model
    model.zero_grad(set_to_none=True)
    seen = {}
    inner = trainer._get_per_token_logps_and_entropies

    def keep(*args, **kwargs):
        seen["out"] = inner(*args, **kwargs)
        return seen["out"]

    trainer._get_per_token_logps_and_entropies = keep
    try:
        loss = trainer._compute_loss(model, inputs)
        loss.backward()
    finally:
        del trainer._get_per_token_logps_and_entropies
    logps, entropies, _ = seen["out"]
    grads = torch.cat([p.grad.flatten().float() for p in model.parameters() if p.requires_grad])
    return logps.detach().float().cpu(), entropies.detach().float().cpu(), loss.detach().float().cpu(), grads.cpu()


@pytest.mark.parametrize(
    "precision,device,compiled",
    [
        ("nvfp4", "cpu", False),
        ("bf16", "cpu", False),
        pytest.param("nvfp4", "cuda", False, marks=pytest.mark.gpu),
        pytest.param("nvfp4", "cuda", True, marks=pytest.mark.gpu),
    ],
)
def test_unpadded_forward_matches_trl_padded_path_in_bf16(checkpoints, tmp_path, precision, device, compiled, seed):
    """On the GPU the two paths run different attention kernels: TRL's layout takes the padding mask to
    EFFICIENT_ATTENTION, the unpadded one runs FlashAttention under the causal mask alone. `compiled`: the unpadded
    path with compile_layers (the kernels torch.compile fuses round differently; on the CPU it compiles for minutes)."""
    bf16_dir, nvfp4_dir = checkpoints
    folder = nvfp4_dir if precision == "nvfp4" else bf16_dir
    gen = torch.Generator().manual_seed(seed)
    results = {}
    for name, dtype, flag in [
        ("padded", torch.bfloat16, False),
        ("unpadded", torch.bfloat16, True),
        ("fp32", torch.float32, False),
    ]:
        args = QeRLConfig(
            output_dir=str(tmp_path / name),
            per_device_train_batch_size=8,
            num_generations=4,
            max_completion_length=96,
            learning_rate=1e-5,
            lora_rank=4,
            lora_alpha=8,
            bf16=dtype == torch.bfloat16,
            gradient_checkpointing=False,
            loss_type="dapo",
            beta=0.0,
            epsilon_high=0.28,
            aqn=False,
            report_to=[],
            seed=3,
            unpadded_forward=flag,
            compile_layers=compiled and flag,
            use_cpu=device == "cpu",
        )
        trainer = make_trainer(folder, args, dtype=dtype)
        torch.manual_seed(0)  # the same LoRA B (nonzero below) in every copy
        for module in trainer.model.modules():
            if hasattr(module, "lora_B"):
                torch.nn.init.normal_(module.lora_B["default"].weight, std=0.02)
        trainer.model.train()
        trainer.current_gradient_accumulation_steps = 1  # what Trainer.train() sets before the first step
        if not results:
            rows = _gsm8k_rows(trainer.processing_class, 8, gen)
            prompt_ids, prompt_mask, completion_ids, completion_mask = _padded_batch(
                rows, trainer.processing_class.pad_token_id
            )
            advantages = torch.randn(len(rows), generator=gen)
        inputs = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
                  "completion_mask": completion_mask, "advantages": advantages,
                  "num_items_in_batch": completion_mask.sum()}  # fmt: skip
        inputs = {k: v.to(trainer.accelerator.device) for k, v in inputs.items()}
        results[name] = _grads_and_outputs(trainer, inputs)

    mask = completion_mask.bool()
    assert 0 < mask.sum() < mask.numel()  # padding and masked rows both present
    reference = results["fp32"]
    for i, what in enumerate(["log-probs", "entropies"]):
        spread = (results["padded"][i] - reference[i])[mask].abs()
        error = (results["unpadded"][i] - reference[i])[mask].abs()
        assert spread.max() > 0  # BF16 really rounds differently from FP32 here
        assert error.mean() <= 1.5 * spread.mean() and error.max() <= 2 * spread.max(), what
        assert (results["unpadded"][i][~mask] == 0).all()  # TRL's zeros past each completion and on masked rows
    loss_spread = (results["padded"][2] - reference[2]).abs()
    assert (results["unpadded"][2] - reference[2]).abs() <= 2 * loss_spread + 1e-6
    grad_spread = (results["padded"][3] - reference[3]).norm() / reference[3].norm()
    grad_error = (results["unpadded"][3] - reference[3]).norm() / reference[3].norm()
    assert 0 < grad_spread < 0.1 and grad_error <= 1.5 * grad_spread
