"""An evaluation run through its command line, as tests/tools/eval/test_generate.py and test_competition_math.py
make one: the summary line and the scored samples it writes."""

import json

from qerl import cli


def _eval(module, argv, out):
    assert cli.run_cli(module.main, module.__name__, [*argv, "--out", str(out)]) == 0
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    return lines[0], lines[1:]
