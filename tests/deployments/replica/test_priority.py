"""A replica says when it does not run at the niceness the app asked for, and why that happens."""
from __future__ import annotations

import logging
import os

from deployments.replica.priority import RAY_NICENESS_ENV, check_niceness, rank_env, stage_actor_options


def test_a_replica_not_at_the_asked_niceness_says_so_naming_the_fix(caplog):
    now = os.nice(0)
    with caplog.at_level(logging.INFO, logger="deployments.replica.priority"):
        assert check_niceness(now, "r-same") == now
        assert check_niceness(None, "r-unasked") == now
        assert not caplog.records
        check_niceness(now + 1 if now < 19 else now - 1, "r-other")
    (record,) = caplog.records
    assert f"r-other: runs at nice {now}" in record.getMessage() and RAY_NICENESS_ENV in record.getMessage()


def test_stage_options_carry_the_niceness_and_ranks_take_their_replicas():
    assert stage_actor_options({"num_cpus": 1}, 0) == {"num_cpus": 1,
                                                       "runtime_env": {"env_vars": {RAY_NICENESS_ENV: "0"}}}
    assert stage_actor_options({"num_cpus": 1}, None) == {"num_cpus": 1}
    assert rank_env() == {RAY_NICENESS_ENV: str(os.nice(0))}
