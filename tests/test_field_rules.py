"""qerl/field_rules.py: the one table of what each setting accepts agrees with what the code behind each choice
knows (the rollout registry, AQN's dtype rules), and a wrong choice is one line naming where it came from."""

import pytest

from qerl import aqn, field_rules, rollout
from qerl.errors import UsageError


def test_the_choices_are_what_the_code_behind_them_knows():
    assert field_rules.ROLLOUT_BACKENDS == ("auto", *rollout.BACKENDS)
    assert field_rules.AQN_DTYPES == tuple(aqn.DTYPE_RULES)


def test_a_wrong_choice_names_its_source_and_the_nearest_choice():
    with pytest.raises(
        UsageError, match=r"^--config r.yaml: rollout_backend 'natve' \(did you mean native\?\): use one"
    ):
        field_rules.check_choices({"rollout_backend": "natve"}, lambda name: f"--config r.yaml: {name}")
    field_rules.check_choices({"rollout_backend": "vllm", "precision": None}, str)  # right, or not set: no error
