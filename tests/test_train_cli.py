"""The `python -m qerl.train` entry point: flags in the reference's names, YAML recipes, scripts, resume."""

import glob
import json
import logging
import os
import shlex
import subprocess

import pytest
import torch
from fakes import digit_share_reward, train_argv
from safetensors.torch import load_file
from transformers import TrainerCallback

from qerl import rewards, train
from qerl.errors import UsageError

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
    assert (script.model_name, script.dataset, script.max_prompt_length) == ("m", "dapomath", 300)
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


def test_the_rollout_engines_context_is_the_prompt_cap_plus_a_completion(tmp_path):
    """vLLM's context (vllm_max_model_length) defaults to the prompt cap plus a full completion, set while parsing:
    the config is built once with it (a recipe's or flag's own value wins)."""
    common = ["--model-name", "m", "--output-dir", str(tmp_path), "--use-cpu", "True", "--max-completion-length", "50"]
    _, config = train.parse_args([*common, "--max-prompt-length", "100"])
    assert config.vllm_max_model_length == 150
    _, config = train.parse_args([*common, "--max-prompt-length", "100", "--vllm-max-model-length", "999"])
    assert config.vllm_max_model_length == 999
    _, config = train.parse_args(common)
    assert config.vllm_max_model_length is None  # no prompt cap: the engine's own default


@pytest.mark.parametrize("recipe", sorted(glob.glob(os.path.join(REPO_ROOT, "configs", "dapo_*.yaml"))))
def test_yaml_recipes(recipe, tmp_path):
    script, config = train.parse_args(
        [
            "--config",
            recipe,
            "--model-name",
            "m",
            "--output-dir",
            str(tmp_path),
            "--use-cpu",
            "True",
            "--bf16",
            "False",
            "--learning-rate",
            "3e-6",
        ]
    )
    nvfp4 = recipe.endswith("_nvfp4.yaml")
    assert config.learning_rate == 3e-6  # flags override the recipe
    assert (config.loss_type, config.beta, config.epsilon_high, config.max_grad_norm) == ("dapo", 0.0, 0.28, 0.2)
    assert (config.lora_rank, config.lora_alpha, config.trainable_norms) == (16, 16, True)
    assert config.aqn is nvfp4 and (config.sigma_start, config.sigma_end, config.num_stages) == (1e-2, 1e-4, 10)
    assert script.dataset in os.path.basename(recipe)


def test_a_recipe_extends_its_bases_in_order(tmp_path, monkeypatch):
    (tmp_path / "parts").mkdir()
    (tmp_path / "parts" / "a.yaml").write_text("lora_rank: 8\nsigma_start: 0.5\nenv: {QERL_RECIPE_A: a}\n")
    (tmp_path / "parts" / "b.yaml").write_text("lora_rank: 32\nlora_alpha: 7\nenv: {QERL_RECIPE_B: b}\n")
    (tmp_path / "run.yaml").write_text("base: [parts/a.yaml, parts/b.yaml]\nlora_alpha: 9\nenv: {QERL_RECIPE_B: own}\n")
    for name in ("QERL_RECIPE_A", "QERL_RECIPE_B"):
        monkeypatch.setenv(name, "")  # restored (removed) after the test
    _, config = train.parse_args(
        [
            "--config",
            str(tmp_path / "run.yaml"),
            "--model-name",
            "m",
            "--output-dir",
            str(tmp_path / "out"),
            "--use-cpu",
            "True",
            "--sigma-start",
            "0.2",
        ]
    )
    assert (config.lora_rank, config.lora_alpha, config.sigma_start) == (32, 9, 0.2)  # later base, own key, flag
    assert (os.environ["QERL_RECIPE_A"], os.environ["QERL_RECIPE_B"]) == ("a", "own")


def parse_script(script_path: str, tmp_path) -> tuple:
    """A training script's command (its DRY_RUN prints it) parsed as `qerl.train` parses it."""
    env = dict(os.environ, DRY_RUN="1", MODEL_PATH="/models/x", CKPTS_DIR=str(tmp_path))
    flags = ["--use-cpu", "True", "--bf16", "False"]
    out = subprocess.run(["bash", script_path, *flags], env=env, check=True, capture_output=True, text=True, cwd="/")
    argv = shlex.split(out.stdout)
    assert argv[1:3] == ["-m", "qerl.train"]
    os.chdir(REPO_ROOT)  # the script cds there; the recipe path in its command is relative to it
    return train.parse_args(argv[3:])


@pytest.mark.parametrize("script_path", sorted(glob.glob(os.path.join(REPO_ROOT, "training", "dapo_qwen2.5-*.sh"))))
def test_training_scripts(script_path, tmp_path):
    script, config = parse_script(script_path, tmp_path)
    name = os.path.basename(script_path)
    nvfp4 = "_nvfp4_" in name
    assert config.learning_rate == (1e-5 if nvfp4 else 5e-6)
    assert config.aqn is nvfp4 and script.dataset == "gsm8k" and script.max_prompt_length == 256
    batch = 8 if name.startswith("dapo_qwen2.5-32b_nvfp4") else 2
    assert config.per_device_train_batch_size == config.num_generations == batch
    assert (config.beta, config.epsilon_high, config.adam_beta2, config.weight_decay) == (0.0, 0.28, 0.99, 0.1)
    assert (config.seed, config.max_completion_length, config.resume_from_checkpoint) == (2025, 2048, "true")
    assert config.compile_layers and config.unpadded_forward and not config.aqn_log_shift


def test_llama_recipe_is_the_references_batch(tmp_path):
    """training/llama3.1_8b_nemotron.sh: the reference's Llama-3.1-8B settings (batch 4 x accumulation 16, its
    bnpo loss, lr 1e-5, gsm8k 256/2048) on top of the shared DAPO + AQN parts."""
    script, config = parse_script(os.path.join(REPO_ROOT, "training", "llama3.1_8b_nemotron.sh"), tmp_path)
    batch = (config.per_device_train_batch_size, config.num_generations, config.gradient_accumulation_steps)
    assert batch == (4, 4, 16)
    assert (config.loss_type, config.beta, config.epsilon_high, config.learning_rate) == ("bnpo", 0.0, 0.28, 1e-5)
    assert config.aqn and (config.lora_rank, config.lora_alpha, config.trainable_norms) == (16, 16, True)
    assert (script.dataset, script.max_prompt_length, config.max_completion_length) == ("gsm8k", 256, 2048)


GSM8K_TEST = os.path.join(REPO_ROOT, "..", "shared", "data", "gsm8k", "test.jsonl")


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
