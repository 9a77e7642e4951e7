"""The `server` rollout backend: each round sampled by rollout servers on GPUs of their own (python -m
qerl.rollout_server, one per GPU), with the policy's adapter.

Every round: a snapshot of the policy's LoRA and trained norms (version: the optimizer steps it has taken), sent to
the servers that do not hold it yet; the round's AQN as its seed, round and sigma, which each server turns into the
trainer's noise on its own norms; the prompts cut into one shard per server; the digest of the norms each server
sampled under, checked against the same noise on the policy.

With max_staleness 0 the trainer waits for each round as its step needs it. With 1, the trainer hands over the next
round's prompts and noise as soon as it has taken this one (`sample_ahead`), and the servers sample it while this
step trains, with this step's adapter (qerl/rollout/remote.py's RolloutPipeline): the round the next step trains on
was sampled one version behind, which TRL's importance-sampling correction accounts for.
"""

from __future__ import annotations

import torch

from qerl import aqn
from qerl.errors import UsageError
from qerl.rollout.base import Perturb, RolloutBackend, RolloutOutput, RolloutSetup
from qerl.rollout.remote import AdapterMismatch, RolloutPipeline, ServerPool
from qerl.rollout.vllm import lora_settings, sampling_kwargs
from qerl.rollout.wire import NoiseSpec, RoundResult, norms_digest, snapshot

# A round without AQN (evaluation, or AQN off): sigma 0 draws nothing, whatever the other settings.
NO_NOISE = NoiseSpec(0.0, (0, 0), 0, False, False, "fp32")


def noise_spec(perturb: Perturb) -> NoiseSpec:
    """The round's AQN as the servers take it: a NoisyRound's fields, or none for another perturb (rollout.no_noise)."""
    if isinstance(perturb, aqn.NoisyRound):
        return NoiseSpec.of(perturb.noise, perturb.sigma, perturb.round)
    return NO_NOISE


def noisy_norms_digest(policy, spec: NoiseSpec) -> str:
    """The digest a server reports of its norms under the round's noise, taken on the policy: what the servers must
    have sampled with (their norms are the checkpoint's, or the trained ones sent, and the noise is a function of
    the spec alone)."""
    noise = spec.round_noise()
    with noise.of_round(policy, spec.sigma, spec.round, fp32_compute=False):
        return norms_digest(policy, noise)


class ServerRollout(RolloutBackend):
    """Rollouts from the servers in RolloutSetup.server, on the checkpoint the policy came from (the handshake compares
    the servers' base with it and refuses one that differs)."""

    name = "server"

    def __init__(self, setup: RolloutSetup):
        super().__init__(setup)
        settings = setup.server
        if not settings.urls:
            raise UsageError(
                "rollout_backend server: give rollout_servers, the address of each rollout server "
                "(http://HOST:PORT; start one per GPU with python -m qerl.rollout_server)"
            )
        with setup.open_policy() as policy:
            if not hasattr(policy, "peft_config"):
                raise UsageError("rollout_backend server samples a LoRA policy: the servers hold the base alone")
            rank = lora_settings(policy)["r"]
        self.sampling = sampling_kwargs(setup.generation_config, setup.eos_token_ids)
        self.pool = ServerPool(settings.urls, setup.model_path, lora_rank=rank, timeout=settings.timeout)
        self.pool.handshake(settings.timeout)
        self.timeout = settings.timeout
        self.pipeline = RolloutPipeline(self.pool, settings.max_staleness, settings.timeout)
        self.ahead: dict[NoiseSpec, tuple[int, list[list[int]]]] = {}  # a round sampled ahead: its index and prompts
        self.rounds = 0  # rounds handed to the pipeline (their indices)
        self.rounds_ahead = 0  # of them, the rounds sampled ahead that a step then took

    def generate(self, prompt_ids: list[list[int]], perturb: Perturb) -> RolloutOutput:
        """The round of `perturb`: the one sampled ahead for it when its prompts and noise are these, else sampled
        now. Either way with the policy's adapter as it is now published first."""
        spec = noise_spec(perturb)
        with self.setup.open_policy() as policy:
            adapter = snapshot(policy, spec.round[0])
            expected = noisy_norms_digest(policy, spec)
        self.pipeline.publish(adapter)
        index, prompts = self.ahead.pop(spec, (None, None))
        # Rounds sampled ahead for this step or an earlier one that are not this round (another round of the step
        # came first, an evaluation's; or other prompts, a resumed run's) will never be asked for.
        for stale in [s for s in self.ahead if s.round[0] <= spec.round[0]]:
            self.pipeline.discard(self.ahead.pop(stale)[0])
        if prompts == prompt_ids:
            self.rounds_ahead += 1
        else:
            if index is not None:
                self.pipeline.discard(index)
            index = self._submit(prompt_ids, spec)
        result = self.pipeline.result(index, self.timeout)
        # A round sampled one version behind had the norms of that version: checked where the norms are not trained.
        if result.adapter_version == adapter.version or not adapter.norms:
            self._check_norms(result, spec, expected)
        return RolloutOutput(result.completion_ids, result.logprobs, result.noise, result.adapter_version)

    def sample_ahead(self, prompt_ids: list[list[int]], perturb: aqn.NoisyRound) -> None:
        """Start sampling a later round (`perturb`: its noise, of the step it will train) with the newest adapter;
        `generate` of that round takes it."""
        spec = noise_spec(perturb)
        self.ahead[spec] = (self._submit(prompt_ids, spec), prompt_ids)

    def _submit(self, prompt_ids: list[list[int]], spec: NoiseSpec) -> int:
        self.rounds += 1
        self.pipeline.submit(self.rounds, prompt_ids, spec, self.sampling)
        return self.rounds

    def _check_norms(self, result: RoundResult, spec: NoiseSpec, expected: str) -> None:
        if result.noise_digest != expected:
            step, k = spec.round
            raise AdapterMismatch(
                f"rollout servers {result.server} sampled round {k} of step {step} under other norms than the trainer's"
                f" ({result.noise_digest[:12]} vs {expected[:12]}): another checkpoint's "
                f"norms, or another torch (the trainer's is {torch.__version__}; see each server's /qerl/info)"
            )
