"""Fixtures of the stage replica's tests."""
from __future__ import annotations

import pytest

from deployments.replica.worker import StageWorker


@pytest.fixture
def workers():
    """``make(config)`` builds a StageWorker in this process; every one made is closed after the test."""
    made = []

    def make(config) -> StageWorker:
        made.append(StageWorker(config))
        return made[-1]

    yield make
    for worker in made:
        worker.close()
