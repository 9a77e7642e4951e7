"""The `vllm` rollout backend: a vLLM engine colocated in the training process, on the same checkpoint.

vLLM loads the folder the policy came from (NVFP4 through its Marlin FP4 kernel on Hopper, or BF16) and keeps
its own copy of the frozen base. Every generation round:

    wake up (sleep mode) -> push the current LoRA matrices as tensors (unmerged) and the trained norms ->
    AQN noise on vLLM's own RMSNorm weights -> sample (log-prob of each sampled token after temperature and
    top-k/top-p) -> restore the clean norms bit for bit -> sleep (level 1: KV cache freed, weights to CPU)

Why not TRL's colocate path (`use_vllm=True`): it merges the adapter into the base and pushes full weights,
which a packed NVFP4 base cannot take (there is no BF16 weight to merge into), and it would sample without AQN.
Here the adapter goes through vLLM's own LoRA machinery (`LoRAModel.from_lora_tensors` registered with the
worker's adapter manager), so no file is written and no vLLM module is changed.

AQN needs vLLM's norm weights in FP32 (the `fp32` noise rule): noise of 1e-4 on a scale near 1 does not
survive a BF16 weight. `fp32_norms` registers, through vLLM's out-of-tree layer hook (`CustomOp.register_oot`),
an RMSNorm whose weight is FP32; vLLM's RMSNorm then multiplies in FP32 (its native path: its fused CUDA kernel
needs matching dtypes) and rounds the output once to BF16. Gemma's GemmaRMSNorm (Gemma-3's layer, q/k and final
norms) gets the same: it stores w and computes x * (1 + w) in FP32 already, so only its weight changes dtype.
Both conventions store what the policy's norms store (Gemma3RMSNorm keeps w too), so `load_norms` copies the
trained values as they are, and noise on w is noise on 1 + w. With FP32 weights AQN writes in place, which
CUDA graphs and torch.compile see; a BF16 weight would be swapped for an FP32 copy they never read.

The pure parts (tensor names, norm mapping, sampling parameters, the round's call order) run without vLLM and
are tested on CPU; the engine itself is `VLLMEngine`, which the GPU tests exercise.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import torch
from torch import nn

from qerl import master_port
from qerl.rollout.base import Perturb, RolloutBackend, RolloutOutput, RolloutSetup, copy_norms, truncate_at_eos
from qerl.sharding import whole

LORA_ID = 1  # one adapter, re-registered under the same id every round
_PEFT_PREFIX = "base_model.model."


# ----------------------------------------------------------------------------------------------------------
# What goes from the policy to vLLM (pure: no vLLM import)


def adapter_tensors(policy: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The policy's adapter, split as `split_adapter_state` does. The tensors are the policy's own (no copy; FSDP2's
    shards gathered whole); vLLM copies them."""
    from peft import get_peft_model_state_dict

    return split_adapter_state({name: whole(t.detach()) for name, t in get_peft_model_state_dict(policy).items()})


def split_adapter_state(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(LoRA tensors under peft's saved names, trained norm scales under vLLM's parameter names) of a peft adapter
    state dict (the policy's, or an adapter_model.safetensors).

    peft's saved names ("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight") are what vLLM's LoRA
    loader parses; it packs q/k/v and gate/up into its fused layers itself. Trainable norms (peft
    modules_to_save) become "model.layers.0.input_layernorm.weight", the name of the same scale in vLLM's model.
    """
    lora, norms = {}, {}
    for name, tensor in state.items():
        if ".lora_A." in name or ".lora_B." in name:
            lora[name] = tensor
        elif name.endswith(".weight") and "norm" in name.rsplit(".", 2)[-2]:
            norms[name.removeprefix(_PEFT_PREFIX)] = tensor
        else:
            raise ValueError(f"the vllm rollout backend cannot push trainable tensor {name!r} (LoRA and norms only)")
    return lora, norms


def lora_settings(policy: nn.Module) -> dict[str, Any]:
    """The policy's adapter config, as `vllm_lora_settings` gives it."""
    return vllm_lora_settings(policy.peft_config[policy.active_adapter].to_dict())


def vllm_lora_settings(peft_config: dict[str, Any]) -> dict[str, Any]:
    """A peft LoRA config (dict, or adapter_config.json) as vLLM's PEFTHelper reads it."""
    settings = dict(peft_config)
    settings["target_modules"] = sorted(settings["target_modules"])  # a set in peft; JSON-like for vLLM
    settings["modules_to_save"] = None  # vLLM's LoRA refuses them; the trained norms are copied in by load_norms
    if settings.get("use_dora"):
        raise ValueError("the vllm rollout backend does not support DoRA adapters")
    return settings


def sampling_kwargs(generation_config, eos_token_ids: list[int]) -> dict[str, Any]:
    """vLLM SamplingParams arguments equal to the trainer's generation settings.

    `logprobs=0` returns the sampled token's log-prob; with the engine's logprobs_mode "processed_logprobs" it is
    taken after temperature and top-k/top-p, the distribution the token was drawn from (TRL's convention).
    """
    unsupported = {"typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0, "no_repeat_ngram_size": 0}
    for name, neutral in unsupported.items():
        value = getattr(generation_config, name, None)
        if value not in (None, neutral):
            raise ValueError(f"generation option {name}={value!r} is not supported by the vllm rollout backend")
    if not generation_config.do_sample:
        temperature = 0.0
    else:
        temperature = 1.0 if generation_config.temperature is None else float(generation_config.temperature)
    return {
        "n": 1,
        "temperature": temperature,
        "top_p": 1.0 if generation_config.top_p is None else float(generation_config.top_p),
        "top_k": int(generation_config.top_k or 0),
        "min_p": float(generation_config.min_p or 0.0),
        "repetition_penalty": float(generation_config.repetition_penalty or 1.0),
        "max_tokens": int(generation_config.max_new_tokens),
        "stop_token_ids": list(eos_token_ids),
        "logprobs": 0,
        "detokenize": False,  # the trainer decodes; the engine runs without a tokenizer
    }


# ----------------------------------------------------------------------------------------------------------
# The engine (vLLM, in this process)


def _register_fp32_rmsnorm() -> None:
    """Make every RMSNorm and GemmaRMSNorm that vLLM builds in this process hold its scale in FP32 (see the module
    docstring)."""
    from vllm.model_executor.custom_op import CustomOp, op_registry_oot
    from vllm.model_executor.layers.layernorm import GemmaRMSNorm, RMSNorm

    # Each name on its own: register_oot refuses a name twice (a second engine in this process), and one of the
    # two may be registered without the other.
    if "RMSNorm" not in op_registry_oot:

        @CustomOp.register_oot(name="RMSNorm")
        class FP32ScaleRMSNorm(RMSNorm):
            def __init__(self, hidden_size, eps=1e-6, var_hidden_size=None, has_weight=True, dtype=None):
                super().__init__(hidden_size, eps, var_hidden_size, has_weight, dtype=torch.float32)

    if "GemmaRMSNorm" not in op_registry_oot:

        @CustomOp.register_oot(name="GemmaRMSNorm")
        class FP32ScaleGemmaRMSNorm(GemmaRMSNorm):
            # GemmaRMSNorm takes no dtype: replace its weight (zeros, as it starts; the loader fills it).
            # Its forward, (w.float() + 1) in FP32, then reads this Parameter unchanged.
            def __init__(self, hidden_size, eps=1e-6):
                super().__init__(hidden_size, eps)
                self.weight = nn.Parameter(torch.zeros(hidden_size, dtype=torch.float32))


class VLLMEngine:
    """A vLLM `LLM` in this process (TRL's colocate setup) with the handful of operations a round needs."""

    def __init__(
        self,
        model_path: str,
        *,
        lora_rank: int | None,
        gpu_memory_utilization: float = 0.3,
        max_model_len: int | None = None,
        max_num_seqs: int | None = None,
        sleep: bool = True,
        fp32_norms: bool = True,
        seed: int = 0,
        enforce_eager: bool = False,
    ):
        from vllm import LLM

        if fp32_norms:
            _register_fp32_rmsnorm()
        # vLLM's external launcher joins the training processes' world instead of spawning its own workers.
        dist = torch.distributed.is_available() and torch.distributed.is_initialized()
        os.environ.setdefault("RANK", str(torch.distributed.get_rank() if dist else 0))
        os.environ.setdefault("LOCAL_RANK", str(torch.cuda.current_device()))
        os.environ.setdefault("WORLD_SIZE", str(torch.distributed.get_world_size() if dist else 1))
        self.sleep_enabled = sleep
        self.asleep = False
        with master_port.held_until_bound():  # runs started together on one host get ports of their own
            self.llm = LLM(
                model=model_path,
                # A sampler, never a pooling model: "auto" makes an embedding model of an architecture named like a
                # base model (Qwen3Model, Gemma3TextModel: what vLLM assumes when config.json names none).
                runner="generate",
                skip_tokenizer_init=True,  # prompts arrive as token ids
                dtype="bfloat16",
                gpu_memory_utilization=gpu_memory_utilization,
                max_model_len=max_model_len,
                max_num_seqs=max_num_seqs,
                enable_lora=lora_rank is not None,
                max_lora_rank=lora_rank or 16,
                max_loras=1,
                enable_sleep_mode=sleep,
                distributed_executor_backend="external_launcher",
                seed=seed,
                logprobs_mode="processed_logprobs",
                # KV cached across rounds was computed under another round's LoRA weights and AQN noise; a GRPO
                # round's samples of one prompt would share its prefill, but the prompt is short next to the decode.
                enable_prefix_caching=False,
                enforce_eager=enforce_eager,
            )
        self.lora_request = None
        self._params: dict[str, nn.Parameter] | None = None

    @property
    def worker(self):
        return self.llm.llm_engine.model_executor.driver_worker.worker

    @property
    def model(self) -> nn.Module:
        return self.worker.model_runner.model

    def wake_up(self) -> None:
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False

    def sleep(self) -> None:
        if self.sleep_enabled and not self.asleep:
            self.llm.sleep(level=1)
            self.asleep = True

    def load_lora(self, tensors: dict[str, torch.Tensor], settings: dict[str, Any]) -> None:
        """Register `tensors` as the adapter LORA_ID, replacing the previous round's, and activate it."""
        from vllm.lora.lora_model import LoRAModel
        from vllm.lora.peft_helper import PEFTHelper
        from vllm.lora.request import LoRARequest

        worker_manager = self.worker.model_runner.lora_manager
        peft_helper = PEFTHelper.from_dict(settings)
        peft_helper.validate_legal(worker_manager.lora_config)
        mapper = getattr(self.model, "hf_to_vllm_mapper", None)
        lora = LoRAModel.from_lora_tensors(
            lora_model_id=LORA_ID,
            tensors=tensors,
            peft_helper=peft_helper,
            device="cuda",
            dtype=worker_manager.lora_config.lora_dtype,
            model_vocab_size=worker_manager.vocab_size,
            weights_mapper=mapper.get_unstacked_mapper() if mapper is not None else None,
        )
        adapters = worker_manager._adapter_manager  # vLLM's LoRA model manager: the owner of the GPU LoRA slots
        adapters.remove_adapter(LORA_ID)
        adapters.add_adapter(lora)
        adapters.activate_adapter(LORA_ID)  # copies the matrices into the slot the kernels read
        # The request names the adapter already registered; vLLM never reads this path.
        self.lora_request = LoRARequest("qerl-policy", LORA_ID, lora_path="qerl://in-memory")

    @torch.no_grad()
    def load_norms(self, norms: dict[str, torch.Tensor]) -> None:
        if self._params is None:  # vLLM's Parameter objects stay the same across rounds and sleeps
            self._params = dict(self.model.named_parameters())
        copy_norms(self._params, norms, f"vLLM's {type(self.model).__name__}")

    def generate(self, prompt_ids: list[list[int]], sampling: dict[str, Any]) -> list[tuple[list[int], list[float]]]:
        from vllm import SamplingParams

        outputs = self.llm.generate(
            [{"prompt_token_ids": ids} for ids in prompt_ids],
            SamplingParams(**sampling),
            lora_request=self.lora_request,
            use_tqdm=False,
        )
        result = []
        for output in outputs:
            sample = output.outputs[0]
            token_ids = list(sample.token_ids)
            logprobs = (  # none when the sampling settings ask for none (evaluation)
                [step[token].logprob for step, token in zip(sample.logprobs, token_ids, strict=True)]
                if sample.logprobs is not None
                else []
            )
            result.append((token_ids, logprobs))
        return result


def saved_adapter(adapter_path: str) -> tuple[dict[str, Any], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(vLLM's LoRA settings, LoRA tensors, trained norm scales) of an adapter folder peft saved."""
    from safetensors.torch import load_file

    with open(os.path.join(adapter_path, "adapter_config.json")) as f:
        settings = vllm_lora_settings(json.load(f))
    return settings, *split_adapter_state(load_file(os.path.join(adapter_path, "adapter_model.safetensors")))


# ----------------------------------------------------------------------------------------------------------
# The backend


class VLLMRollout(RolloutBackend):
    """Rollouts from a colocated vLLM engine; settings: RolloutSetup.vllm (the trainer fills them from TRL's vllm_*
    fields). The policy's LoRA and norms are pushed every round; a setup without a policy in memory
    (RolloutSetup.for_checkpoint) has its saved adapter's pushed instead."""

    name = "vllm"
    samples_from_checkpoint = True

    def __init__(self, setup: RolloutSetup, engine_factory=None):
        super().__init__(setup)
        if not setup.model_path or not os.path.isdir(setup.model_path):
            raise ValueError(
                "rollout_backend vllm loads the checkpoint folder the policy came from, and none is known "
                f"({setup.model_path!r}): load the policy from a local folder, or use rollout_backend transformers"
            )
        self.sampling = sampling_kwargs(setup.generation_config, setup.eos_token_ids)
        self.saved = None  # (settings, LoRA tensors, norms) of a saved adapter, for a setup without a policy
        if setup.open_policy is None:
            self.saved = saved_adapter(setup.adapter_path) if setup.adapter_path else None
            self.lora_settings = self.saved[0] if self.saved else None
        else:
            with setup.open_policy() as policy:
                self.lora_settings = lora_settings(policy) if hasattr(policy, "peft_config") else None
        self.engine = (engine_factory or VLLMEngine)(  # looked up now: tests stand a recording engine in
            setup.model_path,
            lora_rank=self.lora_settings["r"] if self.lora_settings else None,
            **dataclasses.asdict(setup.vllm),
        )
        self.engine.sleep()

    def generate(self, prompt_ids: list[list[int]], perturb: Perturb) -> RolloutOutput:
        engine = self.engine
        engine.wake_up()
        try:
            self._push_adapter()
            with perturb(engine.model) as noise:
                samples = engine.generate(prompt_ids, self.sampling)
        finally:
            engine.sleep()  # frees the KV cache for the trainer's log-prob and backward passes
        # vLLM stops at the first stop token already; the shared cut keeps the backends' contract in one place.
        output = truncate_at_eos([ids for ids, _ in samples], [lps for _, lps in samples], self.setup.eos_token_ids)
        output.noise = noise
        return output

    def _push_adapter(self) -> None:
        """This round's LoRA tensors and trained norms into the awake engine: the policy's as they are now, or the
        saved adapter's."""
        if self.lora_settings is None:
            return
        if self.saved is not None:
            self.engine.load_lora(self.saved[1], self.lora_settings)
            self.engine.load_norms(self.saved[2])
            return
        with self.setup.open_policy() as policy:
            lora, norms = adapter_tensors(policy)
            self.engine.load_lora(lora, self.lora_settings)
            self.engine.load_norms(norms)
