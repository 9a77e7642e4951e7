"""Real GRPO/DAPO steps of QeRLTrainer (qerl/trainer.py) on a tiny NVFP4 policy (CPU), and the training step's
attention backends: cuDNN's SDPA backward (the cause of the SmolLM2 runs' NaNs) kept out of the step."""

import json
import math
import os

import pytest
import torch
import torch.nn.functional as F
from fakes import make_trainer, recipe_config
from torch.nn.attention import sdpa_kernel

from qerl import aqn, base_model, norms
from qerl.nvfp4.linear import NVFP4Linear
from qerl.rollout import RolloutOutput
from qerl.tiny import save_tiny_checkpoints
from qerl.trainer import TRAINING_SDPA_BACKENDS


def test_grpo_steps_on_nvfp4_policy(checkpoints, tmp_path):
    _, nvfp4_dir = checkpoints
    args = recipe_config(tmp_path, trainable_norms=True, num_stages=3, aqn_log_shift=True)
    trainer = make_trainer(nvfp4_dir, args)
    model = trainer.model
    assert trainer.aqn_enabled and trainer.is_nvfp4  # AQN defaults on for an NVFP4 base
    base = {n: b.clone() for n, b in model.named_buffers() if "weight_" in n}
    assert len(base) == 3 * 14 and all(
        isinstance(m, NVFP4Linear) for m in [model.get_submodule(n.rsplit(".", 1)[0]) for n in base]
    )
    trainable = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    assert len(trainable) == 2 * 14 + 4 and all(p.dtype == torch.float32 for p in trainable.values())  # FP32 masters

    # Watch every rollout: the noise the policy samples with, and the norms the trainer gets back.
    rounds, backend_generate = [], trainer.rollout.generate

    def watched_generate(prompt_ids, perturb):
        sites = norms.find_norms(model)
        assert len(sites.layer_norms) == 4 and all("modules_to_save" in p for p in sites.layer_norms)
        clean = {p: m.weight.detach().clone() for p, m in sites.layer_norms.items()}

        def spy(inner_model):
            cm = perturb(inner_model)

            class Spy:
                def __enter__(self):
                    stats = cm.__enter__()
                    noise = torch.cat([(m.weight - clean[p]).flatten() for p, m in sites.layer_norms.items()])
                    rounds.append(
                        {"step": trainer.state.global_step, "noise_std": noise.std().item(), "sigma": stats.sigma}
                    )
                    return stats

                def __exit__(self, *exc):
                    return cm.__exit__(*exc)

            return Spy()

        out = backend_generate(prompt_ids, spy)
        for p, m in sites.layer_norms.items():
            assert torch.equal(m.weight, clean[p]), f"{p} not restored after the rollout"
        rounds[-1]["logprobs"] = out.logprobs
        return out

    trainer.rollout.generate = watched_generate
    batches, score = [], trainer._generate_and_score_completions

    def capture(inputs):
        output = score(inputs)
        batches.append(output)
        return output

    trainer._generate_and_score_completions = capture
    trainer.train()

    # At the recipe's lr (1e-5) in BF16, every LoRA matrix and every trainable norm moved (a BF16 norm scale
    # near 1 would not: the step is below half its ulp); the NVFP4 base did not (bit for bit).
    unchanged = [n for n, p in model.named_parameters() if p.requires_grad and torch.equal(p, trainable[n])]
    assert not unchanged, f"not trained: {unchanged}"
    for n, b in model.named_buffers():
        if n in base:
            assert torch.equal(b, base[n]), n

    # The saved adapter (FP32 norms and LoRA) loads onto the BF16 base.
    from peft import PeftModel

    trainer.save_model(os.path.join(args.output_dir, "adapter"))
    reloaded = PeftModel.from_pretrained(
        base_model.load_base_model(nvfp4_dir, dtype=torch.bfloat16, device="cpu"),
        os.path.join(args.output_dir, "adapter"),
    )
    for n, p in reloaded.named_parameters():
        if "modules_to_save" in n or "lora_" in n:
            torch.testing.assert_close(p.float(), model.get_parameter(n).float(), rtol=4e-3, atol=0)

    # Sigma follows the schedule, one fresh draw per generation round, with the measured spread.
    assert [r["step"] for r in rounds] == [0, 1, 2, 3, 4]
    expected = [aqn.sigma_at(s, 5, 1e-2, 1e-4, 3) for s in range(5)]
    assert expected == [0.0, 1e-2, 1e-2, 1e-4, 1e-4]
    assert [r["sigma"] for r in rounds] == expected
    for r in rounds:
        assert r["noise_std"] == (0.0 if r["sigma"] == 0 else pytest.approx(r["sigma"], rel=0.3))
    logged = [h["aqn/sigma"] for h in trainer.state.log_history if "loss" in h]
    assert logged == pytest.approx(expected)

    # The rollout log-probs reached the trainer, token for token.
    assert len(batches) == 5
    for r, batch in zip(rounds, batches, strict=True):
        sampling = batch["sampling_per_token_logps"]
        mask = batch["completion_mask"].bool()
        for i, row in enumerate(r["logprobs"]):
            torch.testing.assert_close(sampling[i, : len(row)], torch.tensor(row))
        assert torch.isfinite(sampling[mask]).all() and (sampling[mask] <= 0).all()
    history = [h for h in trainer.state.log_history if "loss" in h]
    assert all("sampling/sampling_logp_difference/mean" in h for h in history)
    # Step 0 samples from the clean policy: rollout and training log-probs agree up to the BF16 numerics of
    # generate()'s KV-cache path, which rounds like the full forward on some CPUs (< 1e-5) and not on others (1.9e-3
    # on an AMD EPYC without AVX512-BF16); noisy steps differ, down to sigma 1e-4 (measured from the loss's own
    # forward: no extra pass).
    assert history[0]["sampling/sampling_logp_difference/max"] < 5e-3
    assert all(h["sampling/sampling_logp_difference/mean"] > 1e-5 for h in history[1:])
    # AQN's own movement of the policy, in the training forward under the round's noise: there at every level.
    assert "aqn/logprob_shift" not in history[0]
    assert all(h["aqn/logprob_shift"] > 0 for h in history[1:]), [h.get("aqn/logprob_shift") for h in history]

    # Every log line went to metrics.jsonl.
    with open(os.path.join(args.output_dir, "metrics.jsonl")) as f:
        lines = [json.loads(line) for line in f]
    assert [line["step"] for line in lines if "loss" in line] == [1, 2, 3, 4, 5]
    assert all({"reward", "entropy", "aqn/sigma"} <= line.keys() for line in lines if "loss" in line)


@pytest.mark.parametrize("backend", ["transformers", "native"])
def test_rollout_logprobs_match_trl_at_the_sampling_temperature(checkpoints, tmp_path, backend):
    """With AQN off, the rollout log-probs must equal TRL's own training log-probs (logits / temperature)."""
    _, nvfp4_dir = checkpoints
    args = recipe_config(tmp_path, aqn=False, temperature=0.7, max_steps=2, rollout_backend=backend)
    trainer = make_trainer(nvfp4_dir, args)
    assert trainer.rollout.name == backend
    trainer.train()
    history = [h for h in trainer.state.log_history if "loss" in h]
    assert all(h["aqn/sigma"] == 0.0 for h in history)
    # In BF16, generate()'s incremental (KV cache) forward and the full-sequence forward round differently:
    # ~1e-3 once the weights are no longer round numbers. A temperature applied wrongly would be off by ~1.
    assert max(h["sampling/sampling_logp_difference/max"] for h in history) < 1e-2


def test_importance_sampling_correction_uses_rollout_logprobs(checkpoints, tmp_path):
    """TRL's own path (its old-log-probs forward over the round), which tests/qerl/test_importance_correction.py
    holds the default (the ratio from the loss forward) to."""
    _, nvfp4_dir = checkpoints
    args = recipe_config(
        tmp_path,
        vllm_importance_sampling_correction=True,
        vllm_importance_sampling_mode="token_truncate",
        vllm_importance_sampling_clip_max=2.0,
        max_steps=2,
        sigma_start=0.5,
        sigma_end=0.1,
        num_stages=3,
    )
    trainer = make_trainer(nvfp4_dir, args)
    trainer.ratio_from_loss_forward = False
    batches, score = [], trainer._generate_and_score_completions
    trainer._generate_and_score_completions = lambda inputs: batches.append(score(inputs)) or batches[-1]
    trainer.train()
    noisy = batches[0]  # step 0 of 2 with 3 stages: sigma 0.5
    mask = noisy["completion_mask"]
    # TRL's token_truncate formula, applied to the rollout and training log-probs it was handed.
    expected = torch.clamp(
        torch.exp((noisy["old_per_token_logps"] - noisy["sampling_per_token_logps"]) * mask), max=2.0
    )
    torch.testing.assert_close(noisy["importance_sampling_ratio"], expected)
    assert (noisy["importance_sampling_ratio"][mask.bool()] != 1).any()
    assert "sampling/importance_sampling_ratio/mean" in trainer.state.log_history[0]


def test_generation_config_of_the_model_does_not_leak(checkpoints, tmp_path):
    """A checkpoint's own sampling defaults (here top_k=1) must not override the trainer's sampling."""
    _, nvfp4_dir = checkpoints
    trainer = make_trainer(nvfp4_dir, recipe_config(tmp_path, aqn=False, max_completion_length=6))
    trainer.model.generation_config.update(do_sample=True, top_k=1, temperature=0.1)
    prompt = trainer.processing_class.apply_chat_template(
        [{"role": "user", "content": "1+1="}], add_generation_prompt=True
    )["input_ids"]
    out = trainer.rollout.generate([prompt] * 16, lambda m: aqn.noisy_norms(m, 0.0))
    assert len({tuple(c) for c in out.completion_ids}) > 1


def test_bf16_checkpoint_and_its_nvfp4_twin_give_the_same_stop_tokens_and_defaults(tmp_path):
    """The NVFP4 loader reads generation_config.json as transformers does for BF16: an end-of-turn token that only
    the generation config declares stops both, and the sampling defaults match."""
    from transformers import GenerationConfig

    from qerl.tiny import build_tiny

    model, tokenizer = build_tiny()
    end_of_turn = tokenizer.convert_tokens_to_ids("<|user|>")
    model.generation_config = GenerationConfig(
        eos_token_id=[tokenizer.eos_token_id, end_of_turn],
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        do_sample=True,
        temperature=0.7,
        top_p=0.8,
        top_k=20,
        repetition_penalty=1.05,
    )
    bf16_dir, nvfp4_dir = save_tiny_checkpoints(str(tmp_path), model, tokenizer)
    trainers = [make_trainer(path, recipe_config(tmp_path)) for path in (bf16_dir, nvfp4_dir)]
    assert trainers[0].is_nvfp4 is False and trainers[1].is_nvfp4 is True
    assert trainers[0].eos_token_ids == trainers[1].eos_token_ids == [tokenizer.eos_token_id, end_of_turn]
    defaults = [t.model.generation_config.to_diff_dict() for t in trainers]
    for d in defaults:
        d.pop("transformers_version", None)
    assert defaults[0] == defaults[1] and defaults[0]["top_k"] == 20


def test_a_tokenizer_eos_the_generation_config_lacks_is_named_and_the_model_keeps_its_own(tmp_path):
    """A GGUF's tokenizer metadata names the wrong EOS (SmolLM2's: <|im_start|>, where its turns end with <|im_end|>).
    The trainer and eval warn naming both; rollouts stop at both (TRL's rule); the model's EOS ids stay its own from
    the first rollout on (transformers' Trainer.train aligns them to the tokenizer's before the first step)."""
    from eval import cli as eval_cli
    from qerl.tiny import build_tiny

    model, tokenizer = build_tiny()
    end_of_turn = tokenizer.convert_tokens_to_ids("<|user|>")
    model.config.eos_token_id = model.generation_config.eos_token_id = end_of_turn
    _, nvfp4_dir = save_tiny_checkpoints(str(tmp_path), model, tokenizer)
    named = (
        rf"the tokenizer's EOS '<\|end\|>' \(id 2\) is not among the generation config's EOS ids: '<\|user\|>' "
        rf"\(id {end_of_turn}\)"
    )
    with pytest.warns(UserWarning, match=named):
        eval_cli._warn_eos(nvfp4_dir)
    with pytest.warns(UserWarning, match=named + r"\. Rollouts end at any of them"):
        trainer = make_trainer(nvfp4_dir, recipe_config(tmp_path, max_steps=1, per_device_train_batch_size=4))
    assert trainer.eos_token_ids == [tokenizer.eos_token_id, end_of_turn]
    seen, generate = [], trainer.rollout.generate

    def probe(prompt_ids, perturb):
        seen.append((trainer.model.config.eos_token_id, trainer.model.generation_config.eos_token_id))
        return generate(prompt_ids, perturb)

    trainer.rollout.generate = probe
    trainer.train()
    assert seen == [(end_of_turn, end_of_turn)]
    assert (trainer.model.config.eos_token_id, trainer.model.generation_config.eos_token_id) == (end_of_turn,) * 2


def test_training_steps_run_without_cudnn_attention(checkpoints, tmp_path):
    _, nvfp4_dir = checkpoints
    trainer = make_trainer(nvfp4_dir, recipe_config(tmp_path, max_steps=1))
    seen, compute_loss = [], trainer.compute_loss

    def spy(*args, **kwargs):
        seen.append(torch.backends.cuda.cudnn_sdp_enabled())
        return compute_loss(*args, **kwargs)

    trainer.compute_loss = spy
    trainer.train()
    assert seen and not any(seen)  # forward (and the backward after it) inside the step: no cuDNN attention
    assert torch.backends.cuda.cudnn_sdp_enabled()  # restored for everything outside the step


def _left_padded_attention(length: int, device: str, dtype=torch.bfloat16):
    """SmolLM2's attention shapes (9 query heads, head dim 64) on 16 left-padded rows of `length` tokens, as
    transformers' SDPA path builds them: a boolean causal mask with padded keys off, so the query rows of the
    padding see no key at all."""
    generator = torch.Generator().manual_seed(length)
    rows, heads, dim = 16, 9, 64
    padding = torch.randint(0, length // 2, (rows,), generator=generator)
    padding[0] = 0
    keys_valid = torch.arange(length)[None, :] >= padding[:, None]
    mask = torch.ones(length, length, dtype=torch.bool).tril()[None] & keys_valid[:, None, :]
    q, k, v = (torch.randn(rows, heads, length, dim, generator=generator) for _ in range(3))
    return [t.to(device, dtype).requires_grad_() for t in (q, k, v)], mask[:, None].to(device), keys_valid


@pytest.mark.gpu
def test_training_attention_backward_is_finite_where_cudnn_returns_nan():
    """pytorch/pytorch#196678: cuDNN's SDPA backward returns NaN dQ at padded lengths 64 mod 128 with fully masked
    query rows. Under the training step's backends the gradients are finite and equal float64 attention's."""
    length = 448  # 192-token prompts + 256-token completions, the SmolLM2 runs' failing steps
    (q, k, v), mask, keys_valid = _left_padded_attention(length, "cuda")
    upstream = torch.randn(q.shape, device="cuda", dtype=q.dtype) * keys_valid[:, None, :, None].cuda()
    with sdpa_kernel(TRAINING_SDPA_BACKENDS):
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask).backward(upstream)
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))

    (q64, k64, v64) = (t.detach().double().requires_grad_() for t in (q, k, v))
    scores = (q64 @ k64.transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(~mask, -math.inf)
    probs = torch.nan_to_num(scores.softmax(-1))  # a fully masked row attends to nothing: output 0
    (probs @ v64).backward(upstream.double())
    valid = keys_valid.cuda()[:, None, :, None]
    for ours, reference in ((q, q64), (k, k64), (v, v64)):
        torch.testing.assert_close((ours.grad.double() * valid), reference.grad * valid, atol=5e-2, rtol=5e-2)


def test_a_rollout_runs_compiled_layers_eagerly(checkpoints, tmp_path):
    """With compile_layers, a rollout that calls the policy's modules (the transformers backend) runs them eagerly:
    compiled, generate would compile every layer again per layer index and KV-cache state (the training passes keep
    their graphs). Seen through a compiled function called inside the rollout: traced, it reads True."""
    _, nvfp4_dir = checkpoints
    args = recipe_config(tmp_path, compile_layers=True, max_steps=1)
    trainer = make_trainer(nvfp4_dir, args)
    seen = []
    traced = torch.compile(torch.compiler.is_dynamo_compiling, fullgraph=True)

    def generate(prompt_ids, perturb):
        seen.append(traced())
        return RolloutOutput([[1, 2]] * len(prompt_ids), [[-0.5, -0.5]] * len(prompt_ids), aqn.NoiseStats())

    trainer.rollout.generate = generate
    completion_ids, _ = trainer._generate_single_turn([[3, 4, 5]] * 2, None, None, 2)
    assert seen == [False] and completion_ids == [[1, 2]] * 2
    assert traced() is True  # the same function, outside the rollout, is compiled


def test_live_row_compaction_is_on_by_default_for_an_nvfp4_base_only(checkpoints, tmp_path):
    """rollout_compact_rows None: on where the H200 measured it to pay (NVFP4), off for BF16; an explicit value wins."""
    bf16_dir, nvfp4_dir = checkpoints
    for folder, compact, expected in ((nvfp4_dir, None, True), (bf16_dir, None, False), (nvfp4_dir, False, False)):
        args = recipe_config(tmp_path, rollout_backend="native", rollout_compact_rows=compact)
        assert make_trainer(folder, args).rollout.engine.compact_rows is expected
