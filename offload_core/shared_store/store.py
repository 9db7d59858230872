"""The node weight store: one read-only host copy of a component's streamed layers per node.

Eight replicas of Wan2.1-14B on one node would otherwise hold eight private copies of 26 GiB of
layers. Here the first replica that needs a copy writes it once into a file in shared memory
(``/dev/shm``, a tmpfs: RAM, never disk), and every replica maps that file read-only, so no
replica can change another's weights (a write is a SIGSEGV, not a silent corruption).

- Keyed by what the bytes are (:class:`StoreKey`): the model folder's identity, the component,
  its dtypes and the layout digest of every layer. The file name is the key's digest.
- Laid out page-aligned (:class:`StoreLayout`): each layer's flat buffer per dtype starts on its
  own page, so each process can register exactly its layers for pinned DMA (cudaHostRegister
  works on whole pages; two extents sharing a page could not both be registered).
- Written under a temporary name and renamed into place when complete, so an attacher never
  maps a half-written copy. The header records the layout digest and hashes of a few sampled
  pages; attaching checks both (:class:`StoreMismatch` on any difference).
- Liveness by ``flock``: every process holding a store keeps a shared lock on its file. A file
  nobody locks is garbage (its processes died: the kernel drops a dead process's locks), which
  is how :func:`sweep_orphans` cleans what a crashed node process left behind.

Node-wide bookkeeping (who creates, who is attached, the one lease) is a :class:`StoreRegistry`'s
job; ``cluster/ledger/shared_stores.py`` implements it over the node ledger.
"""
from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import mmap
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from offload_core.layout import LayerLayout
from offload_core.progress import ByteProgress
from offload_core.shared_store.files import (  # noqa: F401 (re-exported: the store's names for them)
    DEFAULT_STORE_DIR,
    PREFIX,
    STORE_DIR_ENV,
    SUFFIX,
    StoreKey,
    StoreRole,
    folder_identity,
    is_store_file,
    remove_if_unused,
    remove_store,
    store_dir,
    sweep_orphans,
    unlink_quietly,
)
from offload_core.streaming.host_layer import fill_host_buffers

logger = logging.getLogger(__name__)

PAGE = mmap.PAGESIZE
MAGIC = "offload-serve weight store v1"
# Two pages hold the JSON header (16 samples x ~70 B plus the digests: ~1.5 KB).
HEADER_BYTES = 2 * PAGE
# Pages hashed by the creator and re-hashed by each attacher: 16 x 4 KiB = 64 KiB read per attach,
# 0.02 % of one 300 MB medium-Wan copy, and enough to catch a copy of another model or a truncation.
SAMPLED_PAGES = 16


class StoreMismatch(RuntimeError):
    """A store's header or content is not what this replica expects: it refuses to compute with it."""


def _align_page(n: int) -> int:
    return -(-int(n) // PAGE) * PAGE


@dataclass(frozen=True)
class StoreExtent:
    """One layer's flat buffer of one dtype inside the store."""

    key: str  # the layer key, "blocks.3"
    dtype: torch.dtype
    offset: int  # from the start of the file, page-aligned
    nbytes: int  # the layer's hosted bytes of this dtype (LayerLayout.host_flat_bytes: 8-bit where FP8)


@dataclass(frozen=True)
class StoreLayout:
    """Where every layer's flat buffers live in the store file, and the digest of what they hold."""

    extents: tuple[StoreExtent, ...]
    total_bytes: int  # file size: header + page-aligned extents
    digest: str  # of every layer's tensor layout (names, dtypes, shapes, strides, offsets)

    @classmethod
    def of(cls, layouts: Sequence[LayerLayout]) -> StoreLayout:
        h = hashlib.sha256()
        extents, cursor = [], HEADER_BYTES
        for layout in layouts:
            for t in layout.tensors:
                h.update(f"{layout.key}/{t.name}:{t.dtype}:{t.shape}:{t.stride}:{t.extent}:{t.byte_offset};".encode())
            for q in layout.quantized:  # an FP8 store holds other bytes than a native one of the same layers
                h.update(f"{layout.key}/fp8:{q.index}:{q.q_offset}:{q.scale_offset}:{q.rows};".encode())
            for dtype, nbytes in layout.host_flat_bytes:
                extents.append(StoreExtent(layout.key, dtype, cursor, nbytes))
                cursor += _align_page(nbytes)
        return cls(tuple(extents), cursor, h.hexdigest()[:32])

    @property
    def layer_bytes(self) -> int:
        """The layers' own flat bytes (without the header and page padding)."""
        return sum(e.nbytes for e in self.extents)

    def sampled_offsets(self) -> tuple[int, ...]:
        """Page offsets spread evenly over the data (first and last page included)."""
        pages = (self.total_bytes - HEADER_BYTES) // PAGE
        if pages <= 0:
            return ()
        n = min(SAMPLED_PAGES, pages)
        return tuple(sorted({HEADER_BYTES + (i * (pages - 1) // max(1, n - 1)) * PAGE for i in range(n)}))


def key_for(model_identity: str, component: str, layouts: Sequence[LayerLayout]) -> tuple[StoreKey, StoreLayout]:
    layout = StoreLayout.of(layouts)
    dtypes = "+".join(sorted({str(e.dtype).removeprefix("torch.") for e in layout.extents}))
    return StoreKey(model_identity, component, dtypes, layout.digest), layout


def _page_hashes(view: memoryview, offsets: Sequence[int]) -> list[str]:
    return [hashlib.blake2b(view[o:o + PAGE], digest_size=16).hexdigest() for o in offsets]


def _frombuffer(buffer, offset: int, nbytes: int) -> torch.Tensor:
    with warnings.catch_warnings():  # a read-only mapping is the point: torch warns it is not writable
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(buffer, dtype=torch.uint8, count=nbytes, offset=offset)


class WeightStore:
    """One store file mapped read-only into this process, with its shared lock held."""

    def __init__(self, path: Path, key: StoreKey, layout: StoreLayout, fd: int, mapping: mmap.mmap, role: StoreRole):
        self.path, self.key, self.layout, self.role = path, key, layout, role
        self._fd, self._mapping = fd, mapping

    # -- opening -------------------------------------------------------------------------------
    @classmethod
    def create(cls, path: Path, key: StoreKey, layout: StoreLayout,
               layers: Sequence[tuple[LayerLayout, Sequence[torch.Tensor]]]) -> WeightStore:
        """Write ``layers`` (each layout with its tensors, in order) into a new store at ``path``."""
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{path.name}.partial-{os.getpid()}")
        fd = os.open(partial, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            _reserve(fd, layout.total_bytes)
            with mmap.mmap(fd, layout.total_bytes) as writable:
                # The first replica of a model on a node writes every streamed layer here (GBs for a
                # 14B DiT): logged with its rate, a bar in a terminal.
                with ByteProgress(f"writing the node weight store for {key.component}", layout.layer_bytes) as progress:
                    _write_layers(writable, layout, layers, progress.update)
                view = memoryview(writable)
                header = {"magic": MAGIC, "key": key.digest, "layout_digest": layout.digest,
                          "total_bytes": layout.total_bytes, "creator_pid": os.getpid(),
                          "samples": [[o, h] for o, h in zip(layout.sampled_offsets(),
                                                             _page_hashes(view, layout.sampled_offsets()))]}
                encoded = json.dumps(header).encode()
                assert len(encoded) < HEADER_BYTES, f"store header of {len(encoded)} B outgrew {HEADER_BYTES} B"
                view[:len(encoded)] = encoded
                view.release()
            os.link(partial, path)  # fails if a store is already there: never replace a live one
            os.unlink(partial)
            # Downgraded, never released: a sweep between writing and mapping must see it held.
            fcntl.flock(fd, fcntl.LOCK_SH)
        except BaseException:
            os.close(fd)
            unlink_quietly(partial)
            raise
        logger.info("store %s: wrote %d layers of %s (%d B in %d extents) to %s", key.digest, len(layers),
                    key.component, layout.layer_bytes, len(layout.extents), path)
        return cls._map_locked(fd, path, key, layout, StoreRole.CREATE)

    @classmethod
    def attach(cls, path: Path, key: StoreKey, layout: StoreLayout) -> WeightStore:
        """Map an existing store read-only after checking its header and sampled pages."""
        fd = os.open(path, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
        except BaseException:
            os.close(fd)
            raise
        return cls._map_locked(fd, path, key, layout, StoreRole.ATTACH)

    @classmethod
    def _map_locked(cls, fd: int, path: Path, key: StoreKey, layout: StoreLayout, role: StoreRole) -> WeightStore:
        """Map the store behind ``fd`` (its shared lock held) read-only; check it first. Owns ``fd``."""
        try:
            if os.fstat(fd).st_ino != os.stat(path).st_ino:
                raise StoreMismatch(f"store {path} was replaced while this replica opened it")
            size = os.fstat(fd).st_size
            if size != layout.total_bytes:
                raise StoreMismatch(f"store {path} holds {size} B, but this replica's layout of {key.component} "
                                    f"needs {layout.total_bytes} B: another model or layout, refusing to use it")
            mapping = mmap.mmap(fd, size, prot=mmap.PROT_READ)
            try:
                _check(mapping, path, key, layout)
            except StoreMismatch:
                mapping.close()
                raise
        except BaseException:
            os.close(fd)
            raise
        logger.info("store %s: %s, mapped read-only (%s, %d B), header and %d sampled pages checked",
                    key.digest, role.value, path, size, len(layout.sampled_offsets()))
        return cls(path, key, layout, fd, mapping, role)

    # -- use -----------------------------------------------------------------------------------
    def buffers(self, layer_key: str) -> dict[torch.dtype, torch.Tensor]:
        """A layer's flat buffers as read-only uint8 tensors over the shared mapping."""
        found = {e.dtype: _frombuffer(self._mapping, e.offset, e.nbytes) for e in self.layout.extents
                 if e.key == layer_key}
        if not found:
            raise KeyError(f"store {self.key.digest} holds no layer {layer_key!r}")
        return found

    @property
    def closed(self) -> bool:
        return self._fd < 0

    def close(self) -> None:
        """Drop this process's hold on the store: its descriptor, and the mapping once nothing views it.

        The mapping keeps a duplicate of the descriptor (so the shared lock) while any tensor still
        views it, e.g. a model whose streaming was removed keeps its layers as views of the store:
        the lock then says truthfully that this process still maps it.
        """
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        try:
            self._mapping.close()
        except BufferError:
            logger.info("store %s: closed; tensors still view its mapping, which lives on with them", self.key.digest)


def _reserve(fd: int, nbytes: int) -> None:
    """Give the file its blocks now: a full tmpfs then fails here with ENOSPC (an OSError the caller
    can answer by hosting privately), never later with SIGBUS on a write into a sparse mapping.
    Docker's default /dev/shm is 64 MiB, smaller than one medium-Wan copy (289 MiB)."""
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise
        os.ftruncate(fd, nbytes)  # a file system without fallocate: sparse, as before


def _write_layers(writable: mmap.mmap, layout: StoreLayout,
                  layers: Sequence[tuple[LayerLayout, Sequence[torch.Tensor]]], written=lambda nbytes: None) -> None:
    where = {(e.key, e.dtype): e for e in layout.extents}
    for layer_layout, tensors in layers:
        assert len(tensors) == len(layer_layout.tensors), f"{layer_layout.key}: tensors and layout disagree"
        extents = [where[(layer_layout.key, dtype)] for dtype, _ in layer_layout.host_flat_bytes]
        flats = {e.dtype: torch.frombuffer(writable, dtype=torch.uint8, count=e.nbytes, offset=e.offset)
                 for e in extents}
        fill_host_buffers(layer_layout, tensors, flats)  # quantized (FP8) as a private layer would be
        del flats  # the mapping cannot close while a tensor still exports it
        written(layer_layout.host_nbytes)


def _check(mapping: mmap.mmap, path: Path, key: StoreKey, layout: StoreLayout) -> None:
    raw = bytes(mapping[:HEADER_BYTES]).split(b"\0", 1)[0]
    try:
        header = json.loads(raw)
    except ValueError as exc:
        raise StoreMismatch(f"store {path}: unreadable header ({exc}); refusing to use it") from exc
    if header.get("magic") != MAGIC or header.get("key") != key.digest:
        raise StoreMismatch(f"store {path}: header names key {header.get('key')!r}, this replica expects "
                            f"{key.digest!r} ({key.component}); refusing to use it")
    if header.get("layout_digest") != layout.digest:
        raise StoreMismatch(f"store {path}: layout {header.get('layout_digest')!r} differs from this replica's "
                            f"{layout.digest!r} for {key.component}; refusing to compute with other weights")
    samples = [(int(o), h) for o, h in header.get("samples", [])]
    if [o for o, _ in samples] != list(layout.sampled_offsets()):
        raise StoreMismatch(f"store {path}: sampled pages {[o for o, _ in samples][:4]}... are not this layout's")
    view = memoryview(mapping)
    try:
        bad = [o for (o, want), got in zip(samples, _page_hashes(view, [o for o, _ in samples])) if want != got]
    finally:
        view.release()
    if bad:
        raise StoreMismatch(f"store {path}: {len(bad)} of {len(samples)} sampled pages differ from what its "
                            f"creator wrote (first at byte {bad[0]}); refusing to compute with changed weights")
