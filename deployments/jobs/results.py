"""Where finished videos live: a local directory, or any fsspec URL (``s3://bucket/videos``, ...).

The runner (an ingress replica) writes a job's mp4, thumbnail and spritesheet here; any ingress replica serves
them back; the job queue deletes them when the job is deleted or expires. A remix's source video is kept
here too, by the remix's job id, from its creation until the remix is deleted or expires (so a rerun edits
the same frames whatever became of the source job). So the location must be
one every ingress replica and the job queue reach: on one machine a directory, on a cluster shared
storage or object storage (with its fsspec driver installed, e.g. s3fs).
"""
from __future__ import annotations

import enum
import logging
import re

import fsspec

logger = logging.getLogger(__name__)

# Keys are built from job ids the server made (video_<hex>) and an attempt number, never from
# request text; this pattern keeps it so.
_KEY = re.compile(r"^video_[0-9a-f]{24}-[0-9]{1,3}$")
_JOB_ID = re.compile(r"^video_[0-9a-f]{24}$")


class Variant(str, enum.Enum):
    """``GET /v1/videos/{id}/content?variant=``: the assets a completed job has."""

    VIDEO = "video"  # the H.264 mp4
    THUMBNAIL = "thumbnail"  # the first frame as PNG
    SPRITESHEET = "spritesheet"  # up to 16 frames spread over the video, tiled, as JPEG (media.spritesheet_bytes)

    @property
    def suffix(self) -> str:
        return {Variant.VIDEO: ".mp4", Variant.THUMBNAIL: ".png", Variant.SPRITESHEET: ".jpg"}[self]

    @property
    def media_type(self) -> str:
        return {Variant.VIDEO: "video/mp4", Variant.THUMBNAIL: "image/png", Variant.SPRITESHEET: "image/jpeg"}[self]


def result_key(job_id: str, attempt: int) -> str:
    """One key per attempt: a runner that lost its lease never overwrites or deletes the rerun's files."""
    key = f"{job_id}-{attempt}"
    if not _KEY.match(key):
        raise ValueError(f"not a job result key: {key!r}")
    return key


class ResultFolder:
    """Bytes in, bytes out, by key and variant; writes land whole (temporary name, then a rename)."""

    def __init__(self, url: str):
        self.url = url
        self.fs, self.root = fsspec.core.url_to_fs(url)
        self.fs.makedirs(self.root, exist_ok=True)

    def _path(self, key: str, variant: Variant) -> str:
        if not _KEY.match(key):
            raise ValueError(f"not a job result key: {key!r}")
        return f"{self.root.rstrip('/')}/{key}{variant.suffix}"

    def put(self, key: str, variant: Variant, data: bytes) -> None:
        self._write(self._path(key, variant), data)

    def get(self, key: str, variant: Variant) -> bytes | None:
        return self._read(self._path(key, variant))

    def delete(self, key: str) -> int:
        """Remove every variant of ``key``; returns how many files there were."""
        return sum(self._remove(self._path(key, variant)) for variant in Variant)

    def _source_path(self, job_id: str) -> str:
        if not _JOB_ID.match(job_id):
            raise ValueError(f"not a job id: {job_id!r}")
        return f"{self.root.rstrip('/')}/{job_id}.source.mp4"

    def put_source(self, job_id: str, data: bytes) -> None:
        """The video the job ``job_id`` edits or extends, written whole."""
        self._write(self._source_path(job_id), data)

    def get_source(self, job_id: str) -> bytes | None:
        return self._read(self._source_path(job_id))

    def delete_source(self, job_id: str) -> int:
        """Remove the job's source video; returns how many files there were."""
        return self._remove(self._source_path(job_id))

    def _write(self, path: str, data: bytes) -> None:
        partial = path + ".partial"
        with self.fs.open(partial, "wb") as out:
            out.write(data)
        self.fs.mv(partial, path)

    def _read(self, path: str) -> bytes | None:
        try:
            with self.fs.open(path, "rb") as src:
                return src.read()
        except FileNotFoundError:
            return None

    def _remove(self, path: str) -> int:
        """Remove ``path`` and a partial write of it; how many of the two there were."""
        removed = 0
        for candidate in (path, path + ".partial"):
            if self.fs.exists(candidate):
                self.fs.rm(candidate)
                removed += 1
        return removed
