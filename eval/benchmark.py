"""What a benchmark is (its datasets, how a row becomes a question and a gold answer, the prompt formats it can be asked
in) and how a run of it is scored: every sample, then the summary with each score's 95% interval."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field

from eval.statistics import wilson_interval


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
    builtin: dict[str, Callable] = field(default_factory=dict)
    local_rows: str | None = None  # a file of the same rows that a clone carries, named when the hub is out of reach

    def rows(
        self, data: str, split: str | None, prompt_format: PromptFormat, limit: int | None
    ) -> tuple[list, Callable]:
        """(rows of prompt, question and gold, the scorer) of a named dataset, a builtin task or a local file."""
        if data in self.builtin:
            return self.builtin[data](limit)
        questions, gold_column = self.columns
        rows = []
        for raw in self._read(data, split, limit):
            question = next(raw[c] for c in questions if c in raw)
            gold = self.gold(str(raw[gold_column]))
            rows.append({"prompt": prompt_format.messages(question), "question": question, "gold": gold})
        return rows, prompt_format.score

    def _read(self, data: str, split: str | None, limit: int | None) -> list[dict]:
        from datasets import load_dataset

        if data in self.datasets:
            hub_id, config, default_split = self.datasets[data]
            rows = load_dataset(hub_id, config, split=split or default_split)
        else:
            kind = {".parquet": "parquet", ".csv": "csv"}.get(os.path.splitext(data)[1].lower(), "json")
            rows = load_dataset(kind, data_files={split or "test": data}, split=split or "test")
        if limit is not None:
            rows = rows.select(range(min(limit, len(rows))))
        return list(rows)


def score_samples(rows: list[dict], completions: list[str], score: Callable) -> tuple[list[dict], dict]:
    """(every sample with its scores, the share right of each score with its 95% Wilson interval). A row without a
    gold answer counts as wrong."""
    samples = []
    for index, (row, completion) in enumerate(zip(rows, completions, strict=True)):
        scores = score(completion, row["gold"]) if row["gold"] is not None else {"correct": False}
        samples.append(
            {"index": index, "question": row["question"], "gold": row["gold"], "completion": completion, **scores}
        )
    n, summary = len(samples), {}
    for key in (k for k in samples[0] if isinstance(samples[0][k], bool)) if samples else ():
        correct = sum(s[key] for s in samples)
        low, high = wilson_interval(correct, n)
        name = "accuracy" if key == "correct" else f"accuracy_{key}"
        summary.update({name: correct / n, f"{name}_ci95": [low, high]})
    return samples, summary
