"""experiments.arms' report (arms_report.py), read from run records: the experiment pooled, per-arm measures with
intervals, the fixed comparisons against scipy's Welch test, the card/packing effect."""

import argparse
import json
import math

import pytest
from arms_folders import _run
from scipy import stats

from experiments import arms, arms_report, arms_results, arms_runs


def _record(results, arm, seed, accuracy, rewards=(0.1,) * 10 + (0.5,) * 10, sharing="mps", steps=20, **broken):
    """A committed record of a finished run, made from its folder as the runner makes it."""
    folder = results.parent / "runs" / f"{arm}-seed{seed}-{sharing}-{steps}"
    _run(folder, list(rewards[:steps]), accuracy=accuracy, **broken)
    setting = {"arm": arm, "seed": seed, "steps": steps, "sharing": sharing, "model": "m", "format": "gsm8k_hash",
               "runs_per_gpu": 1 if sharing == "alone" else 5, "card": "NVIDIA H100"}  # fmt: skip
    record = arms_results.run_record(folder, setting, arms_runs.PROTOCOLS)
    record["name"] = f"{arm}-seed{seed}" + ("" if sharing == "mps" else f"-{sharing}") + ("" if steps == 20 else "-x")
    arms_results.write_record(arms_results.record_path(results, record["name"]), record)
    return record


def test_report_pools_one_experiment_and_compares_the_arms(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(arms_report, "PAIRED_REGISTERED_FROM_SEED", 1)  # the paired endpoint's seeds: 1 and 2 here
    results = tmp_path / "results"
    for seed, (bf16, nvfp4, aqn) in enumerate([(0.60, 0.58, 0.61), (0.62, 0.57, 0.60), (0.64, 0.59, 0.62)]):
        _record(results, "bf16_lora", seed, bf16)
        _record(results, "nvfp4_lora", seed, nvfp4, rewards=(0.1,) * 10 + (0.3,) * 10)
        _record(results, "nvfp4_lora_aqn", seed, aqn)
    for seed, accuracy in enumerate([0.55, 0.65, 0.60]):
        _record(results, "bf16_lora", seed, accuracy, sharing="alone")
    _record(results, "bf16_lora", 7, 0.99, steps=10)  # another experiment: left out
    base = arms_results.run_record(
        _base(tmp_path / "runs" / "base-bf16"), {"arm": None, "precision": "bf16"}, ("greedy",)
    )
    arms_results.write_record(results / "base-bf16.json", base)
    # One seed: its completions all truncated from step 15 on, its last step's gradient not finite.
    _record(results, "bf16_lora_aqn", 0, 0.5, nan_from=20, truncated_from=15)
    args = argparse.Namespace(results=results, out=tmp_path / "out", png=tmp_path / "out" / "arms.png")
    result = arms.report(args)
    assert (result["steps"], result["sharing"]) == (20, "mps")
    assert result["left_out"] == ["bf16_lora-seed0-alone", "bf16_lora-seed1-alone", "bf16_lora-seed2-alone",
                                  "bf16_lora-seed7-x"]  # fmt: skip
    bf16 = result["arms"]["bf16_lora"]
    assert bf16["seeds"] == [0, 1, 2] and bf16["greedy"]["mean"] == pytest.approx(0.62)
    assert bf16["greedy"]["ci95"] == pytest.approx(stats.t.ppf(0.975, 2) * 0.02 / math.sqrt(3))
    assert bf16["reward_last_tenth"]["mean"] == pytest.approx(0.5)
    broken = result["arms"]["bf16_lora_aqn"]
    assert broken["nonfinite_runs"] == ["bf16_lora_aqn-seed0"] and broken["greedy"]["ci95"] == 0.0
    assert broken["stuck_at_length_cap"] == ["bf16_lora_aqn-seed0"] and bf16["stuck_at_length_cap"] == []
    assert result["runs"]["bf16_lora_aqn-seed0"]["first_nonfinite_grad_step"] == 20
    # The level is 90% of the lowest arm's last-tenth reward (the broken run's (0.5 + 0) / 2): every run's average
    # reaches 0.225 at step 11 (window 1 at 20 steps), where its rewards jump.
    assert result["reward_level"] == {"reward": pytest.approx(0.225), "window": 1, "share": 0.9}
    assert bf16["steps_to_reward"]["mean"] == 11 and bf16["not_reaching_reward_level"] == 0
    aqn_in_bf16 = [c for c in result["comparisons"] if c["a"] == "bf16_lora_aqn"]
    assert aqn_in_bf16 and all("difference" not in c for c in aqn_in_bf16)  # one seed: too few runs
    first = result["comparisons"][0]
    assert (first["a"], first["b"], first["measure"]) == ("nvfp4_lora_aqn", "bf16_lora", "greedy")
    assert not [c for c in result["comparisons"] if "nvfp4_gptq_lora" in (c["a"], c["b"])]  # an arm that never ran
    reference = stats.ttest_ind([0.61, 0.60, 0.62], [0.60, 0.62, 0.64], equal_var=False)
    assert first["difference"] == pytest.approx(-0.01) and first["p"] == pytest.approx(reference.pvalue)
    # Paired by seed (the same seeds' accuracies): scipy's related-samples test.
    paired = result["paired_by_seed"][0]
    assert (paired["a"], paired["b"], paired["seeds"]) == ("nvfp4_lora_aqn", "bf16_lora", [0, 1, 2])
    related = stats.ttest_rel([0.61, 0.60, 0.62], [0.60, 0.62, 0.64])
    assert paired["difference"] == pytest.approx(-0.01) and paired["p"] == pytest.approx(related.pvalue)
    assert "difference" not in next(c for c in result["paired_by_seed"] if c["a"] == "bf16_lora_aqn")  # one seed
    # Its registered reading: only the seeds from the one it was fixed before (here 1 and 2, whose differences do
    # not vary: no interval)
    registered = result["paired_by_seed_registered"][0]
    assert registered["seeds"] == [1, 2] and "difference" not in registered
    # The second look leaves the stuck run out (its arm then has none) and compares the stuck counts.
    second = result["without_stuck"]
    assert second["left_out"] == ["bf16_lora_aqn-seed0"]
    assert [c["measure"] for c in second["comparisons"]] == ["greedy", "reference"] * 4
    assert second["comparisons"][0]["difference"] == pytest.approx(first["difference"])
    rate = next(r for r in second["stuck_rates"] if r["a"] == "bf16_lora_aqn")
    assert (rate["stuck_a"], rate["stuck_b"]) == ([1, 1], [0, 3])
    assert rate["p"] == pytest.approx(stats.fisher_exact([[1, 0], [0, 3]]).pvalue)
    entropy = next(c for c in result["comparisons"] if c["measure"] == "entropy_first_tenth")
    assert "difference" not in entropy  # equal entropies everywhere: no interval to form
    (effect,) = result["settings"]
    assert effect["arm"] == "bf16_lora" and [w["sharing"] for w in effect["ways"]] == ["mps", "alone"]
    alone = effect["ways"][1]
    assert alone["minus_first"]["difference"] == pytest.approx(-0.02)
    assert alone["variance_ratio_to_first"]["ratio"] == pytest.approx(0.05**2 / 0.02**2)
    assert result["bases"]["bf16"]["greedy"]["accuracy"] == 0.3
    assert (tmp_path / "out" / "arms.png").stat().st_size > 0
    saved = json.loads((tmp_path / "out" / "report.json").read_text())
    assert saved["arms"]["nvfp4_lora"]["greedy"]["n"] == 3
    printed = capsys.readouterr().out
    assert "| BF16 + LoRA | 3 | 62.0 ± 5.0 | 2.0 |" in printed and "| base BF16, no training | - | 30.0 |" in printed
    assert "| NVFP4 + AQN vs BF16 LoRA (QeRL against 16-bit LoRA) | greedy | -1.0 |" in printed
    assert "| AQN within BF16 | greedy | - | - | - | - | too few runs |" in printed
    assert "The same over the seeds run after it was fixed (from seed 1" in printed
    assert "| BF16 + LoRA + AQN | 1 | 50.0 ± 0.0 | 0.0 |" in printed and "| 1 of 1 |" in printed
    assert "| AQN within BF16 | 1 of 1 | 0 of 3 | 0.25 |" in printed
    assert (tmp_path / "out" / "report.md").read_text() in printed


def _base(folder):
    folder.mkdir(parents=True)
    summary = {"protocol": "greedy", "accuracy": 0.3, "accuracy_ci95": [0.27, 0.33]}
    (folder / "eval-greedy.jsonl").write_text(json.dumps(summary) + "\n")
    return folder


def test_runs_of_a_changed_recipe_are_not_pooled_with_the_recipe_as_it_is(tmp_path):
    """The recipe file is part of the experiment: the report pools the runs of the recipe as it is now where there
    are any (else the most common experiment), --recipe-sha256 picks another, and one no run has is refused."""
    results = tmp_path / "results"
    now = arms_runs.recipe_sha256(argparse.Namespace(model="qwen2.5-coder-1.5b-instruct", recipe=None))
    for seed in range(3):  # the older recipe: more runs
        record = _record(results, "bf16_lora", seed, 0.5)
        arms_results.write_record(results / f"{record['name']}.json", {**record, "recipe_sha256": "0ld" + "0" * 61})
    for seed in (10, 11):
        record = _record(results, "bf16_lora", seed, 0.7)
        arms_results.write_record(results / f"{record['name']}.json", {**record, "recipe_sha256": now})
    args = argparse.Namespace(results=results, out=tmp_path / "out", png=tmp_path / "out" / "arms.png",
                              model="qwen2.5-coder-1.5b-instruct", recipe=None, recipe_sha256=None)  # fmt: skip
    result = arms.report(args)
    assert result["arms"]["bf16_lora"]["seeds"] == [10, 11] and result["recipe_sha256"] == now
    assert f"recipe {now[:8]}" in (tmp_path / "out" / "report.md").read_text()
    args.recipe_sha256 = "0ld"
    assert arms.report(args)["arms"]["bf16_lora"]["seeds"] == [0, 1, 2]
    args.recipe_sha256 = "feed"
    with pytest.raises(SystemExit, match=f"--recipe-sha256 feed: no run in {results} has it; they have 0ld00000 "
                       f"\\(3 runs\\), {now[:8]} \\(2 runs\\)"):  # fmt: skip
        arms.report(args)


def test_each_lora_adapter_on_both_bases_splits_training_and_sampling_costs(tmp_path):
    """base_split: BF16- and NVFP4-trained adapters each evaluated on their own base and the other's; the training
    cost on each base against scipy's Welch test, the sampling cost paired over seeds."""
    results = tmp_path / "results"
    own = {"bf16_lora": [0.64, 0.62, 0.66], "nvfp4_lora": [0.58, 0.60, 0.57], "nvfp4_gptq_lora": [0.62, 0.61, 0.63]}
    # bf16-trained on NVFP4, the 4-bit-trained (round to nearest or GPTQ) on BF16
    other = {"bf16_lora": [0.61, 0.60, 0.62], "nvfp4_lora": [0.60, 0.61, 0.60], "nvfp4_gptq_lora": [0.63, 0.62, 0.65]}
    for arm in own:
        for seed in range(3):
            folder = tmp_path / "runs" / f"{arm}-{seed}"
            _run(folder, [0.5] * 20, accuracy=own[arm][seed])
            summary = {"protocol": "greedy", "examples": 100, "accuracy": other[arm][seed], "model": "/x"}
            (folder / f"eval-{arms_results.OTHER_BASE}.jsonl").write_text(json.dumps(summary) + "\n")
            setting = {"arm": arm, "precision": arm.split("_")[0], "seed": seed, "steps": 20, "sharing": "mps",
                       "model": "m", "format": "gsm8k_hash", "runs_per_gpu": 5}  # fmt: skip
            record = arms_results.run_record(folder, setting, arms_runs.PROTOCOLS)
            assert record["evals"][arms_results.OTHER_BASE]["base"] == ("nvfp4" if arm == "bf16_lora" else "bf16")
            arms_results.write_record(results / f"{arm}-seed{seed}.json", record)
    _record(results, "nvfp4_lora_aqn", 0, 0.6)  # no other-base evaluation: not in the split
    args = argparse.Namespace(results=results, out=tmp_path / "out", png=tmp_path / "out" / "arms.png")
    split = arms.report(args)["base_split"]
    assert split["cells"]["bf16 on bf16"]["mean"] == pytest.approx(0.64)
    assert split["cells"]["bf16 on nvfp4"]["mean"] == pytest.approx(0.61)
    assert split["cells"]["nvfp4 on bf16"]["n"] == 3
    on_bf16 = stats.ttest_ind(other["nvfp4_lora"], own["bf16_lora"], equal_var=False)
    assert split["training_cost"]["nvfp4"]["bf16"]["p"] == pytest.approx(on_bf16.pvalue)
    on_nvfp4 = split["training_cost"]["nvfp4"]["nvfp4"]
    assert on_nvfp4["difference"] == pytest.approx(sum(own["nvfp4_lora"]) / 3 - sum(other["bf16_lora"]) / 3)
    paired = [o - b for o, b in zip(other["bf16_lora"], own["bf16_lora"], strict=True)]
    assert split["sampling_cost_of"]["bf16"]["mean"] == pytest.approx(sum(paired) / 3)
    assert split["sampling_cost_of"]["bf16"]["ci95"] == pytest.approx(stats.sem(paired) * stats.t.ppf(0.975, 2))
    # The GPTQ arm: its training cost where BF16-trained adapters were evaluated too (the BF16 base only), its
    # sampling cost from its own base.
    assert set(split["training_cost"]["nvfp4_gptq"]) == {"bf16"}
    gptq_on_bf16 = stats.ttest_ind(other["nvfp4_gptq_lora"], own["bf16_lora"], equal_var=False)
    assert split["training_cost"]["nvfp4_gptq"]["bf16"]["p"] == pytest.approx(gptq_on_bf16.pvalue)
    gptq_paired = [o - b for o, b in zip(own["nvfp4_gptq_lora"], other["nvfp4_gptq_lora"], strict=True)]
    assert split["sampling_cost_of"]["nvfp4_gptq"]["mean"] == pytest.approx(sum(gptq_paired) / 3)
    text = (tmp_path / "out" / "report.md").read_text()
    assert "| BF16 | 64.0 ± " in text and "| NVFP4-trained minus BF16-trained (Welch) |" in text
    assert "| on the NVFP4 (GPTQ) base |" in text and "| NVFP4 (GPTQ)-trained minus BF16-trained (Welch) |" in text
