"""experiments.resume_check on two CPU processes under ZeRO-3 (DeepSpeed's CPU accelerator, gloo)."""

import pytest
import torch


@pytest.mark.slow
def test_zero3_checkpoint_resumes_exactly(checkpoints, tmp_path):
    """experiments.resume_check on two CPU processes under ZeRO-3 (DeepSpeed's CPU accelerator, gloo): step 3 after a
    resume from the run's own checkpoint-2 equals that run's step 3 bitwise (loss, each rank's samples, adapter), and
    the checkpoint holds the adapter's partitions but not the packed NVFP4 base."""
    pytest.importorskip("deepspeed", reason="the deepspeed extra (pip install -e .[deepspeed])")
    import argparse

    from experiments import resume_check

    args = argparse.Namespace(
        config="zero3",
        model=checkpoints[1],
        gpu_ids="0,1",
        steps=2,
        batch=4,
        new_tokens=6,
        seed=2025,
        rollout_backend="native",
        eval_problems=0,
        timeout=300,
        dry_run=True,
        out=str(tmp_path / "resume"),
    )
    result = resume_check.run_check(args)
    assert result["verdict"] == "exact", resume_check.report(result)
    assert result["a_vs_b"]["update_norm"] > 0  # step 3 trained
    states = sorted((tmp_path / "resume" / "A" / "checkpoint-2").glob("global_step2/*model_states.pt"))
    assert len(states) == 2
    for path in states:
        module = torch.load(path, weights_only=False)["module"]
        assert any("lora_A" in k for k in module) and not any("weight_packed" in k for k in module)
