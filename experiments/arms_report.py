"""The report of experiments.arms, read from the committed run records (experiments/arms_results.py): per arm the
GSM8K test accuracy per protocol (mean over seeds with its 95% t interval), training reward, early entropy, steps to a
reward level and non-finite gradient steps; the four comparisons fixed before the runs (COMPARISONS: differences of
seed means with Welch 95% intervals, equivalence within +-2 points by TOST); the same on accuracy without the runs
stuck at the length cap, with the stuck counts compared (chosen after seeing the runs, and labelled so); whether the
card or the packing of runs on it moved an arm; report.json, report.md (the tables) and the plot.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter

from experiments.arms_markdown import markdown
from experiments.arms_plot import plot
from experiments.arms_results import (
    OTHER_BASE,
    curve_rows,
    first_nonfinite_step,
    load_records,
    logged,
    write_report,
)
from experiments.arms_runs import ARMS, LORA_ARMS, PROTOCOLS, recipe_sha256
from experiments.arms_stats import fisher_exact, mean_interval, paired, variance_ratio, welch
from qerl import plotting

# Fixed before the runs (issue 42): (arm a, arm b, what a - b answers). The first is QeRL's claim.
COMPARISONS = (
    ("nvfp4_lora_aqn", "bf16_lora", "NVFP4 + AQN vs BF16 LoRA (QeRL against 16-bit LoRA)"),
    ("nvfp4_lora", "bf16_lora", "NVFP4 LoRA vs BF16 LoRA (what quantization costs)"),
    ("nvfp4_lora_aqn", "nvfp4_lora", "AQN within NVFP4"),
    ("bf16_lora_aqn", "bf16_lora", "AQN within BF16"),
    # Fixed 2026-11-29, before any run of the arm (issue 49 lever 3c): what GPTQ rounding of the base buys back.
    ("nvfp4_gptq_lora", "nvfp4_lora", "GPTQ vs round-to-nearest NVFP4 base (LoRA)"),
    ("nvfp4_gptq_lora", "bf16_lora", "NVFP4 (GPTQ) LoRA vs BF16 LoRA"),
    # Fixed 2026-11-29, before any run of the arm (issue 51): what sampling one round ahead on a server costs.
    ("nvfp4_lora_ahead", "nvfp4_lora", "NVFP4 LoRA sampled one round ahead vs colocated"),
)
MARGIN = 0.02  # equivalence margin on accuracy: 2 points
# Per-run measures compared between arms: accuracy under each protocol, then the training-side ones.
TRAINING_MEASURES = ("reward_last_tenth", "entropy_first_tenth", "steps_to_reward")
REWARD_LEVEL_SHARE = 0.9  # steps to reward: the step the moving average reaches 90% of the lowest arm's last tenth
# A run stuck at the length cap: nearly every completion of its last tenth truncated. DAPO masks truncated
# completions, so such a run gets (almost) no gradient and cannot leave the state.
STUCK_TRUNCATED = 0.9
# paired_by_seed was fixed after seeds 20-24 of the fixed recipe: as evidence it reads the seeds from here on only
PAIRED_REGISTERED_FROM_SEED = 25


def steps_to_reach(rows: list[dict], level: float, window: int) -> int | None:
    """The first step whose moving-average training reward reaches `level`."""
    curve = plotting.smooth([logged(r, "reward") for r in rows], window)
    return next((r["step"] for r, v in zip(rows, curve, strict=True) if v >= level), None)


def tenth(rows: list[dict], key: str, last: bool = False) -> float:
    k = max(1, len(rows) // 10)
    return statistics.fmean(logged(r, key) for r in (rows[-k:] if last else rows[:k]))


def experiment(record: dict) -> tuple:
    """What runs must share to be pooled: step count, extra training flags, prompt format, rollout temperature, and
    the recipe file (its SHA-256)."""
    return (record["steps"], tuple(record.get("train_flags") or ()), record.get("format"), record.get("temperature"),
            record.get("recipe_sha256"))  # fmt: skip


def select(
    records: list[dict], steps: int | None, sharing: str | None, recipe: str | None = None
) -> tuple[list[dict], list[dict], dict]:
    """(the runs the arms table pools, every trained run of that experiment, what was chosen). The table pools one
    experiment (the most common; with `steps`, the most common of that step count; with `recipe`, a prefix of its
    SHA-256, of that recipe) and one packing of runs on the GPUs (the most common unless given); runs made otherwise
    are left out of it and named."""
    trained = [r for r in records if r["arm"] is not None and (steps is None or r["steps"] == steps)]
    if recipe is not None:
        trained = [r for r in trained if (r.get("recipe_sha256") or "").startswith(recipe)]
    key = Counter(experiment(r) for r in trained).most_common(1)[0][0] if trained else None
    same = [r for r in trained if experiment(r) == key]
    sharing = sharing or (Counter(r["sharing"] for r in same).most_common(1)[0][0] if same else None)
    pooled = [r for r in same if r["sharing"] == sharing]
    left_out = sorted(r["name"] for r in records if r["arm"] is not None and r not in pooled)
    chosen = {"steps": key[0] if key else None, "train_flags": list(key[1]) if key else [], "sharing": sharing,
              "recipe_sha256": key[4] if key else None}  # fmt: skip
    return pooled, same, {**chosen, "left_out": left_out}


def pooled_recipe(args, records: list[dict]) -> str | None:
    """The recipe whose runs the report pools: --recipe-sha256 (a prefix) where given, else the recipe file as it is
    now where runs of it are recorded, else None (the most common experiment, as before the recipe changed)."""
    wanted = getattr(args, "recipe_sha256", None)
    digests = Counter(r.get("recipe_sha256") for r in records if r["arm"] is not None)
    if wanted:
        if not any((d or "").startswith(wanted) for d in digests):
            found = ", ".join(f"{(d or 'none')[:8]} ({n} runs)" for d, n in digests.most_common())
            raise SystemExit(f"--recipe-sha256 {wanted}: no run in {args.results} has it; they have {found or 'none'}")
        return wanted
    if getattr(args, "model", None) is None:
        return None
    current = recipe_sha256(args)
    return current if current in digests else None


def per_run_measures(runs: list[dict]) -> dict[str, dict[str, float | None]]:
    """Each run's measures by name: accuracy per protocol (strict and flexible), training reward in the first and
    last tenth of its steps, entropy in the first tenth, the step it reached the common reward level, the first
    non-finite gradient step."""
    rows = {r["name"]: curve_rows(r) for r in runs}
    measures = {}
    for run in runs:
        steps = rows[run["name"]]
        m = {}
        for protocol in PROTOCOLS:
            summary = run["evals"].get(protocol)
            m[protocol] = summary["accuracy"] if summary else None
            m[f"{protocol}_flexible"] = summary.get("accuracy_flexible") if summary else None
        other = run["evals"].get(OTHER_BASE)
        m[OTHER_BASE] = other["accuracy"] if other else None
        m["reward_first_tenth"] = tenth(steps, "reward")
        m["reward_last_tenth"] = tenth(steps, "reward", last=True)
        m["entropy_first_tenth"] = tenth(steps, "entropy")
        m["truncated_last_tenth"] = tenth(steps, "completions/clipped_ratio", last=True)
        m["first_nonfinite_grad_step"] = first_nonfinite_step(steps)
        measures[run["name"]] = m
    if runs:
        # The level every arm's runs end above on average: 90% of the lowest arm's mean last-tenth reward.
        by_arm: dict[str, list[float]] = {}
        for run in runs:
            by_arm.setdefault(run["arm"], []).append(measures[run["name"]]["reward_last_tenth"])
        level = REWARD_LEVEL_SHARE * min(statistics.fmean(v) for v in by_arm.values())
        window = max(1, min(len(v) for v in rows.values()) // 15)
        for run in runs:
            measures[run["name"]]["steps_to_reward"] = steps_to_reach(rows[run["name"]], level, window)
        measures["_level"] = {"reward": level, "window": window, "share": REWARD_LEVEL_SHARE}
    return measures


def _values(runs: list[dict], measures: dict, key: str) -> list[float]:
    values = [measures[r["name"]].get(key) for r in runs]
    return [float(v) for v in values if v is not None and math.isfinite(v)]


def stuck(run: dict, measures: dict) -> bool:
    return measures[run["name"]]["truncated_last_tenth"] >= STUCK_TRUNCATED


def arm_table(runs: list[dict], measures: dict) -> dict[str, dict]:
    """Per arm: its seeds and cards, and each measure's mean with its 95% t interval, sd and n."""
    table = {}
    for arm in ARMS:
        mine = sorted((r for r in runs if r["arm"] == arm), key=lambda r: r["seed"])
        if not mine:
            continue
        row = {"seeds": [r["seed"] for r in mine], "cards": sorted({r.get("card", "?") for r in mine})}
        for key in (*PROTOCOLS, *(f"{p}_flexible" for p in PROTOCOLS), "reward_first_tenth", *TRAINING_MEASURES):
            values = _values(mine, measures, key)
            if values:
                mean, half = mean_interval(values)
                sd = statistics.stdev(values) if len(values) > 1 else 0.0
                row[key] = {"mean": mean, "ci95": half, "sd": sd, "n": len(values)}
        row["not_reaching_reward_level"] = sum(measures[r["name"]].get("steps_to_reward") is None for r in mine)
        row["nonfinite_runs"] = [r["name"] for r in mine if measures[r["name"]]["first_nonfinite_grad_step"]]
        row["stuck_at_length_cap"] = [r["name"] for r in mine if stuck(r, measures)]
        table[arm] = row
    return table


def compared(runs: list[dict]) -> list[tuple[str, str, str]]:
    """The fixed comparisons (COMPARISONS) whose two arms both have runs here."""
    arms = {r["arm"] for r in runs}
    return [(a, b, question) for a, b, question in COMPARISONS if a in arms and b in arms]


def comparisons(
    runs: list[dict],
    measures: dict,
    keys: tuple[str, ...] = (*PROTOCOLS, *TRAINING_MEASURES),
    pairs: list[tuple[str, str, str]] | None = None,
) -> list[dict]:
    """Each fixed comparison in `pairs` (default: those whose arms both ran) on each measure in `keys`: mean(a) -
    mean(b) with its Welch interval; on the accuracies also the TOST verdict at +-MARGIN."""
    out = []
    for a, b, question in compared(runs) if pairs is None else pairs:
        runs_a = [r for r in runs if r["arm"] == a]
        runs_b = [r for r in runs if r["arm"] == b]
        for key in keys:
            margin = MARGIN if key in PROTOCOLS else None
            diff = welch(_values(runs_a, measures, key), _values(runs_b, measures, key), margin)
            out.append({"a": a, "b": b, "question": question, "measure": key, **(diff.as_dict() if diff else {})})
    return out


def paired_by_seed(runs: list[dict], measures: dict, first_seed: int = 0) -> list[dict]:
    """Each fixed comparison's greedy accuracy over the seeds >= first_seed both arms ran, the difference paired by
    seed (a seed gives both arms the same prompts in the same order) with its t interval and TOST at +-MARGIN: a
    secondary endpoint beside Welch's, added on 2026-11-29 after seeds 20-24 of the fixed recipe and before any
    later seed (its registered reading: first_seed PAIRED_REGISTERED_FROM_SEED)."""
    out = []
    for a, b, question in compared(runs):
        accuracy = {arm: {r["seed"]: measures[r["name"]]["greedy"] for r in runs if r["arm"] == arm} for arm in (a, b)}
        seeds = sorted(
            s
            for s in set(accuracy[a]) & set(accuracy[b])
            if s >= first_seed and None not in (accuracy[a][s], accuracy[b][s])
        )
        diff = paired([accuracy[a][s] - accuracy[b][s] for s in seeds], MARGIN)
        out.append({"a": a, "b": b, "question": question, "measure": "greedy", "seeds": seeds,
                    **(diff.as_dict() if diff else {})})  # fmt: skip
    return out


def without_stuck(runs: list[dict], measures: dict) -> dict:
    """Chosen after the runs, not before (so a second look, not the fixed test): the accuracy comparisons over the
    runs that did not get stuck at the length cap, and whether the arms got stuck at different rates (Fisher)."""
    stuck_runs = [r for r in runs if stuck(r, measures)]
    counts = {arm: [sum(r["arm"] == arm for r in stuck_runs), sum(r["arm"] == arm for r in runs)] for arm in ARMS}
    rates = []
    pairs = compared(runs)
    for a, b, question in pairs:
        (k_a, n_a), (k_b, n_b) = counts[a], counts[b]
        p = fisher_exact(k_a, n_a, k_b, n_b) if n_a and n_b else None
        rates.append({"a": a, "b": b, "question": question, "stuck_a": counts[a], "stuck_b": counts[b], "p": p})
    return {
        "left_out": sorted(r["name"] for r in stuck_runs),
        "comparisons": comparisons([r for r in runs if r not in stuck_runs], measures, PROTOCOLS, pairs),
        "stuck_rates": rates,
    }


def base_split(runs: list[dict], measures: dict) -> dict | None:
    """Greedy accuracy of the LoRA arms' adapters (LORA_ARMS) on the base they trained on and on the other one
    they were evaluated on (seeds with both): the table of cells "TRAINED on BASE"; what training on a 4-bit base
    costs, on each base both it and the BF16-trained adapters were evaluated on (Welch, 4-bit-trained minus
    BF16-trained); what sampling from the 4-bit base costs each adapter (paired over seeds: on its 4-bit base, the
    RTN one for BF16-trained adapters, minus on BF16). None when no run has the other base's evaluation."""
    table: dict[str, dict[str, dict[int, float]]] = {}  # trained on -> evaluated on -> seed -> accuracy
    for run in runs:
        trained = LORA_ARMS.get(run["arm"])
        m = measures[run["name"]]
        if trained is None or m.get(OTHER_BASE) is None or m.get("greedy") is None:
            continue
        other = run["evals"][OTHER_BASE].get("base") or ("nvfp4" if trained == "bf16" else "bf16")
        table.setdefault(trained, {}).setdefault(trained, {})[run["seed"]] = m["greedy"]
        table[trained].setdefault(other, {})[run["seed"]] = m[OTHER_BASE]
    if not table:
        return None
    cells = {
        f"{trained} on {base}": dict(zip(("mean", "ci95"), mean_interval(list(by_seed.values())), strict=True))
        | {"n": len(by_seed)}
        for trained, bases in table.items()
        for base, by_seed in bases.items()
    }
    bf16_trained = table.get("bf16", {})
    training = {
        trained: {
            base: diff.as_dict() if (diff := welch(list(on.values()), list(bf16_trained[base].values()))) else None
            for base, on in bases.items()
            if base in bf16_trained
        }
        for trained, bases in table.items()
        if trained != "bf16"
    }
    sampling = {}
    for trained, bases in table.items():
        four_bit = "nvfp4" if trained == "bf16" else trained
        seeds = sorted(set(bases.get(four_bit, {})) & set(bases.get("bf16", {})))
        diffs = [bases[four_bit][s] - bases["bf16"][s] for s in seeds]
        if diffs:
            sampling[trained] = dict(zip(("mean", "ci95"), mean_interval(diffs), strict=True)) | {"n": len(diffs)}
    return {"cells": cells, "training_cost": training, "sampling_cost_of": sampling}


def setting_effects(runs: list[dict], measures: dict, pooled: str | None) -> list[dict]:
    """Where an arm ran in more than one way (card, packing of runs on the GPU): greedy accuracy per way (mean,
    interval, sd), and each other way's difference from the first (Welch) and ratio of variances to it (F). The
    first way: the pooled packing's, then the one with the most runs."""
    out = []
    for arm in ARMS:
        ways: dict[tuple[str, str, int | None], list[dict]] = {}
        for run in (r for r in runs if r["arm"] == arm):
            ways.setdefault((run.get("card", "?"), run["sharing"], run.get("runs_per_gpu")), []).append(run)
        if len(ways) < 2:
            continue
        groups = sorted(ways.items(), key=lambda kv: (kv[0][1] != pooled, -len(kv[1])))
        (first_way, first_runs), *others = groups
        first = _values(first_runs, measures, "greedy")
        rows = []
        for way, group in groups:
            values = _values(group, measures, "greedy")
            mean, half = mean_interval(values)
            row = {"card": way[0], "sharing": way[1], "runs_per_gpu": way[2], "seeds": [r["seed"] for r in group]}
            row["runs"] = [r["name"] for r in group]
            row.update(mean=mean, ci95=half, sd=statistics.stdev(values) if len(values) > 1 else 0.0)
            if way != first_way:
                diff = welch(values, first)
                ratio = variance_ratio(values, first)
                row["minus_first"] = diff.as_dict() if diff else None
                row["variance_ratio_to_first"] = {"ratio": ratio[0], "p": ratio[1]} if ratio else None
            rows.append(row)
        out.append({"arm": arm, "ways": rows})
    return out


def report(args) -> dict:
    """report.json, report.md and the plot from the records in --results; prints the tables."""
    records = load_records(args.results)
    runs, same_experiment, chosen = select(
        records, getattr(args, "report_steps", None), getattr(args, "sharing", None), pooled_recipe(args, records)
    )
    measures = per_run_measures(same_experiment)
    bases = {r["precision"]: r["evals"] for r in records if r["arm"] is None}
    result = {
        "results": str(args.results),
        **chosen,
        "margin": MARGIN,
        "paired_registered_from_seed": PAIRED_REGISTERED_FROM_SEED,
        "stuck_truncated": STUCK_TRUNCATED,
        "reward_level": measures.get("_level"),
        "arms": arm_table(runs, measures),
        "comparisons": comparisons(runs, measures),
        "paired_by_seed": paired_by_seed(runs, measures),
        "paired_by_seed_registered": paired_by_seed(runs, measures, PAIRED_REGISTERED_FROM_SEED),
        "without_stuck": without_stuck(runs, measures),
        "base_split": base_split(runs, measures),
        "settings": setting_effects(same_experiment, measures, chosen["sharing"]),
        "bases": bases,
        "runs": {r["name"]: {k: v for k, v in measures[r["name"]].items()} for r in same_experiment},
    }
    written = write_report(args.out, "report", result, markdown(result))
    if runs:
        plot(runs, result, args.png)
        print(f"report: {written}; plot: {args.png}")
    return result
