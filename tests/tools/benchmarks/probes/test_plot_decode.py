"""benchmarks/probes/plot_decode.py on rows shaped as `benchmarks.rollout --rollout-backend native --profile`
writes them."""

import json

import pytest

from benchmarks.probes import plot_decode


def _rollout_json(path, size, rows):
    path.write_text(json.dumps({"args": {"size": size}, "device": "NVIDIA H100 80GB HBM3", "rows": rows}))
    return str(path)


def _row(precision, batch, waves=1):
    kernels = {
        "NVFP4 GEMM": 2482.0,
        "attention": 405.0,
        "cuBLAS GEMM (BF16 base, LoRA, LM head)": 1072.0,
        "add+RMSNorm": 187.0,
        "a family the plot does not know": 9.0,
    }
    if precision == "bf16":
        kernels.pop("NVFP4 GEMM")
    return {
        "precision": precision,
        "batch": batch,
        "ms_per_step": 5.09,
        "floor_ms": 1.84,
        "waves": waves,
        "kernels_us_per_step": kernels,
    }


def test_plot_from_two_runs(tmp_path):
    first = _rollout_json(tmp_path / "a.json", "7b", [_row("nvfp4", 8), _row("bf16", 64)])
    second = _rollout_json(tmp_path / "b.json", "32b", [_row("bf16", 64, waves=5)])
    by_size, devices = plot_decode.load_rows([first, second])
    assert [len(by_size[s]) for s in ("7b", "32b")] == [2, 1] and devices == "NVIDIA H100 80GB HBM3"
    png = tmp_path / "out" / "decode.png"
    plot_decode.main([first, second, "--out", str(png)])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_unprofiled_run_is_refused(tmp_path):
    plain = _rollout_json(tmp_path / "plain.json", "7b", [{"precision": "nvfp4", "batch": 8, "ms_per_step": 5.0}])
    with pytest.raises(SystemExit, match="plain.json: no profiled rows"):
        plot_decode.load_rows([plain])
