"""The native engine behind a rollout server (qerl/rollout/native/server_engine.py), on the CPU (the engine's eager
path): a real HTTP server around it on the tiny NVFP4 checkpoint, fed by the trainer's ServerPool, holds the policy's
adapter (digest of what it holds), samples the colocated native backend's tokens and log-probs bit for bit, clean and
under the round's AQN (whose noisy norms it digests as the trainer does), and serves QeRLTrainer's DAPO steps."""

import pytest
import torch
from fakes import make_trainer, recipe_config
from rollout_servers import native_serving, server_process, trained_policy
from transformers import GenerationConfig

from qerl import aqn, base_model
from qerl.errors import UsageError
from qerl.rollout import RolloutSetup, no_noise
from qerl.rollout.native import NativeRollout
from qerl.rollout.remote import ServerPool
from qerl.rollout.server_backend import NO_NOISE, noise_spec, noisy_norms_digest
from qerl.rollout.vllm import sampling_kwargs
from qerl.rollout.wire import snapshot

GREEDY = GenerationConfig(do_sample=False, max_new_tokens=12)


@pytest.fixture(scope="module")
def served(checkpoints):
    """(url, engine, nvfp4 folder) of a server the greedy tests share."""
    _, nvfp4_dir = checkpoints
    with native_serving(nvfp4_dir) as (url, engine):
        yield url, engine, nvfp4_dir


def _policy(nvfp4_dir, seed: int = 0):
    return trained_policy(seed, base_model.load_base_model(nvfp4_dir, dtype=torch.bfloat16, device="cpu"))


def _colocated(policy, eos: list[int]) -> NativeRollout:
    return NativeRollout(RolloutSetup.for_model(policy, GREEDY, eos, pad_token_id=0))


def _prompts():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, 100, (n,), generator=g).tolist() for n in (5, 9, 3, 7)]


def test_the_server_holds_the_adapter_and_samples_the_colocated_engines_tokens_clean_and_under_aqn(served):
    url, _, nvfp4_dir = served
    policy = _policy(nvfp4_dir)
    eos = [int(policy.generation_config.eos_token_id or 2)]
    pool = ServerPool([url], nvfp4_dir, lora_rank=4, timeout=60)
    pool.handshake(60)
    snap = snapshot(policy, 0)
    # the LoRA and the FP32 norms read back from the engine, bit for bit the trainer's BF16 LoRA and FP32 norms
    assert pool.clients[0].info()["lora_digest_of"] == "held"
    assert pool.sync(snap) == 1 and pool.held[url] == (0, snap.digest)
    colocated, sampling, prompts = _colocated(policy, eos), sampling_kwargs(GREEDY, eos), _prompts()

    served_clean = pool.generate(0, 0, NO_NOISE, sampling, prompts)
    local = colocated.generate(prompts, no_noise)
    assert served_clean.completion_ids == local.completion_ids and served_clean.logprobs == local.logprobs

    noisy = aqn.NoisyRound(aqn.RoundNoise(3, True, "fp32", False), 5e-2, (5, 0), policy=policy)
    spec = noise_spec(noisy)
    served_noisy = pool.generate(1, 0, spec, sampling, prompts)
    assert served_noisy.noise_digest == noisy_norms_digest(policy, spec)  # the trainer's noise, on the server's norms
    assert served_noisy.noise.sigma == 5e-2 and served_noisy.noise.changed_fraction > 0.9
    local_noisy = colocated.generate(prompts, noisy)
    assert served_noisy.completion_ids == local_noisy.completion_ids
    assert served_noisy.logprobs == local_noisy.logprobs and served_noisy.logprobs != served_clean.logprobs


def test_another_lora_or_other_sampling_settings_are_refused_in_one_line(served):
    url, engine, nvfp4_dir = served
    snap = snapshot(_policy(nvfp4_dir, seed=1), 0)
    engine.load_lora(snap.lora, snap.settings)  # the same settings: taken
    with pytest.raises(UsageError, match="serves a LoRA of rank 4 .* the trainer sent rank 8 .* restart the server"):
        engine.load_lora(snap.lora, {**snap.settings, "r": 8})
    greedy = sampling_kwargs(GREEDY, [2])
    engine.generate([[5, 6, 7]], greedy)
    with pytest.raises(UsageError, match="samples with .*temperature.*: 0.0.* a round asked for .*: 0.7"):
        engine.generate([[5, 6, 7]], {**greedy, "temperature": 0.7})


def test_dapo_steps_sample_on_a_native_server_with_the_policys_adapter_and_noise(checkpoints, tmp_path):
    """Two DAPO steps of QeRLTrainer (the recipe's settings, AQN on) sampled by a native server of their own: the
    trainer checks each round's noisy-norms digest against its policy's (a mismatch stops the run)."""
    _, nvfp4_dir = checkpoints
    with native_serving(nvfp4_dir) as (url, _):
        args = recipe_config(tmp_path, rollout_backend="server", rollout_servers=[url], max_steps=2, sigma_start=5e-2)
        trainer = make_trainer(nvfp4_dir, args)
        trainer.train()
    logged = [row for row in trainer.state.log_history if "loss" in row]
    assert len(logged) == 2 and all(row["aqn/sigma"] > 0 for row in logged)
    assert all(row["completions/mean_length"] > 0 for row in logged)


def test_the_program_serves_the_native_engine(checkpoints, tmp_path):
    """`python -m qerl.rollout_server --engine native` in a process of its own (the CPU here): the handshake, the
    adapter held, a greedy round as the colocated native backend samples it."""
    _, nvfp4_dir = checkpoints
    policy = _policy(nvfp4_dir)
    with server_process(nvfp4_dir, tmp_path / "server.log", "--engine", "native", "--kv-cache-gib", "1") as pool:
        snap = snapshot(policy, 0)
        assert pool.sync(snap) == 1 and pool.held[pool.clients[0].url] == (0, snap.digest)
        served = pool.generate(0, 0, NO_NOISE, sampling_kwargs(GREEDY, [2]), _prompts())
    assert served.completion_ids == _colocated(policy, [2]).generate(_prompts(), no_noise).completion_ids
    assert "adapter v0:" in (tmp_path / "server.log").read_text()


def test_one_round_ahead_on_a_native_server_trains_on_rounds_one_version_behind(checkpoints, tmp_path):
    """rollout_max_staleness 1 on a real engine: the rounds of steps 1 and 2 sampled while the step before trained,
    with its adapter; the correction on, its ratio from the loss forward (no old-log-probs forward), the mismatch of
    the stale rounds logged."""
    _, nvfp4_dir = checkpoints
    with native_serving(nvfp4_dir) as (url, _):
        args = recipe_config(
            tmp_path, rollout_backend="server", rollout_servers=[url], rollout_max_staleness=1, max_steps=3
        )
        trainer = make_trainer(nvfp4_dir, args)
        trainer.train()
    assert trainer.ratio_from_loss_forward and trainer.rollout.rounds_ahead == 2
    logs = [log for log in trainer.state.log_history if "loss" in log]
    assert [log["rollout/staleness"] for log in logs] == [0, 1, 1]
    assert all(log["sampling/sampling_logp_difference/mean"] > 0 for log in logs)
