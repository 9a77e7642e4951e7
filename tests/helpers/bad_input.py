"""What the bad-input tests of the command-line programs share. Bad input to a CLI (qerl.quantize, qerl.train,
eval.gsm8k / eval.competition_math): one line naming the culprit, exit code 2, no traceback, found before anything
loads, and the disk left as it was. A few trials run each CLI as a real process (the wiring: exit code, stderr; in
tests/qerl/test_cli.py); the many others call the same entry point, `qerl.cli.run_cli(main)`, in this process, which
is what the process runs after its imports: each program's TRIALS table lives with the program's tests
(tests/qerl/test_quantize.py, tests/qerl/test_train.py, tests/tools/eval/test_gsm8k.py, test_competition_math.py).

Here: each program's entry point (MAINS), the folder a user has (build_world, behind the `world` fixture of
tests/conftest.py), valid argv to spoil (Q, T, E), the one-line check, the trial each table row runs (check_trial),
and the numeric flags of eval and the quantizer (NUMERIC_FLAGS: their ranges, tests/qerl/test_field_rules.py; 0 and -1
in each, tests/tools/eval/test_cli.py and tests/qerl/test_quantize.py).
"""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from clis import snapshot
from safetensors.torch import load_file, save_file

from benchmarks.launch import child_env
from eval import cli as eval_cli
from eval import competition_math, gsm8k
from qerl import cli, field_rules, quantize, train
from qerl.errors import UsageError
from qerl.tiny import build_tiny, save_tiny_checkpoints

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


def build_world(root: Path) -> Path:
    """A folder as a user has it: a BF16 model, its NVFP4 twin, an unrelated file, data files good and bad."""
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


def trial_ids(trials) -> list[str]:
    """A trial's test id: its program and its last two arguments."""
    return [f"{t[0]}:{' '.join(t[1][-2:])}" for t in trials]


def check_trial(world, monkeypatch, capsys, trial):
    """One row of a program's TRIALS: one line naming the culprit, exit code 2, the folder as it was."""
    prog, argv, *culprit = trial
    monkeypatch.chdir(world)
    monkeypatch.delenv(cli.DEBUG_ENV, raising=False)
    before = snapshot(world)
    code = cli.run_cli(MAINS[prog], prog, argv)
    assert_one_line_error(code, capsys.readouterr().err, prog, *culprit)
    assert snapshot(world) == before


NUMERIC_FLAGS = {  # the numeric flags of eval and the quantizer: parser -> argv that is valid but for the flag
    "eval.gsm8k": (eval_cli.build_parser(gsm8k.BENCHMARK, ""), ["--model", "m"]),
    "qerl.quantize": (quantize.build_parser(), ["--model", "m", "--output", "o"]),
}


def range_flags(prog: str) -> list[tuple[str, str]]:
    """(prog, flag) for each flag of `prog` (NUMERIC_FLAGS) that takes a cli.Range."""
    parser, _ = NUMERIC_FLAGS[prog]
    return [(prog, a.option_strings[0]) for a in parser._actions if isinstance(a.type, cli.Range)]


def check_zero_and_minus_one(prog, flag):
    """0 and -1 in a numeric flag of eval or the quantizer: refused by the parser where its cli.Range says so, else
    parsed as the number."""
    parser, argv = NUMERIC_FLAGS[prog]
    rule = next(a.type for a in parser._actions if flag in a.option_strings)
    for value in (0, -1):
        if rule.problem(value):
            with pytest.raises(UsageError, match=re.escape(f"argument {flag}: must be {rule.describe()}")):
                parser.parse_args([*argv, flag, str(value)])
        else:
            assert getattr(parser.parse_args([*argv, flag, str(value)]), flag[2:].replace("-", "_")) == value
