"""QeRLConfig's own checks (qerl/config.py): a config built in Python is held to the command line's rules, by field
name; and what the trainer makes of a config that does not fit its base (AQN on a BF16 base, a folder instead of a
loaded model)."""

import pytest
from fakes import digit_share_reward, make_trainer, recipe_config

from qerl.trainer import QeRLTrainer


def test_bad_configs(checkpoints, tmp_path):
    with pytest.raises(ValueError, match=r"num_generations to a divisor of 6 \(here: 2, 3, 6\)"):
        recipe_config(tmp_path, per_device_train_batch_size=6, num_generations=4)
    with pytest.raises(ValueError, match="rollout_backend"):
        recipe_config(tmp_path, use_vllm=True)
    # A config built in Python is checked against the command line's rules (qerl/field_rules.py), by field name.
    with pytest.raises(ValueError, match="rollout_backend 'sglang': use one of auto, transformers, vllm, native"):
        recipe_config(tmp_path, rollout_backend="sglang")
    with pytest.raises(ValueError, match=r"aqn_dtype 'fp16' \(did you mean bf16\?\): use one of fp32, bf16"):
        recipe_config(tmp_path, aqn_dtype="fp16")
    with pytest.raises(ValueError, match="num_stages must be"):
        recipe_config(tmp_path, num_stages=2)
    bf16_dir, _ = checkpoints
    with pytest.warns(UserWarning, match="AQN is on for a BF16 base"):
        trainer = make_trainer(bf16_dir, recipe_config(tmp_path, aqn=True))
    assert trainer.aqn_enabled and not trainer.is_nvfp4
    assert not make_trainer(bf16_dir, recipe_config(tmp_path)).aqn_enabled  # default: off for BF16
    with pytest.raises(TypeError, match="base_model.load_base_model"):  # one road from a folder: the base loader
        QeRLTrainer(bf16_dir, [digit_share_reward], args=recipe_config(tmp_path))
