"""The vllm rollout backend on a real vLLM engine (GPU only; vLLM from ../shared/gpu-site on the GPU machine).

One engine (engine start takes about a minute) on a small random Qwen2 NVFP4 checkpoint with shapes Marlin
accepts, LoRA r16 and FP32 norm scales, asleep between rounds as in training. Checked: the NVFP4 weights run
through vLLM's FP4 path; the pushed LoRA and trained norms change what vLLM computes, and its sampled-token
log-probs then match the trainer's recomputation of the same tokens; AQN noise on vLLM's own norms moves the
log-probs beyond vLLM's round-to-round jitter and every weight comes back bit for bit; sleep frees GPU memory
and keeps the weights.
"""

import contextlib
import importlib.util

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM"),
]

SIGMA = 1e-2


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from vllm_policy import colocated_vllm, random_nvfp4_policy

    folder, peft_model = random_nvfp4_policy(tmp_path_factory.mktemp("vllm"))
    generation_config = peft_model.generation_config
    # No top-p/top-k: their renormalisation would shift vLLM's processed log-probs away from logits / T.
    generation_config.update(max_new_tokens=24, do_sample=True, temperature=0.8, top_p=1.0, top_k=0)
    backend = colocated_vllm(folder, peft_model, generation_config)
    prompts = [torch.randint(3, 2048, (n,)).tolist() for n in (17, 40, 64, 9)]
    return backend, peft_model, prompts


def _sample(backend, prompts, perturb=None, seed=7):
    """A round through the backend with per-request seeds, so equal weights give equal samples."""
    backend.sampling["seed"] = seed
    try:
        return backend.generate(prompts, perturb or (lambda model: contextlib.nullcontext()))
    finally:
        del backend.sampling["seed"]


def _recompute(peft_model, prompt, completion, temperature=0.8):
    ids = torch.tensor([prompt + completion], device="cuda")
    with torch.no_grad():
        logits = peft_model(ids).logits[0, len(prompt) - 1 : -1].float() / temperature
    return logits.log_softmax(-1).gather(-1, torch.tensor(completion, device="cuda")[:, None]).squeeze(-1)


def test_nvfp4_weights_run_through_vllms_fp4_path(setup):
    backend, _, _ = setup
    backend.engine.wake_up()
    try:
        qkv = backend.engine.model.model.layers[0].self_attn.qkv_proj.base_layer  # under vLLM's LoRA wrapper
        scheme = qkv.scheme
        print(
            "vLLM qkv_proj:",
            type(scheme).__name__,
            getattr(scheme, "kernel", None),
            {k: (tuple(v.shape), v.dtype) for k, v in qkv.named_parameters()},
        )
        assert "FP4" in type(scheme).__name__.upper(), type(scheme).__name__
        assert qkv.weight_scale.dtype == torch.float8_e4m3fn  # the checkpoint's FP8 group scales, 4-bit codes
        norm = backend.engine.model.model.layers[0].input_layernorm
        assert norm.weight.dtype == torch.float32  # FP32 scales, so that AQN's small noise survives
    finally:
        backend.engine.sleep()


def test_lora_and_norms_reach_vllm_and_logprobs_match_the_trainer(setup):
    backend, peft_model, prompts = setup
    out = _sample(backend, prompts)
    diffs = []
    for prompt, completion, logprobs in zip(prompts, out.completion_ids, out.logprobs, strict=True):
        assert len(completion) == len(logprobs) > 0
        ours = _recompute(peft_model, prompt, completion)
        diffs.append((ours - torch.tensor(logprobs, device="cuda")).abs())
    mismatch = torch.cat(diffs).mean().item()
    # The same tokens scored by the policy without its adapter: what the pushed LoRA and norms contribute.
    with peft_model.disable_adapter():
        base_gap = (
            torch.cat(
                [
                    (_recompute(peft_model, p, c) - torch.tensor(lp, device="cuda")).abs()
                    for p, c, lp in zip(prompts, out.completion_ids, out.logprobs, strict=True)
                ]
            )
            .mean()
            .item()
        )
    print(f"vLLM vs trainer log-prob |difference|: mean {mismatch:.4f} (without the adapter: {base_gap:.4f})")
    assert mismatch < 0.02 and base_gap > 5 * mismatch


def _weights(engine) -> dict[str, torch.Tensor]:
    engine.wake_up()
    try:
        return {name: param.detach().clone() for name, param in engine.model.named_parameters()}
    finally:
        engine.sleep()


def _first_token_gap(a, b) -> float:
    """Mean |difference| of the first sampled token's log-prob (same seed and prompt: the same token)."""
    assert [ids[0] for ids in a.completion_ids] == [ids[0] for ids in b.completion_ids]
    return sum(abs(x[0] - y[0]) for x, y in zip(a.logprobs, b.logprobs, strict=True)) / len(a.logprobs)


def test_aqn_reaches_vllm_and_is_restored_bit_for_bit(setup):
    """vLLM's rounds are not bit-reproducible (two clean rounds with the same seeds differ by ~2e-3 in log-prob,
    every parameter unchanged: measured on an H100, see docs/benchmarks.md), so the noise is judged against
    that jitter and the restore on the weights themselves."""
    from qerl import aqn

    backend, _, prompts = setup
    clean, clean_again = _sample(backend, prompts), _sample(backend, prompts)
    jitter = _first_token_gap(clean, clean_again)
    before = _weights(backend.engine)

    def noisy(model, sigma):
        # As the trainer calls it on an engine's model: vLLM's FP32 norms apply the scale themselves.
        return aqn.noisy_norms(model, sigma, torch.Generator().manual_seed(0), fp32_compute=False)

    shifts = {}
    for sigma in (SIGMA, 1e-4):  # the first and the last noise level of the default schedule
        perturbed = _sample(backend, prompts, lambda model, sigma=sigma: noisy(model, sigma))
        # Every scale entry of every layer norm vLLM runs moved (FP32 scales keep even sigma 1e-4).
        assert perturbed.noise.num_norms == 2 * 4 and perturbed.noise.changed_fraction > 0.99
        shifts[sigma] = _first_token_gap(perturbed, clean)
    print(
        f"first-token |logprob| jitter between clean rounds {jitter:.2e}; shift at sigma 1e-2 "
        f"{shifts[SIGMA]:.2e}, at 1e-4 {shifts[1e-4]:.2e}"
    )
    assert shifts[SIGMA] > 2 * jitter + 1e-3
    after = _weights(backend.engine)
    for name, value in before.items():  # every tensor vLLM computes with is back, bit for bit
        assert torch.equal(after[name], value), name


def test_sleep_frees_memory_and_keeps_the_weights(setup):
    backend, _, prompts = setup
    before = _weights(backend.engine)
    first = _sample(backend, prompts)
    assert backend.engine.asleep
    asleep_free, _ = torch.cuda.mem_get_info()
    backend.engine.wake_up()
    awake_free, _ = torch.cuda.mem_get_info()
    backend.engine.sleep()
    print(f"sleep frees {(asleep_free - awake_free) / 2**30:.2f} GiB")
    assert asleep_free - awake_free > 2**30  # the KV cache (and the offloaded weights) at 0.25 utilization
    after = _weights(backend.engine)  # parked in CPU memory and back
    for name, value in before.items():
        assert torch.equal(after[name], value), name
    assert _first_token_gap(_sample(backend, prompts), first) < 1e-2  # the same samples, up to vLLM's jitter
