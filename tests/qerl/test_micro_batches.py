"""qerl.micro_batches: the generation batch split into micro-batches of similar lengths moves rows and nothing else,
and where the split is free, a step's accumulated gradient equals the one of TRL's random split on fewer tokens."""

import pytest
import torch
from fakes import digit_share_reward, make_trainer, recipe_config
from transformers import TrainerCallback

from qerl import micro_batches, unpadded_forward


def _batch(lengths, completion=6, prompt=5):
    """A TRL-shaped batch of rows with these real lengths (left-padded prompt, right-padded completion)."""
    rows = len(lengths)
    prompt_mask, completion_mask = torch.zeros(rows, prompt, dtype=torch.long), torch.zeros(rows, completion)
    for i, n in enumerate(lengths):
        p = min(n - 1, prompt)
        prompt_mask[i, prompt - p :] = 1
        completion_mask[i, : n - p] = 1
    return {
        "prompt_mask": prompt_mask,
        "completion_mask": completion_mask.long(),
        "advantages": torch.arange(rows, dtype=torch.float32),
        "texts": [f"row{i}" for i in range(rows)],
        "num_items_in_batch": completion_mask.sum(),
        "old_per_token_logps": None,
    }


def test_rows_move_together_into_equal_micro_batches_sorted_by_length():
    generator = torch.Generator().manual_seed(0)
    lengths = (torch.randint(2, 12, (16,), generator=generator)).tolist()
    whole = _batch(lengths)
    split = [{k: (v[i : i + 4] if k not in ("num_items_in_batch", "old_per_token_logps") else v)
              for k, v in whole.items()} for i in range(0, 16, 4)]  # fmt: skip
    grouped = micro_batches.by_length(split)
    assert [len(mb["texts"]) for mb in grouped] == [4] * 4
    seen = [micro_batches.real_lengths(mb).tolist() for mb in grouped]
    assert sum(seen, []) == sorted(lengths)  # shortest first, every row once
    for mb in grouped:  # each row's values came along with it: its advantage is its index, its text names it
        assert mb["texts"] == [f"row{int(a)}" for a in mb["advantages"]]
        assert micro_batches.real_lengths(mb).tolist() == [lengths[int(a)] for a in mb["advantages"]]
        assert mb["num_items_in_batch"] is whole["num_items_in_batch"] and mb["old_per_token_logps"] is None


def test_sorted_micro_batches_never_run_more_tokens_than_a_random_split():
    """The unpadded forward runs rows x longest row per micro-batch; by_length's equal groups of the sorted rows
    minimize that sum over every split into equal groups, so no random split (50 drawn here, TRL's shuffle) does
    better. Lengths of the 1.5B recipe's rows (a prompt of ~100 tokens, completions up to 512)."""
    generator = torch.Generator().manual_seed(1)

    def tokens(split):
        return sum(len(mb["texts"]) * int(micro_batches.real_lengths(mb).max()) for mb in split)

    saved = []
    for _ in range(50):
        lengths = torch.randint(100, 612, (64,), generator=generator).tolist()
        whole = _batch(lengths, completion=512, prompt=100)
        shuffled = torch.randperm(64, generator=generator)
        split = [
            {k: (v[shuffled[i : i + 16]] if isinstance(v, torch.Tensor) and v.ndim else
                 [v[j] for j in shuffled[i : i + 16].tolist()] if isinstance(v, list) else v)
             for k, v in whole.items()}
            for i in range(0, 64, 16)
        ]  # fmt: skip
        grouped, drawn = tokens(micro_batches.by_length(split)), tokens(split)
        assert grouped <= drawn
        saved.append(1 - grouped / drawn)
    assert sum(saved) / len(saved) > 0.1  # and it saves: the random splits ran >10% more tokens on average


@pytest.mark.parametrize(
    "change, why",
    [
        ({}, None),
        ({"loss_type": "bnpo"}, "loss_type bnpo normalizes each micro-batch by its own tokens"),
        ({"top_entropy_quantile": 0.2}, "top_entropy_quantile < 1"),
        ({"steps_per_generation": 8}, "the split decides which step sees which rows"),
        ({"unpadded_forward": False}, "without the unpadded forward"),
    ],
)
def test_the_split_is_free_only_where_the_gradient_cannot_tell(tmp_path, change, why):
    args = recipe_config(tmp_path, gradient_accumulation_steps=4, **change)
    found = micro_batches.split_free(args, entropy_bonus=False)
    assert found is None if why is None else why in found
    assert "entropy bonus" in micro_batches.split_free(recipe_config(tmp_path), entropy_bonus=True)


class GradientsBeforeTheStep(TrainerCallback):
    def __init__(self, model):
        self.model, self.grads = model, None

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.grads = {n: p.grad.detach().clone() for n, p in self.model.named_parameters() if p.grad is not None}


def _one_step(checkpoint, tmp_path, grouped):
    """One DAPO step of the tiny NVFP4 model in BF16 (the recipe's optimizer settings), 16 rollouts in 4
    micro-batches: the gradient the optimizer got and the tokens the loss forwards ran (rows x width)."""
    args = recipe_config(tmp_path / str(grouped), per_device_train_batch_size=4, gradient_accumulation_steps=4,
                         num_generations=4, max_completion_length=12, max_steps=1,
                         group_micro_batches_by_length=grouped)  # fmt: skip
    trainer = make_trainer(checkpoint, args, reward=digit_share_reward)
    assert trainer.group_by_length is grouped
    watch = GradientsBeforeTheStep(trainer.model)
    trainer.add_callback(watch)
    tokens, unpad = [], unpadded_forward.unpad

    def counted(*a, **k):
        batch = unpad(*a, **k)
        tokens.append(batch.input_ids.numel())
        return batch

    unpadded_forward.unpad = counted
    try:
        trainer.train()
    finally:
        unpadded_forward.unpad = unpad
    return watch.grads, sum(tokens)


def test_grouping_by_length_keeps_the_gradient_and_runs_fewer_tokens(checkpoints, tmp_path):
    _, nvfp4_dir = checkpoints
    random_split, random_tokens = _one_step(nvfp4_dir, tmp_path, grouped=False)
    grouped, grouped_tokens = _one_step(nvfp4_dir, tmp_path, grouped=True)
    assert grouped.keys() == random_split.keys() and len(grouped) > 0
    a = torch.cat([g.flatten().double() for g in grouped.values()])
    b = torch.cat([g.flatten().double() for g in random_split.values()])
    # The same rows and rollouts; only the sums' order and each micro-batch's BF16 GEMM shapes differ.
    assert (a - b).norm() <= 0.02 * b.norm() and b.norm() > 0
    assert grouped_tokens <= random_tokens
