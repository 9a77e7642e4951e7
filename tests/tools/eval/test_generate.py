"""An evaluation's completions (eval/generate.py), through eval.gsm8k: runs with and without a LoRA through the
rollout engines training uses, seeded, and auto falling back where the native engine refuses a model."""

import json

import pytest
import torch
from eval_runs import _eval
from peft import LoraConfig, get_peft_model

from eval import gsm8k
from eval.protocols import PROTOCOLS, Sampling
from qerl.base_model import load_base_model


def test_runs_on_nvfp4_base_applies_the_adapter_and_is_seeded(checkpoints, tmp_path):
    _, nvfp4_dir = checkpoints
    data = tmp_path / "gsm8k.jsonl"
    data.write_text(
        "".join(
            json.dumps({"question": f"What is {a} plus {a}?", "answer": f"{a}+{a}={2 * a}\n#### {2 * a}"}) + "\n"
            for a in (3, 11, 40)
        )
    )
    base = load_base_model(nvfp4_dir, precision="nvfp4", device="cpu")
    torch.manual_seed(0)
    adapter = get_peft_model(
        base, LoraConfig(r=4, lora_alpha=64, target_modules=["q_proj", "down_proj"], init_lora_weights=False)
    )
    adapter.save_pretrained(tmp_path / "adapter")

    argv = ["--model", nvfp4_dir, "--data", str(data), "--max-new-tokens", "6", "--batch-size", "2", "--device", "cpu"]
    results = {}
    for name, extra in (("base", []), ("lora", ["--adapter", str(tmp_path / "adapter")]), ("again", [])):
        summary, rows = _eval(gsm8k, [*argv, *extra], tmp_path / f"{name}.jsonl")
        assert summary["examples"] == 3 and len(rows) == 3 and summary["protocol"] == "reference"
        assert (summary["temperature"], summary["top_p"], summary["seed"]) == (0.6, 0.95, 0)
        low, high = summary["accuracy_ci95"]
        assert 0.0 <= low <= summary["accuracy"] <= high <= 1.0 and "accuracy_flexible_ci95" in summary
        assert [r["gold"] for r in rows] == ["6", "22", "80"] and all(isinstance(r["correct"], bool) for r in rows)
        results[name] = [r["completion"] for r in rows]
    assert results["base"] != results["lora"]  # the adapter reached generation
    assert results["base"] == results["again"]  # sampled, but seeded
    greedy, _ = _eval(gsm8k, [*argv, "--protocol", "greedy"], tmp_path / "greedy.jsonl")
    assert greedy["do_sample"] is False and not list(tmp_path.glob("*.partial-*"))


def test_native_backend_runs_on_the_policy_and_auto_falls_back_as_training_does(
    checkpoints, tmp_path, monkeypatch, capsys
):
    """--rollout-backend native samples with the engine training uses (here on the CPU, seeded) and greedy decodes
    what transformers' generate decodes; auto falls back where the engine refuses a model through the rule training
    uses (rollout.with_auto_fallback)."""
    from qerl import rollout

    _, nvfp4_dir = checkpoints
    data = tmp_path / "gsm8k.jsonl"
    data.write_text("".join(json.dumps({"question": f"{a} + {a}?", "answer": f"#### {2 * a}"}) + "\n" for a in (1, 7)))
    argv = ["--model", nvfp4_dir, "--data", str(data), "--max-new-tokens", "5", "--device", "cpu"]
    runs = [_eval(gsm8k, [*argv, "--rollout-backend", "native"], tmp_path / f"native{i}.jsonl")[1] for i in range(2)]
    assert [r["completion"] for r in runs[0]] == [r["completion"] for r in runs[1]] and len(runs[0]) == 2
    greedy = {
        name: [r["completion"] for r in _eval(gsm8k, [*argv, "--protocol", "greedy", "--rollout-backend", name],
                                               tmp_path / f"greedy-{name}.jsonl")[1]]
        for name in ("native", "transformers")
    }  # fmt: skip
    assert greedy["native"] == greedy["transformers"]

    build = rollout.build_backend

    def refuse_native(name, setup):
        if name == "native":
            raise rollout.Unsupported("the native engine cannot run this model")
        return build(name, setup)

    monkeypatch.setattr(rollout, "resolve_backend", lambda name, device=None: "native")  # as on a GPU
    monkeypatch.setattr(rollout, "build_backend", refuse_native)
    _, rows = _eval(gsm8k, [*argv, "--protocol", "greedy"], tmp_path / "auto.jsonl")
    assert [r["completion"] for r in rows] == greedy["transformers"]
    assert "eval: the native engine cannot run this model; using transformers" in capsys.readouterr().out


@pytest.mark.parametrize("protocol", sorted(PROTOCOLS))
def test_each_protocol_sets_no_flag_its_decoding_ignores(checkpoints, protocol):
    """transformers warns of a sampling flag set beside greedy decoding ("The following generation flags are not
    valid and may be ignored: ['top_k']"): neither the protocol's config nor the one the transformers backend runs
    carries one (strict validation raises on what would be warned)."""
    from eval.generate import ModelSpec, _backend, generation_config
    from qerl.base_model import load_tokenizer

    _, nvfp4_dir = checkpoints
    sampling = Sampling.of(PROTOCOLS[protocol], 4, 0)
    generation_config(sampling).validate(strict=True)
    spec = ModelSpec(nvfp4_dir, "auto", None, "cpu", rollout_backend="transformers")
    policy = lambda: load_base_model(nvfp4_dir, device="cpu")  # noqa: E731
    backend = _backend(spec, sampling, load_tokenizer(nvfp4_dir), policy, "transformers")
    backend.generation_config.validate(strict=True)
