"""The native engine's fused temperature sampler (qerl/rollout/native/sampling.py) under the Triton interpreter on the
CPU: draws that follow softmax(logits / T), the log-probs of what it drew, fresh draws per call, reproducible under
torch.manual_seed. (GPU: test_engine_gpu.py compares the engine's sampled log-probs with the trainer's.)"""

import torch
from interpreter import run_under_interpreter
from seeds import seed_torch
from transformers import GenerationConfig

from qerl.rollout.native import sampling

CHI2_17_P1E6 = 60.13  # chi-square critical value, 17 degrees of freedom, p = 1e-6 (scipy.stats.chi2.ppf)


def _interpreter_checks():
    seed = seed_torch()  # the subprocess's output is shown when the test fails
    sampler = sampling.Sampler(GenerationConfig(do_sample=True, temperature=0.7), vocab_chunk=16)
    assert sampler.temperature == 0.7

    # 1,024 rows of the same 18 logits (two chunks of 16, the second partial): each row one independent draw. Logits
    # in [0, 1) keep every expected count near 20 or above, where the chi-square statistic is trustworthy; a draw that
    # ignored the second chunk fails it (99.9% of logits, simulated). The interpreter runs a program per row and chunk,
    # ~15 ms each: the 2,048 rows of 20 logits this drew before took 91 s on the 2-core machine and 156 s beside two
    # busy processes, on the way to the subprocess's timeout, then 300 s (issue 53 item 7); these take about half.
    logits = torch.rand(18)
    draws, logprobs = sampler(logits.expand(1024, 18).contiguous())
    probs = torch.softmax(logits.double() / 0.7, -1)
    counts = torch.bincount(draws, minlength=18).double()
    expected = probs * 1024
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    assert chi2 < CHI2_17_P1E6, (chi2, counts.tolist(), expected.tolist())
    torch.testing.assert_close(logprobs.double(), probs.log()[draws], rtol=0, atol=1e-5)

    # The log-prob of each drawn token is log_softmax(logits / T) there, at a real vocabulary's scale.
    logits = torch.randn(3, 3000) * 4
    tokens, logprobs = sampling.sample_fused(logits, 0.7, vocab_chunk=256)
    reference = torch.log_softmax(logits.double() / 0.7, -1).gather(-1, tokens[:, None])[:, 0]
    torch.testing.assert_close(logprobs.double(), reference, rtol=0, atol=1e-5)

    # Every call draws afresh (the seed comes from torch's generator), and torch.manual_seed replays the draws.
    flat = torch.zeros(8, 3000)
    first, again = sampling.sample_fused(flat, 1.0)[0], sampling.sample_fused(flat, 1.0)[0]
    assert not torch.equal(first, again)
    torch.manual_seed(seed)
    replay = sampling.sample_fused(flat, 1.0)[0]
    torch.manual_seed(seed)
    assert torch.equal(sampling.sample_fused(flat, 1.0)[0], replay)
    print("interpreter checks passed")


def test_triton_interpreter():
    run_under_interpreter(__file__)


def test_fused_path_only_for_a_temperature_alone():
    def temperature(**options):
        return sampling.Sampler(GenerationConfig(**options)).temperature

    assert temperature(do_sample=True, temperature=0.7) == 0.7
    assert temperature(do_sample=True, temperature=1.0, top_k=0, top_p=1.0) == 1.0  # no warper at all
    assert temperature(do_sample=True, temperature=0.7, top_k=20) is None
    assert temperature(do_sample=True, top_p=0.9) is None
    greedy = sampling.Sampler(GenerationConfig(do_sample=False))
    logits = torch.randn(4, 50)
    assert torch.equal(greedy(logits)[0], logits.argmax(-1))  # greedy never draws


if __name__ == "__main__":
    _interpreter_checks()
