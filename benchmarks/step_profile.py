"""Where a QeRL step's time goes: each phase's wall time, GPU busy time and kernel launches, the forwards per
update, and the training passes' model FLOP utilization. Used by `python -m benchmarks.step --profile`; its other
runs and benchmarks.trl_baseline use the plainer clocks here (PhaseTimer, StepClock).

Phases are the trainer's own calls, wrapped (CUDA-synchronized at both ends, so a phase's wall time is what it
costs the step; the syncs remove some CPU/GPU overlap the unprofiled step has). Nested phases count in their own row
only: a row is its phase's exclusive time. Rows:
  rollout: refresh (LoRA + norms into the engine), prefill, graph capture, and the rest of the round (decode, AQN,
    bookkeeping: `rollout`'s own row)
  generation round: TRL's _generate_and_score_completions beyond the rollout and the rows below (tokenizing,
    decoding, advantages, gathers, completion logging)
  rewards; old log-probs forward (TRL computes them when the update needs them); AQN shift forward (aqn_log_shift)
  loss forward (the log-prob forward with gradients); loss (TRL's loss math and metrics beyond that forward)
  backward (gradient checkpointing's recomputed forward included); grad clip; optimizer; logging
  other: the step's wall time not in any row (dataloader, callbacks, the Trainer loop)
One steady step also runs under torch.profiler: per row, GPU kernel time and the number of kernels launched (kernels
of a CUDA-graph replay count one by one), and the GPU's idle share of the row's wall time. Kernel times add up: under
programmatic dependent launch (the native engine's decode) kernels overlap, so a row's GPU time can exceed its wall.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile, record_function
from transformers import TrainerCallback

from qerl import base_model

# Dense BF16 tensor-core peaks (TFLOP/s) by device-name fragment, first match wins.
BF16_PEAK_TFLOPS = (("H100 PCIe", 756.0), ("H100", 989.4), ("H200", 989.4), ("A100", 312.0))
FORWARD_PHASES = ("old log-probs forward", "AQN shift forward", "loss forward")
TRAINING_PHASES = (*FORWARD_PHASES, "backward")


def synchronize() -> None:
    """Wait for the GPU (timings end when its work does); nothing to wait for on a CPU run."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class PhaseTimer:
    """Adds up the wall time of wrapped calls per phase (CUDA-synchronized), and splits it per optimizer step."""

    def __init__(self):
        self.total = defaultdict(float)
        self.peak_gpu_gib = 0.0  # driver-level: the trainer's memory and vLLM's together

    def wrap(self, obj, method: str, phase: str):
        inner = getattr(obj, method)

        def timed(*args, **kwargs):
            with self.phase(phase):
                return inner(*args, **kwargs)

        setattr(obj, method, timed)

    @contextlib.contextmanager
    def phase(self, phase: str):
        synchronize()
        start = time.perf_counter()
        try:
            yield
        finally:
            synchronize()
            self.total[phase] += time.perf_counter() - start
            self.peak_gpu_gib = max(self.peak_gpu_gib, gpu_used_gib())


class StepClock(TrainerCallback):
    """The wall time of each optimizer step (CUDA-synchronized)."""

    def __init__(self):
        self.times: list[float] = []
        self.start = 0.0

    def on_step_begin(self, *args, **kwargs):
        synchronize()
        self.start = time.perf_counter()

    def on_step_end(self, *args, **kwargs):
        synchronize()
        self.times.append(time.perf_counter() - self.start)


def gpu_used_gib() -> float:
    """This process's GPU's memory in use at the driver (0 without a GPU)."""
    if not torch.cuda.is_available():
        return 0.0
    free, total = torch.cuda.mem_get_info()
    return (total - free) / 2**30


def bf16_peak_tflops(device_name: str) -> float | None:
    return next((peak for fragment, peak in BF16_PEAK_TFLOPS if fragment in device_name), None)


class StepProfile(TrainerCallback):
    """Instruments a QeRLTrainer; add it before trainer.train(). `profile_step` (0-based) runs under torch.profiler."""

    def __init__(self, trainer, profile_step: int | None = None):
        self.trainer = trainer
        self.profile_step = profile_step
        self.step = -1
        self.step_starts: list[float] = []
        self.stack: list[list] = []  # [name, start, children's time]
        self._ranges: list = []  # the open torch.profiler ranges, one per entry of `stack`
        self.exclusive: list[dict[str, float]] = []  # per step: phase -> seconds
        self.forwards: list[dict[str, int]] = []  # per step: phase -> decoder passes (layer 0 forwards)
        self.tokens: list[dict[str, list[int]]] = []  # per step: forward phase -> [real tokens, sum of squared rows]
        self.profiler = None
        self.kernels: dict[str, list[float]] = {}  # phase -> [kernel count, GPU ms] of the profiled step
        self.unattributed_gpu_ms = 0.0
        self._instrument()

    # ---------------------------------------------------------------------------------------------- phases

    def _enter(self, name: str):
        synchronize()
        self.stack.append([name, time.perf_counter(), 0.0])
        self._ranges.append(record_function(name).__enter__())

    def _exit(self):
        synchronize()  # before the range closes: the phase's kernels run inside its range on the profiler's clock
        self._ranges.pop().__exit__(None, None, None)
        name, start, children = self.stack.pop()
        seconds = time.perf_counter() - start
        if self.stack:
            self.stack[-1][2] += seconds
        if self.step >= 0:
            self.exclusive[self.step][name] = self.exclusive[self.step].get(name, 0.0) + seconds - children

    def _wrap(self, obj, method: str, name):
        """Time obj.method as phase `name` (a string, or a function of the enclosing phase giving one or None)."""
        inner = getattr(obj, method)

        def timed(*args, **kwargs):
            phase = name(self.stack[-1][0] if self.stack else None) if callable(name) else name
            if phase is None:
                return inner(*args, **kwargs)
            self._enter(phase)
            try:
                return inner(*args, **kwargs)
            finally:
                self._exit()

        setattr(obj, method, timed)

    def _instrument(self):
        t = self.trainer
        self._wrap(t, "_generate_and_score_completions", "generation round")
        self._wrap(t.rollout, "generate", "rollout")
        if t.rollout.name == "native":
            self._wrap(t.rollout.engine.decoder, "refresh", "refresh")
            self._wrap(t.rollout.engine, "_prefill", "prefill")
            self._wrap(t.rollout.engine, "_capture", "graph capture")
        self._wrap(t, "_calculate_rewards", "rewards")
        self._wrap(t, "_noisy_logps", "AQN shift forward")
        self._wrap(t, "_compute_loss", "loss")
        self._count_tokens(t)  # inside the forward's phase, below
        forward_of = {"generation round": "old log-probs forward", "loss": "loss forward"}
        self._wrap(t, "_get_per_token_logps_and_entropies", lambda parent: forward_of.get(parent))
        self._wrap(t.accelerator, "backward", "backward")
        self._wrap(t, "_clip_grad_norm", "grad clip")
        self._wrap(t, "log", "logging")
        # Out of torch.compile's reach: a hook on a compiled layer is traced with it, and each step's new counter
        # compiled the hook again (eight times a run on the H200, logged with TORCH_LOGS=recompiles).
        counter = torch.compiler.disable(self._count_forward)
        base_model.decoder_layers(t.accelerator.unwrap_model(t.model))[0].register_forward_pre_hook(counter)

    def _count_tokens(self, trainer):
        """Real tokens (and the sum of squared row lengths, for attention FLOPs) of each training forward."""
        inner = trainer._get_per_token_logps_and_entropies

        def counted(model, input_ids, attention_mask, *args, **kwargs):
            if self.step >= 0 and self.stack:
                lengths = attention_mask.sum(1).double()
                entry = self.tokens[self.step].setdefault(self.stack[-1][0], [0.0, 0.0])
                entry[0] += float(lengths.sum())
                entry[1] += float((lengths**2).sum())
            return inner(model, input_ids, attention_mask, *args, **kwargs)

        trainer._get_per_token_logps_and_entropies = counted

    def _count_forward(self, module, args):
        if self.step >= 0:
            phase = self.stack[-1][0] if self.stack else "other"
            self.forwards[self.step][phase] = self.forwards[self.step].get(phase, 0) + 1

    # ------------------------------------------------------------------------------------------- callbacks

    def on_step_begin(self, args, state, control, **kwargs):
        synchronize()
        self.step_starts.append(time.perf_counter())
        self._stop_profiler()
        self.step += 1
        self.exclusive.append({})
        self.forwards.append({})
        self.tokens.append({})
        if self.step == self.profile_step and torch.cuda.is_available():
            self.profiler = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
            self.profiler.start()

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self._enter("optimizer")

    def on_optimizer_step(self, args, state, control, **kwargs):
        self._exit()

    def on_train_end(self, args, state, control, **kwargs):
        synchronize()
        self.step_starts.append(time.perf_counter())
        self._stop_profiler()

    def _stop_profiler(self):
        """Kernels (and copies) of the profiled step by phase. A phase synchronizes at both ends, so every kernel it
        launched, from any thread (the backward's run on autograd's), ran inside its range: each GPU event goes to the
        innermost phase range that contains its start."""
        if self.profiler is None:
            return
        self.profiler.stop()
        events = self.profiler.events()
        names = {name for step in self.exclusive for name in step}
        cpu = torch.autograd.DeviceType.CPU
        ranges = sorted(
            (e.time_range.start, e.time_range.end, e.name) for e in events if e.device_type == cpu and e.name in names
        )
        gpu = sorted(
            (e for e in events if e.device_type != cpu and e.name not in names),  # names: GPU-side spans
            key=lambda e: e.time_range.start,
        )
        open_ranges, upcoming = [], iter(ranges)
        following = next(upcoming, None)
        for event in gpu:  # one sweep: phases nest, so the innermost open range is the last one opened
            t = event.time_range.start
            while following is not None and following[0] <= t:
                open_ranges.append(following)
                following = next(upcoming, None)
            while open_ranges and open_ranges[-1][1] <= t:
                open_ranges.pop()
            if not open_ranges:
                self.unattributed_gpu_ms += event.time_range.elapsed_us() / 1e3
                continue
            name = open_ranges[-1][2]
            entry = self.kernels.setdefault(name, [0, 0.0])
            entry[0] += 1
            entry[1] += event.time_range.elapsed_us() / 1e3
        self.profiler = None

    # ---------------------------------------------------------------------------------------------- report

    def step_seconds(self) -> list[float]:
        return [b - a for a, b in zip(self.step_starts, self.step_starts[1:], strict=False)]

    def summary(self, steady: slice) -> dict:
        """Mean per steady step: each phase's exclusive seconds, 'other', forwards per update, MFU of the training
        passes; with the profiled step's kernels and GPU time per phase."""
        steps = self.step_seconds()[steady]
        exclusive = self.exclusive[steady]
        n = len(steps)
        if n == 0:
            raise RuntimeError(f"no steady step to summarize: the run made {len(self.step_seconds())} steps")
        phases = defaultdict(float)
        for step in exclusive:
            for name, seconds in step.items():
                phases[name] += seconds / n
        phases["other"] = sum(steps) / n - sum(phases.values())
        forwards = defaultdict(float)
        for step in self.forwards[steady]:
            for name, count in step.items():
                forwards[name] += count / n
        flops = self._training_flops(self.tokens[steady]) / n
        seconds = sum(phases.get(p, 0.0) for p in TRAINING_PHASES)
        device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        peak = bf16_peak_tflops(device)
        return {
            "device": device,
            "first_step_seconds": self.step_seconds()[0],
            "step_seconds": steps,
            "mean_step_seconds": sum(steps) / n,
            "phases": dict(phases),
            "decoder_passes": dict(forwards),
            "updates_per_step": self.trainer.args.gradient_accumulation_steps,
            "training_tflop": flops / 1e12,
            "training_seconds": seconds,
            "training_tflops": flops / seconds / 1e12 if seconds else None,
            "mfu": flops / seconds / 1e12 / peak if seconds and peak else None,
            "kernels": self.kernels,
            "unattributed_gpu_ms": self.unattributed_gpu_ms,
        }

    def _training_flops(self, tokens: list[dict[str, list[float]]]) -> float:
        """Model FLOPs the algorithm needs: 2 x (the decoder's linear weights) per real token and the causal
        attention's 2 x layers x width x length^2 per row, once per forward pass, once more for the backward (the
        input gradients: the base is frozen, LoRA's own gradients are negligible); padding, the recomputed forward
        of gradient checkpointing and the LM head's vocabulary projection are left out."""
        model = self.trainer.accelerator.unwrap_model(self.trainer.model).get_base_model()
        config = model.config
        linear = sum(
            m.in_features * m.out_features
            for name, m in model.model.layers.named_modules()
            if isinstance(m, torch.nn.Linear) and "lora_" not in name
        )
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        width = config.num_attention_heads * head_dim
        total = 0.0
        for step in tokens:
            for phase, (real, squares) in step.items():
                passes = 2 if phase == "loss forward" else 1  # the loss forward's backward
                total += passes * (2 * linear * real + 2 * config.num_hidden_layers * width * squares)
        return total


def print_summary(summary: dict) -> None:
    phases, kernels = summary["phases"], summary["kernels"]
    steps = ", ".join(f"{s:.2f}" for s in summary["step_seconds"])
    print(
        f"mean step {summary['mean_step_seconds']:.2f} s over {len(summary['step_seconds'])} steady steps ({steps}), "
        f"the first {summary['first_step_seconds']:.1f} s; {summary['device']}"
    )
    print(f"{'phase':24s} {'wall s':>7s} {'GPU s':>7s} {'GPU idle':>8s} {'kernels':>8s}   (GPU columns: one step)")
    for name, seconds in sorted(phases.items(), key=lambda kv: -kv[1]):
        count, gpu_ms = kernels.get(name, (None, None))
        gpu = "" if gpu_ms is None else f"{gpu_ms / 1e3:7.2f} {max(0.0, 1 - gpu_ms / 1e3 / seconds):7.0%}"
        print(f"{name:24s} {seconds:7.2f} {gpu:16s} {'' if count is None else count:>8}")
    print(f"GPU time outside every phase (profiled step): {summary['unattributed_gpu_ms'] / 1e3:.2f} s")
    per_update = {k: v / summary["updates_per_step"] for k, v in summary["decoder_passes"].items()}
    print("decoder passes per update: " + ", ".join(f"{k} {v:.1f}" for k, v in per_update.items()))
    if summary["training_tflops"]:
        mfu = "" if summary["mfu"] is None else f", MFU {summary['mfu']:.0%} of the card's dense BF16 peak"
        print(
            f"training passes: {summary['training_tflop']:.1f} TFLOP of model FLOPs per step in "
            f"{summary['training_seconds']:.2f} s: {summary['training_tflops']:.0f} TFLOP/s{mfu}"
        )
