"""benchmarks/probes/decode_attention.py's --configs: the launch shapes it times are named as its table labels them."""

import pytest

from benchmarks.probes import decode_attention as bench


def test_configs_round_trip_the_table_labels_and_bad_ones_name_the_flag():
    for config in bench.grid():
        assert bench.parse_config(bench.label(config).removeprefix("triton ").replace(" ", "")) == config
    with pytest.raises(SystemExit, match="--configs: 's64w8'"):
        bench.parse_config("s64w8")
