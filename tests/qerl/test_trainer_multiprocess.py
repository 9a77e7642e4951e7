"""Two CPU processes (gloo): the tiny NVFP4 policy trained in step under `accelerate launch` (DDP, DeepSpeed ZeRO-3)
(QeRLTrainer through qerl.train's entry point in each process).

accelerate runs DeepSpeed on a machine without a GPU when the launch does not ask for the CPU (`use_cpu: false`)
and the processes pass `--ddp-backend gloo` (DeepSpeed's CPU accelerator then talks gloo); it never runs FSDP
without one, so the FSDP2 test shards the policy with accelerate's own `fsdp2_prepare_model` under torch's gloo.
"""

import contextlib
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import yaml
from rollout_servers import native_serving
from safetensors.torch import load_file

from benchmarks.launch import REPO, child_env, free_port

ACCELERATE_CONFIGS = os.path.join(REPO, "configs", "accelerate")


# Runs inside each process: the real entry point, plus a dump of this rank's trainable weights.
HARNESS = textwrap.dedent("""
    import os, sys, torch
    from qerl import rewards, train

    def digit_share_reward(completions, answer, **kwargs):  # varies on a random model, so steps update
        return [sum(ch.isdigit() for ch in c[0]["content"]) / max(len(c[0]["content"]), 1) for c in completions]

    rewards.exact_answer_reward = digit_share_reward
    trainer = train.build_trainer(*train.parse_args(sys.argv[1:]))
    def trainable():
        with trainer._open_policy() as model:  # ZeRO-3: gathered whole
            return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    before = trainable()
    seen = []
    generate = trainer.rollout.generate
    trainer.rollout.generate = lambda ids, perturb: seen.append(ids) or generate(ids, perturb)
    trainer.train()
    trainer.save_model(trainer.args.output_dir)  # the final adapter, as qerl.train writes it
    rank = trainer.accelerator.process_index
    shifts = [row["aqn/logprob_shift"] for row in trainer.state.log_history if "aqn/logprob_shift" in row]
    torch.save({"before": before, "after": trainable(), "prompts": seen, "world": trainer.accelerator.num_processes,
                "backend": trainer.rollout.name, "sharding": trainer.rollout.setup.sharding,
                "shifts": shifts}, os.path.join(trainer.args.output_dir, f"rank{rank}.pt"))
""")


def _zero3_config(tmp_path) -> str:
    """configs/accelerate/zero3.yaml with DeepSpeed's own config file, which holds every parameter partitioned
    (stage3_param_persistence_threshold 0: the tiny model's tensors would all stay whole at the default)."""
    with open(os.path.join(ACCELERATE_CONFIGS, "zero3.yaml")) as f:
        config = yaml.safe_load(f)
    ds_config = {
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                              "stage3_gather_16bit_weights_on_model_save": True},  # zero3_save_16bit_model
        "bf16": {"enabled": "auto"}, "gradient_clipping": "auto", "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
    }  # fmt: skip
    (tmp_path / "ds.json").write_text(json.dumps(ds_config))
    config["deepspeed_config"] = {"deepspeed_config_file": str(tmp_path / "ds.json"), "zero3_init_flag": False}
    (tmp_path / "zero3.yaml").write_text(yaml.safe_dump(config))
    return str(tmp_path / "zero3.yaml")


# (accelerate config, extra flags, the rollout backend the run must use, the trainer's sharding)
SETUPS = {
    "ddp": (lambda tmp: os.path.join(ACCELERATE_CONFIGS, "ddp.yaml"), ["--use-cpu", "True"], "transformers", None),
    # The native engine on ZeRO-3's partitions: gathered whole every round inside TRL's gather.
    "zero3": (
        _zero3_config,
        ["--use-cpu", "False", "--ddp-backend", "gloo", "--rollout-backend", "native"],
        "native",
        "zero3",
    ),
    # Both ranks' rounds sampled by one rollout server (the native engine, in this test's process): each rank sends
    # the same adapter and its own prompts (training/dapo_rollout_servers.sh with N trainers).
    "ddp-server": (
        lambda tmp: os.path.join(ACCELERATE_CONFIGS, "ddp.yaml"),
        ["--use-cpu", "True", "--rollout-backend", "server"],
        "server",
        None,
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("setup", SETUPS)
def test_two_processes_end_with_identical_lora(setup, checkpoints, tmp_path):
    if setup == "zero3":
        pytest.importorskip("deepspeed", reason="the deepspeed extra (pip install -e .[deepspeed])")
    _, nvfp4_dir = checkpoints
    config, flags, backend, sharding = SETUPS[setup]
    harness = tmp_path / "harness.py"
    harness.write_text(HARNESS)
    out = tmp_path / "out"
    server = native_serving(nvfp4_dir) if setup == "ddp-server" else contextlib.nullcontext()
    with server as served:
        cmd = [
            sys.executable, "-m", "accelerate.commands.launch", "--config_file", config(tmp_path), "--num_processes",
            "2", "--mixed_precision", "no", "--main_process_port", str(free_port()), str(harness),
            "--model-name", nvfp4_dir, "--dataset", "arithmetic", "--num-examples", "64", "--dtype", "float32",
            "--output-dir", str(out), "--per-device-train-batch-size", "4", "--num-generations", "4",
            "--max-completion-length", "6", "--max-steps", "3", "--save-strategy", "no", "--report-to", "none",
            "--bf16", "False", "--gradient-checkpointing", "False", "--lora-rank", "4",
            "--ln", "True", "--learning-rate", "5e-3", "--sigma-start", "0.1", "--sigma-end", "0.01",
            "--num-stages", "3", "--aqn-log-shift", "True", "--logging-steps", "1", *flags,
            *(["--rollout-servers", served[0]] if served else []),
        ]  # fmt: skip
        result = subprocess.run(cmd, env=child_env(threads=1), capture_output=True, text=True, timeout=300, cwd=REPO)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    ranks = [torch.load(out / f"rank{r}.pt") for r in range(2)]
    assert all(r["world"] == 2 and r["backend"] == backend and r["sharding"] == sharding for r in ranks)
    # Each rank sampled its own prompts...
    assert ranks[0]["prompts"] != ranks[1]["prompts"]
    # ...yet, with gradients all-reduced, both end with the same adapters (and trained norms), moved by training.
    after0, after1 = ranks[0]["after"], ranks[1]["after"]
    assert after0.keys() == after1.keys() and any("layernorm" in k for k in after0)
    for name in after0:
        torch.testing.assert_close(after0[name], after1[name], rtol=0, atol=0)
    assert any(not torch.equal(ranks[0]["before"][n], after0[n]) for n in after0 if "lora_B" in n)
    # The adapter file holds the trained values (ZeRO-3: gathered from the partitions).
    saved = load_file(out / "adapter_model.safetensors")
    lora_b = {n: t for n, t in saved.items() if "lora_B" in n}
    assert lora_b and all(torch.equal(t, after0[n.replace("lora_B.", "lora_B.default.")]) for n, t in lora_b.items())
    # AQN reached the training forward's norms (ZeRO-3: inside the gather) in every noisy round.
    assert ranks[0]["shifts"] and all(shift > 0 for shift in ranks[0]["shifts"])
