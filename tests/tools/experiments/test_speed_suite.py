"""experiments.speed_suite's wiring on the CPU: which jobs a machine gets, each benchmark's --out where its parser reads
it (before a `--` that hands the rest to qerl.train), and the summary of finished results."""

import argparse
import contextlib
import json

import pytest

from benchmarks import launch
from experiments import speed_suite, speed_summary


def _args(tmp_path, gguf=None):
    return argparse.Namespace(out=str(tmp_path), gpus=4, site=str(tmp_path / "site"), gguf=gguf, steps=22, timeout=5,
                              retry_failed=False, bundle=None, gpu_ids=[])  # fmt: skip


SEVEN_B = ["step7b-colocated", "server7b-1p1-native-ahead", "server7b-1p3-native-ahead"]


def test_the_real_model_jobs_come_with_the_gguf(tmp_path):
    without = [job.name for job in speed_suite.jobs(_args(tmp_path))]
    assert without == ["kernels", "gptq", "rollout", "step-7b", "gpu-tests", "vllm-rollout", *SEVEN_B]
    with_gguf = [job.name for job in speed_suite.jobs(_args(tmp_path, gguf="/tmp/q15.gguf"))]
    # the defaults' pair and TRL first, then the newest questions: a lease that ends early loses the oldest
    assert with_gguf == [
        "kernels", "gptq", "rollout", "step-7b", "gpu-tests", "vllm-rollout", "real-prep", "real-nvfp4",
        "real-nvfp4-dense", "real-bf16", "trl-baseline", "real-nvfp4-dense-before", "real-bf16-before",
        "real-nvfp4-dense-combined", "real-bf16-combined", "real-nvfp4-dense-compact", "real-bf16-compact",
        "real-nvfp4-dense-kept-mb32", "real-bf16-kept-mb32", "real-nvfp4-dense-random-split",
        "real-bf16-random-split", "real-nvfp4-dense-compiled", "real-bf16-compiled", "server-shared-native-ahead",
        "server-shared-ahead", "server-shared", "server-1p1-native-ahead", "server-1p1-ahead", "server-1p1",
        "server-1p3-native-ahead", "server-1p3-ahead", *SEVEN_B,
    ]  # fmt: skip
    two_gpus = _args(tmp_path, gguf="x")
    two_gpus.gpus = 2  # 1 + 3 does not fit
    assert [job.name for job in speed_suite.jobs(two_gpus)][-5:] == [
        "server-1p1-native-ahead", "server-1p1-ahead", "server-1p1", *SEVEN_B[:2]
    ]  # fmt: skip
    two_gpus.gpus = 1
    assert [job.name for job in speed_suite.jobs(two_gpus)][-4:] == [
        "server-shared-native-ahead", "server-shared-ahead", "server-shared", "step7b-colocated"
    ]  # fmt: skip
    prep = next(job for job in speed_suite.jobs(_args(tmp_path, gguf="x")) if job.name == "real-prep")
    assert prep.gpus == 0 and prep.share == 3  # beside the others, on the last GPU


def test_out_goes_before_the_flags_for_qerl_train(tmp_path, monkeypatch):
    ran = []
    monkeypatch.setattr(
        speed_suite, "run_commands", lambda args, name, commands, gpu_ids, site: ran.append(commands) or []
    )
    (tmp_path / "json").mkdir()
    for key in ("step-7b-nvfp4", "step-7b-nvfp4-dense", "step-7b-bf16"):
        (tmp_path / "json" / f"{key}.json").write_text(json.dumps({"key": key}))
    job = next(job for job in speed_suite.jobs(_args(tmp_path)) if job.name == "step-7b")
    result = job.work([2])
    assert list(result) == ["step-7b-nvfp4", "step-7b-nvfp4-dense", "step-7b-bf16"]
    for command in ran[0]:
        assert command[:3] == ["-m", "benchmarks.step", "--out"] and command[3].startswith(str(tmp_path / "json"))
        assert command.index("--out") < command.index("--")
    assert ran[0][1][ran[0][1].index("--") + 1 :] == ["--dense-training-weights", "true"]


@pytest.mark.parametrize(
    ("name", "servers_on", "engine", "shared"),
    [("server-shared", [5], "vllm", True), ("server-1p1", [6], "vllm", False), ("server-1p1-native-ahead", [6],
     "native", False)],
)  # fmt: skip
def test_a_server_job_trains_on_its_first_gpu_and_samples_on_the_others_or_beside_it(
    tmp_path, monkeypatch, name, servers_on, engine, shared
):
    started, ran = [], []

    @contextlib.contextmanager
    def servers(args, job, gpu_ids, model, engine, shared):
        started.append((gpu_ids, engine, shared))
        yield ["http://127.0.0.1:1"]

    monkeypatch.setattr(speed_suite, "rollout_servers", servers)
    monkeypatch.setattr(speed_suite, "real_prepared", lambda args: None)
    monkeypatch.setattr(
        speed_suite, "run_commands", lambda args, job, commands, gpu_ids, site: ran.append((commands, gpu_ids)) or []
    )
    (tmp_path / "json").mkdir()
    (tmp_path / "json" / f"{name}.json").write_text("{}")
    job = next(job for job in speed_suite.jobs(_args(tmp_path, gguf="x")) if job.name == name)
    assert job.work([5, 6][: job.gpus]) == {name: {}}
    assert started == [(servers_on, engine, shared)]
    ((command, gpu_ids),) = ran
    assert gpu_ids == [5]
    assert command[0][command[0].index("--rollout-servers") + 1] == "http://127.0.0.1:1"


def test_the_random_7b_jobs_write_one_checkpoint_that_trainer_and_servers_load(tmp_path, monkeypatch):
    """server7b-1p1-native-ahead: benchmarks.step --write-checkpoint on the job's first GPU (under a lock: another
    7B job may be writing it), a native server on the second loading that folder, and the trainer on the first with
    the random 7B's flags, the batch doubled and one round ahead; step7b-colocated writes it the same way first."""
    started, ran = [], []

    @contextlib.contextmanager
    def servers(args, job, gpu_ids, model, engine, shared):
        started.append((gpu_ids, model, engine, shared))
        yield ["http://127.0.0.1:1"]

    def run_commands(args, job, commands, gpu_ids, site):
        ran.append((job, commands, gpu_ids))
        return []

    monkeypatch.setattr(speed_suite, "rollout_servers", servers)
    monkeypatch.setattr(speed_suite, "run_commands", run_commands)
    (tmp_path / "json").mkdir()
    (tmp_path / "json" / "server7b-1p1-native-ahead.json").write_text("{}")
    found = {job.name: job for job in speed_suite.jobs(_args(tmp_path))}
    assert found["server7b-1p1-native-ahead"].work([2, 3]) == {"server7b-1p1-native-ahead": {}}
    workdir = tmp_path / "random"
    folder = str(workdir / "qwen2.5-7b-random-nvfp4")  # where benchmarks.step writes it
    assert started == [([3], folder, "native", False)]
    (write_job, (write,), write_gpus), (step_job, (step,), step_gpus) = ran
    assert (write_job, write_gpus, step_job, step_gpus) == ("random-7b", [2], "server7b-1p1-native-ahead", [2])
    seven_b = ["--size", "7b", "--precision", "nvfp4", "--workdir", str(workdir)]
    assert write == ["-m", "benchmarks.step", *seven_b, "--write-checkpoint"]
    assert step[step.index("--out") + 2 : step.index("--rollout-backend")] == seven_b
    assert step[step.index("--") + 1 :] == ["--rollout-servers", "http://127.0.0.1:1", "--gradient-accumulation-steps",
                                            "2", "--rollout-max-staleness", "1"]  # fmt: skip
    ran.clear()
    found["step7b-colocated"].work([1])
    assert [(job, gpus) for job, _, gpus in ran] == [("random-7b", [1]), ("step7b-colocated", [1])]
    assert ran[1][1][0][ran[1][1][0].index("--rollout-backend") + 1] == "native"


def test_summary_gives_medians_lengths_phases_and_failures(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    profile = {
        "device": "NVIDIA H100 80GB HBM3",
        "step_seconds": [3.0, 4.0, 3.5],
        "completion_lengths": [[450, 160.0], [300, 150.0], [512, 170.0]],
        "phases": {"rollout": 1.5, "backward": 0.9},
        "dense_weight_rounds": 3,
    }
    (results / "real-nvfp4-dense.json").write_text(json.dumps({"real-nvfp4-dense": {"profile": profile}}))
    (results / "vllm-rollout.json").write_text(json.dumps({"error": "RuntimeError: no vLLM"}))
    trl = {"device": "NVIDIA H100 80GB HBM3", "step_seconds": [9.0, 3.0, 4.0], "median_step_seconds": 3.5}
    (results / "trl-baseline.json").write_text(json.dumps({"trl-baseline": trl}))
    graph = {"layer_seconds": 0.5, "model_seconds": 14.0, "passes": {}}
    gptq = {
        "card": "NVIDIA H200",
        "sizes": {"1.5b": {"layer_seconds": 2.5, "model_seconds": 70.0, "passes": {}, "graph": graph}},
    }
    (results / "gptq.json").write_text(json.dumps({"gptq": gptq}))
    text = speed_summary.summarize(_args(tmp_path))
    assert "- gptq 1.5b eager: 2.50 s a layer, ~1.2 min a model, NVIDIA H200" in text
    assert "- gptq 1.5b graph: 0.50 s a layer, ~0.2 min a model, NVIDIA H200" in text
    assert "- real-nvfp4-dense: median 3.50 s over 3 steps, NVIDIA H100 80GB HBM3" in text
    assert "longest completions 300-512 (median 450); dense-weight rounds 3" in text
    assert "phases (s/step): rollout 1.50, backward 0.90" in text
    assert "- vllm-rollout: FAILED: RuntimeError: no vLLM" in text
    # TRL's own median leaves its first step out, as the QeRL profile's steps do
    assert "- trl-baseline: median 3.50 s of 3 steps run, NVIDIA H100 80GB HBM3" in text
    assert (tmp_path / "summary.md").read_text() == text


def test_a_real_run_waits_for_the_checkpoints_not_only_a_kept_result(tmp_path, monkeypatch):
    """A real-prep result kept from an earlier start, whose folders went with that machine, must not start the runs."""
    monkeypatch.setattr(speed_suite.time, "sleep", lambda seconds: None)
    args = _args(tmp_path, gguf="x")
    args.timeout = 0
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "real-prep.json").write_text(json.dumps(speed_suite.checkpoints(args)))
    with pytest.raises(RuntimeError, match="checkpoints did not arrive"):
        speed_suite.real_prepared(args)
    for folder in speed_suite.checkpoints(args).values():
        (tmp_path / folder).mkdir(parents=True)
        (tmp_path / folder / "config.json").write_text("{}")
    speed_suite.real_prepared(args)  # both folders there: go
    (tmp_path / "results" / "real-prep.json").write_text(json.dumps({"error": "ImportError: gguf"}))
    for folder in speed_suite.checkpoints(args).values():
        (tmp_path / folder / "config.json").unlink()
    with pytest.raises(RuntimeError, match="real-prep failed"):
        speed_suite.real_prepared(args)


def test_a_server_job_trains_on_its_first_gpu_and_serves_from_the_others(tmp_path, monkeypatch):
    """server-1p3-ahead holds four GPUs: python -m qerl.rollout_server on the last three (ports and seeds of their own,
    the NVFP4 checkpoint), benchmarks.step on the first with every server's address, and the servers stopped after."""
    args = _args(tmp_path, gguf="x")
    args.gpu_ids = [4, 5, 6, 7]  # the machine's GPUs the suite may use
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / ".complete").touch()
    monkeypatch.setattr(speed_suite, "real_prepared", lambda args: None)
    started, killed, ran = [], [], []

    class Server:
        def __init__(self, command, env, **kwargs):
            started.append((command, env["CUDA_VISIBLE_DEVICES"]))

    monkeypatch.setattr(launch.subprocess, "Popen", Server)
    monkeypatch.setattr(speed_suite, "kill_session", killed.append)

    def run_commands(args, name, commands, gpu_ids, site):
        ran.append((commands, gpu_ids))
        (tmp_path / "json" / f"{name}.json").write_text(json.dumps({"profile": {"step_seconds": [1.0]}}))
        return []

    monkeypatch.setattr(speed_suite, "run_commands", run_commands)
    (tmp_path / "json").mkdir()
    job = next(job for job in speed_suite.jobs(args) if job.name == "server-1p3-ahead")
    assert job.gpus == 4
    result = job.work([0, 1, 2, 3])
    assert result == {"server-1p3-ahead": {"profile": {"step_seconds": [1.0]}}}
    nvfp4 = speed_suite.checkpoints(args)["nvfp4"]
    ports = []
    for i, (command, gpu) in enumerate(started):
        assert command[1:5] == ["-m", "qerl.rollout_server", "--model", nvfp4] and gpu == str(5 + i)
        assert command[command.index("--seed") + 1] == str(i + 1)
        ports.append(command[command.index("--port") + 1])
    assert len(started) == 3 and len(set(ports)) == 3 and len(killed) == 3
    (command,), gpu_ids = ran[0]
    assert gpu_ids == [0] and command[command.index("--rollout-backend") + 1] == "server"
    flags = command[command.index("--") + 1 :]
    assert flags[: 1 + 3] == ["--rollout-servers", *(f"http://127.0.0.1:{port}" for port in ports)]
    assert flags[4:] == ["--gradient-accumulation-steps", "16", "--rollout-max-staleness", "1"]


@pytest.mark.parametrize(
    ("engine", "shared", "flags"),
    [
        ("vllm", False, ["--engine", "vllm", "--gpu-memory-utilization", "0.85"]),
        # a third of the card beside the trainer
        ("vllm", True, ["--engine", "vllm", "--gpu-memory-utilization", "0.3"]),
        ("native", False, ["--engine", "native"]),
        ("native", True, ["--engine", "native", "--kv-cache-gib", "20"]),
    ],
)
def test_each_server_gets_its_engine_port_seed_and_share_and_one_beside_the_trainer_is_waited_for(
    tmp_path, monkeypatch, engine, shared, flags
):
    import qerl.rollout.remote

    started, waited = [], []
    monkeypatch.setattr(speed_suite, "site_env", lambda args, **extra: extra)
    monkeypatch.setattr(speed_suite, "kill_session", lambda proc: None)
    monkeypatch.setattr(launch.subprocess, "Popen", lambda command, env, **kw: started.append((command, env)))
    monkeypatch.setattr(
        qerl.rollout.remote.ServerPool, "handshake", lambda pool, timeout: waited.append(len(pool.clients))
    )
    monkeypatch.setattr(qerl.rollout.remote, "base_fingerprint", lambda path: "fp")
    args = _args(tmp_path)
    with speed_suite.rollout_servers(args, "job", [2, 3], "/m", engine, shared) as urls:
        assert len(urls) == 2
    for i, (command, env) in enumerate(started):
        assert command[1:] == ["-m", "qerl.rollout_server", "--model", "/m", "--port", urls[i].rsplit(":", 1)[1],
                               "--seed", str(i + 1), *flags]  # fmt: skip
        assert env == {"CUDA_VISIBLE_DEVICES": str(2 + i)}
    assert waited == ([2] if shared else [])
