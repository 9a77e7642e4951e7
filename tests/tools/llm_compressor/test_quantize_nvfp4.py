"""llm-compressor/quantize_nvfp4.py: its default (native) backend writes what `python -m qerl.quantize` writes, and
its llmcompressor backend the same bytes."""

import json
import subprocess
import sys

import pytest
import torch
from checkpoint_models import _bf16_model
from clis import QUANTIZER, quantize_nvfp4
from safetensors.torch import load_file

from benchmarks.launch import REPO
from qerl import quantize


def test_llmcompressor_script_native_backend_is_the_package_quantizer(seed, tmp_path):
    """llm-compressor/quantize_nvfp4.py's default backend writes what `python -m qerl.quantize` writes."""
    _bf16_model("qwen2", tmp_path / "bf16")
    for main, out in ((quantize.main, "package"), (quantize_nvfp4.main, "script")):
        assert main(["--model", str(tmp_path / "bf16"), "--output", str(tmp_path / out)]) == 0
    for name in ("model.safetensors", "config.json"):
        assert (tmp_path / "package" / name).read_bytes() == (tmp_path / "script" / name).read_bytes()


def test_llmcompressor_backend_writes_the_same_bytes(seed, tmp_path):
    pytest.importorskip("llmcompressor", reason="the llmcompressor backend is optional (pip install -e .[quantize])")
    _bf16_model("qwen2", tmp_path / "bf16")
    for backend in ("native", "llmcompressor"):
        result = subprocess.run(
            [
                sys.executable,
                str(QUANTIZER),
                "--model",
                str(tmp_path / "bf16"),
                "--output",
                str(tmp_path / backend),
                "--backend",
                backend,
            ],
            capture_output=True,
            text=True,
            cwd=REPO,
        )
        assert result.returncode == 0, result.stderr
    configs = [json.loads((tmp_path / b / "config.json").read_text()) for b in ("native", "llmcompressor")]
    assert configs[0]["quantization_config"] == configs[1]["quantization_config"]
    native = load_file(tmp_path / "native" / "model.safetensors")
    theirs = load_file(tmp_path / "llmcompressor" / "model.safetensors")
    assert native.keys() == theirs.keys()
    for key in native:
        assert torch.equal(native[key].view(torch.uint8), theirs[key].view(torch.uint8)), key
