"""The zoo cache builds once, publishes atomically, rebuilds on a changed recipe, and serializes builders."""
from __future__ import annotations

import logging
import multiprocessing
import time

import pytest

from zoo.cache import STAMP_NAME, ensure_built
from zoo.tiny import ensure_tiny_wan


def _writer(calls: list):
    def build(folder):
        calls.append(folder)
        (folder / "weights.bin").write_bytes(b"x" * 10)

    return build


def test_second_call_reuses_the_folder_without_rebuilding(tmp_path):
    calls = []
    first = ensure_built(tmp_path, "m", {"v": 1}, _writer(calls))
    second = ensure_built(tmp_path, "m", {"v": 1}, _writer(calls))
    assert first == second == tmp_path / "m"
    assert len(calls) == 1
    assert (first / "weights.bin").read_bytes() == b"x" * 10


def test_a_changed_recipe_rebuilds_and_replaces_the_folder(tmp_path):
    calls = []
    folder = ensure_built(tmp_path, "m", {"v": 1}, _writer(calls))
    (folder / "leftover").write_text("from the old recipe")
    ensure_built(tmp_path, "m", {"v": 2}, _writer(calls))
    assert len(calls) == 2
    assert not (folder / "leftover").exists()
    assert '"v": 2' in (folder / STAMP_NAME).read_text()
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")) == ["m"], "no temp or old folders left"


def test_a_failed_build_publishes_nothing_and_leaves_no_temp_folder(tmp_path):
    def broken(folder):
        (folder / "half.bin").write_bytes(b"partial")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        ensure_built(tmp_path, "m", {"v": 1}, broken)
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == []


def _slow_build_in_child(root: str, log: str) -> None:
    from pathlib import Path

    def build(folder):
        with open(log, "a") as f:
            f.write("built\n")
        time.sleep(0.3)  # long enough that the other processes arrive while the first one builds
        (folder / "weights.bin").write_bytes(b"y")

    out = ensure_built(Path(root), "m", {"v": 1}, build)
    assert (out / "weights.bin").read_bytes() == b"y"


def test_concurrent_processes_build_once_and_all_see_the_finished_folder(tmp_path):
    log = tmp_path / "builds.log"
    root = tmp_path / "zoo"
    root.mkdir()
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_slow_build_in_child, args=(str(root), str(log))) for _ in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=30)
    assert [p.exitcode for p in procs] == [0, 0, 0, 0]
    assert log.read_text() == "built\n"


def test_ensure_tiny_wan_twice_does_not_rebuild(caplog):
    folder = ensure_tiny_wan()
    stamp = (folder / STAMP_NAME).stat()
    caplog.clear()  # the first call may have built it (fresh cache)
    with caplog.at_level(logging.INFO, logger="zoo.cache"):
        again = ensure_tiny_wan()
    assert again == folder
    assert (folder / STAMP_NAME).stat().st_ino == stamp.st_ino
    assert not [r for r in caplog.records if "building" in r.getMessage()]


def test_a_killed_builders_temp_folder_is_removed_by_the_next_build(tmp_path):
    leftover = tmp_path / ".m.building-abc123"
    leftover.mkdir()
    (leftover / "half.bin").write_bytes(b"partial")
    ensure_built(tmp_path, "m", {"v": 1}, _writer([]))
    assert not leftover.exists()
    assert (tmp_path / "m" / "weights.bin").is_file()
