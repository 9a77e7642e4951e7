"""qerl/device_facts.py's memory rule, which the dense training weights, the kept rollout cache and the kept
activations share: taken up to its share of the memory available, one line each time the decision changes."""

import logging

from qerl.device_facts import MemoryRule


def test_a_memory_rule_takes_up_to_its_share_and_says_each_change_once(caplog):
    logger = logging.getLogger("qerl.test_memory_rule")
    rule = MemoryRule(logger, "the thing", 0.4, "thing_flag", "kept", "dropped")
    with caplog.at_level(logging.INFO, logger=logger.name):
        decisions = [rule(40, 100), rule(40, 100), rule(41, 100), rule(2**30, 2**32), rule(0, 0)]
    assert decisions == [True, True, False, True, True]
    assert [r.getMessage() for r in caplog.records] == [
        "the thing kept: 0.00 GiB of 0.0 GiB available (taken up to 40%; thing_flag true/false decides)",
        "the thing dropped: 0.00 GiB of 0.0 GiB available (taken up to 40%; thing_flag true/false decides)",
        "the thing kept: 1.00 GiB of 4.0 GiB available (taken up to 40%; thing_flag true/false decides)",
    ]
