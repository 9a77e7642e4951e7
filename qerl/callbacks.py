"""The trainer's callbacks (transformers' TrainerCallback): each log line to metrics.jsonl, the model's EOS ids
kept as its configs had them, and a readable line per logging step for qerl.train and the demo (with the closing
lines both print: where the outputs are and how to evaluate the adapter). Apart from the trainer, as TRL keeps its
callbacks.py.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import statistics
import time
from collections.abc import Callable

from transformers import TrainerCallback

logger = logging.getLogger(__name__)


class JsonlMetrics(TrainerCallback):
    """Writes each log line as one JSON object (with the step) to a file, from the main process.

    One file holds one run: a fresh start keeps an earlier run's file aside as metrics.N.jsonl; a resume from
    step k keeps the lines up to k and drops what an interrupted run logged after it (kept aside the same way),
    so no step appears twice.
    """

    def __init__(self, path: str):
        self.path = path

    def on_train_begin(self, args, state, control, **kwargs):
        if not state.is_world_process_zero or not os.path.isfile(self.path):
            return
        with open(self.path) as f:
            lines = [line for line in f if line.strip()]
        kept = [
            line
            for line in lines
            if state.global_step
            and json.loads(line).get("step", 0) <= state.global_step
            and "train_runtime" not in line  # the interrupted session's closing summary
        ]
        if kept == lines:
            return
        root, ext = os.path.splitext(self.path)
        aside = next(f"{root}.{n}{ext}" for n in range(1, 10**6) if not os.path.exists(f"{root}.{n}{ext}"))
        os.rename(self.path, aside)
        with open(self.path, "w") as f:
            f.writelines(kept)
        logger.warning(
            "%s: %s; the earlier file is kept as %s",
            self.path,
            f"continues at step {state.global_step}" if state.global_step else "starts anew",
            os.path.basename(aside),
        )

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": state.global_step, **logs}) + "\n")


class KeepModelEos(TrainerCallback):
    """Puts the model's EOS ids back as its configs had them when the trainer was built. transformers' Trainer.train
    "aligns" them to the tokenizer's EOS before the first step (align_special_tokens, logged as "Updated tokens"),
    which would make a wrong tokenizer EOS (a GGUF's metadata) the model's own."""

    def __init__(self, model):
        self.configs = (model.config, model.generation_config)
        self.eos = [copy.copy(getattr(config, "eos_token_id", None)) for config in self.configs]

    def on_train_begin(self, args, state, control, **kwargs):
        for config, eos in zip(self.configs, self.eos, strict=True):
            if config is not None:
                config.eos_token_id = eos


class CompactProgress(TrainerCallback):
    """A readable line every `every` steps instead of the trainer's dict of every logged key (every key still goes to
    metrics.jsonl): the step, the means since the last line of the reward, of the share of completions cut at
    max_completion_length and of the token entropy, AQN's sigma, seconds per step and the time so far. `say` writes
    the line (print, a logger's info)."""

    def __init__(self, every: int = 1, say: Callable[[str], object] = print):
        self.every, self.say, self.window = max(every, 1), say, []
        self.start = self.last_time = time.time()
        self.last_step = 0

    def on_train_begin(self, args, state, control, **kwargs):
        self.start = self.last_time = time.time()
        self.last_step = state.global_step  # a resumed run's first step time counts from its checkpoint

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs or "reward" not in logs:
            return
        self.window.append(logs)
        if state.global_step % self.every == 0 or state.global_step == state.max_steps:
            mean = lambda key: statistics.fmean(row.get(key, 0.0) for row in self.window)  # noqa: E731
            now = time.time()
            per_step = (now - self.last_time) / max(state.global_step - self.last_step, 1)
            self.say(
                f"step {state.global_step:4d}/{state.max_steps}  reward {mean('reward'):.3f}  "
                f"truncated {mean('completions/clipped_ratio'):4.0%}  entropy {mean('entropy'):.3f}  "
                f"sigma {logs.get('aqn/sigma', 0.0):.1e}  {per_step:.1f} s/step  ({now - self.start:.0f} s)"
            )
            self.window, self.last_time, self.last_step = [], now, state.global_step


def say_outputs(say: Callable[[str], object], metrics: str, plot: str | None, adapter: str, base: str, command: str):
    """The closing lines of a run (qerl.train, the demo): where its metrics, plot and adapter are, and the command
    that evaluates the adapter, on a line of its own to run as printed."""
    say(f"metrics: {metrics}")
    if plot is not None:
        say(f"plot:    {plot}")
    say(f"adapter: {adapter} (on the base {base}); evaluate it with")
    say(f"  {command}")
