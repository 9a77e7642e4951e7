"""The `server` rollout backend: each round sampled by rollout servers on GPUs of their own (python -m
qerl.rollout_server, one per GPU), with the policy's adapter as it is now.

Every round: a snapshot of the policy's LoRA and trained norms, sent to the servers that do not hold it yet (a new
version whenever its digest changed: once per optimizer step, not once per round); the round's AQN as its seed,
round and sigma, which each server turns into the trainer's noise on its own norms; the prompts cut into one shard
per server; the digest of the norms each server sampled under, checked against the same noise on the policy.
Synchronous: the trainer waits for its round (staleness 0), so its samples are those of the colocated
vllm backend on the same adapter and noise. Sampling ahead while a step trains (qerl/rollout/remote.py's
RolloutPipeline) is not wired into the trainer yet.
"""

from __future__ import annotations

import dataclasses

import torch

from qerl import aqn
from qerl.aqn import RoundNoise
from qerl.errors import UsageError
from qerl.rollout.base import Perturb, RolloutBackend, RolloutOutput, RolloutSetup
from qerl.rollout.remote import AdapterMismatch, ServerPool
from qerl.rollout.vllm import lora_settings, sampling_kwargs
from qerl.rollout.wire import AdapterSnapshot, NoiseSpec, norms_digest, snapshot

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
    noise = RoundNoise(*spec.settings)
    with noise.of_round(policy, spec.sigma, spec.round, fp32_compute=False):
        return norms_digest(policy, noise)


class ServerRollout(RolloutBackend):
    """Rollouts from the servers in RolloutSetup.server, on the checkpoint the policy came from (the handshake compares
    the servers' base with it and refuses one that differs)."""

    name = "server"

    def __init__(self, setup: RolloutSetup):
        super().__init__(setup)
        if not setup.server.urls:
            raise UsageError(
                "rollout_backend server: give rollout_servers, the address of each rollout server "
                "(http://HOST:PORT; start one per GPU with python -m qerl.rollout_server)"
            )
        with setup.open_policy() as policy:
            if not hasattr(policy, "peft_config"):
                raise UsageError("rollout_backend server samples a LoRA policy: the servers hold the base alone")
            rank = lora_settings(policy)["r"]
        self.sampling = sampling_kwargs(setup.generation_config, setup.eos_token_ids)
        self.pool = ServerPool(setup.server.urls, setup.model_path, lora_rank=rank, timeout=setup.server.timeout)
        self.pool.handshake(setup.server.timeout)
        self.adapter: AdapterSnapshot | None = None  # the newest adapter sent
        self.rounds = 0

    def generate(self, prompt_ids: list[list[int]], perturb: Perturb) -> RolloutOutput:
        spec = noise_spec(perturb)
        with self.setup.open_policy() as policy:
            self.adapter = self._current_adapter(policy)
            expected = noisy_norms_digest(policy, spec)
        self.pool.sync(self.adapter)
        result = self.pool.generate(self.rounds, self.adapter.version, spec, self.sampling, prompt_ids)
        if result.noise_digest != expected:
            raise AdapterMismatch(
                f"rollout servers {result.server} sampled round {self.rounds} under other norms than the trainer's "
                f"({result.noise_digest[:12]} vs {expected[:12]}): another checkpoint's norms, or another torch "
                f"(the trainer's is {torch.__version__}; see each server's /qerl/info)"
            )
        self.rounds += 1
        return RolloutOutput(result.completion_ids, result.logprobs, result.noise)

    def _current_adapter(self, policy) -> AdapterSnapshot:
        """The policy's adapter: the one sent last while its tensors are unchanged, else a new version."""
        current = snapshot(policy, 0)
        if self.adapter is None:
            return current
        changed = current.digest != self.adapter.digest
        return dataclasses.replace(current, version=self.adapter.version + changed)
