"""The Markdown of experiments.arms' report (report.md, what docs/benchmarks.md and the README take): the arms'
table, the fixed comparisons and the second look without stuck runs, the stuck counts, each adapter on both bases,
and the ways an arm ran. Reads the result dict experiments/arms_report.py builds."""

from __future__ import annotations

from experiments.arms_runs import ARM_NAMES, BASE_NAMES, PROTOCOLS


def _points(cell: dict | None, scale: float = 100, digits: int = 1) -> str:
    if not cell:
        return "-"
    return f"{cell['mean'] * scale:.{digits}f} ± {cell['ci95'] * scale:.{digits}f}"


def _verdict(c: dict) -> str:
    if "difference" not in c:
        return "too few runs"
    differs = "differs" if c["p"] < 0.05 else "no difference shown"
    if c.get("equivalent") is None:
        return differs
    return f"{differs}; {'equivalent' if c['equivalent'] else 'not shown equivalent'} at ±{c['margin'] * 100:g}"


def _comparison_table(rows: list[dict]) -> list[str]:
    lines = [
        "| comparison (a - b) | measure | difference | 95% CI | p | TOST p (±2) | verdict |",
        "|---|---|---|---|---|---|---|",
    ]
    for c in rows:
        scale, digits = (
            (100, 1) if c["measure"] in PROTOCOLS else ((1, 1) if c["measure"] == "steps_to_reward" else (1, 3))
        )
        if "difference" not in c:
            lines.append(f"| {c['question']} | {c['measure']} | - | - | - | - | too few runs |")
            continue
        tost = f"{c['p_equivalent']:.3f}" if c.get("p_equivalent") is not None else "-"
        lines.append(
            f"| {c['question']} | {c['measure']} | {c['difference'] * scale:+.{digits}f} | "
            f"[{c['low'] * scale:+.{digits}f}, {c['high'] * scale:+.{digits}f}] | {c['p']:.3f} | {tost} | "
            f"{_verdict(c)} |"
        )
    return lines


def markdown(result: dict) -> str:
    """The report's tables as Markdown (what docs/benchmarks.md and the README take)."""
    lines = [
        f"Runs pooled: {result['steps']} steps"
        + (f" with {' '.join(result['train_flags'])}" if result["train_flags"] else "")
        + (f", recipe {result['recipe_sha256'][:8]}" if result.get("recipe_sha256") else "")
        + f", runs packed '{result['sharing']}' on their GPUs; left out: {', '.join(result['left_out']) or 'none'}.",
        "",
        "| arm | seeds | greedy % (mean ± 95% CI) | sd | reference % | reward first -> last tenth | entropy, first "
        "tenth | steps to reward | stuck at the cap |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for arm, row in result["arms"].items():
        greedy = row.get("greedy")
        reward = f"{_points(row.get('reward_first_tenth'), 1, 3)} -> {_points(row.get('reward_last_tenth'), 1, 3)}"
        stuck = f"{len(row['stuck_at_length_cap'])} of {len(row['seeds'])}"
        reference = row.get("reference")
        fewer = f" ({reference['n']} seeds)" if reference and reference["n"] != len(row["seeds"]) else ""
        lines.append(
            f"| {ARM_NAMES[arm]} | {len(row['seeds'])} | {_points(greedy)} | {greedy['sd'] * 100:.1f} | "
            f"{_points(reference)}{fewer} | {reward} | {_points(row.get('entropy_first_tenth'), 1, 3)} | "
            f"{_points(row.get('steps_to_reward'), 1, 1)} | {stuck} |"
            if greedy
            else f"| {ARM_NAMES[arm]} | {len(row['seeds'])} | - | - | - | {reward} | - | - | {stuck} |"
        )
    for precision, evals in sorted(result["bases"].items()):
        cells = [f"{evals[p]['accuracy'] * 100:.1f}" if p in evals else "-" for p in ("greedy", "reference")]
        lines.append(f"| base {precision.upper()}, no training | - | {cells[0]} | - | {cells[1]} | - | - | - | - |")
    level = result.get("reward_level")
    if level:
        lines.append(
            f"\nSteps to reward: the first step whose {level['window']}-step moving average reaches "
            f"{level['reward']:.3f} ({level['share']:.0%} of the lowest arm's mean last-tenth reward). Stuck at "
            f"the cap: runs whose last tenth of steps had >= {result['stuck_truncated']:.0%} of completions truncated "
            "(masked by DAPO: no gradient left to leave that state)."
        )
    lines += ["", *_comparison_table(result["comparisons"])]
    lines += [
        "",
        "The same accuracy comparisons paired by seed (a seed trains both arms on the same prompts in the same order; "
        "a secondary endpoint, fixed after seeds 20-24 of the fixed recipe, before any later seed):",
        "",
        *_comparison_table(result["paired_by_seed"]),
        "",
        f"The same over the seeds run after it was fixed (from seed {result['paired_registered_from_seed']}: its "
        "registered reading; the table above also holds the seeds it was chosen after):",
        "",
        *_comparison_table(result["paired_by_seed_registered"]),
    ]
    second = result["without_stuck"]
    lines += [
        "",
        "Chosen after seeing the runs (a second look, not the fixed test): the same accuracy comparisons without the "
        f"runs stuck at the cap ({', '.join(second['left_out']) or 'none'}), and the stuck counts compared "
        "(Fisher's exact test).",
        "",
        *_comparison_table(second["comparisons"]),
        "",
        "| comparison (a - b) | stuck in a | stuck in b | Fisher p |",
        "|---|---|---|---|",
    ]
    for rate in second["stuck_rates"]:
        p = f"{rate['p']:.2f}" if rate["p"] is not None else "-"
        lines.append(
            f"| {rate['question']} | {rate['stuck_a'][0]} of {rate['stuck_a'][1]} | "
            f"{rate['stuck_b'][0]} of {rate['stuck_b'][1]} | {p} |"
        )
    split = result.get("base_split")
    if split:
        trained_on = [b for b in BASE_NAMES if any(key.startswith(f"{b} on ") for key in split["cells"])]
        bases = [b for b in BASE_NAMES if any(key.endswith(f" on {b}") for key in split["cells"])]
        lines += [
            "",
            "Each LoRA adapter on the base it trained on and on another (greedy %): what a 4-bit base costs in "
            "training (4-bit-trained minus BF16-trained on one base, Welch) and at sampling (one adapter on its 4-bit "
            "base minus on the BF16 base, paired over seeds).",
            "",
            "| adapter trained on | "
            + " | ".join(f"on the {BASE_NAMES[b]} base" for b in bases)
            + " | its 4-bit base minus the BF16 base (paired) |",
            "|---|" + "---|" * (len(bases) + 1),
        ]
        for trained in trained_on:
            on = [_points(split["cells"].get(f"{trained} on {base}")) for base in bases]
            paired = split["sampling_cost_of"].get(trained)
            lines.append(
                f"| {BASE_NAMES[trained]} | "
                + " | ".join(on)
                + " | "
                + (f"{_points(paired)} (n {paired['n']})" if paired else "-")
                + " |"
            )
        for trained, on in split["training_cost"].items():
            diffs = [
                f"{d['difference'] * 100:+.1f} [{d['low'] * 100:+.1f}, {d['high'] * 100:+.1f}]" if d else "-"
                for d in (on.get(base) for base in bases)
            ]
            lines.append(f"| {BASE_NAMES[trained]}-trained minus BF16-trained (Welch) | " + " | ".join(diffs) + " | |")
    for effect in result["settings"]:
        lines += [
            "",
            f"{ARM_NAMES[effect['arm']]}, greedy accuracy by the way it ran:",
            "",
            "| card | packing | seeds | mean ± 95% CI | sd | minus the first row (95% CI) | variance ratio (F p) |",
            "|---|---|---|---|---|---|---|",
        ]
        for way in effect["ways"]:
            diff, ratio = way.get("minus_first"), way.get("variance_ratio_to_first")
            packing = way["sharing"] + (f", {way['runs_per_gpu']} per GPU" if way["runs_per_gpu"] else "")
            lines.append(
                f"| {way['card']} | {packing} | {','.join(map(str, way['seeds']))} | "
                f"{way['mean'] * 100:.1f} ± {way['ci95'] * 100:.1f} | {way['sd'] * 100:.1f} | "
                + (
                    f"{diff['difference'] * 100:+.1f} [{diff['low'] * 100:+.1f}, {diff['high'] * 100:+.1f}]"
                    if diff
                    else "-"
                )
                + " | "
                + (f"{ratio['ratio']:.2f} ({ratio['p']:.2f})" if ratio else "-")
                + " |"
            )
    return "\n".join(lines) + "\n"
