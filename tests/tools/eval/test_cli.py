"""The command line eval.gsm8k and eval.competition_math share (eval/cli.py): 0 and -1 in each numeric flag, refused by
the parser where its range says so (that every numeric flag has a range: tests/qerl/test_field_rules.py)."""

import pytest
from bad_input import check_zero_and_minus_one, range_flags


@pytest.mark.parametrize("prog, flag", range_flags("eval.gsm8k"))
def test_zero_and_minus_one_in_every_numeric_flag(prog, flag):
    check_zero_and_minus_one(prog, flag)
