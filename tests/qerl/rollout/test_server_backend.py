"""The `server` rollout backend (qerl/rollout/server_backend.py) in QeRLTrainer's steps, on the CPU: DAPO steps on the
tiny NVFP4 checkpoint whose rounds two real HTTP rollout servers (fake engines, tests/helpers/rollout_servers.py)
sample, with the policy's adapter sent once per optimizer step and each round's AQN as the trainer draws it."""

import pytest
import torch
from fakes import make_trainer, recipe_config
from rollout_servers import EOS, serving

from qerl import aqn
from qerl.errors import UsageError
from qerl.rollout import no_noise
from qerl.rollout.remote import AdapterMismatch
from qerl.rollout.server_backend import NO_NOISE, noise_spec
from qerl.rollout.vllm import adapter_tensors
from qerl.rollout.wire import adapter_digest


def test_dapo_steps_sample_on_the_servers_with_the_policys_adapter_and_noise(checkpoints, tmp_path):
    _, nvfp4_dir = checkpoints
    with serving(nvfp4_dir) as servers:
        args = recipe_config(tmp_path, rollout_backend="server", rollout_servers=[url for url, _, _ in servers])
        args.max_steps = 2
        trainer = make_trainer(nvfp4_dir, args)
        backend = trainer.rollout
        rounds = []  # (prompts, output, the adapter the policy had, the round's noise) of every round

        def recorded(prompt_ids, perturb):
            lora, norms = adapter_tensors(trainer.model)
            output = generate(prompt_ids, perturb)
            rounds.append((prompt_ids, output, adapter_digest(lora, norms), perturb))
            return output

        generate, backend.generate = backend.generate, recorded
        trainer.train()

    assert backend.name == "server" and len(rounds) == 2
    engines = [fake for _, _, fake in servers]
    assert [fake.loads for fake in engines] == [2, 2]  # one sync per optimizer step: the adapter moved once
    assert [fake.prompts_seen for fake in engines] == [8, 8]  # two rounds of 8, half to each server
    assert rounds[0][2] != rounds[1][2] and backend.adapter.version == 1
    for fake in engines:  # what the servers hold now is the policy's adapter of the last round, bit for bit
        assert adapter_digest(fake.lora, {}) == rounds[1][2]
    for step, (prompt_ids, output, _, perturb) in enumerate(rounds):
        assert isinstance(perturb, aqn.NoisyRound) and perturb.round == (step, 0) and perturb.sigma > 0
        assert output.noise.sigma == perturb.sigma and output.noise.changed_fraction > 0  # the servers' own draw
        for prompt, ids in zip(prompt_ids, output.completion_ids, strict=True):
            assert ids[0] == prompt[0] and ids[-1] == EOS and len(ids) == 6  # the fake's tokens, cut after EOS
    assert torch.isfinite(torch.tensor([log["loss"] for log in trainer.state.log_history if "loss" in log])).all()


def test_a_server_sampling_under_other_norms_stops_the_round(checkpoints, tmp_path):
    """The trainer replays the round's noise on the policy and compares the norms' digest with the one each server
    read back while sampling: a server on other norms (another checkpoint's, or another torch's noise) is named."""
    _, nvfp4_dir = checkpoints
    with serving(nvfp4_dir) as servers:
        args = recipe_config(tmp_path, rollout_backend="server", rollout_servers=[url for url, _, _ in servers])
        trainer = make_trainer(nvfp4_dir, args)
        noisy = trainer._next_round(sigma=1e-2)
        assert trainer.rollout.generate([[5, 6, 7]] * 2, noisy).noise.sigma == 1e-2  # the same norms: it samples
        with torch.no_grad():  # both servers alike, or the pool would see them differ first (test_remote.py)
            for _, _, fake in servers:
                fake.model.model.layers[0].input_layernorm.weight.add_(0.5)
        with pytest.raises(AdapterMismatch, match=r"sampled round 1 under other norms than the trainer's") as caught:
            trainer.rollout.generate([[5, 6, 7]] * 2, trainer._next_round(sigma=1e-2))
    assert "\n" not in str(caught.value)


def test_the_noise_a_server_draws_is_the_rounds():
    noise = aqn.RoundNoise(seed=7, include_final=True, dtype_rule="fp32", include_head_norms=False)
    spec = noise_spec(aqn.NoisyRound(noise, 1e-3, (4, 1)))
    assert (spec.sigma, spec.round, spec.settings) == (1e-3, (4, 1), (7, True, "fp32", False))
    assert noise_spec(no_noise) == NO_NOISE and NO_NOISE.sigma == 0


def test_without_server_addresses_the_backend_is_one_line(checkpoints, tmp_path):
    _, nvfp4_dir = checkpoints
    with pytest.raises(UsageError, match=r"^rollout_backend server: give rollout_servers") as caught:
        make_trainer(nvfp4_dir, recipe_config(tmp_path, rollout_backend="server"))
    assert "\n" not in str(caught.value) and "python -m qerl.rollout_server" in str(caught.value)
