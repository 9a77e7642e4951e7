"""qerl/field_rules.py: the one table of what each setting accepts agrees with what the code behind each choice
knows (the rollout registry, AQN's dtype rules), a wrong choice is one line naming where it came from, every numeric
setting (and every numeric flag of eval and the quantizer) has a range, and 0 and -1 in each training setting are
refused in one line or accepted all the way through TRL's and transformers' checks."""

import dataclasses
import types
import typing
import warnings

import pytest
from bad_input import NUMERIC_FLAGS

from qerl import aqn, field_rules, rollout, train
from qerl.config import QeRLConfig
from qerl.errors import UsageError, one_line


def test_the_choices_are_what_the_code_behind_them_knows():
    assert field_rules.ROLLOUT_BACKENDS == ("auto", *rollout.BACKENDS)
    assert field_rules.AQN_DTYPES == tuple(aqn.DTYPE_RULES)


def test_a_wrong_choice_names_its_source_and_the_nearest_choice():
    with pytest.raises(
        UsageError, match=r"^--config r.yaml: rollout_backend 'natve' \(did you mean native\?\): use one"
    ):
        field_rules.check_choices({"rollout_backend": "natve"}, lambda name: f"--config r.yaml: {name}")
    field_rules.check_choices({"rollout_backend": "vllm", "precision": None}, str)  # right, or not set: no error


def numeric_fields(cls) -> list[str]:
    """The dataclass fields that hold a number (int or float, alone or in a union such as `int | None`)."""
    hints = typing.get_type_hints(cls)
    return [
        f.name
        for f in dataclasses.fields(cls)
        if {int, float}
        & set(typing.get_args(hints[f.name]) if isinstance(hints[f.name], types.UnionType) else (hints[f.name],))
    ]


def test_every_numeric_setting_has_a_range():
    """A numeric field of the training configs (ours, TRL's, transformers') or a numeric flag of eval and the quantizer
    without a range fails here: the table is the one place where the checks come from."""
    fields = numeric_fields(train.QeRLScriptArguments) + numeric_fields(QeRLConfig)
    assert len(fields) > 70 and sorted(fields) == sorted(field_rules.RANGES)  # stale entries too (a field TRL dropped)
    for parser, _ in NUMERIC_FLAGS.values():
        for action in parser._actions:
            assert action.type not in (int, float), f"{action.option_strings}: give it a cli.Range type"


@pytest.mark.parametrize("name", sorted(field_rules.RANGES))
def test_zero_and_minus_one_in_every_training_setting(tmp_path, name):
    """0 and -1 in each numeric field: refused in one line naming the flag where its range says so, and otherwise
    accepted all the way through TRL's and transformers' own config checks."""
    rule, flag = field_rules.RANGES[name], f"--{name.replace('_', '-')}"
    for value in (0, -1):
        argv = ["--model-name", "m", "--output-dir", str(tmp_path), "--use-cpu", "True", flag, str(value)]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # ignored reference flags say so
            if rule is not None and rule.problem(value):
                with pytest.raises(UsageError) as refused:
                    train.parse_args(argv)
                assert one_line(refused.value) == f"{flag} must be {rule.describe()}, got {value}"
            else:
                train.parse_args(argv)
