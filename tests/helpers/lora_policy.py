"""The policy QeRLTrainer trains from a checkpoint (base_model.load_base_model, then lora.lora_config), as
tests/qerl/test_base_model.py and tests/qerl/test_lora.py take it."""

import torch
from fakes import make_trainer

from qerl.config import QeRLConfig


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
