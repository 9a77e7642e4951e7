"""How qerl.train reads its settings (qerl/recipes.py): YAML recipes and their bases, the training scripts' commands
parsed as qerl.train parses them, and the short --help (QUICK_HELP; with the quantizer's and eval's --help)."""

import glob
import json
import os
import shlex
import subprocess
from dataclasses import MISSING, fields
from importlib.metadata import version

import pytest

from benchmarks.launch import REPO
from eval import gsm8k
from qerl import quantize, recipes, train


@pytest.mark.parametrize("recipe", sorted(glob.glob(os.path.join(REPO, "configs", "dapo_*.yaml"))))
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
    os.chdir(REPO)  # the script cds there; the recipe path in its command is relative to it
    return train.parse_args(argv[3:])


@pytest.mark.parametrize("script_path", sorted(glob.glob(os.path.join(REPO, "training", "dapo_qwen2.5-*.sh"))))
def test_training_scripts(script_path, tmp_path):
    script, config = parse_script(script_path, tmp_path)
    name = os.path.basename(script_path)
    nvfp4 = "_nvfp4_" in name
    assert config.learning_rate == (1e-5 if nvfp4 else 5e-6)
    assert config.aqn is nvfp4 and script.dataset == "gsm8k" and config.max_prompt_length == 256
    batch = 8 if name.startswith("dapo_qwen2.5-32b_nvfp4") else 2
    assert config.per_device_train_batch_size == config.num_generations == batch
    assert (config.beta, config.epsilon_high, config.adam_beta2, config.weight_decay) == (0.0, 0.28, 0.99, 0.1)
    assert (config.seed, config.max_completion_length, config.resume_from_checkpoint) == (2025, 2048, "true")
    assert config.compile_layers and config.unpadded_forward and not config.aqn_log_shift


def test_llama_recipe_is_the_references_batch(tmp_path):
    """training/llama3.1_8b_nemotron.sh: the reference's Llama-3.1-8B settings (batch 4 x accumulation 16, its
    bnpo loss, lr 1e-5, gsm8k 256/2048) on top of the shared DAPO + AQN parts."""
    script, config = parse_script(os.path.join(REPO, "training", "llama3.1_8b_nemotron.sh"), tmp_path)
    batch = (config.per_device_train_batch_size, config.num_generations, config.gradient_accumulation_steps)
    assert batch == (4, 4, 16)
    assert (config.loss_type, config.beta, config.epsilon_high, config.learning_rate) == ("bnpo", 0.0, 0.28, 1e-5)
    assert config.aqn and (config.lora_rank, config.lora_alpha, config.trainable_norms) == (16, 16, True)
    assert (script.dataset, config.max_prompt_length, config.max_completion_length) == ("gsm8k", 256, 2048)


def test_help_is_short_shows_defaults_and_says_what_flags_do(capsys):
    with pytest.raises(SystemExit, match="0"):
        train.parse_args(["--help"])
    text = capsys.readouterr().out
    assert len(text.splitlines()) < 85
    for flag in (
        "--config",
        "--model-name",
        "--dataset",
        "--max-completion-length",
        "--lora-rank",
        "--sigma-start",
        "--rollout-backend",
        "--output-dir",
        "--resume-from-checkpoint",
        "--help-all",
    ):
        assert flag in text
    assert "(default: 16)" in text  # LoRA rank
    parser = train.build_parser()
    no_metrics = next(a for a in parser._actions if "--no_metrics_jsonl" in a.option_strings)
    assert no_metrics.help == "Turn --metrics-jsonl off."
    with pytest.raises(SystemExit, match="0"):  # argparse %-formats every help text: a bare "%" broke it once
        train.parse_args(["--help-all"])
    assert "--rollout_kv_cache_gib" in capsys.readouterr().out
    for main in (quantize.main, gsm8k.main):
        with pytest.raises(SystemExit, match="0"):
            main(["--help"])
        assert "(default: bfloat16)" in capsys.readouterr().out or main is gsm8k.main


# The flag table: `--help` and the flags' checks read qerl/train_flags.json instead of importing TRL and torch.


def test_the_flag_table_describes_trls_parser_as_it_is():
    written = json.loads(recipes.FLAG_TABLE.read_text())
    assert written["made_with"] == {name: version(name) for name in recipes.MADE_WITH}, REWRITE
    assert written["flags"] == train.flag_table(), REWRITE


REWRITE = 'qerl/train_flags.json is stale: python -c "from qerl import train; train.write_flag_table()"'


def trl_parser():
    from trl import TrlParser

    from qerl.config import QeRLConfig

    return TrlParser((train.QeRLScriptArguments, QeRLConfig))


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["--aqn", "true", "--use-cpu", "--no-metrics-jsonl", "--ln", "--bf16", "no", "--max-prompt-length", "none"],
        ["--lora-target-modules", "q_proj", "v_proj", "--random-state", "3", "--warmup-ratio", "0.1", "--beta=-0"],
        ["--learning-rate", "3e-5", "--report-to", "none", "--lr-scheduler-type", "cosine", "--optim", "adamw_torch"],
    ],
)
def test_the_table_parses_as_trls_parser(argv):
    recipe = recipes.load_recipe(os.path.join(REPO, "configs", "dapo_gsm8k_nvfp4.yaml"), train.build_parser())
    del recipe["env"]
    for settings in ({}, recipe):
        ours, trls = train.build_parser(), trl_parser()
        ours.set_defaults_with_config(**settings)
        trls.set_defaults_with_config(**settings)
        assert vars(ours.parse_args(argv)) == vars(trls.parse_args(argv))


def test_the_helps_defaults_are_the_configs(capsys):
    """Each flag's default is its field's, and the short --help shows it (where the field's is None, it says what
    that means; those claims that a config can show are checked)."""
    from qerl.config import QeRLConfig

    defaults = {
        f.name: f.default if f.default_factory is MISSING else f.default_factory()
        for dataclass in (train.QeRLScriptArguments, QeRLConfig)
        for f in fields(dataclass)
        if f.init and f.name != "debug"  # TRL's parser gives this list-or-str field no default; run_cli takes --debug
    }
    actions = {action.dest: action for action in reversed(train.build_parser()._actions)}  # --X before --no_X
    assert {dest: actions[dest].default for dest in defaults} == defaults
    with pytest.raises(SystemExit, match="0"):
        train.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    for dest in (dest for group in recipes.QUICK_HELP.values() for dest in group):
        if defaults[dest] is not None and dest not in recipes.QUICK_HELP_TEXT:
            assert f"(default: {defaults[dest]})" in text, dest
    config = QeRLConfig(use_cpu=True, per_device_train_batch_size=2, num_generations=2)
    assert (
        "(default: trainer_output)" in recipes.QUICK_HELP_TEXT["output_dir"] and config.output_dir == "trainer_output"
    )
    assert "(default: on unless --fp16)" in recipes.QUICK_HELP_TEXT["bf16"] and config.bf16 and not config.fp16
    assert "(recipes: 5e-06, 1e-05" in text  # --learning-rate: what the recipes set beside TRL's 1e-06


@pytest.mark.parametrize(("train_gpus", "engine"), [("0", None), ("0,3", "vllm")])
def test_the_rollout_servers_script_starts_a_server_per_gpu_and_points_the_run_at_them(train_gpus, engine, tmp_path):
    """training/dapo_rollout_servers.sh (issue 51): one server per rollout GPU, each with its own port and seed, on
    the native engine unless ENGINE says vllm (then with vLLM's memory share), parsed by the server's own parser; the
    run (one process, or accelerate's DDP over several) on the recipe, with every server's address."""
    from qerl import rollout_server

    env = dict(os.environ, DRY_RUN="1", MODEL_PATH="/models/x", CKPTS_DIR=str(tmp_path), ROLLOUT_GPUS="1,2",
               TRAIN_GPUS=train_gpus, PORT="8100", PYTHON="python")  # fmt: skip
    if engine:
        env["ENGINE"] = engine
    script = os.path.join(REPO, "training", "dapo_rollout_servers.sh")
    out = subprocess.run(["bash", script, "--use-cpu", "True"], env=env, check=True, capture_output=True, text=True)
    *server_lines, train_line = [shlex.split(line) for line in out.stdout.splitlines()]
    servers = []
    for gpu, argv in zip(("1", "2"), server_lines, strict=True):
        assert argv[:4] == ["env", f"CUDA_VISIBLE_DEVICES={gpu}", "python", "-m"] and argv[4] == "qerl.rollout_server"
        servers.append(rollout_server.parse_args(argv[5:]))
    expected = [("/models/x", 8100, 1, 16), ("/models/x", 8101, 2, 16)]  # own ports and seeds, the recipes' rank
    assert [(s.model, s.port, s.seed, s.lora_rank) for s in servers] == expected
    memory = 0.85 if engine == "vllm" else None
    assert [(s.engine, s.gpu_memory_utilization) for s in servers] == [(engine or "native", memory)] * 2
    assert train_line[1] == f"CUDA_VISIBLE_DEVICES={train_gpus}"
    module = train_line.index("qerl.train")
    if "," in train_gpus:
        assert train_line[2:module - 1] == ["accelerate", "launch", "--config_file", "configs/accelerate/ddp.yaml",
                                            "--num_processes", "2"]  # fmt: skip
    os.chdir(REPO)  # the recipe path in the command is relative to the checkout
    _, config = train.parse_args(train_line[module + 1 :])
    assert config.rollout_backend == "server" and config.output_dir == str(tmp_path)
    assert config.rollout_servers == ["http://127.0.0.1:8100", "http://127.0.0.1:8101"]
    assert config.aqn and config.lora_rank == 16  # the NVFP4 recipe's
