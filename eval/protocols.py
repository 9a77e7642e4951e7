"""How an evaluation samples. Protocols fix the sampling knobs; everything else about decoding (stop tokens, pad token)
comes from the checkpoint, for an NVFP4 base as for a BF16 one:
  reference  the QeRL reference's eval: temperature 0.6, top-p 0.95, 1024 new tokens (vLLM SamplingParams: no top-k,
             no repetition penalty), seeded
  greedy     greedy decoding
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Protocol:
    do_sample: bool
    temperature: float | None
    top_p: float | None
    max_new_tokens: int


PROTOCOLS = {
    "reference": Protocol(do_sample=True, temperature=0.6, top_p=0.95, max_new_tokens=1024),
    "greedy": Protocol(do_sample=False, temperature=None, top_p=None, max_new_tokens=1024),
}


@dataclass(frozen=True)
class Sampling:
    """A protocol as one run applies it: its knobs, the new-token budget and the seed."""

    do_sample: bool
    temperature: float | None
    top_p: float | None
    max_new_tokens: int
    seed: int

    @classmethod
    def of(cls, protocol: Protocol, max_new_tokens: int | None, seed: int) -> Sampling:
        return cls(
            protocol.do_sample, protocol.temperature, protocol.top_p, max_new_tokens or protocol.max_new_tokens, seed
        )
