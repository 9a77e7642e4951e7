"""The `python -m qerl.train` entry point (qerl/train.py): bad input refused in one line before anything loads (its
TRIALS, launch configs it cannot run, a rollout backend that cannot run the model), flags in the reference's names,
long prompts, resume, reruns, and a run interrupted while saving a checkpoint."""

import json
import logging
import os
import signal
import textwrap

import pytest
import torch
from bad_input import MAINS, T, assert_one_line_error, check_trial, trial_ids
from fakes import digit_share_reward, train_argv
from interrupts import assert_interrupted, start, wait_for
from safetensors.torch import load_file
from transformers import TrainerCallback

from benchmarks.launch import REPO, SHARED_GSM8K
from qerl import cli, rewards, train
from qerl.errors import UsageError
from qerl.input_checks import FETCH_COMMAND
from qerl.run_dir import LOCK_FILE
from qerl.tiny import build_tiny_tokenizer, save_tiny_checkpoints

TRIALS = [
    # prog, argv, fragment(s) of the one line
    ("qerl.train", ["--output-dir", "fresh", "--use-cpu", "True"], "--model-name is required"),
    ("qerl.train", [*T, "--model-name", "./nope"], "--model-name ./nope: no such folder"),
    ("qerl.train", [*T, "--dataset", "gsm9k"], "--dataset gsm9k: unknown dataset (did you mean gsm8k?)"),
    ("qerl.train", [*T, "--dataset", "data/train.jsonl"], "--dataset data/train.jsonl: no such file"),
    ("qerl.train", [*T, "--dataset", "broken.jsonl"], "broken.jsonl, line 2: not JSON"),
    ("qerl.train", [*T, "--dataset", "nocolumn.jsonl", "--dataset-format", "gsm8k"], "column(s) answer"),
    ("qerl.train", [*T, "--dataset", "nocolumn.jsonl"], "cannot tell the dataset format"),
    ("qerl.train", [*T, "--learning-rate", "-1e-5"], "--learning-rate must be a number >= 0, got -1e-05"),
    ("qerl.train", [*T, "--sigma-start", "-0.1"], "--sigma-start must be a number > 0"),
    ("qerl.train", [*T, "--aqn", "false", "--sigma-end", "-1"], "--sigma-end must be a number > 0"),
    ("qerl.train", [*T, "--num-examples", "0"], "--num-examples must be an integer >= 1, got 0"),
    ("qerl.train", [*T, "--sigma-strat", "0.1"], "unknown flag --sigma-strat (did you mean --sigma-start?)"),
    ("qerl.train", [*T, "--config", "typo.yaml"], "typo.yaml: unknown key 'sigma_strat' (did you mean sigma_start?)"),
    ("qerl.train", [*T, "--config", "nope.yaml"], "--config nope.yaml: no such file"),
    ("qerl.train", [*T, "--config", "extends_typo.yaml"], "extends_typo.yaml: base typo.yaml: unknown key"),
    ("qerl.train", [*T, "--config", "extends_missing.yaml"], "extends_missing.yaml: base nope.yaml: no such file"),
    ("qerl.train", [*T, "--config", "loop.yaml"], "base loop.yaml extends itself"),
    ("qerl.train", [*T, "--max-steps", "abc"], "invalid int value: 'abc'"),
    ("qerl.train", [*T, "--max-steps", "0"], "--max-steps must be an integer >= 1, or -1"),
    ("qerl.train", [*T, "--temperature", "0"], "--temperature must be a number > 0, got 0"),
    ("qerl.train", [*T, "--top-p", "1.5"], "--top-p must be a number in (0, 1], got 1.5"),
    ("qerl.train", [*T, "--per-device-train-batch-size", "0"], "--per-device-train-batch-size must be an integer >= 1"),
    ("qerl.train", [*T, "--gradient-accumulation-steps", "0"], "--gradient-accumulation-steps must be an integer >= 1"),
    ("qerl.train", [*T, "--num-generations", "1"], "--num-generations must be an integer >= 2 (GRPO compares"),
    ("qerl.train", [*T, "--config", "zero.yaml"], "zero.yaml: num_generations must be an integer >= 2"),
    ("qerl.train", [*T, "--lora-rank", "0"], "--lora-rank must be an integer >= 1, got 0"),
    ("qerl.train", [*T, "--num-stages", "2"], "--num-stages must be an integer >= 3 (AQN"),
    ("qerl.train", [*T, "--model-name", "model.gguf"], "model.gguf is a GGUF file", FETCH_COMMAND),
    ("qerl.train", [*T, "--model-name", "alien"], "AlienForCausalLM of model_type 'alien_lm', unknown to transformers"),
    (
        "qerl.train",
        [*T, "--output-dir", "run_r4", "--resume-from-checkpoint", "true", "--lora-rank", "8"],
        "checkpoint-1: its LoRA rank is 4, --lora-rank is 8; pass --lora-rank 4",
    ),
    ("qerl.train", [*T, "--num-generations", "3"], "num_generations to a divisor of 8"),
    ("qerl.train", [*T, "--precision", "bf16"], "is an NVFP4 checkpoint"),
    ("qerl.train", [*T, "--model-name", "truncated"], "truncated or corrupt"),
    ("qerl.train", [*T, "--output-dir", "run"], "holds an earlier run (checkpoint-2)"),
    ("qerl.train", [*T, "--resume-from-checkpoint", "fresh/checkpoint-9"], "no such checkpoint folder"),
]


@pytest.mark.parametrize("trial", TRIALS, ids=trial_ids(TRIALS))
def test_bad_input_is_one_line_and_changes_nothing(world, monkeypatch, capsys, trial):
    check_trial(world, monkeypatch, capsys, trial)


@pytest.mark.parametrize(
    "env, argv, culprit",
    [
        ({"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "1"}, [], "FSDP version 1 is not supported"),
        (
            {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3"},
            ["--ds3-gather-for-generation", "false"],
            "ds3_gather_for_generation false is not supported",
        ),
    ],
    ids=["fsdp1", "zero3-without-gather"],
)
def test_unsupported_launch_configs_are_one_line(world, monkeypatch, capsys, env, argv, culprit):
    """What `accelerate launch` hands the processes (its config as environment variables), refused before loading."""
    if "ACCELERATE_USE_DEEPSPEED" in env:
        pytest.importorskip("deepspeed")
    from transformers.integrations import unset_hf_deepspeed_config

    monkeypatch.chdir(world)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    try:
        code = cli.run_cli(MAINS["qerl.train"], "qerl.train", [*T, *argv])
    finally:
        unset_hf_deepspeed_config()  # TrainingArguments registers the ZeRO-3 config process-wide
    assert_one_line_error(code, capsys.readouterr().err, "qerl.train", culprit)


def test_a_backend_that_cannot_run_the_model_is_named_with_the_one_auto_would_use(tmp_path, monkeypatch, capsys):
    """--rollout-backend native on a checkpoint with a plain GELU MLP (which the native engine does not run):
    one line naming the architecture, why, and the backend that auto uses instead; no output folder is left. (The
    engine's check needs the loaded policy, so this one comes after the load.)"""
    from qerl.tiny import build_tiny_model

    tokenizer = build_tiny_tokenizer()
    model = build_tiny_model(tokenizer, num_layers=1)
    model.config.hidden_act = "gelu"
    _, nvfp4_dir = save_tiny_checkpoints(str(tmp_path), model, tokenizer)
    monkeypatch.delenv(cli.DEBUG_ENV, raising=False)
    argv = ["--model-name", nvfp4_dir, "--output-dir", str(tmp_path / "out"), "--use-cpu", "True", "--dataset",
            "arithmetic", "--num-examples", "8", "--rollout-backend", "native"]  # fmt: skip
    code = cli.run_cli(MAINS["qerl.train"], "qerl.train", argv)
    assert_one_line_error(
        code,
        capsys.readouterr().err,
        "qerl.train",
        "rollout_backend native: the native engine "
        "cannot run Qwen2ForCausalLM: hidden_act 'gelu'; the engine's MLP gates are silu, "
        "gelu_pytorch_tanh",
        "rollout_backend auto would use transformers",
    )
    assert not (tmp_path / "out").exists()


def test_reference_flag_names(tmp_path):
    argv = [
        "--model-name", "m", "--dataset", "dapomath", "--lora-rank", "32", "--lora-alpha", "64", "--ln", "True",
        "--sigma-start", "5e-2", "--sigma-end", "5e-4", "--num-stages", "6", "--random-state", "7",
        "--loss-type", "bnpo", "--beta", "0.04", "--epsilon-high", "0.2", "--max-prompt-length", "300",
        "--mask-truncated-completions", "True", "--output-dir", str(tmp_path), "--use-cpu", "True",
        "--fast-inference", "True", "--max-seq-length", "10000", "--warmup-ratio", "0.1",
    ]  # fmt: skip
    with pytest.warns(UserWarning, match="ignoring --fast-inference") as caught:
        script, config = train.parse_args(argv)
    assert any("--max-seq-length" in str(w.message) for w in caught)
    assert (script.model_name, script.dataset, config.max_prompt_length) == ("m", "dapomath", 300)
    assert (config.lora_rank, config.lora_alpha, config.trainable_norms, config.seed) == (32, 64, True, 7)
    assert (config.sigma_start, config.sigma_end, config.num_stages) == (5e-2, 5e-4, 6)
    loss = (config.loss_type, config.beta, config.epsilon_high, config.mask_truncated_completions)
    assert loss == ("bnpo", 0.04, 0.2, True)
    assert config.warmup_steps == 0.1 and config.get_warmup_steps(100) == 10
    assert config.aqn is None and config.vllm_importance_sampling_correction is False  # defaults
    # The aliases are HfArgumentParser's: both spellings, and the fields keep TRL's defaults.
    _, config = train.parse_args(
        [
            "--model-name",
            "m",
            "--random_state",
            "8",
            "--warmup_ratio",
            "0.2",
            "--output-dir",
            str(tmp_path),
            "--use-cpu",
            "True",
        ]
    )
    assert (config.seed, config.warmup_steps) == (8, 0.2)
    _, config = train.parse_args(["--model-name", "m", "--output-dir", str(tmp_path), "--use-cpu", "True"])
    assert (config.seed, config.warmup_steps) == (42, 0)


GSM8K_TEST = str(SHARED_GSM8K / "test.jsonl")


@pytest.mark.skipif(not os.path.isfile(GSM8K_TEST), reason=f"GSM8K data not found at {GSM8K_TEST}")
def test_long_prompts_keep_last_trains_on_every_row(checkpoints, tmp_path):
    """A BF16 base on real GSM8K rows whose prompts all exceed --max-prompt-length: the default drops every row (a
    one-line refusal); --long-prompts keep_last keeps all, and the rollout (so the loss too) gets them cut to it."""
    bf16_dir, _ = checkpoints
    cap = 400  # characters = tokens for the tiny tokenizer; these think/answer prompts run 460-900
    argv = train_argv(
        bf16_dir, str(tmp_path), 1, "--dataset", GSM8K_TEST, "--num-examples", "16", "--max-prompt-length", str(cap)
    )
    with pytest.raises(UsageError, match=f"no prompt of .* fits --max-prompt-length {cap}"):
        train.build_trainer(*train.parse_args(argv))
    trainer = train.build_trainer(*train.parse_args([*argv, "--long-prompts", "keep_last"]))
    assert len(trainer.train_dataset) == 16
    seen = []
    generate = trainer._generate_single_turn

    def spy(prompt_ids, *args, **kwargs):
        seen.extend(len(ids) for ids in prompt_ids)
        return generate(prompt_ids, *args, **kwargs)

    trainer._generate_single_turn = spy
    trainer.train()
    assert seen == [cap] * 8  # 2 prompts x 4 samples
    with pytest.raises(UsageError, match="--long-prompts 'truncate': use one of drop, keep_last"):
        train.validate(*train.parse_args([*argv, "--long-prompts", "truncate"]))


def test_a_soft_overlong_cache_longer_than_the_cap_is_one_line(checkpoints, tmp_path):
    """The 1.5B recipe punishes the last 128 tokens before its 512 cap; a cap shrunk under that is refused before
    anything loads, naming both flags."""
    bf16_dir, _ = checkpoints
    recipe = str(REPO / "configs" / "qwen2.5_coder_1.5b_gsm8k_hash.yaml")
    argv = ["--config", recipe, "--model-name", bf16_dir, "--output-dir", str(tmp_path), "--dataset", "gsm8k_hash"]
    assert train.parse_args(argv)[0].soft_overlong_cache == 128
    with pytest.raises(UsageError, match="^--soft-overlong-cache 128: .* --max-completion-length 64; give 0 .* to 64$"):
        train.validate(*train.parse_args([*argv, "--max-completion-length", "64"]))


def _run(checkpoint, output_dir, steps, *extra):
    return train.main(train_argv(checkpoint, output_dir, steps, *extra))


class StopAfter(TrainerCallback):
    """Interrupts a run after `step` optimizer steps, as a crash or a preemption would."""

    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True


def test_resume_continues_exactly(checkpoints, tmp_path, monkeypatch):
    """A 3-step run == the same run interrupted after 2 steps and resumed: same adapters, noise and samples."""
    monkeypatch.setattr(rewards, "exact_answer_reward", digit_share_reward)
    _, nvfp4_dir = checkpoints
    straight = _run(nvfp4_dir, str(tmp_path / "a"), 3)
    interrupted = train.build_trainer(*train.parse_args(train_argv(nvfp4_dir, str(tmp_path / "b"), 3)))
    interrupted.add_callback(StopAfter(2))
    interrupted.train()
    assert interrupted.state.global_step == 2
    resumed = _run(nvfp4_dir, str(tmp_path / "b"), 3, "--resume-from-checkpoint", "true")
    assert resumed.state.global_step == 3
    a = load_file(str(tmp_path / "a" / "adapter_model.safetensors"))
    b = load_file(str(tmp_path / "b" / "adapter_model.safetensors"))
    at_two = load_file(str(tmp_path / "b" / "checkpoint-2" / "adapter_model.safetensors"))
    assert any("layernorm" in k for k in a)  # trained norms are saved with the adapter
    assert not all(torch.equal(b[k], at_two[k]) for k in b)  # the resumed step trained
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=1e-7)
    rewards_a = [h["reward"] for h in straight.state.log_history if "reward" in h]
    rewards_b = [h["reward"] for h in resumed.state.log_history if "reward" in h]
    assert rewards_b[-1] == pytest.approx(rewards_a[-1])


def test_cli_bad_input(checkpoints, tmp_path):
    _, nvfp4_dir = checkpoints
    with pytest.raises(UsageError, match="known datasets are gsm8k, gsm8k_hash, gsm8k_lenient, bigmath"):
        _run(nvfp4_dir, str(tmp_path / "x"), 1, "--dataset", "gsm9k")
    with pytest.raises(UsageError, match="num_generations to a divisor of 8"):
        _run(nvfp4_dir, str(tmp_path / "x"), 1, "--num-generations", "3")
    with pytest.raises(UsageError, match="--model-name is required"):
        train.parse_args(["--dataset", "gsm8k", "--use-cpu", "True", "--output-dir", str(tmp_path)])


def _metrics_steps(path):
    rows = [json.loads(line) for line in open(path)]
    return [r["step"] for r in rows if "loss" in r]


def test_rerun_and_resume_keep_runs_apart(checkpoints, tmp_path, monkeypatch, caplog):
    """An interrupted run whose newest checkpoint is incomplete resumes from the one before, says so, and its
    metrics.jsonl ends with each step once; a fresh rerun is refused, then starts over only when asked."""
    monkeypatch.setattr(rewards, "exact_answer_reward", digit_share_reward)
    _, nvfp4_dir = checkpoints
    out = tmp_path / "run"
    interrupted = train.build_trainer(*train.parse_args(train_argv(nvfp4_dir, str(out), 4)))
    interrupted.add_callback(StopAfter(3))
    interrupted.train()
    (out / "checkpoint-3" / "trainer_state.json").unlink()  # killed while saving step 3
    assert _metrics_steps(out / "metrics.jsonl") == [1, 2, 3]

    with pytest.raises(UsageError, match=r"holds an earlier run \(checkpoint-3, checkpoint-2"):
        train.main(train_argv(nvfp4_dir, str(out), 4))  # a plain rerun does not silently start over
    with caplog.at_level(logging.INFO):
        resumed = _run(nvfp4_dir, str(out), 4, "--resume-from-checkpoint", "true")
    messages = [r.getMessage() for r in caplog.records]
    assert any("skipping" in m and "checkpoint-3: incomplete" in m for m in messages)
    assert "resuming from checkpoint-2, step 2 of 4" in messages
    assert resumed.state.global_step == 4
    assert _metrics_steps(out / "metrics.jsonl") == [1, 2, 3, 4]  # step 3 logged once, by the resumed run
    assert _metrics_steps(out / "metrics.1.jsonl") == [1, 2, 3]  # the interrupted run's file, kept aside

    _run(nvfp4_dir, str(out), 1, "--overwrite-output-dir", "true")
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-1"]
    assert _metrics_steps(out / "metrics.jsonl") == [1]
    assert _metrics_steps(out / "metrics.2.jsonl") == [1, 2, 3, 4]


# Holds the run inside the save of checkpoint-2, after the adapter and optimizer and before trainer_state.json, until
# the file `sent` says that the signal was sent.
TRAIN_HARNESS = textwrap.dedent("""
    import os, sys, time
    from qerl import train
    from qerl.trainer import QeRLTrainer

    saving, sent = sys.argv[1:3]
    save_rng_state = QeRLTrainer._save_rng_state

    def held(self, output_dir):
        if self.state.global_step == 2:
            open(saving, "w").close()
            while not os.path.exists(sent):
                time.sleep(0.01)
        save_rng_state(self, output_dir)

    QeRLTrainer._save_rng_state = held
    sys.exit(train.run(sys.argv[3:]))
""")


def test_training_interrupted_while_saving_keeps_whole_checkpoints_and_resumes(checkpoints, tmp_path, caplog):
    """SIGINT in the middle of saving checkpoint-2: the save completes, then the run stops in one line, leaving
    checkpoint-1 and checkpoint-2 whole and no final adapter; a resume continues from checkpoint-2, taking over the
    lock that a killed run left behind and saying so."""
    _, nvfp4_dir = checkpoints
    out, saving, sent = tmp_path / "run", tmp_path / "saving", tmp_path / "sent"
    child = start(TRAIN_HARNESS, saving, sent, *train_argv(nvfp4_dir, str(out), 4))
    wait_for(saving, child)
    child.send_signal(signal.SIGINT)
    sent.touch()
    _, stderr = child.communicate(timeout=240)
    assert child.returncode == 128 + signal.SIGINT, stderr
    assert_interrupted(stderr, "qerl.train", "SIGINT")
    assert "stopped at step 2: checkpoint-2 is the newest complete checkpoint" in stderr
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["checkpoint-1", "checkpoint-2"]
    for checkpoint in ("checkpoint-1", "checkpoint-2"):
        assert json.loads((out / checkpoint / "trainer_state.json").read_text())["global_step"] == int(checkpoint[-1])
        assert (out / checkpoint / "rng_state.pth").is_file() and (out / checkpoint / "optimizer.pt").is_file()
    assert not (out / "adapter_model.safetensors").exists()  # the run did not end: no final adapter
    assert not (out / LOCK_FILE).exists()  # released on the way out

    (out / LOCK_FILE).write_text("999999999 elsewhere\n")  # a run killed outright leaves its lock file
    with caplog.at_level(logging.INFO):
        resumed = train.main(train_argv(nvfp4_dir, str(out), 3, "--resume-from-checkpoint", "true"))
    messages = [r.getMessage() for r in caplog.records]
    assert any("took over the lock of process 999999999 on elsewhere" in m for m in messages), messages
    assert "resuming from checkpoint-2, step 2 of 3" in messages
    assert resumed.state.global_step == 3 and (out / "adapter_model.safetensors").is_file()
    assert not (out / LOCK_FILE).exists()
