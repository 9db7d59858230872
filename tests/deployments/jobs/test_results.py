"""Finished videos in a folder or at any fsspec URL: whole writes, per-attempt keys, no request text in paths."""
from __future__ import annotations

import pytest

from deployments.jobs.results import ResultFolder, Variant, result_key

JOB = "video_0665172898800010592da7e0"


@pytest.mark.parametrize("url", ["folder", "memory://offload-serve-test-results"])
def test_a_result_is_stored_read_back_and_deleted_with_every_variant(tmp_path, url):
    folder = ResultFolder(str(tmp_path / url) if url == "folder" else url)
    key = result_key(JOB, 1)
    folder.put(key, Variant.VIDEO, b"mp4 bytes")
    folder.put(key, Variant.THUMBNAIL, b"png bytes")
    assert (folder.get(key, Variant.VIDEO), folder.get(key, Variant.THUMBNAIL)) == (b"mp4 bytes", b"png bytes")
    assert folder.get(result_key(JOB, 2), Variant.VIDEO) is None, "another attempt's files are its own"
    assert folder.delete(key) == 2
    assert folder.get(key, Variant.VIDEO) is None and folder.delete(key) == 0
    if url == "folder":
        assert list((tmp_path / url).iterdir()) == [], "no partial file is left behind"


@pytest.mark.parametrize("job_id", ["../etc/passwd", "video_x", JOB + "/..", ""])
def test_keys_that_are_not_a_server_made_job_id_are_refused(tmp_path, job_id):
    with pytest.raises(ValueError, match="not a job result key"):
        result_key(job_id, 1)
    with pytest.raises(ValueError, match="not a job result key"):
        ResultFolder(str(tmp_path)).get(f"{job_id}-1", Variant.VIDEO)
