"""Bad input to the three CLIs (qerl.quantize, qerl.train, eval.gsm8k / eval.math): one line naming the culprit,
exit code 2, no traceback, found before anything loads, and the disk left as it was.

A few trials run each CLI as a real process (the wiring: exit code, stderr); the many others call the same entry
point, `qerl.cli.run_cli(main)`, in this process, which is what the process runs after its imports.
"""

import dataclasses
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import types
import typing
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from clis import QUANTIZER, REPO, snapshot
from safetensors.torch import load_file, save_file

from benchmarks.launch import child_env
from eval import cli as eval_cli
from eval import competition_math, gsm8k
from eval.statistics import wilson_interval
from qerl import cli, field_rules, quantize, train
from qerl.config import QeRLConfig
from qerl.errors import UsageError, nearest, one_line
from qerl.input_checks import FETCH_COMMAND
from qerl.run_dir import RunLock
from qerl.sniff import looks_like_path
from qerl.tiny import build_tiny, build_tiny_tokenizer, save_tiny_checkpoints

MAINS = {
    "qerl.quantize": quantize.main,
    "qerl.train": lambda argv: train.main(argv) and 0,
    "eval.gsm8k": gsm8k.main,
    "eval.competition_math": competition_math.main,
}


def assert_one_line_error(code: int, stderr: str, prog: str, *culprit: str) -> str:
    errors = [line for line in stderr.splitlines() if line.startswith(f"{prog}: error: ")]
    assert code == 2, stderr
    assert "Traceback" not in stderr
    assert len(errors) == 1, stderr
    for fragment in culprit:
        assert fragment in errors[0], errors[0]
    return errors[0]


def run_process(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=cwd, env=child_env(), capture_output=True, text=True)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A folder as a user has it: a BF16 model, its NVFP4 twin, an unrelated file, data files good and bad."""
    root = tmp_path_factory.mktemp("world")
    save_tiny_checkpoints(str(root / "ck"))
    (root / "notes.txt").write_text("an unrelated file\n")
    (root / "parent").mkdir()
    shutil.copytree(root / "ck" / "bf16", root / "parent" / "model")
    (root / "good.jsonl").write_text(json.dumps({"question": "What is 2 plus 2?", "answer": "2+2=4\n#### 4"}) + "\n")
    (root / "broken.jsonl").write_text('{"question": "q", "answer": "#### 1"}\n{"question": "q2", answer: 2}\n')
    (root / "nocolumn.jsonl").write_text(json.dumps({"question": "q", "solution": "1"}) + "\n")
    (root / "math.jsonl").write_text(json.dumps({"problem": "What is $1+1$?", "answer": "2"}) + "\n")
    (root / "typo.yaml").write_text("dataset: arithmetic\nsigma_strat: 0.1\n")
    (root / "extends_typo.yaml").write_text("base: typo.yaml\n")
    (root / "extends_missing.yaml").write_text("base: [nope.yaml]\n")
    (root / "loop.yaml").write_text("base: extends_loop.yaml\n")
    (root / "extends_loop.yaml").write_text("base: [loop.yaml]\n")
    (root / "truncated").mkdir()
    for name in ("config.json", "generation_config.json"):
        (root / "truncated" / name).write_bytes((root / "ck" / "bf16" / name).read_bytes())
    (root / "truncated" / "model.safetensors").write_bytes(
        (root / "ck" / "bf16" / "model.safetensors").read_bytes()[:5000]
    )
    (root / "nan").mkdir()
    for p in (root / "ck" / "bf16").iterdir():
        (root / "nan" / p.name).write_bytes(p.read_bytes())
    weights = load_file(root / "nan" / "model.safetensors")
    weights["model.norm.weight"][3] = float("inf")  # not a quantized weight: a tensor copied as is
    save_file(weights, root / "nan" / "model.safetensors", metadata={"format": "pt"})
    (root / "no_adapter").mkdir()
    (root / "run" / "checkpoint-2").mkdir(parents=True)
    (root / "run" / "checkpoint-2" / "trainer_state.json").write_text(json.dumps({"global_step": 2}))
    (root / "run" / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 0.1}) + "\n")
    (root / "zero.yaml").write_text("dataset: arithmetic\nnum_generations: 0\n")
    # Foreign inputs: GGUF weights, architectures that are no causal LM, adapters of another base or rank.
    (root / "model.gguf").write_bytes(b"GGUF" + bytes(60))
    (root / "gguf_folder").mkdir()
    (root / "gguf_folder" / "SmolLM2-135M-Instruct.Q4_1.gguf").write_bytes(b"GGUF" + bytes(60))
    for name, config in (
        ("t5", {"model_type": "t5", "architectures": ["T5ForConditionalGeneration"]}),
        ("alien", {"model_type": "alien_lm", "architectures": ["AlienForCausalLM"]}),
    ):
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps(config))
    save_lora(build_tiny(hidden_size=32, intermediate_size=64, num_heads=2, num_kv_heads=1)[0], root / "other_base")
    save_lora(build_tiny()[0], root / "run_r4" / "checkpoint-1")
    shutil.copytree(root / "ck" / "nvfp4", root / "eos_elsewhere")  # its configs end turns at <|system|> (id 3)
    for name in ("config.json", "generation_config.json"):
        config = json.loads((root / "eos_elsewhere" / name).read_text())
        (root / "eos_elsewhere" / name).write_text(json.dumps({**config, "eos_token_id": 3}))
    (root / "run_r4" / "checkpoint-1" / "trainer_state.json").write_text(json.dumps({"global_step": 1}))
    return root


def save_lora(model, folder: Path, rank: int = 4) -> None:
    """A LoRA adapter of `model` as peft saves it."""
    from peft import LoraConfig, get_peft_model

    get_peft_model(model, LoraConfig(r=rank, target_modules=list(field_rules.LORA_TARGETS))).save_pretrained(folder)


Q = ["--model", "ck/bf16", "--output", "out"]
T = ["--model-name", "ck/nvfp4", "--output-dir", "fresh", "--use-cpu", "True", "--dataset", "arithmetic"]
E = ["--model", "ck/nvfp4", "--data", "good.jsonl", "--device", "cpu"]

TRIALS = [
    # prog, argv, fragment(s) of the one line
    ("qerl.quantize", ["--model", "ck/bf16", "--output", "ck/bf16", "--overwrite"], "holds the input model"),
    ("qerl.quantize", ["--model", "parent/model", "--output", "parent", "--overwrite"], "holds the input model"),
    ("qerl.quantize", ["--model", "ck/bf16", "--output", ".", "--overwrite"], "holds the input model"),
    ("qerl.quantize", ["--model", "ck/bf16", "--output", "notes.txt", "--overwrite"], "notes.txt: is a file"),
    ("qerl.quantize", ["--model", "ck/bf16", "--output", "parent", "--overwrite"], "not a checkpoint this tool wrote"),
    ("qerl.quantize", ["--model", "ck/bf16", "--output", "ck/nvfp4"], "pass --overwrite"),
    ("qerl.quantize", ["--model", "./ck/nope", "--output", "out"], "./ck/nope: no such folder"),
    ("qerl.quantize", ["--model", "ck/nope", "--output", "out"], "ck/nope: no such folder"),
    ("qerl.quantize", ["--model", "notes.txt", "--output", "out"], "notes.txt: is a file"),
    ("qerl.quantize", ["--model", "truncated", "--output", "out"], "model.safetensors: truncated or corrupt"),
    ("qerl.quantize", ["--model", "nan", "--output", "out"], "model.norm.weight contains NaN or Inf"),
    ("qerl.quantize", ["--model", "ck/nvfp4", "--output", "out"], "already quantized"),
    ("qerl.quantize", [*Q, "--device", "gpu0"], "--device 'gpu0': not a device name"),
    ("qerl.quantize", [*Q, "--device", "cuda:7"], "--device 'cuda:7'"),
    ("qerl.quantize", [*Q, "--overwite"], "unknown flag --overwite (did you mean --overwrite?)"),
    ("qerl.quantize", [*Q, "--max-shard-gb", "-1"], "--max-shard-gb: must be a number > 0, got -1"),
    ("qerl.quantize", ["--model", "model.gguf", "--output", "out"], "model.gguf is a GGUF file", FETCH_COMMAND),
    ("qerl.quantize", ["--model", "t5", "--output", "out"], "T5ForConditionalGeneration (model_type 't5') is not a"),
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
    ("eval.gsm8k", [*E, "--limit", "0"], "--limit: must be an integer >= 1, got 0"),
    ("eval.gsm8k", [*E, "--limit", "-3"], "--limit: must be an integer >= 1, got -3"),
    ("eval.gsm8k", [*E, "--adapter", "no_adapter"], "no_adapter: no adapter_config.json"),
    ("eval.gsm8k", [*E, "--adapter", "nope"], "--adapter nope: no such folder"),
    (
        "eval.gsm8k",
        [*E, "--adapter", "other_base"],
        "--adapter other_base does not fit --model ck/nvfp4: "
        "model.layers.0.mlp.down_proj is [64, 128] (out, in) in the model, [32, 64] in the adapter",
    ),
    ("eval.gsm8k", [*E, "--model", "gguf_folder"], "SmolLM2-135M-Instruct.Q4_1.gguf is a GGUF file"),
    ("eval.gsm8k", [*E, "--seed", "-1"], "--seed: must be an integer in [0, 4294967295], got -1"),
    ("eval.gsm8k", [*E, "--batch-size", "0"], "--batch-size: must be an integer >= 1, got 0"),
    ("eval.gsm8k", [*E, "--data", "gsm9k"], "--data gsm9k: unknown dataset (did you mean gsm8k?)"),
    ("eval.gsm8k", [*E, "--data", "missing.jsonl"], "--data missing.jsonl: no such file"),
    ("eval.gsm8k", [*E, "--data", "broken.jsonl"], "broken.jsonl, line 2: not JSON"),
    ("eval.gsm8k", [*E, "--data", "nocolumn.jsonl"], "column(s) answer"),
    ("eval.gsm8k", [*E, "--device", "cuda:3"], "--device 'cuda:3'"),
    ("eval.gsm8k", [*E, "--device", "tpu-ish"], "not a device name"),
    ("eval.gsm8k", [*E, "--model", "./nope"], "--model ./nope: no such folder"),
    ("eval.gsm8k", [*E, "--model", "truncated"], "truncated or corrupt"),
    ("eval.gsm8k", [*E, "--load", "bf16"], "is an NVFP4 checkpoint"),
    ("eval.gsm8k", [*E, "--protocol", "greedyy"], "invalid choice: 'greedyy'"),
    ("eval.gsm8k", [*E, "--out", "ck"], "--out ck: is a folder"),
    ("eval.gsm8k", [*E, "--modle", "x"], "unknown flag --modle (did you mean --model?)"),
    ("eval.competition_math", [*E[:2], "--data", "nocolumn.jsonl"], "column(s) answer"),
    ("eval.competition_math", [*E[:2], "--data", "math501"], "--data math501: unknown dataset (did you mean math500?)"),
]


@pytest.mark.parametrize("trial", TRIALS, ids=[f"{t[0]}:{' '.join(t[1][-2:])}" for t in TRIALS])
def test_bad_input_is_one_line_and_changes_nothing(world, monkeypatch, capsys, trial):
    prog, argv, *culprit = trial
    monkeypatch.chdir(world)
    monkeypatch.delenv(cli.DEBUG_ENV, raising=False)
    before = snapshot(world)
    code = cli.run_cli(MAINS[prog], prog, argv)
    assert_one_line_error(code, capsys.readouterr().err, prog, *culprit)
    assert snapshot(world) == before


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


def test_each_cli_as_a_process(world, tmp_path):
    """Trials through real processes, each class of bad input at least once: exit code 2, one line naming the
    culprit, no traceback, nothing touched; and a tokenizer whose EOS the generation config lacks, which an eval
    runs with, warning. The processes run side by side (most of their time is imports)."""
    lock = RunLock(world / "busy")  # another run, in progress: this process
    lock.acquire()
    before = snapshot(world)
    trials = [
        (["-m", "qerl.quantize", "--model", "parent/model", "--output", "parent", "--overwrite"], "qerl.quantize",
         "parent"),
        (["-m", "qerl.quantize", "--model", "truncated", "--output", "out"], "qerl.quantize",
         "truncated/model.safetensors"),
        ([str(QUANTIZER), "--model", "t5", "--output", "out"], "quantize_nvfp4", "T5ForConditionalGeneration"),
        (["-m", "qerl.train", *T, "--sigma-strat", "1"], "qerl.train", "did you mean --sigma-start?"),
        (["-m", "qerl.train", *T, "--output-dir", "run"], "qerl.train", "--resume-from-checkpoint true"),
        (["-m", "qerl.train", *T, "--num-generations", "0"], "qerl.train", "--num-generations must be an integer >= 2"),
        (["-m", "qerl.train", *T, "--model-name", "model.gguf"], "qerl.train", "GGUF", FETCH_COMMAND),
        (["-m", "qerl.train", *T, "--output-dir", "busy"], "qerl.train",
         f"--output-dir busy is in use by another run (process {os.getpid()} on {socket.gethostname()}"),
        (["-m", "eval.gsm8k", *E, "--adapter", "no_adapter"], "eval.gsm8k", "adapter_config.json"),
        (["-m", "eval.gsm8k", *E, "--adapter", "other_base"], "eval.gsm8k", "down_proj is [64, 128] (out, in)"),
        (["-m", "eval.competition_math", *E[:2], "--limit", "0"], "eval.competition_math", "--limit"),
    ]  # fmt: skip
    warned = ["-m", "eval.gsm8k", "--model", "eos_elsewhere", "--data", "arithmetic", "--limit", "1", "--protocol",
              "greedy", "--max-new-tokens", "1", "--device", "cpu", "--out", str(tmp_path / "eos.jsonl")]  # fmt: skip
    try:
        with ThreadPoolExecutor(os.cpu_count() or 2) as pool:
            *results, eos = pool.map(lambda args: run_process(args, world), [t[0] for t in trials] + [warned])
        for (_, prog, *culprit), result in zip(trials, results, strict=True):
            assert_one_line_error(result.returncode, result.stderr, prog, *culprit)
        assert snapshot(world) == before
    finally:
        lock.release()
    assert eos.returncode == 0, eos.stderr
    assert (
        "the tokenizer's EOS '<|end|>' (id 2) is not among the generation config's EOS ids: '<|system|>' (id 3)"
        in eos.stderr
    )


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


def numeric_fields(cls) -> list[str]:
    """The dataclass fields that hold a number (int or float, alone or in a union such as `int | None`)."""
    hints = typing.get_type_hints(cls)
    return [
        f.name
        for f in dataclasses.fields(cls)
        if {int, float}
        & set(typing.get_args(hints[f.name]) if isinstance(hints[f.name], types.UnionType) else (hints[f.name],))
    ]


NUMERIC_FLAGS = {  # the numeric flags of eval and the quantizer: parser -> argv that is valid but for the flag
    "eval.gsm8k": (eval_cli.build_parser(gsm8k.BENCHMARK, ""), ["--model", "m"]),
    "qerl.quantize": (quantize.build_parser(), ["--model", "m", "--output", "o"]),
}


def test_every_numeric_setting_has_a_range():
    """A numeric field of the training configs (ours, TRL's, transformers') or a numeric flag of eval and the quantizer
    without a range fails here: the table is the one place where the checks come from."""
    fields = numeric_fields(train.QeRLScriptArguments) + numeric_fields(QeRLConfig)
    assert len(fields) > 70 and sorted(fields) == sorted(field_rules.RANGES)  # stale entries too (a field TRL dropped)
    for parser, _ in NUMERIC_FLAGS.values():
        for action in parser._actions:
            assert action.type not in (int, float), f"{action.option_strings}: give it a cli.Range type"


@pytest.mark.parametrize("name", sorted(field_rules.RANGES))
def test_zero_and_minus_one_in_every_training_setting(tmp_path, name):
    """0 and -1 in each numeric field: refused in one line naming the flag where its range says so, and otherwise
    accepted all the way through TRL's and transformers' own config checks."""
    rule, flag = field_rules.RANGES[name], f"--{name.replace('_', '-')}"
    for value in (0, -1):
        argv = ["--model-name", "m", "--output-dir", str(tmp_path), "--use-cpu", "True", flag, str(value)]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # ignored reference flags say so
            if rule is not None and rule.problem(value):
                with pytest.raises(UsageError) as refused:
                    train.parse_args(argv)
                assert one_line(refused.value) == f"{flag} must be {rule.describe()}, got {value}"
            else:
                train.parse_args(argv)


@pytest.mark.parametrize(
    "prog, flag",
    [
        (prog, a.option_strings[0])
        for prog, (parser, _) in NUMERIC_FLAGS.items()
        for a in parser._actions
        if isinstance(a.type, cli.Range)
    ],
)
def test_zero_and_minus_one_in_every_numeric_flag(prog, flag):
    parser, argv = NUMERIC_FLAGS[prog]
    rule = next(a.type for a in parser._actions if flag in a.option_strings)
    for value in (0, -1):
        if rule.problem(value):
            with pytest.raises(UsageError, match=re.escape(f"argument {flag}: must be {rule.describe()}")):
                parser.parse_args([*argv, flag, str(value)])
        else:
            assert getattr(parser.parse_args([*argv, flag, str(value)]), flag[2:].replace("-", "_")) == value


def test_debug_shows_the_traceback_and_program_errors_keep_theirs(world, monkeypatch, capsys):
    monkeypatch.chdir(world)
    with pytest.raises(UsageError, match="no such folder"):
        cli.run_cli(gsm8k.main, "eval.gsm8k", ["--model", "./nope", "--debug"])
    monkeypatch.setenv(cli.DEBUG_ENV, "1")
    with pytest.raises(UsageError, match="no such folder"):
        cli.run_cli(gsm8k.main, "eval.gsm8k", ["--model", "./nope"])

    def buggy(argv):
        raise KeyError("a bug, not a user error")

    with pytest.raises(KeyError):
        cli.run_cli(buggy, "x", [])


def test_overwrite_replaces_only_its_own_checkpoint_and_cleans_stale_work_folders(world, tmp_path, caplog):
    """A killed run's hidden work folder goes (its process is gone), with a line saying so; --overwrite replaces a
    checkpoint the tool wrote, and the source and its neighbours stay."""
    src = world / "ck" / "bf16"
    out = tmp_path / "out"
    dead = 2**31 - 1  # no such process
    stale = tmp_path / f".out.partial-{dead}"
    stale.mkdir()
    (stale / "half.safetensors").write_bytes(b"x" * 1000)
    live = tmp_path / f".out.partial-{os.getppid()}"  # a running process's work folder stays
    live.mkdir()
    source_before = snapshot(src)
    for overwrite in ([], ["--overwrite"]):
        code = cli.run_cli(quantize.main, "qerl.quantize", ["--model", str(src), "--output", str(out), *overwrite])
        assert code == 0
    assert any(f"removed {stale}" in r.getMessage() and "did not finish" in r.getMessage() for r in caplog.records)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["out", live.name])
    assert snapshot(src) == source_before
    assert (out / "generation_config.json").is_file() and (out / "tokenizer.json").is_file()


def test_help_is_short_shows_defaults_and_says_what_flags_do(capsys):
    with pytest.raises(SystemExit, match="0"):
        train.parse_args(["--help"])
    text = capsys.readouterr().out
    assert len(text.splitlines()) < 80
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
    parser = train._parser()
    no_metrics = next(a for a in parser._actions if "--no_metrics_jsonl" in a.option_strings)
    assert no_metrics.help == "Turn --metrics-jsonl off."
    with pytest.raises(SystemExit, match="0"):  # argparse %-formats every help text: a bare "%" broke it once
        train.parse_args(["--help-all"])
    assert "--rollout_kv_cache_gib" in capsys.readouterr().out
    for main in (quantize.main, gsm8k.main):
        with pytest.raises(SystemExit, match="0"):
            main(["--help"])
        assert "(default: bfloat16)" in capsys.readouterr().out or main is gsm8k.main


def test_setup_stamp_lives_in_the_environment():
    """A second environment must not inherit a checkout's "installed" stamp."""
    import sysconfig

    result = subprocess.run(
        ["make", "-np", f"PYTHON={sys.executable}", "setup"], cwd=REPO, capture_output=True, text=True
    )
    stamp = next(line.split(":=", 1)[1].strip() for line in result.stdout.splitlines() if line.startswith("STAMP :="))
    assert Path(stamp).parent == Path(sysconfig.get_path("purelib"))
    assert not stamp.startswith(str(REPO))
    setup = (REPO / "setup_env.sh").read_text()
    assert "https://download.pytorch.org/whl/cpu" in setup and "CUDA" in setup


def test_cli_helpers():
    assert cli.attach_negative_numbers(["--lr", "-1e-5", "--x", "-y"]) == ["--lr=-1e-5", "--x", "-y"]
    assert looks_like_path("./model") and looks_like_path("/abs/model") and looks_like_path("a/b/c")
    assert not looks_like_path("Qwen/Qwen2.5-7B-Instruct") and not looks_like_path("gpt2")
    assert nearest("--lora-rnak", ["--lora-rank", "--lora-alpha"]) == " (did you mean --lora-rank?)"
    low, high = wilson_interval(0, 10)
    assert low == 0.0 and 0.27 < high < 0.29  # the rule of three, roughly
    assert torch.tensor(1.0)  # torch stays importable next to the CLI helpers
