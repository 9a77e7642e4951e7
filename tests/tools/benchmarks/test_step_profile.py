"""benchmarks/step_profile.py on a real (tiny, CPU) QeRL run: every phase of a step is found and timed once, the
rows add up to the step, and the forwards per update are the ones the configuration implies."""

from fakes import make_trainer

from benchmarks.step_profile import StepProfile
from qerl.config import QeRLConfig


def test_profile_splits_the_step_and_counts_forwards(checkpoints, tmp_path):
    _, nvfp4_dir = checkpoints
    args = QeRLConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        num_generations=4,
        steps_per_generation=2,
        max_completion_length=6,
        max_steps=5,
        learning_rate=1e-5,
        lora_rank=4,
        use_cpu=True,
        bf16=True,
        gradient_checkpointing=True,
        keep_activations=False,  # recomputed in the backward, whatever the memory
        loss_type="dapo",
        beta=0.0,
        aqn_log_shift=True,
        sigma_start=1e-2,
        sigma_end=1e-4,
        num_stages=3,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        metrics_jsonl=False,
    )
    trainer = make_trainer(nvfp4_dir, args)
    profile = StepProfile(trainer)
    trainer.add_callback(profile)
    trainer.train()
    summary = profile.summary(slice(1, None))  # steps 2-5: two generation rounds when they come every other step
    phases = summary["phases"]
    for name in ("rollout", "generation round", "rewards", "loss forward", "loss", "backward", "optimizer", "logging"):
        assert phases[name] > 0, name
    assert abs(sum(phases.values()) - summary["mean_step_seconds"]) < 1e-9  # "other" closes the sum
    assert phases["other"] > -1e-3
    passes = summary["decoder_passes"]
    # One loss forward per update and its recomputation in the backward (gradient checkpointing).
    assert passes["loss forward"] == passes["backward"] == 1
    # A round serves two updates, so TRL computes old log-probs: one pass per update's rows, at generation time.
    assert passes["old log-probs forward"] == 1
    assert summary["training_tflop"] > 0 and summary["mfu"] is None  # no peak to compare with on a CPU
