"""experiments.beside_server, the arm that samples one round ahead (issue 51's accuracy goal): a real qerl.train run on
the tiny NVFP4 checkpoint, the 1.5B recipe shrunk (BF16, its learning rate), whose rounds a native rollout server
process beside it samples one round ahead; and a server that dies stopping the run at once, in one line."""

import json

import pytest

from benchmarks import launch
from experiments import arms_runs, beside_server

DATA = launch.REPO / "tests" / "data" / "gsm8k"
SHRUNK = ["--max-completion-length", "6", "--soft-overlong-cache", "2", "--max-prompt-length", "4096",
          "--per-device-train-batch-size", "8", "--gradient-accumulation-steps", "1", "--num-generations", "4",
          "--use-cpu", "true", "--dataset", str(DATA / "train_sample.jsonl")]  # fmt: skip


def _flags(base: str, out) -> list[str]:
    recipe = launch.RECIPES["qwen2.5-coder-1.5b-instruct"]
    return ["--config", str(recipe), "--model-name", base, "--output-dir", str(out), "--max-steps", "2", *SHRUNK]


def test_the_arm_runs_qerl_train_through_a_server_beside_it(tmp_path):
    from arms_folders import _args

    task = arms_runs.train_task(_args(tmp_path), "run-seed20", "ckpt/nvfp4", False, 1e-4, 20, 51, ahead=True)
    command = task.command
    assert command[1:3] == ["-m", "experiments.beside_server"]
    assert command[3 : command.index("--")] == ["--model", "ckpt/nvfp4", "--seed", "20"]
    plain = arms_runs.train_task(_args(tmp_path), "run-seed20", "ckpt/nvfp4", False, 1e-4, 20, 51).command
    assert command[command.index("--") + 1 :] == plain[3:]  # qerl.train's flags as the colocated arm's


def test_a_run_samples_one_round_ahead_on_a_native_server(checkpoints, tmp_path):
    _, nvfp4 = checkpoints
    out = tmp_path / "run"
    assert beside_server.main(["--model", nvfp4, "--seed", "3", "--kv-cache-gib", "1", "--", *_flags(nvfp4, out)]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    staleness = [row["rollout/staleness"] for row in rows if "rollout/staleness" in row]
    assert staleness == [0, 1]  # the first round sampled when needed, the second while the first step trained
    assert (out / "adapter_config.json").exists()
    # both rounds sampled with the adapter before any step (v0): the second while step 1 trained
    assert "adapter v0: " in (out / "rollout-server.log").read_text()


def test_a_server_that_dies_stops_the_run_in_one_line(checkpoints, tmp_path):
    _, nvfp4 = checkpoints
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as caught:  # the server's base does not exist: it exits at once
        beside_server.main(["--model", str(tmp_path / "missing"), "--", *_flags(nvfp4, out)])
    message = str(caught.value)
    assert "\n" not in message and "the rollout server exited with code 2" in message
    assert "missing" in (out / "rollout-server.log").read_text()
