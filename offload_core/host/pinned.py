"""Host allocations for layer buffers: whole pages of their own, page-locked when the device can use it.

torch's pinned caching allocator rounds each block up to a power of two (a 1.2 GiB layer costs
2 GiB), so pinned buffers here are anonymous mappings page-locked in place with
``cuMemHostRegister``. Each buffer is its own mapping: page-aligned, rounded up to whole pages, so
registering it never locks a page that malloc'd data shares (a 2 KiB per-dtype buffer from the
heap would lock, and later unlock under, its neighbours). The rounding costs < 1 page per buffer.

A refused registration (a memlock limit, a driver out of pinnable memory) is not fatal: the buffer
stays pageable and the refusal says why. Registration goes through the CUDA driver API, which
leaves no last-error state behind (see :class:`CudaPageLocker`), so the next kernel launch check
never sees the refusal. Unlocking waits for the device first: a copy still reading the buffer must
finish before its pages are unlocked.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import mmap
from dataclasses import dataclass
from typing import Iterator, Protocol

import torch

logger = logging.getLogger(__name__)

PAGE_BYTES = mmap.PAGESIZE


class PinError(RuntimeError):
    """The driver refused to unlock a page-locked host buffer (registration refusals fall back instead)."""


class PageLocker(Protocol):
    """How host pages are locked for one device (CUDA's driver; tests pass a fake).

    A failed call must leave no error state behind (the driver API keeps none)."""

    def register(self, ptr: int, nbytes: int, flags: int = 0) -> int:
        """Lock ``nbytes`` at ``ptr`` (``CU_MEMHOSTREGISTER_*`` flags); 0 on success, else the driver's error code."""

    def unregister(self, ptr: int) -> int:
        """Unlock the range registered at ``ptr``; 0 on success."""

    def quiesce(self) -> None:
        """Wait until no copy can still read locked memory (before it is unlocked)."""

    def describe(self, code: int) -> str:
        """The error's name, for the log."""


@dataclass(frozen=True)
class PinRefusal:
    """Why a buffer planned pinned stayed pageable."""

    nbytes: int  # the page-rounded bytes the driver was asked to lock
    code: int  # the CUDA driver's error code (CUresult)
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
    set (and no CUDA error state); :func:`free_host_buffer` unlocks it.
    """
    nbytes = data.numel() * data.element_size()
    return _lock(data, nbytes, nbytes, device, flags=flags)


def _lock(data: torch.Tensor, nbytes: int, size: int, device: torch.device, *, flags: int) -> HostBuffer:
    locker = page_locker(device) if size else None
    if locker is None:
        return HostBuffer(data, nbytes, page_locked=False, mapped_bytes=size)
    code = int(locker.register(data.data_ptr(), size, flags))
    if code != 0:
        return HostBuffer(data, nbytes, page_locked=False, mapped_bytes=size,
                          refusal=PinRefusal(size, code, locker.describe(code)))
    return HostBuffer(data, nbytes, page_locked=True, mapped_bytes=size, locker=locker)


def free_host_buffer(buffer: HostBuffer) -> None:
    """Unlock a page-locked buffer once the device is done with it. The pages go with the last view."""
    if not buffer.page_locked:
        return
    # A buffer made page-locked elsewhere without its locker was locked through CUDA's driver.
    locker = buffer.locker or page_locker(torch.device("cuda"))
    locker.quiesce()
    code = int(locker.unregister(buffer.data.data_ptr()))
    if code != 0:
        raise PinError(f"unlocking {buffer.mapped_bytes or buffer.nbytes} B failed with CUDA error {code} "
                       f"({locker.describe(code)})")


def page_locker(device: torch.device) -> PageLocker | None:
    """The page locker for ``device``: CUDA's driver on a CUDA device, none elsewhere."""
    if device.type != "cuda":
        return None
    return _cuda_locker(torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device()))


@functools.lru_cache(maxsize=None)
def _cuda_locker(device: torch.device) -> PageLocker:
    return CudaPageLocker(device)


class CudaPageLocker:
    """``cuMemHostRegister`` through the CUDA driver API (libcuda, ctypes), in the device's primary context.

    Why the driver and not the runtime: a refused ``cudaHostRegister`` leaves the calling thread's
    runtime last-error set, and the next kernel launch check raises it ("out of memory" from an
    unrelated kernel). Clearing it needs the very libcudart torch calls, and a process often maps
    two (a conda and a pip one) or links it statically. The driver API returns its error and
    keeps no last-error state; there is one libcuda per process (the installed driver's). The
    range registered there is page-locked for the primary context, which is the one the runtime
    (and so torch) uses, so its copies from it run asynchronously.
    """

    def __init__(self, device: torch.device):
        self.device = device
        torch.cuda.init()  # the primary context exists (torch made it) before it is retained
        self._driver = _cuda_driver()
        handle = ctypes.c_int()
        _check(self._driver, self._driver.cuDeviceGet(ctypes.byref(handle), int(device.index)), "cuDeviceGet")
        self._context = ctypes.c_void_p()
        _check(self._driver, self._driver.cuDevicePrimaryCtxRetain(ctypes.byref(self._context), handle),
               "cuDevicePrimaryCtxRetain")

    def register(self, ptr: int, nbytes: int, flags: int = 0) -> int:
        with self._current():
            return int(self._driver.cuMemHostRegister_v2(ctypes.c_void_p(ptr), ctypes.c_size_t(nbytes),
                                                         ctypes.c_uint(flags)))

    def unregister(self, ptr: int) -> int:
        with self._current():
            return int(self._driver.cuMemHostUnregister(ctypes.c_void_p(ptr)))

    def quiesce(self) -> None:
        # Every stream of the device, the copy stream and any staging copies included: a DMA still
        # reading these pages must land before they are unlocked.
        torch.cuda.synchronize(self.device)

    def describe(self, code: int) -> str:
        return _error_name(self._driver, code)

    @contextlib.contextmanager
    def _current(self) -> Iterator[None]:
        """The device's primary context current on this thread for one driver call (any thread may pin)."""
        _check(self._driver, self._driver.cuCtxPushCurrent_v2(self._context), "cuCtxPushCurrent")
        try:
            yield
        finally:
            popped = ctypes.c_void_p()
            self._driver.cuCtxPopCurrent_v2(ctypes.byref(popped))


@functools.lru_cache(maxsize=1)
def _cuda_driver() -> ctypes.CDLL:
    """The CUDA driver library (already loaded by torch's runtime; one per process)."""
    driver = ctypes.CDLL("libcuda.so.1")
    driver.cuGetErrorName.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    return driver


def _error_name(driver: ctypes.CDLL, code: int) -> str:
    name = ctypes.c_char_p()
    if driver.cuGetErrorName(int(code), ctypes.byref(name)) != 0 or not name.value:
        return f"CUDA driver error {code}"
    return name.value.decode()


def _check(driver: ctypes.CDLL, code: int, call: str) -> None:
    if code != 0:
        raise PinError(f"{call} failed with CUDA driver error {code} ({_error_name(driver, code)})")
