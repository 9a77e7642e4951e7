"""experiments.multi_gpu_summary: the benchmarks.md rows it writes from results."""

import json

from multi_gpu_args import _args

from experiments import multi_gpu_summary as summary


def _row(config, gpus, samples):
    return {
        "config": config,
        "gpus": gpus,
        "device": "NVIDIA H100 80GB HBM3",
        "samples_per_s": samples,
        "step_s": 8 * gpus / samples,
        "split_s": {"rollout": 1.5, "refresh": 0.1, "log-prob forwards": 0.5, "backward": 0.6, "other": 0.2},
        "comm_s": 0.05 if gpus > 1 else 0.0,
        "peak_gib": [10.0] * gpus,
        "peak_driver_gib": [12.5] * gpus,
        "adapters_equal": True,
        "prompts_differ": None if gpus == 1 else True,
        "model": "m",
        "steps": 4,
        "batch": 8,
        "new_tokens": 512,
    }


def test_summary_rows(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    for name, row in {
        "7b-ddp-1gpu": _row("ddp", 1, 2.5),
        "7b-ddp-2gpu": _row("ddp", 2, 5.0),
        "7b-zero3-2gpu": {"config": "zero3-2gpu", "gpus": 2, "error": "boom"},
        "32b-ddp-1gpu": _row("ddp", 1, 1.0),
        "32b-fsdp-2gpu": _row("fsdp", 2, 1.5),
    }.items():
        (results / f"{name}.json").write_text(json.dumps({**row, "job": name, "job_wall_s": 60}))
    text = summary.summarize(_args(tmp_path, bundle=str(tmp_path / "bundle")))
    assert "| ddp | 2 | 5.00 | 2.00x |" in text and "| zero3-2gpu | 2 | failed: boom" in text
    assert "| fsdp | 2 | 1.50 | 1.50x |" in text  # 32B: DDP's one-GPU row is the baseline
    assert "10.0 / 12.5" in text and "NVIDIA H100 80GB HBM3" in text
    assert sorted(p.name for p in (tmp_path / "bundle").iterdir()) == ["logs.tar.gz", "results.json", "summary.md"]
