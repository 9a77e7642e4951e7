"""QeRLConfig's own checks and defaults (qerl/config.py): a config built in Python is held to the command line's rules,
by field name, and equals the one the command line builds; and what the trainer makes of a config that does not fit
its base (AQN on a BF16 base, a folder instead of a loaded model)."""

import pytest
from fakes import digit_share_reward, make_trainer, recipe_config

from qerl import train
from qerl.config import QeRLConfig
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


@pytest.mark.parametrize(
    ("lengths", "context"),
    [
        ({"max_prompt_length": 100}, 150),  # the rollout engine's context: the prompt cap plus a full completion
        ({"max_prompt_length": 100, "vllm_max_model_length": 999}, 999),  # given: kept
        ({}, None),  # no prompt cap: the engine's own default
    ],
)
def test_a_config_built_in_python_is_the_command_lines(lengths, context, tmp_path):
    """The defaults one setting derives from others are the config's: the same settings make the same config, from
    Python as from the flags."""
    settings = {"output_dir": str(tmp_path), "use_cpu": True, "bf16": False, "max_completion_length": 50, **lengths}
    argv = ["--model-name", "m", *(f"--{name.replace('_', '-')}={value}" for name, value in settings.items())]
    _, from_flags = train.parse_args(argv)
    config = QeRLConfig(**settings)
    assert config.vllm_max_model_length == context
    assert config == from_flags
