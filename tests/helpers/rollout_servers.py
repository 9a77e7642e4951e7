"""Rollout servers on the CPU for the tests of rollouts on their own GPUs (qerl/rollout/server.py): real HTTP servers on
free ports, in threads, each around a fake engine whose completions are a function of the LoRA and norms it holds
when it samples, so that a stale, wrong or noisy adapter shows in the tokens."""

import contextlib
import threading

import torch
from peft import get_peft_model

from qerl import lora
from qerl.norms import find_norms
from qerl.rollout.server import RolloutServer, make_http_server
from qerl.rollout.wire import adapter_digest
from qerl.tiny import build_tiny

EOS = 2  # the tiny tokenizer's


def fake_sample(digest: str, prompt: list[int]) -> tuple[list[int], list[float]]:
    """What FakeEngine samples: the prompt's first token, four tokens read off the digest of what it holds (inside the
    tiny vocabulary, never EOS), EOS, and two tokens past EOS that the server's cut must drop."""
    ids = [prompt[0], *(3 + int(digest[i : i + 2], 16) % 100 for i in range(0, 8, 2)), EOS, 99, 99]
    return ids, [-0.25 * (i + 1) for i in range(len(ids))]


class FakeEngine:
    """A server engine's surface on a tiny base model whose norm scales are FP32 (as vLLM's with fp32_norms, unless
    `fp32_norms=False`), holding the LoRA as sent (or in `lora_dtype`) and reading it back as the native engine does;
    `during_round` runs inside generate, for a test to hold or kill a round."""

    def __init__(self, fp32_norms: bool = True, lora_dtype: torch.dtype | None = None):
        self.model = build_tiny(dtype=torch.bfloat16)[0]
        if fp32_norms:
            for module in find_norms(self.model).select(include_final=True, include_heads=True).values():
                module.weight.data = module.weight.data.float()
        self.lora: dict[str, torch.Tensor] = {}
        self.lora_dtype = lora_dtype  # None: as sent
        self.norm_names: list[str] = []
        self.loads, self.prompts_seen = 0, 0
        self.during_round = lambda: None

    def load_lora(self, tensors, settings):
        assert settings["r"] == 4 and settings["modules_to_save"] is None
        self.lora = {name: tensor.to(self.lora_dtype or tensor.dtype, copy=True) for name, tensor in tensors.items()}
        self.loads += 1

    def lora_held(self, names):
        return {name: self.lora[name] for name in names}

    @torch.no_grad()
    def load_norms(self, norms):
        params = dict(self.model.named_parameters())
        for name, value in norms.items():
            params[name].copy_(value)
        self.norm_names = sorted(norms)

    def generate(self, prompt_ids, sampling):
        self.during_round()
        self.prompts_seen += len(prompt_ids)
        params = dict(self.model.named_parameters())
        digest = adapter_digest(self.lora, {name: params[name] for name in self.norm_names})
        return [fake_sample(digest, prompt) for prompt in prompt_ids]


@contextlib.contextmanager
def server_process(folder: str, log_path, *flags: str):
    """`python -m qerl.rollout_server --model folder` with `flags` in a process of its own (a free port, seed 1), its
    output to `log_path`; yields a ServerPool (LoRA rank 16) that has shaken hands with it, and stops it after."""
    from benchmarks.launch import child_env, kill_session, start_rollout_server
    from qerl.rollout.remote import ServerPool

    server, url = start_rollout_server(folder, 1, list(flags), log_path, child_env())
    try:
        pool = ServerPool([url], folder, lora_rank=16, timeout=300)
        pool.handshake(timeout=300)
        yield pool
    finally:
        kill_session(server)


@contextlib.contextmanager
def native_serving(base: str, seed: int = 1):
    """A real HTTP rollout server around the native engine on the checkpoint `base` (CPU), in a thread; yields (url,
    engine)."""
    from qerl.rollout.native.server_engine import NativeServerEngine

    engine = NativeServerEngine(base, torch.device("cpu"), seed=seed)
    http = make_http_server(RolloutServer(engine, base, lora_rank=16, seed=seed, name=f"native{seed}"))
    threading.Thread(target=http.serve_forever, args=(0.02,), daemon=True).start()
    try:
        yield f"http://127.0.0.1:{http.server_address[1]}", engine
    finally:
        http.shutdown()
        http.server_close()


@contextlib.contextmanager
def serving(base: str, seeds=(1, 2), **engine):
    """Real HTTP rollout servers on free ports, one thread each; yields [(url, http server, engine)]."""
    running = []
    for seed in seeds:
        fake = FakeEngine(**engine)
        http = make_http_server(RolloutServer(fake, base, lora_rank=4, seed=seed, name=f"fake{seed}"))
        threading.Thread(target=http.serve_forever, args=(0.02,), daemon=True).start()  # shutdown() waits a poll
        running.append((f"http://127.0.0.1:{http.server_address[1]}", http, fake))
    try:
        yield running
    finally:
        for _, http, _ in running:
            http.shutdown()
            http.server_close()


def trained_policy(seed: int = 0, model=None):
    """`model` (default: a BF16 tiny Qwen2) with LoRA r4 and trainable norms as QeRLTrainer holds it (FP32 masters),
    moved off its initial values (peft starts B at zero)."""
    model = build_tiny(dtype=torch.bfloat16)[0] if model is None else model
    policy = get_peft_model(model, lora.lora_config(model, rank=4, alpha=8, trainable_norms=True))
    lora.keep_fp32_masters(policy)
    train_step(policy, seed)
    return policy


@torch.no_grad()
def train_step(policy, seed: int) -> None:
    """What an optimizer step does to the adapter, for these tests: every trainable tensor moves."""
    draw = torch.Generator().manual_seed(seed)
    for param in policy.parameters():
        if param.requires_grad:
            param.add_(torch.randn(param.shape, generator=draw, dtype=param.dtype) * 0.05)
