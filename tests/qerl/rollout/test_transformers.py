"""The transformers rollout backend (qerl/rollout/transformers.py): the log-probs it records are those of the
filtered, temperature-scaled distribution it samples from."""

import torch

from qerl.rollout.transformers import SampledTokenLogprobs
from qerl.rollout.warpers import sampling_warpers


def test_sampled_token_logprobs_with_filters():
    """The recorder's log-probs are those of the filtered, temperature-scaled distribution it samples from."""
    from transformers import GenerationConfig

    torch.manual_seed(0)
    logits = [torch.randn(3, 20) for _ in range(4)]
    warpers = sampling_warpers(GenerationConfig(temperature=0.5, top_k=5, top_p=0.9, do_sample=True))
    recorder = SampledTokenLogprobs(warpers)
    ids = torch.zeros(3, 1, dtype=torch.long)
    expected = []
    for step_logits in logits:
        logp = recorder(ids, step_logits)
        token = torch.multinomial(logp.exp(), 1)
        ref = step_logits / 0.5
        kth = ref.topk(5).values[:, -1:]
        ref = ref.masked_fill(ref < kth, -float("inf"))
        probs = ref.softmax(-1)
        sorted_probs, order = probs.sort(descending=True)
        drop = sorted_probs.cumsum(-1) - sorted_probs > 0.9
        ref = ref.masked_fill(drop.scatter(1, order, drop), -float("inf"))
        expected.append(ref.log_softmax(-1).gather(1, token).squeeze(1))
        ids = torch.cat([ids, token], dim=1)
    got = recorder.finish(ids[:, 1:])
    torch.testing.assert_close(got, torch.stack(expected, 1))
