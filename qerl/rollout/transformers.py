"""The `transformers` rollout backend: generate() on the training policy itself (LoRA active, no merge).

Runs wherever the policy runs (CPU tests, any GPU, every distributed setup TRL supports), with no second
copy of the weights, but decodes eagerly: on a GPU the vLLM backend is many times faster.
"""

from __future__ import annotations

import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

from qerl.rollout.base import Perturb, RolloutBackend, RolloutOutput, RolloutSetup, truncate_at_eos
from qerl.rollout.warpers import sampling_warpers


class SampledTokenLogprobs(LogitsProcessor):
    """Last logits processor of generate(): applies the sampling warpers itself and records the log-probability
    of each token that gets sampled.

    generate() puts user processors before its own warpers, so a recorder passed in would see the scores before
    temperature; here the warpers are switched off in the GenerationConfig and applied in this processor,
    which returns log-probs (softmax of log-probs is the same distribution). A token's log-prob is read on the
    next call, when it appears in input_ids, so memory holds one [batch, vocab] row, not the whole sequence.
    """

    def __init__(self, warpers: LogitsProcessorList):
        self.warpers = warpers
        self._last: torch.Tensor | None = None
        self._picked: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self._last is not None:
            self._picked.append(self._last.gather(-1, input_ids[:, -1:]).squeeze(-1))
        logprobs = torch.log_softmax(self.warpers(input_ids, scores.float()), dim=-1)
        self._last = logprobs
        return logprobs

    def finish(self, completion_ids: torch.LongTensor) -> torch.Tensor:
        """[batch, completion length] log-probs of `completion_ids` (the tokens generate() returned)."""
        steps = completion_ids.size(1)
        if steps == 0:
            return completion_ids.new_zeros(completion_ids.shape, dtype=torch.float32)
        picked = [*self._picked, self._last.gather(-1, completion_ids[:, -1:]).squeeze(-1)]
        if len(picked) < steps:
            raise RuntimeError(f"recorded {len(picked)} sampling steps for {steps} generated tokens")
        return torch.stack(picked[:steps], dim=1)


class TransformersRollout(RolloutBackend):
    """Sample with transformers' generate() on the training policy itself (LoRA active, no merge)."""

    name = "transformers"

    def __init__(self, setup: RolloutSetup):
        super().__init__(setup)
        config = GenerationConfig.from_dict(setup.generation_config.to_dict())
        self.warpers = sampling_warpers(config)
        # The warpers run in SampledTokenLogprobs; neutral values here keep generate() from applying them twice.
        # Greedy decoding applies none, and transformers warns of sampling flags set beside do_sample False.
        if config.do_sample:
            config.update(temperature=1.0, top_k=0, top_p=1.0, min_p=None)
        self.generation_config = config

    def generate(self, prompt_ids: list[list[int]], perturb: Perturb) -> RolloutOutput:
        """The round's prompts, `setup.transformers.batch_size` per generate() call (all at once by default), all of
        them under one draw of the noise."""
        setup = self.setup
        size = setup.transformers.batch_size or max(1, len(prompt_ids))
        chunks = [prompt_ids[i : i + size] for i in range(0, len(prompt_ids), size)]
        if len(chunks) > 1:
            from tqdm.auto import tqdm

            chunks = tqdm(chunks, desc="generate", unit="batch")
        completion_ids, logprobs = [], []
        with (
            setup.open_policy() as model,
            torch.no_grad(),
            perturb(model) as noise,  # inside open_policy, so that ZeRO-3 has gathered the norm scales it perturbs
        ):
            for chunk in chunks:
                ids, lps = self._sample(model, chunk)
                completion_ids += ids
                logprobs += lps
        output = truncate_at_eos(completion_ids, logprobs, setup.eos_token_ids)
        output.noise = noise
        return output

    def _sample(self, model, prompt_ids: list[list[int]]) -> tuple[list[list[int]], list[list[float]]]:
        """(completion ids, their sampled-token log-probs) of one generate() call on left-padded prompts."""
        from trl.trainer.utils import pad

        setup = self.setup
        prompts = [torch.tensor(ids) for ids in prompt_ids]
        multiple = setup.pad_to_multiple_of
        input_ids = pad(prompts, setup.pad_token_id, padding_side="left", pad_to_multiple_of=multiple)
        attention_mask = pad([torch.ones_like(p) for p in prompts], 0, padding_side="left", pad_to_multiple_of=multiple)
        recorder = SampledTokenLogprobs(self.warpers)
        sequences = model.generate(
            input_ids=input_ids.to(setup.device),
            attention_mask=attention_mask.to(setup.device),
            generation_config=self.generation_config,
            logits_processor=LogitsProcessorList([recorder]),
        )
        completion_ids = sequences[:, input_ids.size(1) :]
        return completion_ids.cpu().tolist(), recorder.finish(completion_ids).float().cpu().tolist()
