"""experiments.multi_gpu_suite without launching anything: where jobs go, the wall time it plans for, a job done
earlier skipped on a second start (multi_gpu_runner.py), and the benchmarks.md rows it writes from results
(multi_gpu_summary.py)."""

import argparse
import json

import pytest

from experiments import multi_gpu_runner as runner
from experiments import multi_gpu_suite as suite
from experiments import multi_gpu_summary as summary


def test_jobs_take_aligned_free_gpus():
    assert runner.pick([0, 1, 2, 3], 2) == [0, 1] and runner.pick([0, 2, 3], 2) == [2, 3]
    assert runner.pick([0, 3], 2) == [0, 3] and runner.pick([0, 1, 2, 3], 4) == [0, 1, 2, 3]
    assert runner.pick([3], 1) == [3]


def _args(tmp_path, **kw):
    return argparse.Namespace(**{"out": str(tmp_path), "retry_failed": False, "gpus": 4, "bundle": None, **kw})


def test_phase_places_jobs_in_order_and_skips_done_ones(tmp_path):
    ran = []

    def job(name, gpus, share=0):
        return runner.Job(name, gpus, lambda ids, name=name: ran.append((name, ids)) or {"ok": 1}, 1.0, share)

    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "done.json").write_text(json.dumps({"ok": 1}))
    jobs = [job("done", 1), job("one", 1), job("pair", 2), job("beside", 0, share=3), job("all", 4)]
    runner.run_phase(_args(tmp_path), "x", jobs, 4)
    placed = dict(ran)
    assert "done" not in placed and placed["one"] == [0] and placed["pair"] == [2, 3] and placed["beside"] == [3]
    assert placed["all"] == [0, 1, 2, 3]
    assert all((tmp_path / "results" / f"{n}.json").is_file() for n in placed)
    # Placement in list order: 1 GPU, then a pair beside it, then all four once both are done (+ a shared job).
    assert runner.estimate([("x", jobs)], 4) == 2.0


def test_restored_results_skip_their_jobs_but_models_are_rebuilt(tmp_path):
    earlier = {"7b-ddp-1gpu": {"samples_per_s": 1.0}, "7b-fsdp-1gpu": {"error": "boom"},
               "build-7b": {"model": str(tmp_path / "gone")}}  # fmt: skip
    (tmp_path / "earlier.json").write_text(json.dumps(earlier))
    args = _args(tmp_path / "new", restore=str(tmp_path / "earlier.json"))
    suite.restore(args)
    ran = []

    def job(name, holds=lambda result: True):
        return runner.Job(name, 1, lambda ids: ran.append(name) or {"model": "x"}, 1.0, holds=holds)

    built = lambda result: (tmp_path / "gone").is_dir()  # noqa: E731
    runner.run_phase(args, "x", [job("7b-ddp-1gpu"), job("7b-fsdp-1gpu"), job("build-7b", built), job("new")], 4)
    assert sorted(ran) == ["build-7b", "new"]  # the failed one stays failed unless --retry-failed


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


def test_a_deepspeed_that_does_not_import_stops_the_suite_before_any_launch(tmp_path, monkeypatch):
    """A deepspeed installed without its pydantic (as carried to the GPU machine once) breaks every launch, FSDP and
    DDP too, since transformers imports it: the suite refuses to start and names the missing module."""
    zero = tmp_path / "deepspeed" / "runtime" / "zero"
    zero.mkdir(parents=True)
    for folder in (tmp_path / "deepspeed", tmp_path / "deepspeed" / "runtime", zero):
        (folder / "__init__.py").write_text("")
    (zero / "config.py").write_text("import pydantic_that_is_missing\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    with pytest.raises(SystemExit, match="pydantic_that_is_missing"):
        suite.check_deepspeed()
