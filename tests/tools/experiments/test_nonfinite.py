"""dump_nonfinite_grads saves the micro-batch that made a gradient non-finite (qerl/nonfinite_dump.py, through the
trainer), and experiments.nonfinite replays it."""

import json
import math

import torch
from fakes import make_trainer, recipe_config

from experiments import nonfinite


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
