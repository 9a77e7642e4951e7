"""experiments.multi_gpu_suite without launching anything: results restored from an earlier run skip their jobs,
and a deepspeed that does not import stops the suite before any launch."""

import json

import pytest
from multi_gpu_args import _args

from experiments import multi_gpu_runner as runner
from experiments import multi_gpu_suite as suite


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
