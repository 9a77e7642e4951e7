"""The vLLM rollout backend's CPU-testable parts: what goes from the policy to vLLM, and a round's call order.

vLLM itself needs a GPU; test_vllm_gpu.py runs the real engine there.
"""

import contextlib
import re
import sys
import types

import pytest
import torch
from fakes import make_trainer
from transformers import GenerationConfig

from qerl import aqn, base_model, rollout
from qerl.config import QeRLConfig
from qerl.rollout import vllm as rollout_vllm
from qerl.rollout.vllm import (
    VLLMEngine,
    VLLMRollout,
    _register_fp32_rmsnorm,
    adapter_tensors,
    lora_settings,
    sampling_kwargs,
)


@pytest.fixture(scope="module")
def trainer(checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("run")
    _, nvfp4_dir = checkpoints
    args = QeRLConfig(
        output_dir=str(root / "out"),
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=8,
        max_steps=1,
        report_to=[],
        lora_rank=4,
        lora_alpha=8,
        use_cpu=True,
        save_strategy="no",
        trainable_norms=True,
        rollout_backend="transformers",
        temperature=0.7,
        top_p=0.9,
        top_k=20,
    )
    return make_trainer(nvfp4_dir, args, reward=lambda completions, **kw: [0.0] * len(completions), num_examples=8)


def test_adapter_tensors_use_peft_names_and_vllm_norm_names(trainer):
    model = trainer.model
    lora, norms = adapter_tensors(model)
    layers = model.config.num_hidden_layers
    assert len(lora) == 2 * 7 * layers  # A and B of q, k, v, o, gate, up, down in every layer
    # Parameter names of the checkpoint's own model: vLLM's Qwen2 uses the same names.
    checkpoint_names = set(base_model.load_base_model(trainer._rollout_setup().model_path, device="cpu").state_dict())
    base_modules = dict(model.get_base_model().named_modules())
    for name, tensor in lora.items():
        # The format vLLM's parse_fine_tuned_lora_name reads: base_model.model.<module>.lora_{A,B}.weight
        match = re.fullmatch(r"base_model\.model\.(.+)\.lora_([AB])\.weight", name)
        assert match, name
        module = base_modules[match.group(1)]
        assert tensor.shape[1 if match.group(2) == "A" else 0] == (
            module.in_features if match.group(2) == "A" else module.out_features
        )
    assert sorted(norms) == sorted(
        f"model.layers.{i}.{n}.weight" for i in range(layers) for n in ("input_layernorm", "post_attention_layernorm")
    )
    for name, tensor in norms.items():
        # The trained copy (not peft's frozen original), under the name the scale has in the base (and vLLM).
        trained = model.get_submodule(f"base_model.model.{name[:-7]}.modules_to_save.default").weight
        assert tensor.data_ptr() == trained.data_ptr() and name in checkpoint_names
    settings = lora_settings(model)
    assert settings["r"] == 4 and settings["lora_alpha"] == 8 and "q_proj" in settings["target_modules"]
    assert settings["modules_to_save"] is None  # vLLM's PEFTHelper refuses them; the norms travel by load_norms


def test_sampling_kwargs_follow_the_trainer_generation_config(trainer):
    kwargs = sampling_kwargs(trainer.generation_config, trainer.eos_token_ids)
    assert kwargs["temperature"] == 0.7 and kwargs["top_p"] == 0.9 and kwargs["top_k"] == 20
    assert kwargs["max_tokens"] == 8 and kwargs["stop_token_ids"] == trainer.eos_token_ids
    assert kwargs["logprobs"] == 0 and kwargs["n"] == 1
    with pytest.raises(ValueError, match="typical_p"):
        sampling_kwargs(GenerationConfig(typical_p=0.5, max_new_tokens=4), [0])


class RecordingEngine:
    """Stands in for VLLMEngine: records the order of a round's calls; samples nothing real."""

    def __init__(self, model_path, **options):
        self.calls, self.options = [], options
        self.model = torch.nn.Linear(2, 2)

    def sleep(self):
        self.calls.append("sleep")

    def wake_up(self):
        self.calls.append("wake_up")

    def load_lora(self, tensors, settings):
        self.calls.append(("load_lora", len(tensors), settings["r"]))

    def load_norms(self, norms):
        self.calls.append(("load_norms", len(norms)))

    def generate(self, prompt_ids, sampling):
        self.calls.append(("generate", len(prompt_ids)))
        if any(not ids for ids in prompt_ids):
            raise RuntimeError("empty prompt")
        return [([7, 3, 9], [-0.5, -0.25, -0.125]) for _ in prompt_ids]


def test_round_order_with_a_recording_engine(trainer, tmp_path):
    setup = trainer._rollout_setup()
    assert setup.vllm.sleep  # the config's vllm_enable_sleep_mode (QeRL's default: on)
    backend = VLLMRollout(setup, engine_factory=RecordingEngine)
    engine = backend.engine
    assert engine.options["gpu_memory_utilization"] == trainer.args.vllm_gpu_memory_utilization
    assert engine.options["fp32_norms"]  # the default fp32 noise rule needs FP32 scales in vLLM
    assert engine.calls == ["sleep"]  # asleep from the start: the trainer's first steps have the memory

    @contextlib.contextmanager
    def perturb(model):
        assert model is engine.model  # the noise goes on the module vLLM runs
        engine.calls.append("noise on")
        yield "stats"
        engine.calls.append("noise off")

    eos = trainer.eos_token_ids[0]
    engine.generate = lambda ids, s: engine.calls.append("generate") or [([4, eos, 5], [-1.0, -2.0, -3.0])] * len(ids)
    out = backend.generate([[1, 2], [3]], perturb)
    layers = trainer.model.config.num_hidden_layers
    assert engine.calls[1:] == [
        "wake_up",
        ("load_lora", 2 * 7 * layers, 4),
        ("load_norms", 2 * layers),
        "noise on",
        "generate",
        "noise off",
        "sleep",
    ]
    assert out.completion_ids == [[4, eos]] * 2 and out.logprobs == [[-1.0, -2.0]] * 2 and out.noise == "stats"


def test_engine_sleeps_again_when_a_round_fails(trainer):
    backend = VLLMRollout(trainer._rollout_setup(), engine_factory=RecordingEngine)
    with pytest.raises(RuntimeError, match="empty prompt"):
        backend.generate([[]], lambda model: contextlib.nullcontext())
    assert backend.engine.calls[-1] == "sleep"


def test_backend_needs_a_checkpoint_folder(trainer):
    setup = trainer._rollout_setup()
    setup.model_path = "Qwen/not-a-folder"
    with pytest.raises(ValueError, match="checkpoint folder the policy came from"):
        VLLMRollout(setup, engine_factory=RecordingEngine)


def test_on_a_checkpoint_the_saved_adapter_is_pushed_and_the_protocol_sampled(trainer, tmp_path, monkeypatch):
    """eval's vLLM road (RolloutSetup.for_checkpoint, no policy in memory): the saved adapter's LoRA and trained norms
    reach the engine as the policy's do in training, every round; prompts are the chat-templated ids; the protocol's
    sampling settings and the checkpoint's stop tokens go to vLLM; the other engines refuse such a setup."""
    from eval import generate
    from eval.protocols import PROTOCOLS, Sampling
    from qerl.data import think_answer_prompt

    adapter = tmp_path / "adapter"
    trainer.save_model(str(adapter))
    model_path = trainer._rollout_setup().model_path
    tokenizer = trainer.processing_class
    engines = []

    class Engine(RecordingEngine):
        def __init__(self, path, **options):
            super().__init__(path, **options)
            self.path = path
            engines.append(self)

        def generate(self, prompt_ids, sampling):
            self.calls.append(("generate", prompt_ids, sampling))
            return [(tokenizer.encode("42") + [tokenizer.eos_token_id], []) for _ in prompt_ids]

    monkeypatch.setattr(rollout_vllm, "VLLMEngine", Engine)
    prompts = [think_answer_prompt("6*7?")]
    sampling = Sampling.of(PROTOCOLS["reference"], 12, seed=5)
    spec = generate.ModelSpec(model_path, "auto", str(adapter), "cuda", rollout_backend="vllm")
    assert generate.generate(spec, prompts, sampling) == ["42"]
    engine = engines[0]
    layers = trainer.model.config.num_hidden_layers
    assert engine.path == model_path and engine.options["lora_rank"] == 4 and engine.options["seed"] == 5
    assert engine.calls[:4] == ["sleep", "wake_up", ("load_lora", 2 * 7 * layers, 4), ("load_norms", 2 * layers)]
    _, prompt_ids, params = engine.calls[4]
    assert prompt_ids == [tokenizer.apply_chat_template(prompts[0], add_generation_prompt=True)["input_ids"]]
    assert (params["temperature"], params["top_p"], params["max_tokens"]) == (0.6, 0.95, 12)
    assert tokenizer.eos_token_id in params["stop_token_ids"]
    setup = rollout.RolloutSetup.for_checkpoint(model_path, str(adapter), trainer.generation_config, [2], 0)
    with pytest.raises(rollout.Unsupported, match="the native backend samples from a policy in memory"):
        rollout.build_backend("native", setup)


def test_engine_asks_vllm_for_a_sampler_that_takes_token_ids(monkeypatch):
    """The LLM(...) arguments VLLMEngine passes (a stand-in `vllm` module records them): runner "generate", so that
    vLLM never makes an embedding model of the folder (which then wants the tokenizer we skip)."""
    created = []

    class LLM:
        def __init__(self, **kwargs):
            created.append(kwargs)

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=LLM))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    for name, value in {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "localhost",
        "MASTER_PORT": "29500",
    }.items():
        monkeypatch.setenv(name, value)  # restored afterwards; VLLMEngine only sets what is missing
    VLLMEngine("/ckpt", lora_rank=16, fp32_norms=False, max_model_len=2304)
    (kwargs,) = created
    assert kwargs["model"] == "/ckpt" and kwargs["runner"] == "generate" and kwargs["skip_tokenizer_init"]
    assert kwargs["enable_lora"] and kwargs["max_lora_rank"] == 16 and kwargs["max_model_len"] == 2304
    assert kwargs["logprobs_mode"] == "processed_logprobs" and not kwargs["enable_prefix_caching"]
    assert kwargs["distributed_executor_backend"] == "external_launcher" and kwargs["dtype"] == "bfloat16"


@pytest.fixture
def vllm_norms(monkeypatch):
    """Stand-ins for what _register_fp32_rmsnorm uses of vLLM 0.26 (model_executor/custom_op.py and
    layers/layernorm.py): a CustomOp is built as the class op_registry_oot holds under its class name,
    register_oot refuses a name twice, and RMSNorm / GemmaRMSNorm compute as vLLM's native forwards."""
    registry = {}

    class CustomOp(torch.nn.Module):
        def __new__(cls, *args, **kwargs):
            return super().__new__(registry.get(cls.__name__, cls))

        @classmethod
        def register_oot(cls, _decorated_op_cls=None, name=None):
            def decorator(op_cls):
                assert name not in registry, f"Duplicate op name: {name}"
                op_cls.name = name
                registry[name] = op_cls
                return op_cls

            return decorator

    def rms_norm(x, weight, epsilon):  # vllm/ir/ops/layernorm.py
        orig_dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + epsilon)
        return (x.to(weight.dtype) * weight).to(orig_dtype)

    class RMSNorm(CustomOp):
        def __init__(self, hidden_size, eps=1e-6, var_hidden_size=None, has_weight=True, dtype=None):
            super().__init__()
            self.variance_epsilon = eps
            self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=dtype or torch.get_default_dtype()))

        def forward(self, x):
            return rms_norm(x, self.weight.data, self.variance_epsilon)

    class GemmaRMSNorm(CustomOp):
        def __init__(self, hidden_size, eps=1e-6):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(hidden_size))
            self.variance_epsilon = eps

        def forward(self, x):
            return rms_norm(x, self.weight.float() + 1.0, self.variance_epsilon)

    custom_op = types.ModuleType("vllm.model_executor.custom_op")
    custom_op.CustomOp, custom_op.op_registry_oot = CustomOp, registry
    layernorm = types.ModuleType("vllm.model_executor.layers.layernorm")
    layernorm.RMSNorm, layernorm.GemmaRMSNorm = RMSNorm, GemmaRMSNorm
    for module in (
        types.ModuleType("vllm"),
        types.ModuleType("vllm.model_executor"),
        custom_op,
        types.ModuleType("vllm.model_executor.layers"),
        layernorm,
    ):
        monkeypatch.setitem(sys.modules, module.__name__, module)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # vLLM builds the model under the model's dtype
    yield types.SimpleNamespace(registry=registry, RMSNorm=RMSNorm, GemmaRMSNorm=GemmaRMSNorm)
    torch.set_default_dtype(default_dtype)


def test_fp32_norms_cover_rmsnorm_and_gemma_rmsnorm(vllm_norms):
    """Both of vLLM's norm classes are built with an FP32 scale (Gemma-3 uses GemmaRMSNorm throughout); a second
    engine in the process registers nothing again, and each name is skipped on its own."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    registry = vllm_norms.registry
    registry["RMSNorm"] = kept = type("OtherRMSNorm", (vllm_norms.RMSNorm,), {})  # registered before us
    _register_fp32_rmsnorm()
    assert registry["RMSNorm"] is kept and set(registry) == {"RMSNorm", "GemmaRMSNorm"}
    del registry["RMSNorm"]
    _register_fp32_rmsnorm()
    registered = dict(registry)
    _register_fp32_rmsnorm()  # would trip register_oot's duplicate-name assertion
    assert registry == registered

    norm = vllm_norms.RMSNorm(16, eps=1e-6)
    assert type(norm) is registry["RMSNorm"] and norm.weight.dtype == torch.float32
    gemma = vllm_norms.GemmaRMSNorm(16, eps=1e-6)
    assert type(gemma) is registry["GemmaRMSNorm"] and isinstance(gemma, vllm_norms.GemmaRMSNorm)
    assert isinstance(gemma.weight, torch.nn.Parameter) and gemma.weight.dtype == torch.float32
    assert torch.equal(gemma.weight, torch.zeros(16)) and gemma.variance_epsilon == 1e-6
    # Same w, same output as the policy's Gemma3RMSNorm: the (1 + w) convention is kept, so w is copied as is.
    w = torch.randn(16, dtype=torch.float32) * 0.1
    reference = Gemma3RMSNorm(16, eps=1e-6).float()  # the policy's trained norm: an FP32 master
    with torch.no_grad():
        gemma.weight.copy_(w)
        reference.weight.copy_(w)
    x = torch.randn(3, 16, dtype=torch.bfloat16)
    assert gemma(x).dtype == torch.bfloat16 and torch.equal(gemma(x), reference(x))


def test_aqn_writes_in_place_on_vllm_gemma_norms_after_load_norms(vllm_norms):
    """On a vLLM-like Gemma model, load_norms copies the trained w into the FP32 scales exactly, and AQN's fp32 rule
    perturbs them in place (the Parameter objects that captured graphs read) and restores them bit for bit; a stock
    BF16 GemmaRMSNorm would get a new Parameter instead, which a captured graph never sees."""
    stock = vllm_norms.GemmaRMSNorm(16)
    original = stock.weight
    with aqn.noisy_norms(
        torch.nn.Sequential(torch.nn.ModuleList([stock])), 1e-4, torch.Generator().manual_seed(0), fp32_compute=False
    ):
        assert original.dtype == torch.bfloat16 and stock.weight is not original
    _register_fp32_rmsnorm()

    def layer():
        return torch.nn.ModuleDict({n: vllm_norms.GemmaRMSNorm(16) for n in ("input_layernorm", "q_norm")})

    inner = torch.nn.Module()
    inner.layers, inner.norm = torch.nn.ModuleList([layer(), layer()]), vllm_norms.GemmaRMSNorm(16)
    model = torch.nn.Module()
    model.model = inner
    trained = {f"model.layers.{i}.input_layernorm.weight": torch.randn(16, dtype=torch.float32) * 0.1 for i in (0, 1)}
    VLLMEngine.load_norms(types.SimpleNamespace(model=model, _params=None), trained)
    # (norm, its Parameter, the trained w) for each pushed norm
    sites = [(model.get_submodule(n.removesuffix(".weight")), model.get_parameter(n), w) for n, w in trained.items()]
    assert all(torch.equal(param, w) for _, param, w in sites)  # FP32 values, not rounded to BF16

    x = torch.randn(3, 16, dtype=torch.float32)
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    clean = [norm(x) for norm, _, _ in sites]
    with aqn.noisy_norms(model, 1e-4, torch.Generator().manual_seed(0), fp32_compute=False) as stats:
        assert stats.changed_fraction == 1.0  # 1e-4 survives on every FP32 entry
        for (norm, param, w), before in zip(sites, clean, strict=True):
            assert norm._parameters["weight"] is param  # in place
            noise = param - w
            assert 0 < noise.abs().max() < 1e-3
            torch.testing.assert_close(norm(x) - before, normed * noise, rtol=1e-3, atol=1e-6)  # noise on 1 + w
    assert all(norm._parameters["weight"] is param and torch.equal(param, w) for norm, param, w in sites)
