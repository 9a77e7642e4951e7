"""benchmarks/probes/step_costs.py's stand-ins (CPU, a tiny BF16 Qwen2 with a LoRA adapter): each one really replaces
its kernel family in the engine's step, and leaves the engine as it was."""

import torch
from peft import get_peft_model
from transformers import GenerationConfig

from benchmarks.probes.step_costs import STAND_INS, step_costs, without
from qerl import lora
from qerl.rollout.native.decoder import Decoder
from qerl.rollout.native.engine import NativeEngine
from qerl.rollout.native.sampling import Sampler
from qerl.tiny import build_tiny


def _engine():
    model, tokenizer = build_tiny(dtype=torch.bfloat16, num_layers=2)
    model = get_peft_model(model, lora.lora_config(model, rank=4, alpha=8))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)  # peft starts B at zero: removing the adapter would change nothing
    engine = NativeEngine(
        Decoder(model.eval()), Sampler(GenerationConfig(do_sample=False)), [-1], tokenizer.pad_token_id
    )
    engine.decoder.refresh()
    gen = torch.Generator().manual_seed(0)
    return engine, [torch.randint(10, len(tokenizer), (n,), generator=gen).tolist() for n in (5, 9)]


def test_each_stand_in_changes_the_step_and_is_undone():
    engine, prompts = _engine()
    reference = engine.generate(prompts, 6)
    for family in STAND_INS:
        with without(engine, [family]):
            assert engine.generate(prompts, 6) != reference, family
        assert engine.generate(prompts, 6) == reference, family


def test_rows_cover_every_family_alone_and_all_at_once():
    engine, prompts = _engine()
    rows = step_costs(engine, prompts, 4, repeats=1)
    assert [row["replaced"] for row in rows] == [[], *[[f] for f in STAND_INS], list(STAND_INS), []]
    assert all(row["ms_per_step"] > 0 for row in rows)
