"""Bad input to the three CLIs (quantize_nvfp4.py, qerl.train, eval.gsm8k / eval.math): one line naming the culprit,
exit code 2, no traceback, found before anything loads, and the disk left as it was.

A few trials run each CLI as a real process (the wiring: exit code, stderr); the many others call the same entry
point, `qerl.cli.run_cli(main)`, in this process, which is what the process runs after its imports.
"""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from eval import gsm8k
from eval import math as eval_math
from qerl import cli, train
from qerl.tiny import save_tiny_checkpoints

REPO = Path(__file__).resolve().parents[1]
QUANTIZER = REPO / "llm-compressor" / "quantize_nvfp4.py"


def _load_quantizer():
    spec = importlib.util.spec_from_file_location("quantize_nvfp4", QUANTIZER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


quantize_nvfp4 = _load_quantizer()
MAINS = {
    "quantize_nvfp4": quantize_nvfp4.main,
    "qerl.train": lambda argv: train.main(argv) and 0,
    "eval.gsm8k": gsm8k.main,
    "eval.math": eval_math.main,
}


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """Every file and folder under root (hidden ones too) with its size and modification time."""
    return {
        str(p.relative_to(root)): (p.stat().st_size if p.is_file() else -1, p.stat().st_mtime_ns)
        for p in sorted(root.rglob("*"))
    }


def assert_one_line_error(code: int, stderr: str, prog: str, *culprit: str) -> str:
    errors = [line for line in stderr.splitlines() if line.startswith(f"{prog}: error: ")]
    assert code == 2, stderr
    assert "Traceback" not in stderr
    assert len(errors) == 1, stderr
    for fragment in culprit:
        assert fragment in errors[0], errors[0]
    return errors[0]


def run_process(args: list[str], cwd: Path, **env) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if k != cli.DEBUG_ENV}
    environment.update(PYTHONPATH=str(REPO), **env)
    return subprocess.run([sys.executable, *args], cwd=cwd, env=environment, capture_output=True, text=True)


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
    return root


Q = ["--model", "ck/bf16", "--output", "out"]
T = ["--model-name", "ck/nvfp4", "--output-dir", "fresh", "--use-cpu", "True", "--dataset", "arithmetic"]
E = ["--model", "ck/nvfp4", "--data", "good.jsonl", "--device", "cpu"]

TRIALS = [
    # prog, argv, fragments of the one line
    ("quantize_nvfp4", ["--model", "ck/bf16", "--output", "ck/bf16", "--overwrite"], "holds the input model"),
    ("quantize_nvfp4", ["--model", "parent/model", "--output", "parent", "--overwrite"], "holds the input model"),
    ("quantize_nvfp4", ["--model", "ck/bf16", "--output", ".", "--overwrite"], "holds the input model"),
    ("quantize_nvfp4", ["--model", "ck/bf16", "--output", "notes.txt", "--overwrite"], "notes.txt: is a file"),
    ("quantize_nvfp4", ["--model", "ck/bf16", "--output", "parent", "--overwrite"], "not a checkpoint this tool wrote"),
    ("quantize_nvfp4", ["--model", "ck/bf16", "--output", "ck/nvfp4"], "pass --overwrite"),
    ("quantize_nvfp4", ["--model", "./ck/nope", "--output", "out"], "./ck/nope: no such folder"),
    ("quantize_nvfp4", ["--model", "ck/nope", "--output", "out"], "ck/nope: no such folder"),
    ("quantize_nvfp4", ["--model", "notes.txt", "--output", "out"], "notes.txt: is a file"),
    ("quantize_nvfp4", ["--model", "truncated", "--output", "out"], "model.safetensors: truncated or corrupt"),
    ("quantize_nvfp4", ["--model", "nan", "--output", "out"], "model.norm.weight contains NaN or Inf"),
    ("quantize_nvfp4", ["--model", "ck/nvfp4", "--output", "out"], "already quantized"),
    ("quantize_nvfp4", [*Q, "--device", "gpu0"], "--device 'gpu0': not a device name"),
    ("quantize_nvfp4", [*Q, "--device", "cuda:7"], "--device 'cuda:7'"),
    ("quantize_nvfp4", [*Q, "--overwite"], "unknown flag --overwite (did you mean --overwrite?)"),
    ("quantize_nvfp4", [*Q, "--max-shard-gb", "-1"], "--max-shard-gb: expected a positive number"),
    ("qerl.train", ["--output-dir", "fresh", "--use-cpu", "True"], "--model-name is required"),
    ("qerl.train", [*T, "--model-name", "./nope"], "--model-name ./nope: no such folder"),
    ("qerl.train", [*T, "--dataset", "gsm9k"], "--dataset gsm9k: unknown dataset (did you mean gsm8k?)"),
    ("qerl.train", [*T, "--dataset", "data/train.jsonl"], "--dataset data/train.jsonl: no such file"),
    ("qerl.train", [*T, "--dataset", "broken.jsonl"], "broken.jsonl, line 2: not JSON"),
    ("qerl.train", [*T, "--dataset", "nocolumn.jsonl", "--dataset-format", "gsm8k"], "column(s) answer"),
    ("qerl.train", [*T, "--dataset", "nocolumn.jsonl"], "cannot tell the dataset format"),
    ("qerl.train", [*T, "--learning-rate", "-1e-5"], "--learning-rate must not be negative"),
    ("qerl.train", [*T, "--sigma-start", "-0.1"], "sigma_start=-0.1"),
    ("qerl.train", [*T, "--aqn", "false", "--sigma-end", "-1"], "--sigma-end must not be negative"),
    ("qerl.train", [*T, "--num-examples", "0"], "--num-examples must be a positive integer"),
    ("qerl.train", [*T, "--sigma-strat", "0.1"], "unknown flag --sigma-strat (did you mean --sigma-start?)"),
    ("qerl.train", [*T, "--config", "typo.yaml"], "typo.yaml: unknown key 'sigma_strat' (did you mean sigma_start?)"),
    ("qerl.train", [*T, "--config", "nope.yaml"], "--config nope.yaml: no such file"),
    ("qerl.train", [*T, "--config", "extends_typo.yaml"], "extends_typo.yaml: base typo.yaml: unknown key"),
    ("qerl.train", [*T, "--config", "extends_missing.yaml"], "extends_missing.yaml: base nope.yaml: no such file"),
    ("qerl.train", [*T, "--config", "loop.yaml"], "base loop.yaml extends itself"),
    ("qerl.train", [*T, "--max-steps", "abc"], "invalid int value: 'abc'"),
    ("qerl.train", [*T, "--num-generations", "3"], "num_generations to a divisor of 8"),
    ("qerl.train", [*T, "--precision", "bf16"], "is an NVFP4 checkpoint"),
    ("qerl.train", [*T, "--model-name", "truncated"], "truncated or corrupt"),
    ("qerl.train", [*T, "--output-dir", "run"], "holds an earlier run (checkpoint-2)"),
    ("qerl.train", [*T, "--resume-from-checkpoint", "fresh/checkpoint-9"], "no such checkpoint folder"),
    ("eval.gsm8k", [*E, "--limit", "0"], "--limit: expected a positive integer, got 0"),
    ("eval.gsm8k", [*E, "--limit", "-3"], "--limit: expected a positive integer, got -3"),
    ("eval.gsm8k", [*E, "--adapter", "no_adapter"], "no_adapter: no adapter_config.json"),
    ("eval.gsm8k", [*E, "--adapter", "nope"], "--adapter nope: no such folder"),
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
    ("eval.math", [*E[:2], "--data", "nocolumn.jsonl"], "column(s) answer"),
    ("eval.math", [*E[:2], "--data", "math501"], "--data math501: unknown dataset (did you mean math500?)"),
]


@pytest.mark.parametrize("prog, argv, culprit", TRIALS, ids=[f"{t[0]}:{' '.join(t[1][-2:])}" for t in TRIALS])
def test_bad_input_is_one_line_and_changes_nothing(world, monkeypatch, capsys, prog, argv, culprit):
    monkeypatch.chdir(world)
    monkeypatch.delenv(cli.DEBUG_ENV, raising=False)
    before = snapshot(world)
    code = cli.run_cli(MAINS[prog], prog, argv)
    assert_one_line_error(code, capsys.readouterr().err, prog, culprit)
    assert snapshot(world) == before


@pytest.mark.parametrize("env, argv, culprit", [
    ({"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "1"}, [], "FSDP version 1 is not supported"),
    ({"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3"},
     ["--ds3-gather-for-generation", "false"], "ds3_gather_for_generation false is not supported"),
], ids=["fsdp1", "zero3-without-gather"])  # fmt: skip
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


def test_each_cli_as_a_process(world):
    """The same trials through real processes: exit code 2, one line, no traceback, nothing touched."""
    before = snapshot(world)
    trials = [
        ([str(QUANTIZER), "--model", "parent/model", "--output", "parent", "--overwrite"], "quantize_nvfp4", "parent"),
        ([str(QUANTIZER), "--model", "truncated", "--output", "out"], "quantize_nvfp4", "truncated/model.safetensors"),
        (["-m", "qerl.train", *T, "--sigma-strat", "1"], "qerl.train", "did you mean --sigma-start?"),
        (["-m", "qerl.train", *T, "--output-dir", "run"], "qerl.train", "--resume-from-checkpoint true"),
        (["-m", "eval.gsm8k", *E, "--adapter", "no_adapter"], "eval.gsm8k", "adapter_config.json"),
        (["-m", "eval.math", *E[:2], "--limit", "0"], "eval.math", "--limit"),
    ]
    for args, prog, culprit in trials:
        result = run_process(args, world)
        assert_one_line_error(result.returncode, result.stderr, prog, culprit)
    assert snapshot(world) == before


def test_debug_shows_the_traceback_and_program_errors_keep_theirs(world, monkeypatch, capsys):
    monkeypatch.chdir(world)
    with pytest.raises(cli.UsageError, match="no such folder"):
        cli.run_cli(gsm8k.main, "eval.gsm8k", ["--model", "./nope", "--debug"])
    monkeypatch.setenv(cli.DEBUG_ENV, "1")
    with pytest.raises(cli.UsageError, match="no such folder"):
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
        code = cli.run_cli(
            quantize_nvfp4.main, "quantize_nvfp4", ["--model", str(src), "--output", str(out), *overwrite]
        )
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
    for flag in ("--config", "--model-name", "--dataset", "--max-completion-length", "--lora-rank", "--sigma-start",
                 "--rollout-backend", "--output-dir", "--resume-from-checkpoint", "--help-all"):  # fmt: skip
        assert flag in text
    assert "(default: 16)" in text  # LoRA rank
    parser = train._parser()
    no_metrics = next(a for a in parser._actions if "--no_metrics_jsonl" in a.option_strings)
    assert no_metrics.help == "Turn --metrics-jsonl off."
    for main in (quantize_nvfp4.main, gsm8k.main):
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
    assert cli.looks_like_path("./model") and cli.looks_like_path("/abs/model") and cli.looks_like_path("a/b/c")
    assert not cli.looks_like_path("Qwen/Qwen2.5-7B-Instruct") and not cli.looks_like_path("gpt2")
    assert cli.nearest("--lora-rnak", ["--lora-rank", "--lora-alpha"]) == " (did you mean --lora-rank?)"
    low, high = __import__("eval.common", fromlist=["x"]).wilson_interval(0, 10)
    assert low == 0.0 and 0.27 < high < 0.29  # the rule of three, roughly
    assert torch.tensor(1.0)  # torch stays importable next to the CLI helpers
