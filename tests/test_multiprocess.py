"""Two CPU processes (gloo) under `accelerate launch` with our DDP config train the tiny NVFP4 policy in step."""

import os
import socket
import subprocess
import sys
import textwrap

import pytest
import torch

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Runs inside each process: the real entry point, plus a dump of this rank's trainable weights.
HARNESS = textwrap.dedent("""
    import os, sys, torch
    from qerl import rewards, train

    def digit_share_reward(completions, answer, **kwargs):  # varies on a random model, so steps update
        return [sum(ch.isdigit() for ch in c[0]["content"]) / max(len(c[0]["content"]), 1) for c in completions]

    rewards.exact_answer_reward = digit_share_reward
    trainer = train.build_trainer(*train.parse_args(sys.argv[1:]))
    def trainable():
        return {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    before = trainable()
    seen = []
    generate = trainer.rollout.generate
    trainer.rollout.generate = lambda ids, perturb: seen.append(ids) or generate(ids, perturb)
    trainer.train()
    rank = trainer.accelerator.process_index
    torch.save({"before": before, "after": trainable(), "prompts": seen, "world": trainer.accelerator.num_processes},
               os.path.join(trainer.args.output_dir, f"rank{rank}.pt"))
""")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_end_with_identical_lora(checkpoints, tmp_path):
    _, nvfp4_dir = checkpoints
    harness = tmp_path / "harness.py"
    harness.write_text(HARNESS)
    out = tmp_path / "out"
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file",
        os.path.join(REPO_ROOT, "configs", "accelerate", "ddp.yaml"), "--num_processes", "2",
        "--mixed_precision", "no", "--main_process_port", str(_free_port()), str(harness),
        "--model-name", nvfp4_dir, "--dataset", "arithmetic", "--num-examples", "64", "--dtype", "float32",
        "--output-dir", str(out), "--per-device-train-batch-size", "4", "--num-generations", "4",
        "--max-completion-length", "6", "--max-steps", "3", "--save-strategy", "no", "--report-to", "none",
        "--use-cpu", "True", "--bf16", "False", "--gradient-checkpointing", "False", "--lora-rank", "4",
        "--ln", "True", "--learning-rate", "5e-3", "--sigma-start", "0.1", "--sigma-end", "0.01",
        "--num-stages", "3", "--logging-steps", "1",
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=REPO_ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    ranks = [torch.load(out / f"rank{r}.pt") for r in range(2)]
    assert all(r["world"] == 2 for r in ranks)
    # Each rank sampled its own prompts...
    assert ranks[0]["prompts"] != ranks[1]["prompts"]
    # ...yet, with gradients all-reduced, both end with the same adapters (and trained norms), moved by training.
    after0, after1 = ranks[0]["after"], ranks[1]["after"]
    assert after0.keys() == after1.keys() and any("layernorm" in k for k in after0)
    for name in after0:
        torch.testing.assert_close(after0[name], after1[name], rtol=0, atol=0)
    assert any(not torch.equal(ranks[0]["before"][n], after0[n]) for n in after0 if "lora_B" in n)
