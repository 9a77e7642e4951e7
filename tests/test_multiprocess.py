"""Two CPU processes (gloo): the tiny NVFP4 policy trained in step under `accelerate launch` (DDP, DeepSpeed ZeRO-3),
and under FSDP2 the pieces that read and perturb its sharded parameters (AQN, the native engine's gather).

accelerate runs DeepSpeed on a machine without a GPU when the launch does not ask for the CPU (`use_cpu: false`)
and the processes pass `--ddp-backend gloo` (DeepSpeed's CPU accelerator then talks gloo); it never runs FSDP
without one, so the FSDP2 test shards the policy with accelerate's own `fsdp2_prepare_model` under torch's gloo.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import yaml
from safetensors.torch import load_file

from benchmarks.launch import child_env, free_port

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ACCELERATE_CONFIGS = os.path.join(REPO_ROOT, "configs", "accelerate")

# Runs inside each process: the real entry point, plus a dump of this rank's trainable weights.
HARNESS = textwrap.dedent("""
    import os, sys, torch
    from qerl import rewards, train

    def digit_share_reward(completions, answer, **kwargs):  # varies on a random model, so steps update
        return [sum(ch.isdigit() for ch in c[0]["content"]) / max(len(c[0]["content"]), 1) for c in completions]

    rewards.exact_answer_reward = digit_share_reward
    trainer = train.build_trainer(*train.parse_args(sys.argv[1:]))
    def trainable():
        with trainer._open_policy() as model:  # ZeRO-3: gathered whole
            return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    before = trainable()
    seen = []
    generate = trainer.rollout.generate
    trainer.rollout.generate = lambda ids, perturb: seen.append(ids) or generate(ids, perturb)
    trainer.train()
    trainer.save_model(trainer.args.output_dir)  # the final adapter, as qerl.train writes it
    rank = trainer.accelerator.process_index
    shifts = [row["aqn/logprob_shift"] for row in trainer.state.log_history if "aqn/logprob_shift" in row]
    torch.save({"before": before, "after": trainable(), "prompts": seen, "world": trainer.accelerator.num_processes,
                "backend": trainer.rollout.name, "sharding": trainer.rollout.setup.sharding,
                "shifts": shifts}, os.path.join(trainer.args.output_dir, f"rank{rank}.pt"))
""")


def _zero3_config(tmp_path) -> str:
    """configs/accelerate/zero3.yaml with DeepSpeed's own config file, which holds every parameter partitioned
    (stage3_param_persistence_threshold 0: the tiny model's tensors would all stay whole at the default)."""
    with open(os.path.join(ACCELERATE_CONFIGS, "zero3.yaml")) as f:
        config = yaml.safe_load(f)
    ds_config = {
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                              "stage3_gather_16bit_weights_on_model_save": True},  # zero3_save_16bit_model
        "bf16": {"enabled": "auto"}, "gradient_clipping": "auto", "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
    }  # fmt: skip
    (tmp_path / "ds.json").write_text(json.dumps(ds_config))
    config["deepspeed_config"] = {"deepspeed_config_file": str(tmp_path / "ds.json"), "zero3_init_flag": False}
    (tmp_path / "zero3.yaml").write_text(yaml.safe_dump(config))
    return str(tmp_path / "zero3.yaml")


# (accelerate config, extra flags, the rollout backend the run must use, the trainer's sharding)
SETUPS = {
    "ddp": (lambda tmp: os.path.join(ACCELERATE_CONFIGS, "ddp.yaml"), ["--use-cpu", "True"], "transformers", None),
    # The native engine on ZeRO-3's partitions: gathered whole every round inside TRL's gather.
    "zero3": (
        _zero3_config,
        ["--use-cpu", "False", "--ddp-backend", "gloo", "--rollout-backend", "native"],
        "native",
        "zero3",
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("setup", SETUPS)
def test_two_processes_end_with_identical_lora(setup, checkpoints, tmp_path):
    if setup == "zero3":
        pytest.importorskip("deepspeed", reason="the deepspeed extra (pip install -e .[deepspeed])")
    _, nvfp4_dir = checkpoints
    config, flags, backend, sharding = SETUPS[setup]
    harness = tmp_path / "harness.py"
    harness.write_text(HARNESS)
    out = tmp_path / "out"
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file", config(tmp_path), "--num_processes", "2",
        "--mixed_precision", "no", "--main_process_port", str(free_port()), str(harness),
        "--model-name", nvfp4_dir, "--dataset", "arithmetic", "--num-examples", "64", "--dtype", "float32",
        "--output-dir", str(out), "--per-device-train-batch-size", "4", "--num-generations", "4",
        "--max-completion-length", "6", "--max-steps", "3", "--save-strategy", "no", "--report-to", "none",
        "--bf16", "False", "--gradient-checkpointing", "False", "--lora-rank", "4",
        "--ln", "True", "--learning-rate", "5e-3", "--sigma-start", "0.1", "--sigma-end", "0.01",
        "--num-stages", "3", "--aqn-log-shift", "True", "--logging-steps", "1", *flags,
    ]  # fmt: skip
    result = subprocess.run(cmd, env=child_env(threads=1), capture_output=True, text=True, timeout=300, cwd=REPO_ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    ranks = [torch.load(out / f"rank{r}.pt") for r in range(2)]
    assert all(r["world"] == 2 and r["backend"] == backend and r["sharding"] == sharding for r in ranks)
    # Each rank sampled its own prompts...
    assert ranks[0]["prompts"] != ranks[1]["prompts"]
    # ...yet, with gradients all-reduced, both end with the same adapters (and trained norms), moved by training.
    after0, after1 = ranks[0]["after"], ranks[1]["after"]
    assert after0.keys() == after1.keys() and any("layernorm" in k for k in after0)
    for name in after0:
        torch.testing.assert_close(after0[name], after1[name], rtol=0, atol=0)
    assert any(not torch.equal(ranks[0]["before"][n], after0[n]) for n in after0 if "lora_B" in n)
    # The adapter file holds the trained values (ZeRO-3: gathered from the partitions).
    saved = load_file(out / "adapter_model.safetensors")
    lora_b = {n: t for n, t in saved.items() if "lora_B" in n}
    assert lora_b and all(torch.equal(t, after0[n.replace("lora_B.", "lora_B.default.")]) for n, t in lora_b.items())
    # AQN reached the training forward's norms (ZeRO-3: inside the gather) in every noisy round.
    assert ranks[0]["shifts"] and all(shift > 0 for shift in ranks[0]["shifts"])


# Runs inside each process of the FSDP2 test.
FSDP2_HARNESS = textwrap.dedent("""
    import sys, types, torch
    from accelerate import PartialState
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import fsdp2_prepare_model
    from peft import get_peft_model
    from transformers import GenerationConfig
    from qerl import aqn, base_model, lora, norms, sharding
    from qerl.rollout.native.engine import NativeEngine
    from qerl.rollout.native.decoder import Decoder
    from qerl.rollout.native.sampling import Sampler

    checkpoint, out = sys.argv[1:]
    state = PartialState(cpu=True)  # gloo

    def make_policy():
        # The trainer's policy before accelerate prepares it: BF16 base, FP32 LoRA, trainable BF16 norm copies,
        # here with a trained look (LoRA B is zero at initialisation), the same on every rank.
        base = base_model.load_base_model(checkpoint, dtype=torch.bfloat16, device="cpu")
        torch.manual_seed(0)  # peft draws LoRA A from torch's generator
        model = get_peft_model(base, lora.lora_config(base, 4, 8, trainable_norms=True))
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
                elif p.requires_grad and p.dim() == 1:
                    p.add_(torch.randn(p.shape, generator=gen).to(p.dtype) * 0.2)
        return model.eval()

    def engine(decoder):
        sampler = Sampler(GenerationConfig(do_sample=True, temperature=1.0, max_new_tokens=5))
        return NativeEngine(decoder, sampler, [-1], 0)

    prompts = [[9, 30, 41, 12, 7], [15, 60, 3]]
    def sample(eng):
        eng.decoder.refresh()
        torch.manual_seed(1)
        ids, _ = eng.generate(prompts, 5)
        return ids

    reference = make_policy()
    for p in reference.parameters():  # the FP32 masters accelerate makes of trainable parameters
        if p.requires_grad:
            p.data = p.data.float()
    reference_engine = engine(Decoder(reference))

    model = make_policy()
    sharded_engine = engine(Decoder(model, gather_each_round=True))  # built before sharding, as the trainer does
    sharding.keep_base_out_of_checkpoints(model)  # as QeRLTrainer does under FSDP2
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
                                            reshard_after_forward=True, mixed_precision_policy="bf16",
                                            state_dict_type="FULL_STATE_DICT")  # configs/accelerate/fsdp.yaml's
    accelerator = types.SimpleNamespace(state=types.SimpleNamespace(fsdp_plugin=plugin), mixed_precision="bf16",
                                        is_main_process=state.is_main_process, device=torch.device("cpu"),
                                        num_processes=state.num_processes, process_index=state.process_index,
                                        is_fsdp2=True, wait_for_everyone=state.wait_for_everyone)
    model = fsdp2_prepare_model(accelerator, model)
    result = {"sharded": [n for n, p in model.named_parameters() if sharding.is_sharded(p)]}
    # A forward without gradients leaves accelerate's tail unit (final norm, LM head) whole: the trainer reshards
    # before and after each rollout, so that AQN and the engine meet the shards every forward all-gathers.
    with torch.no_grad():
        model(input_ids=torch.tensor([prompts[1]]))
    final = model.base_model.model.model.norm
    result["tail"] = (sharding.is_sharded(final.weight), sharding.reshard(model) or sharding.is_sharded(final.weight))

    # AQN on the sharded norm scales: the same noise as one process draws, restored bit for bit.
    sites, reference_sites = norms.find_norms(model), norms.find_norms(reference)
    result["norms"] = (list(sites.layer_norms), list(reference_sites.layer_norms))
    shards = [m.weight.to_local().clone() for m in sites.layer_norms.values()]
    ids = torch.tensor([prompts[0]])
    with torch.no_grad():
        clean = model(input_ids=ids).logits
        with aqn.noisy_norms(model, 0.05, torch.Generator().manual_seed(3), sites=sites) as stats:
            noisy_scales = [sharding.whole(m.weight) for m in sites.layer_norms.values()]
            noisy = model(input_ids=ids).logits
        with aqn.noisy_norms(reference, 0.05, torch.Generator().manual_seed(3), sites=reference_sites):
            reference_scales = [m.weight.clone() for m in reference_sites.layer_norms.values()]
        result["noise_equal"] = all(torch.equal(a, b) for a, b in zip(noisy_scales, reference_scales, strict=True))
        result["restored"] = all(
            torch.equal(m.weight.to_local(), shard) for m, shard in zip(sites.layer_norms.values(), shards, strict=True)
        )
        result["noise_reached_forward"] = not torch.equal(clean, noisy)
        result["clean_again"] = torch.equal(model(input_ids=ids).logits, clean)
        result["stats"] = (stats.num_norms, stats.changed_fraction)

    # The native engine on the sharded policy: the round's gather makes the single-process engine's samples.
    result["samples"] = (sample(sharded_engine), sample(reference_engine))
    sharded_engine.decoder.release()
    result["released"] = sharded_engine.decoder.embed is None
    # After an optimizer step, the next round gathers the new adapter (not what the policy held when it was built).
    model.train()
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0)
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    sharded_engine.decoder.refresh()
    qkv = sharded_engine.decoder.layers[0].qkv
    q_a = model.base_model.model.model.layers[0].self_attn.q_proj.lora_A["default"].weight
    result["tracks_training"] = torch.equal(qkv.lora_a[: q_a.shape[0]], sharding.whole(q_a).to(qkv.lora_a.dtype))

    # A checkpoint as transformers' Trainer writes one under FSDP2 with FULL_STATE_DICT (save_model's gathered state
    # dict into peft's adapter file; accelerate's model and optimizer files, adapter_only), then read back after
    # another step moved everything: the trainable tensors and the optimizer state come back exactly.
    from accelerate.utils import load_fsdp_model, load_fsdp_optimizer, save_fsdp_model, save_fsdp_optimizer
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    def trainable():
        return {n: sharding.whole(p.detach()).clone() for n, p in model.named_parameters() if p.requires_grad}

    def optimizer_state():
        return [sharding.whole(t).clone() for v in optimizer.state.values() for t in v.values() if torch.is_tensor(t)]

    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    def train_step():
        optimizer.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
    train_step()
    ckpt = f"{out}/checkpoint"
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True,
                                                                cpu_offload=True))  # accelerator.get_state_dict's
    if state.is_main_process:
        model.save_pretrained(ckpt, state_dict=full)
    save_fsdp_model(plugin, accelerator, model, ckpt, adapter_only=True)
    save_fsdp_optimizer(plugin, accelerator, optimizer, model, ckpt)
    saved, saved_optimizer = trainable(), optimizer_state()
    state.wait_for_everyone()
    written = torch.load(f"{ckpt}/pytorch_model_fsdp.bin", weights_only=True)
    result["checkpoint_keys"] = sorted(written)
    result["adapter_file_keys"] = sorted(load_file(f"{ckpt}/adapter_model.safetensors"))
    train_step()
    result["moved"] = not all(torch.equal(a, saved[n]) for n, a in trainable().items())
    load_fsdp_model(plugin, accelerator, model, ckpt, adapter_only=True)
    load_fsdp_optimizer(plugin, accelerator, optimizer, model, ckpt, adapter_only=True)
    result["restored_trainable"] = all(torch.equal(a, saved[n]) for n, a in trainable().items())
    result["restored_optimizer"] = all(torch.equal(a, b) for a, b in zip(optimizer_state(), saved_optimizer,
                                                                          strict=True))
    result["trainable_names"] = sorted(saved)
    torch.save(result, f"{out}/rank{state.process_index}.pt")
    # Tear gloo down before the interpreter does: left to exit, its threads were once destroyed unjoined ("terminate
    # called without an active exception", exit -6) after every result had been saved.
    state.wait_for_everyone()
    state.destroy_process_group()
""")


@pytest.mark.slow
def test_fsdp2_shards_aqn_and_native_engine(checkpoints, tmp_path):
    _, nvfp4_dir = checkpoints
    harness = tmp_path / "fsdp2.py"
    harness.write_text(FSDP2_HARNESS)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           str(harness), nvfp4_dir, str(tmp_path)]  # fmt: skip
    result = subprocess.run(cmd, env=child_env(threads=1), capture_output=True, text=True, timeout=300, cwd=REPO_ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    for rank in range(2):
        r = torch.load(tmp_path / f"rank{rank}.pt")
        # FSDP2 shards the BF16 parameters (LoRA, norms, embedding, LM head, biases); the packed weights are buffers.
        assert any("lora_A" in n for n in r["sharded"]) and any("embed_tokens" in n for n in r["sharded"])
        assert r["norms"][0] == r["norms"][1] and len(r["norms"][0]) == 4
        assert r["noise_equal"] and r["restored"] and r["noise_reached_forward"] and r["clean_again"]
        assert r["stats"][0] == 4 and r["stats"][1] > 0.9
        sharded, reference = r["samples"]
        assert sharded == reference and len(sharded) == 2
        assert r["released"] and r["tracks_training"]
        assert r["tail"] == (False, True)
        # FSDP2's FULL_STATE_DICT checkpoint: the trainable tensors alone, restored exactly.
        assert r["checkpoint_keys"] == r["trainable_names"]  # no packed base
        assert any("lora_B" in k for k in r["adapter_file_keys"]) and any("norm" in k for k in r["adapter_file_keys"])
        assert r["moved"] and r["restored_trainable"] and r["restored_optimizer"]


@pytest.mark.slow
def test_zero3_checkpoint_resumes_exactly(checkpoints, tmp_path):
    """experiments.resume_check on two CPU processes under ZeRO-3 (DeepSpeed's CPU accelerator, gloo): step 3 after a
    resume from the run's own checkpoint-2 equals that run's step 3 bitwise (loss, each rank's samples, adapter), and
    the checkpoint holds the adapter's partitions but not the packed NVFP4 base."""
    pytest.importorskip("deepspeed", reason="the deepspeed extra (pip install -e .[deepspeed])")
    import argparse

    from experiments import resume_check

    args = argparse.Namespace(
        config="zero3",
        model=checkpoints[1],
        gpu_ids="0,1",
        steps=2,
        batch=4,
        new_tokens=6,
        seed=2025,
        rollout_backend="native",
        eval_problems=0,
        timeout=300,
        dry_run=True,
        out=str(tmp_path / "resume"),
    )
    result = resume_check.run_check(args)
    assert result["verdict"] == "exact", resume_check.report(result)
    assert result["a_vs_b"]["update_norm"] > 0  # step 3 trained
    states = sorted((tmp_path / "resume" / "A" / "checkpoint-2").glob("global_step2/*model_states.pt"))
    assert len(states) == 2
    for path in states:
        module = torch.load(path, weights_only=False)["module"]
        assert any("lora_A" in k for k in module) and not any("weight_packed" in k for k in module)
