"""The `native` rollout backend: batched sampling on the policy's own modules and memory, no second copy of any
weight, the whole decode step in one CUDA graph.

    decoder.py      the policy's decoder as fused steps over its own tensors (q/k/v and gate/up as one GEMM each,
                    LoRA unmerged in fixed BF16 buffers, FP32 norm scales that AQN perturbs in place)
    elementwise.py  fused elementwise kernels: residual + RMSNorm, rotary + KV-cache write, SiLU / GELU-tanh gate
    attention.py    decode attention over each sequence's valid keys only (Triton, split-K)
    sampling.py     temperature / top-k / top-p / min-p and the sampled token's log-prob, on the GPU
    kv_cache.py     the cache's layout and its FP8 format
    engine.py       KV cache sized from the round's lengths (waves when it does not fit), prefill, graph, EOS,
                    live-row compaction
    decode_state.py what a captured decode step reads and advances, and what a kept wave holds between rounds

Every round: refresh the decoder's LoRA buffers and norm scales from the policy (gathered whole where FSDP2 or
ZeRO-3 shard it) -> AQN noise on those scales -> prefill + decode -> clean scales back. Runs on CPU too (eager,
PyTorch twins of the kernels), which is how the tests check it against the policy's own forward.
"""

from __future__ import annotations

import torch

from qerl.rollout.base import Perturb, RolloutBackend, RolloutOutput, RolloutSetup, truncate_at_eos


class NativeRollout(RolloutBackend):
    """Settings: RolloutSetup.native (KV-cache budget and dtype); under FSDP2 / ZeRO-3 (RolloutSetup.sharding) the
    policy's parameters are gathered whole every round (see decoder.py, `Decoder.refresh`)."""

    name = "native"

    def __init__(self, setup: RolloutSetup):
        from qerl.rollout.native.sampling import Sampler

        super().__init__(setup)
        self.generation_config = setup.generation_config  # max_new_tokens is read every round
        self.sampler = Sampler(setup.generation_config)
        self.engine = None
        self._policy_id = None
        with setup.open_policy() as policy:  # a model the engine cannot run is refused now, not at the first round
            self._engine_for(policy)

    def _engine_for(self, policy):
        from qerl.rollout.native.decoder import Decoder
        from qerl.rollout.native.engine import NativeEngine

        if self.engine is None or self._policy_id != id(policy):  # built once: the module tree never changes
            settings = self.setup.native
            gib = settings.kv_cache_gib
            decoder = Decoder(policy, gather_each_round=self.setup.sharding is not None)
            self.engine = NativeEngine(
                decoder,
                self.sampler,
                self.setup.eos_token_ids,
                self.setup.pad_token_id,
                kv_cache_bytes=None if gib is None else int(gib * 2**30),
                kv_cache_dtype=settings.kv_cache_dtype,
                compact_rows=settings.compact_rows,
                keep_between_rounds=settings.keep_between_rounds,
            )
            self._policy_id = id(policy)
        return self.engine

    def generate(self, prompt_ids: list[list[int]], perturb: Perturb) -> RolloutOutput:
        setup = self.setup
        with setup.open_policy() as policy, torch.no_grad():
            engine = self._engine_for(policy)
            engine.decoder.refresh()
            try:
                with perturb(engine.decoder.norms) as noise:
                    ids, logprobs = engine.generate(prompt_ids, int(self.generation_config.max_new_tokens))
            finally:
                engine.decoder.release()
        output = truncate_at_eos(ids, logprobs, setup.eos_token_ids)
        output.noise = noise
        return output
