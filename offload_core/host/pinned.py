"""Host allocations for layer buffers: whole pages of their own, page-locked when the device can use it.

torch's pinned caching allocator rounds each block up to a power of two (a 1.2 GiB layer costs
2 GiB), so pinned buffers here are anonymous mappings page-locked in place with
``cudaHostRegister``. Each buffer is its own mapping: page-aligned, rounded up to whole pages, so
registering it never locks a page that malloc'd data shares (a 2 KiB per-dtype buffer from the
heap would lock, and later unlock under, its neighbours). The rounding costs < 1 page per buffer.

A refused registration (a memlock limit, a driver out of pinnable memory) is not fatal: the buffer
stays pageable, the refusal says why, and the CUDA runtime's last error is cleared so the next
kernel launch check does not raise it. Unlocking waits for the device first: a copy still reading
the buffer must finish before its pages are unlocked.
"""
from __future__ import annotations

import ctypes
import functools
import logging
import mmap
import os
from dataclasses import dataclass
from typing import Protocol

import torch

logger = logging.getLogger(__name__)

PAGE_BYTES = mmap.PAGESIZE


class PinError(RuntimeError):
    """The driver refused to unlock a page-locked host buffer (registration refusals fall back instead)."""


class PageLocker(Protocol):
    """How host pages are locked for one device (CUDA's runtime; tests pass a fake)."""

    def register(self, ptr: int, nbytes: int, flags: int = 0) -> int:
        """Lock ``nbytes`` at ``ptr`` (``cudaHostRegister`` flags); 0 on success, else the driver's error code."""

    def unregister(self, ptr: int) -> int:
        """Unlock the range registered at ``ptr``; 0 on success."""

    def clear_error(self) -> None:
        """Reset the runtime's last-error state after a failed call."""

    def quiesce(self) -> None:
        """Wait until no copy can still read locked memory (before it is unlocked)."""

    def describe(self, code: int) -> str:
        """The error's name, for the log."""


@dataclass(frozen=True)
class PinRefusal:
    """Why a buffer planned pinned stayed pageable."""

    nbytes: int  # the page-rounded bytes the driver was asked to lock
    code: int  # the CUDA error code
    message: str

    def explain(self) -> str:
        return f"locking {self.nbytes} B refused with CUDA error {self.code} ({self.message})"


@dataclass(frozen=True)
class HostBuffer:
    """One flat host allocation: ``data`` is ``nbytes`` uint8 at the start of whole pages of its own."""

    data: torch.Tensor
    nbytes: int
    # True only when the pages are really locked (CUDA). Planned-pinned buffers on machines
    # without CUDA, or whose registration was refused, are pageable and say so here.
    page_locked: bool
    mapped_bytes: int = 0  # the page-rounded size of its anonymous mapping (what is locked)
    refusal: PinRefusal | None = None  # set when a pin was asked for and refused
    locker: PageLocker | None = None  # who unlocks it (page-locked buffers only)


def page_up(nbytes: int) -> int:
    return -(-int(nbytes) // PAGE_BYTES) * PAGE_BYTES


def _anonymous_pages(nbytes: int) -> tuple[torch.Tensor, int]:
    """``nbytes`` as a uint8 tensor over an anonymous mapping of whole pages (page-aligned)."""
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8), 0
    size = page_up(nbytes)
    pages = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    # The tensor holds a reference to the mapping: the pages go with the last view, as torch's own
    # allocations do.
    data = torch.frombuffer(pages, dtype=torch.uint8, count=nbytes)
    return data, size


def allocate_host_buffer(nbytes: int, *, pin: bool, device: torch.device) -> HostBuffer:
    """Allocate ``nbytes`` of anonymous host pages; page-lock them if ``pin`` and ``device`` can.

    A refused lock leaves the buffer pageable with ``refusal`` set: the caller decides (a layer
    falls back to PAGEABLE).
    """
    nbytes = int(nbytes)
    data, size = _anonymous_pages(nbytes)
    if not pin:
        return HostBuffer(data, nbytes, page_locked=False, mapped_bytes=size)
    return _lock(data, nbytes, size, device, flags=0)


def lock_host_tensor(data: torch.Tensor, device: torch.device, *, flags: int = 0) -> HostBuffer:
    """Page-lock memory that already exists (a node weight store's page-aligned extent) for ``device``.

    Same contract as :func:`allocate_host_buffer`: a refusal leaves it pageable with ``refusal``
    set and the runtime's error cleared; :func:`free_host_buffer` unlocks it.
    """
    nbytes = data.numel() * data.element_size()
    return _lock(data, nbytes, nbytes, device, flags=flags)


def _lock(data: torch.Tensor, nbytes: int, size: int, device: torch.device, *, flags: int) -> HostBuffer:
    locker = page_locker(device) if size else None
    if locker is None:
        return HostBuffer(data, nbytes, page_locked=False, mapped_bytes=size)
    code = int(locker.register(data.data_ptr(), size, flags))
    if code != 0:
        locker.clear_error()
        return HostBuffer(data, nbytes, page_locked=False, mapped_bytes=size,
                          refusal=PinRefusal(size, code, locker.describe(code)))
    return HostBuffer(data, nbytes, page_locked=True, mapped_bytes=size, locker=locker)


def free_host_buffer(buffer: HostBuffer) -> None:
    """Unlock a page-locked buffer once the device is done with it. The pages go with the last view."""
    if not buffer.page_locked:
        return
    # A buffer made page-locked elsewhere without its locker was locked through CUDA's runtime.
    locker = buffer.locker or page_locker(torch.device("cuda"))
    locker.quiesce()
    code = int(locker.unregister(buffer.data.data_ptr()))
    if code != 0:
        locker.clear_error()
        raise PinError(f"unlocking {buffer.mapped_bytes or buffer.nbytes} B failed with CUDA error {code} "
                       f"({locker.describe(code)})")


def page_locker(device: torch.device) -> PageLocker | None:
    """The page locker for ``device``: CUDA's runtime on a CUDA device, none elsewhere."""
    if device.type != "cuda":
        return None
    return _cuda_locker(torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device()))


@functools.lru_cache(maxsize=None)
def _cuda_locker(device: torch.device) -> PageLocker:
    return CudaPageLocker(device)


class CudaPageLocker:
    """``cudaHostRegister`` through the runtime torch loaded; its last error reached with ctypes."""

    def __init__(self, device: torch.device):
        self.device = device
        self._cudart = torch.cuda.cudart()

    def register(self, ptr: int, nbytes: int, flags: int = 0) -> int:
        return int(self._cudart.cudaHostRegister(ptr, nbytes, flags))

    def unregister(self, ptr: int) -> int:
        return int(self._cudart.cudaHostUnregister(ptr))

    def clear_error(self) -> None:
        runtime = loaded_cuda_runtime()
        if runtime is None:
            logger.warning("pinning: CUDA runtime library not found in this process; its last error "
                           "(from the refused cudaHostRegister) stays set")
            return
        runtime.cudaGetLastError()  # returns and resets the (non-sticky) error of the failed call

    def quiesce(self) -> None:
        # Every stream of the device, the copy stream and any staging copies included: a DMA still
        # reading these pages must land before they are unlocked.
        torch.cuda.synchronize(self.device)

    def describe(self, code: int) -> str:
        runtime = loaded_cuda_runtime()
        if runtime is None:
            return f"CUDA error {code}"
        name = runtime.cudaGetErrorName
        name.restype = ctypes.c_char_p
        return name(int(code)).decode()


def loaded_cuda_runtime() -> ctypes.CDLL | None:
    """The libcudart this process already loaded (torch's), found in /proc/self/maps; None if none.

    torch exposes no ``cudaGetLastError``; the same library object torch calls has it, and its
    error state is per thread, so this must be the very library torch uses, not another copy.
    """
    global _runtime
    if _runtime is None:
        try:
            with open("/proc/self/maps") as maps:
                paths = {line.split()[-1] for line in maps if "libcudart" in line}
        except OSError:
            return None
        found = [p for p in sorted(paths) if os.path.basename(p).startswith("libcudart") and os.path.exists(p)]
        # Only a library found is kept: looked for before torch loaded it, it is found on a later call.
        _runtime = ctypes.CDLL(found[0]) if found else None
    return _runtime


_runtime: ctypes.CDLL | None = None
