"""A real rollout server (python -m qerl.rollout_server, vLLM in its own process) against the colocated vllm backend
on the same GPU (GPU only; vLLM from ../shared/gpu-site on the GPU machine; engine starts take about a minute each).

On the random NVFP4 checkpoint of test_vllm_gpu.py with a trained-looking LoRA r16 and trained norms: the server
takes the adapter (its digest, the norms read back), samples greedily the tokens the colocated engine samples with
the same adapter, and under AQN reads back the noisy norms the trainer draws on the policy.
"""

import importlib.util

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM"),
]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from rollout_servers import server_process
    from vllm_policy import colocated_vllm, random_nvfp4_policy

    root = tmp_path_factory.mktemp("server")
    folder, policy = random_nvfp4_policy(root)
    vllm_flags = ["--engine", "vllm", "--gpu-memory-utilization", "0.25", "--max-model-len", "512"]
    with server_process(folder, root / "server.log", *vllm_flags) as pool:
        generation_config = policy.generation_config
        generation_config.update(max_new_tokens=24, do_sample=False, top_p=1.0, top_k=0)
        colocated = colocated_vllm(folder, policy, generation_config, sleep=False)  # beside test_vllm_gpu's
        prompts = [torch.randint(3, 2048, (n,)).tolist() for n in (17, 40, 64, 9)]
        yield pool, colocated, policy, prompts


def test_the_server_holds_the_adapter_and_samples_the_colocated_engines_greedy_tokens(setup):
    from qerl.rollout import no_noise
    from qerl.rollout.server_backend import NO_NOISE
    from qerl.rollout.wire import snapshot

    pool, colocated, policy, prompts = setup
    snap = snapshot(policy, 0)
    assert pool.sync(snap) == 1 and pool.held[pool.clients[0].url] == (0, snap.digest)  # norms read back as sent
    served = pool.generate(0, 0, NO_NOISE, colocated.sampling, prompts)
    local = colocated.generate(prompts, no_noise)
    assert served.completion_ids == local.completion_ids
    # vLLM is not batch-invariant: two engines split prefill and batch their own way, so the log-probs agree to the
    # BF16 rounding of the logits (seen on an H200: 0.008 at most, most tokens bit-equal), not bit for bit
    pairs = zip(served.logprobs, local.logprobs, strict=True)
    gaps = torch.cat([(torch.tensor(a) - torch.tensor(b)).abs() for a, b in pairs])
    assert gaps.max() < 0.05 and gaps.mean() < 5e-3


def test_under_aqn_the_server_reads_back_the_noisy_norms_the_trainer_draws(setup):
    from qerl import aqn
    from qerl.rollout.server_backend import noise_spec, noisy_norms_digest
    from qerl.rollout.wire import snapshot

    pool, colocated, policy, prompts = setup
    pool.sync(snapshot(policy, 0))
    noisy = aqn.NoisyRound(aqn.RoundNoise(3, True, "fp32", False), 1e-2, (5, 0), policy=policy)
    spec = noise_spec(noisy)
    served = pool.generate(1, 0, spec, colocated.sampling, prompts)
    assert served.noise.sigma == 1e-2 and served.noise.changed_fraction > 0.9
    assert served.noise_digest == noisy_norms_digest(policy, spec)
