"""What eval.gsm8k and eval.math share: flags, protocols, loading the policy, generation, the 95% interval and the
per-sample JSONL.

Protocols fix the sampling knobs; everything else about decoding (stop tokens, pad token) comes from the
checkpoint's generation_config.json, for an NVFP4 base as for a BF16 one:
  reference  the QeRL reference's eval: temperature 0.6, top-p 0.95, 1024 new tokens (vLLM SamplingParams: no
             top-k, no repetition penalty), seeded
  greedy     greedy decoding
Prompt formats (`--format`) fix how a question is asked and how a completion is scored, as in training (the
think/answer system prompt by default, which the reference's eval uses).
Generation is one function behind GENERATORS: transformers' generate on the policy, the native rollout backend on the
policy (what training samples with), or vLLM on the checkpoint with the adapter pushed from memory
(rollout.vllm.checkpoint_engine); auto picks native on a CUDA device (vLLM or transformers where native cannot run the
model: rollout.with_auto_fallback, as in training), transformers on CPU.
"""

from __future__ import annotations

import json
import math
import os
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from qerl import cli, input_checks
from qerl.errors import UsageError


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
    do_sample: bool
    temperature: float | None
    top_p: float | None
    max_new_tokens: int
    seed: int


@dataclass(frozen=True)
class ModelSpec:
    model: str
    load: str  # auto | nvfp4 | bf16
    adapter: str | None
    device: str
    kv_cache_gib: float | None = None  # native backend: the KV cache's memory budget (default: 80% of what is free)


@dataclass(frozen=True)
class PromptFormat:
    """How a question is asked (chat messages, as the training dataset format asks it) and how a completion
    scores: booleans, the first key the headline accuracy."""

    messages: Callable[[str], list[dict]]
    score: Callable[[str, str], dict[str, bool]]


@dataclass
class Benchmark:
    """One evaluation: its datasets, how a row becomes a question and a gold answer, and the prompt formats it can
    be asked in (the first is the default). `builtin` tasks (no files) bring their own rows (prompt, question,
    gold) and scorer: builtin[name](limit) -> (rows, score)."""

    name: str
    datasets: dict[str, tuple[str, str | None, str]]  # name -> (hub id, config, default split)
    columns: tuple[tuple[str, ...], str]  # (question column candidates, gold column)
    gold: Callable[[str], str | None]
    formats: dict[str, PromptFormat]
    default_data: str
    default_split: str | None = None
    builtin: dict[str, Callable] = field(default_factory=dict)


def _load_policy(spec: ModelSpec):
    """(base + adapter in eval mode, tokenizer), as training loads them."""
    from peft import PeftModel

    from qerl.policy import load_base_model, load_tokenizer

    model = load_base_model(spec.model, precision=spec.load, device=spec.device)
    if spec.adapter:
        model = PeftModel.from_pretrained(model, spec.adapter)
    return model.eval(), load_tokenizer(spec.model)


def transformers_generate(spec: ModelSpec, prompts: list[list[dict]], sampling: Sampling, batch_size: int) -> list[str]:
    """Completions (text, special tokens dropped) of the chat prompts, with transformers' generate on the policy."""
    import torch
    from tqdm.auto import tqdm

    model, tokenizer = _load_policy(spec)
    config = model.generation_config.to_dict()  # the checkpoint's: stop tokens, pad token
    config.update(
        do_sample=sampling.do_sample,
        max_new_tokens=sampling.max_new_tokens,
        top_k=None,
        min_p=None,
        repetition_penalty=None,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
    )
    if config.get("pad_token_id") is None:
        config["pad_token_id"] = tokenizer.pad_token_id
    generation_config = type(model.generation_config).from_dict(config)
    torch.manual_seed(sampling.seed)
    completions = []
    with torch.no_grad():
        for start in tqdm(range(0, len(prompts), batch_size), desc="generate", unit="batch"):
            texts = [
                tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=False)
                for p in prompts[start : start + batch_size]
            ]
            batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
            out = model.generate(**batch, generation_config=generation_config)
            completions += tokenizer.batch_decode(out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
    return completions


def native_generate(spec: ModelSpec, prompts: list[list[dict]], sampling: Sampling, batch_size: int) -> list[str]:
    """Completions from the native rollout backend on the policy itself (base + adapter, LoRA unmerged, its norms),
    the engine training samples with: all prompts in one round, in as many waves as the KV cache needs
    (`batch_size` does not apply). Raises rollout.Unsupported for a model the engine cannot run."""
    import torch
    from transformers import GenerationConfig

    from qerl.rollout import RolloutSetup, build_backend, no_noise

    model, tokenizer = _load_policy(spec)
    temperature = sampling.temperature if sampling.do_sample else None
    config = GenerationConfig(
        do_sample=sampling.do_sample,
        temperature=temperature,
        top_p=sampling.top_p,
        top_k=0,
        max_new_tokens=sampling.max_new_tokens,
    )
    setup = RolloutSetup.for_model(
        model,
        config,
        _generation_eos(spec.model, tokenizer),
        tokenizer.pad_token_id,
        options={"kv_cache_gib": spec.kv_cache_gib},
    )
    backend = build_backend("native", setup)
    ids = [tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=True)["input_ids"] for p in prompts]
    torch.manual_seed(sampling.seed)
    return tokenizer.batch_decode(backend.generate(ids, no_noise).completion_ids, skip_special_tokens=True)


def vllm_generate(
    spec: ModelSpec, prompts: list[list[dict]], sampling: Sampling, batch_size: int, engine_factory=None
) -> list[str]:
    """Completions from a vLLM engine on the checkpoint folder (Marlin NVFP4 or BF16), the adapter's LoRA as
    in-memory tensors and its trained norms copied into vLLM's FP32 norm scales, as the vllm rollout backend
    does in training. vLLM schedules all prompts itself: `batch_size` does not apply."""
    from qerl.policy import load_tokenizer
    from qerl.rollout.vllm import VLLMEngine, checkpoint_engine

    tokenizer = load_tokenizer(spec.model)
    engine = checkpoint_engine(
        spec.model,
        spec.adapter,
        engine_factory=engine_factory or VLLMEngine,
        gpu_memory_utilization=0.85,
        sleep=False,
        seed=sampling.seed,
    )
    stop = _generation_eos(spec.model, tokenizer)
    params = {
        "n": 1, "temperature": sampling.temperature if sampling.do_sample else 0.0,
        "top_p": sampling.top_p if sampling.do_sample and sampling.top_p is not None else 1.0,
        "max_tokens": sampling.max_new_tokens, "seed": sampling.seed, "stop_token_ids": stop, "detokenize": False,
    }  # fmt: skip
    ids = [tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=True)["input_ids"] for p in prompts]
    return [tokenizer.decode(tokens, skip_special_tokens=True) for tokens, _ in engine.generate(ids, params)]


def _generation_eos(model: str, tokenizer) -> list[int]:
    """Stop tokens: the checkpoint's generation_config.json (what transformers_generate uses) and the tokenizer's."""
    from transformers import GenerationConfig

    eos = []
    if os.path.isfile(os.path.join(model, "generation_config.json")):
        configured = GenerationConfig.from_pretrained(model).eos_token_id
        eos = [configured] if isinstance(configured, int) else list(configured or [])
    return sorted({*eos, tokenizer.eos_token_id} - {None})


def _auto_generate(spec: ModelSpec, prompts: list[list[dict]], sampling: Sampling, batch_size: int) -> list[str]:
    """On a CUDA device the native engine (what training samples with), or vLLM / transformers where it cannot
    run the model; on CPU transformers."""
    from qerl.rollout import with_auto_fallback

    return with_auto_fallback(
        spec.device,
        lambda backend: GENERATORS[backend](spec, prompts, sampling, batch_size),
        lambda error, fallback: print(f"eval: {error}; using {fallback}"),
    )


GENERATORS: dict[str, Callable[[ModelSpec, list[list[dict]], Sampling, int], list[str]]] = {
    "auto": _auto_generate,
    "native": native_generate,
    "transformers": transformers_generate,
    "vllm": vllm_generate,
}


def wilson_interval(successes: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """95% Wilson score interval of a binomial proportion (sound at 0% and 100%, unlike the normal one)."""
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    denominator = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denominator
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denominator
    return max(0.0, centre - half), min(1.0, centre + half)


def build_parser(benchmark: Benchmark, description: str) -> cli.ArgumentParser:
    parser = cli.ArgumentParser(prog=f"python -m eval.{benchmark.name}", description=description)
    parser.add_argument("--model", required=True, help="base model: checkpoint folder (NVFP4 or BF16) or hub id")
    parser.add_argument("--load", choices=("auto", "nvfp4", "bf16"), default="auto", help="precision of the base")
    parser.add_argument("--adapter", help="LoRA adapter folder (a training checkpoint or its final save)")
    names = ", ".join([*benchmark.datasets, *benchmark.builtin])
    parser.add_argument("--data", default=benchmark.default_data, help=f"{names}, or a local .jsonl/.json/.parquet")
    parser.add_argument("--split", default=benchmark.default_split, help="dataset split (default: the dataset's own)")
    parser.add_argument("--protocol", choices=sorted(PROTOCOLS), default="reference", help="see above")
    parser.add_argument(
        "--format",
        choices=list(benchmark.formats),
        default=next(iter(benchmark.formats)),
        help="how questions are asked and completions scored: the training dataset format",
    )
    parser.add_argument("--max-new-tokens", type=cli.COUNT, help="override the protocol's 1024")
    parser.add_argument("--seed", type=cli.SEED, default=0, help="sampling seed (with the batch size and device)")
    parser.add_argument("--limit", type=cli.COUNT, help="evaluate the first N examples only")
    parser.add_argument("--batch-size", type=cli.COUNT, default=32, help="prompts per generate call")
    parser.add_argument("--device", help="cuda if there is one, else cpu")
    parser.add_argument(
        "--backend",
        choices=sorted(GENERATORS),
        default="auto",
        help="generation engine; auto: native on a CUDA device (vllm or transformers where it "
        "cannot run the model), transformers on CPU",
    )
    parser.add_argument(
        "--kv-cache-gib",
        type=cli.POSITIVE,
        help="native backend: GPU memory for the KV cache (default: 80%% of what is free); more "
        "prompts than fit run in waves",
    )
    parser.add_argument("--out", help="per-sample JSONL (first line: the summary); default runs/eval/NAME-TIME.jsonl")
    return parser


def _check_out(path: str) -> None:
    out = Path(path)
    if out.is_dir():
        raise UsageError(f"--out {path}: is a folder; give a file name")
    for parent in out.parents:
        if parent.exists() and not parent.is_dir():
            raise UsageError(f"--out {path}: {parent} is a file, not a folder")


def _check_data(benchmark: Benchmark, data: str) -> None:
    columns = input_checks.check_dataset(data, [*benchmark.datasets, *benchmark.builtin], "--data")
    if columns is None:
        return
    questions, gold = benchmark.columns
    if not any(c in columns for c in questions):
        input_checks.require_columns(data, columns, questions[:1], f"eval.{benchmark.name}")
    input_checks.require_columns(data, columns, (gold,), f"eval.{benchmark.name}")


def _warn_eos(model: str) -> None:
    """A tokenizer whose EOS is not among the generation config's EOS ids is said, naming both."""
    if not os.path.isfile(os.path.join(model, "generation_config.json")):
        return
    from transformers import GenerationConfig

    from qerl.policy import eos_mismatch, load_tokenizer

    mismatch = eos_mismatch(load_tokenizer(model), GenerationConfig.from_pretrained(model))
    if mismatch:
        warnings.warn(f"{model}: {mismatch} (is the tokenizer another model's, or a GGUF's metadata?)", stacklevel=2)


def _read_rows(benchmark: Benchmark, data: str, split: str | None, limit: int | None) -> list[dict]:
    from datasets import load_dataset

    if data in benchmark.datasets:
        hub_id, config, default_split = benchmark.datasets[data]
        rows = load_dataset(hub_id, config, split=split or default_split)
    else:
        kind = {".parquet": "parquet", ".csv": "csv"}.get(os.path.splitext(data)[1].lower(), "json")
        rows = load_dataset(kind, data_files={split or "test": data}, split=split or "test")
    if limit is not None:
        rows = rows.select(range(min(limit, len(rows))))
    return list(rows)


def run(benchmark: Benchmark, argv: list[str], description: str) -> dict:
    """Parse and check the flags and files, generate, score; print and write the results."""
    args = build_parser(benchmark, description).parse_args(argv)
    input_checks.check_model(args.model)
    if args.adapter:
        input_checks.check_adapter(args.adapter, model=args.model)
    _check_data(benchmark, args.data)
    if args.out:
        _check_out(args.out)
    from qerl.nvfp4.checkpoint import is_nvfp4_checkpoint

    if args.load == "bf16" and is_nvfp4_checkpoint(args.model):
        raise UsageError(f"--model {args.model} is an NVFP4 checkpoint; use --load auto or nvfp4")
    if args.device is not None:
        input_checks.check_device(args.device)
    else:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    _warn_eos(args.model)

    protocol, prompt_format = PROTOCOLS[args.protocol], benchmark.formats[args.format]
    score = prompt_format.score
    if args.data in benchmark.builtin:
        rows, score = benchmark.builtin[args.data](args.limit)
    else:
        questions, gold_column = benchmark.columns
        rows = []
        for raw in _read_rows(benchmark, args.data, args.split, args.limit):
            question = next(raw[c] for c in questions if c in raw)
            rows.append(
                {
                    "prompt": prompt_format.messages(question),
                    "question": question,
                    "gold": benchmark.gold(str(raw[gold_column])),
                }
            )
    sampling = Sampling(
        protocol.do_sample,
        protocol.temperature,
        protocol.top_p,
        args.max_new_tokens or protocol.max_new_tokens,
        args.seed,
    )
    spec = ModelSpec(args.model, args.load, args.adapter, args.device, args.kv_cache_gib)
    completions = GENERATORS[args.backend](spec, [r["prompt"] for r in rows], sampling, args.batch_size)

    samples = []
    for index, (row, completion) in enumerate(zip(rows, completions, strict=True)):
        scores = score(completion, row["gold"]) if row["gold"] is not None else {"correct": False}
        samples.append(
            {"index": index, "question": row["question"], "gold": row["gold"], "completion": completion, **scores}
        )
    n = len(samples)
    summary = {"benchmark": benchmark.name, "data": args.data, "protocol": args.protocol, "format": args.format,
               **asdict(sampling), **asdict(spec), "examples": n}  # fmt: skip
    for key in (k for k in samples[0] if isinstance(samples[0][k], bool)) if samples else ():
        correct = sum(s[key] for s in samples)
        low, high = wilson_interval(correct, n)
        name = "accuracy" if key == "correct" else f"accuracy_{key}"
        summary.update({name: correct / n, f"{name}_ci95": [low, high]})
    out = args.out or os.path.join(
        "runs",
        "eval",
        f"{benchmark.name}-{Path(args.data).stem}-{args.protocol}-{time.strftime('%Y%m%d-%H%M%S')}.jsonl",
    )
    _write_jsonl(out, [summary, *samples])
    if n:
        low, high = summary["accuracy_ci95"]
        print(
            f"eval.{benchmark.name}: accuracy {summary['accuracy']:.1%} (95% CI {low:.1%}-{high:.1%}, n={n}); "
            f"per sample: {out}"
        )
    return summary


def _write_jsonl(path: str, rows: list[dict]) -> None:
    """Written whole or not at all: a temporary file renamed into place."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.partial-{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
