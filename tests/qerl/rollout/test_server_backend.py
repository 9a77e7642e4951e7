"""The `server` rollout backend (qerl/rollout/server_backend.py) in QeRLTrainer's steps, on the CPU: DAPO steps on the
tiny NVFP4 checkpoint whose rounds two real HTTP rollout servers (fake engines, tests/helpers/rollout_servers.py)
sample, with the policy's adapter sent once per optimizer step and each round's AQN as the trainer draws it."""

import itertools

import pytest
import torch
from fakes import make_trainer, recipe_config
from rollout_servers import EOS, serving

from qerl import aqn, rounds_ahead
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
            held = {name: tensor.to(torch.bfloat16) for name, tensor in lora.items()}  # as the servers' engines hold it
            output = generate(prompt_ids, perturb)
            rounds.append((prompt_ids, output, adapter_digest(held, norms), perturb, adapter_digest(lora, norms)))
            return output

        generate, backend.generate = backend.generate, recorded
        trainer.train()

    assert backend.name == "server" and len(rounds) == 2
    engines = [fake for _, _, fake in servers]
    # one sync per optimizer step (v0, v1), not per round; v1 only relabelled: the fake's completions of a prompt are
    # all alike (zero advantages), so the step moved the FP32 masters by weight decay alone, below BF16's resolution
    assert [fake.loads for fake in engines] == [1, 1] and all(v == 1 for v, _ in backend.pool.held.values())
    assert [fake.prompts_seen for fake in engines] == [8, 8]  # two rounds of 8, half to each server
    assert rounds[0][4] != rounds[1][4]  # the step moved the FP32 adapter (in BF16 the first step may not show)
    for fake in engines:  # what the servers hold now is the policy's adapter of the last round, bit for bit
        assert adapter_digest(fake.lora, {}) == rounds[1][2]
    for step, (prompt_ids, output, _, perturb, _) in enumerate(rounds):
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
        with pytest.raises(AdapterMismatch, match=r"sampled round 1 of step 0 under other norms") as caught:
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


def test_with_staleness_one_the_next_round_samples_while_a_step_trains(checkpoints, tmp_path):
    """rollout_max_staleness 1: the round of step k + 1 is handed to the servers as soon as step k's round is taken,
    with its prompts (the rows after this round's in the sampler's order, tokenized as TRL then does) and its noise,
    and sampled with step k's adapter; TRL's importance-sampling correction is on by default."""
    _, nvfp4_dir = checkpoints
    with serving(nvfp4_dir) as servers:
        args = recipe_config(
            tmp_path, rollout_backend="server", rollout_servers=[url for url, _, _ in servers], rollout_max_staleness=1
        )
        args.max_steps = 3
        trainer = make_trainer(nvfp4_dir, args)
        backend = trainer.rollout
        versions = []  # the adapter version each round taken by a step was sampled with
        result = backend.pipeline.result

        def recorded(index, timeout):
            taken = result(index, timeout)
            versions.append(taken.adapter_version)
            return taken

        backend.pipeline.result = recorded
        trainer.train()

    assert trainer.args.vllm_importance_sampling_correction and trainer.use_vllm
    assert backend.rounds_ahead == 2  # steps 1 and 2 took the rounds sampled ahead: same prompts, same noise
    assert versions == [0, 0, 1]  # step 0 samples with v0; the rounds of steps 1 and 2 with the adapter one behind
    # v0 sent, v1 relabelled (the same BF16 tensors, as above); v2 was published after the last round
    assert [fake.loads for _, _, fake in servers] == [1, 1] and all(v == 1 for v, _ in backend.pool.held.values())
    logs = [log for log in trainer.state.log_history if "loss" in log]
    assert len(logs) == 3 and all(torch.isfinite(torch.tensor(log["loss"])) for log in logs)
    assert all("sampling/importance_sampling_ratio/mean" in log for log in logs)
    assert [log["rollout/staleness"] for log in logs] == [0, 1, 1]  # each step's round, versions behind


def test_the_rows_after_a_round_follow_trls_sampler():
    """rounds_ahead.rows_after against TRL's RepeatSampler itself: each round's rows (the dataloader's batches) are
    found in the recorded order, and the ones after them are the next round's."""
    from trl.trainer.grpo_trainer import RepeatSampler

    sampler = RepeatSampler(range(40), mini_repeat_count=4, batch_size=2, repeat_count=3, shuffle=True, seed=5)
    recorded = rounds_ahead.RecordedOrder(sampler)
    order = list(recorded)
    assert recorded.order == order and len(recorded) == len(sampler)
    batches = [order[i : i + 8] for i in range(0, len(order), 8)]  # 2 prompts x 4 generations a round
    rounds = batches[::3]  # each round's rows come three times in a row
    assert all(batch == rounds[i // 3] for i, batch in enumerate(batches))
    for this, after in itertools.pairwise(rounds):
        assert rounds_ahead.rows_after(order, this, repeats=3) == after
    assert rounds_ahead.rows_after(order, rounds[-1], repeats=3) is None  # the next epoch's order is not drawn yet


def test_a_dataset_without_rows_to_read_ahead_is_one_line():
    with pytest.raises(UsageError, match=r"^rollout_max_staleness 1 reads the next round's rows ahead, which a list"):
        rounds_ahead.number_rows([{"prompt": "1 + 1"}])


def test_a_round_sampled_ahead_that_no_step_takes_is_dropped(checkpoints, tmp_path):
    """An evaluation round at step 1 takes the noise round (1, 0) that step 1's round was sampled ahead for, so the
    training round comes as (1, 1): sampled anew, and the one sampled ahead is dropped, not kept for ever."""
    _, nvfp4_dir = checkpoints
    with serving(nvfp4_dir) as servers:
        args = recipe_config(
            tmp_path, rollout_backend="server", rollout_servers=[url for url, _, _ in servers], rollout_max_staleness=1
        )
        backend = make_trainer(nvfp4_dir, args).rollout
        noise = aqn.RoundNoise(seed=3, include_final=False, dtype_rule="fp32", include_head_norms=False)
        prompts = [[5, 6, 7]] * 4
        backend.sample_ahead(prompts, aqn.NoisyRound(noise, 1e-2, (1, 0)))
        taken = backend.generate(prompts, aqn.NoisyRound(noise, 1e-2, (1, 1)))
        assert taken.noise.sigma == 1e-2 and backend.rounds_ahead == 0 and backend.ahead == {}
        backend.pipeline.close()
        assert backend.pipeline._results == {} and backend.pipeline._unwanted == set()
    assert sum(fake.prompts_seen for _, _, fake in servers) == 8  # both rounds were sampled, one of them dropped
