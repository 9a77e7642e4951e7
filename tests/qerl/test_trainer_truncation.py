"""QeRLTrainer's rounds at the length cap (qerl/trainer.py with qerl/truncation.py's TruncationWatch): the earned
reward of truncated and finished completions in TRL's metrics, fail_truncated_completions, and a run driven to the
cap told in one line and counted, on a tiny NVFP4 policy (CPU)."""

import json
import logging
import os

import pytest
import torch
from fakes import digit_share_reward, make_trainer, recipe_config


def test_rounds_rewards_split_by_truncation_and_failed_when_asked(checkpoints, tmp_path, seed):
    """_calculate_rewards: each round's earned reward of the truncated and of the finished completions (the soft
    overlong punishment, a length rule, left out) reaches TRL's metrics; fail_truncated_completions zeroes every
    reward function's payment to a truncated completion, and only that."""
    from qerl import rewards
    from qerl.truncation import FINISHED_REWARD, TRUNCATED_REWARD

    _, nvfp4_dir = checkpoints
    args = recipe_config(tmp_path, max_completion_length=8)
    punishment = rewards.soft_overlong_punishment(8, 4)
    trainer = make_trainer(nvfp4_dir, args, reward=[digit_share_reward, punishment])
    eos, pad = trainer.eos_token_ids[0], trainer.processing_class.pad_token_id
    generator = torch.Generator().manual_seed(seed)
    cut = (torch.rand(16, generator=generator) < 0.5).tolist()
    cut[0], cut[1] = True, False
    texts, ids = [], []
    for truncated in cut:  # a truncated completion runs to the cap; a finished one ends in EOS at or before it
        length = 8 if truncated else int(torch.randint(1, 9, (1,), generator=generator))
        texts.append(
            "".join(str(int(d)) if d < 10 else "x" for d in torch.randint(0, 20, (length,), generator=generator))
        )
        body = [t for t in torch.randint(0, 40, (length,), generator=generator).tolist() if t not in (eos, pad)]
        body += [7] * length  # enough ids even where draws hit EOS or padding (7 is neither)
        ids.append(body[:length] if truncated else [*body[: length - 1], eos])
    completions = [[{"role": "assistant", "content": t}] for t in texts]
    inputs = [{"prompt": [{"role": "user", "content": "1+1="}], "answer": "2"}] * len(texts)
    earned = torch.tensor(digit_share_reward(completions))
    expected_columns = torch.stack([earned, torch.tensor(punishment(completion_ids=ids), dtype=torch.float32)], 1)
    trainer.model.train()
    for fail in (False, True):
        trainer.args.fail_truncated_completions = fail
        trainer._metrics["train"].clear()
        got = trainer._calculate_rewards(inputs, [i["prompt"] for i in inputs], completions, ids)
        mask = torch.tensor(cut)
        torch.testing.assert_close(got[~mask], expected_columns[~mask])
        torch.testing.assert_close(got[mask], torch.zeros_like(got[mask]) if fail else expected_columns[mask])
        logged = trainer._metrics["train"]
        assert logged[TRUNCATED_REWARD] == [pytest.approx(earned[mask].mean().item(), abs=1e-6)]
        assert logged[FINISHED_REWARD] == [pytest.approx(earned[~mask].mean().item(), abs=1e-6)]
    trainer._metrics["train"].clear()


@pytest.mark.parametrize("fail", [False, True], ids=["masked", "failed"])
def test_a_run_driven_to_the_cap_is_told_and_counted(checkpoints, tmp_path, caplog, fail):
    """The tiny random policy with a 2-token cap: nearly every completion is truncated, as in a run locked at the
    cap. The first such round is said in one line, each round logs its truncated and finished mean reward, which
    TRL's own logged reward must agree with (masked: the mean of both sides; failed: the truncated ones count 0),
    and the closing line counts the rounds."""
    _, nvfp4_dir = checkpoints
    args = recipe_config(
        tmp_path,
        aqn=False,
        max_steps=3,
        max_completion_length=2,
        mask_truncated_completions=not fail,
        fail_truncated_completions=fail,
    )
    trainer = make_trainer(nvfp4_dir, args)
    with caplog.at_level(logging.WARNING, logger="qerl.truncation"):
        trainer.train()
    history = [h for h in trainer.state.log_history if "loss" in h]
    shares = [h["completions/clipped_ratio"] for h in history]
    assert max(shares) >= 0.9, shares
    first = next(i for i, s in enumerate(shares, start=1) if s >= 0.9)
    said = [r.getMessage() for r in caplog.records if r.name == "qerl.truncation"]
    assert said and said[0].startswith(f"step {first}: "), said
    assert ("masked out of the loss" in said[0]) != fail
    for h, share in zip(history, shares, strict=True):
        cut = h["completions/truncated_reward_mean"]
        done = h.get("completions/finished_reward_mean", 0.0)
        expected = (1 - share) * done + (0.0 if fail else share * cut)
        assert h["reward"] == pytest.approx(expected, abs=1e-5)
    closing = trainer.state.log_history[-1]
    assert "train_runtime" in closing
    assert closing["truncation/rounds_nearly_all_truncated"] == sum(s >= 0.9 for s in shares)
    assert closing["truncation/rounds_mostly_truncated"] == sum(s >= 0.5 for s in shares)
    with open(os.path.join(args.output_dir, "metrics.jsonl")) as f:
        assert "truncation/rounds_mostly_truncated" in json.loads(f.readlines()[-1])
