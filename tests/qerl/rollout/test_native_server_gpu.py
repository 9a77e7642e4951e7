"""A native rollout server process (python -m qerl.rollout_server --engine native) against the colocated native
backend on the same GPU (GPU only; no vLLM needed), on the random NVFP4 checkpoint of the vLLM GPU tests with a
trained-looking LoRA r16 and trained norms: the server holds the adapter, samples the colocated engine's greedy tokens
(its Triton kernels and CUDA graph), and under AQN digests the noisy norms the trainer draws on its policy."""

import pytest
import torch
from transformers import GenerationConfig

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]

GREEDY = GenerationConfig(do_sample=False, max_new_tokens=48)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from rollout_servers import server_process
    from vllm_policy import random_nvfp4_policy

    from qerl.rollout import RolloutSetup
    from qerl.rollout.native import NativeRollout

    root = tmp_path_factory.mktemp("native-server")
    folder, policy = random_nvfp4_policy(root)
    with server_process(folder, root / "server.log", "--engine", "native", "--kv-cache-gib", "4") as pool:
        colocated = NativeRollout(RolloutSetup.for_model(policy, GREEDY, [2], pad_token_id=0))
        prompts = [torch.randint(3, 2048, (n,)).tolist() for n in (17, 40, 64, 9)]
        yield pool, colocated, policy, prompts


def test_the_native_server_samples_the_colocated_native_engines_tokens_clean_and_under_aqn(setup):
    from qerl import aqn
    from qerl.rollout import no_noise
    from qerl.rollout.server_backend import NO_NOISE, noise_spec, noisy_norms_digest
    from qerl.rollout.vllm import sampling_kwargs
    from qerl.rollout.wire import snapshot

    pool, colocated, policy, prompts = setup
    snap = snapshot(policy, 0)
    assert pool.sync(snap) == 1 and pool.held[pool.clients[0].url] == (0, snap.digest)
    sampling = sampling_kwargs(GREEDY, [2])
    served = pool.generate(0, 0, NO_NOISE, sampling, prompts)
    local = colocated.generate(prompts, no_noise)
    assert served.completion_ids == local.completion_ids
    pairs = zip(served.logprobs, local.logprobs, strict=True)
    gaps = torch.cat([(torch.tensor(a) - torch.tensor(b)).abs() for a, b in pairs])
    assert gaps.max() < 1e-3  # one engine, one batch: the same kernels on the same values

    noisy = aqn.NoisyRound(aqn.RoundNoise(3, True, "fp32", False), 1e-2, (5, 0), policy=policy)
    spec = noise_spec(noisy)
    served_noisy = pool.generate(1, 0, spec, sampling, prompts)
    assert served_noisy.noise_digest == noisy_norms_digest(policy, spec)
    assert served_noisy.completion_ids == colocated.generate(prompts, noisy).completion_ids
