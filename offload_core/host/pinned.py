"""Exact-size host allocations for layer buffers, pinned when the device can use it.

torch's pinned caching allocator rounds each block up to a power of two (a 1.2 GiB layer costs
2 GiB), so pinned buffers here are ordinary allocations page-locked in place with
``cudaHostRegister``: exactly ``nbytes`` are locked, and unlocking is explicit.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)


class PinError(RuntimeError):
    """The driver refused to page-lock a host buffer."""


@dataclass(frozen=True)
class HostBuffer:
    """One flat host allocation of ``nbytes`` bytes (uint8)."""

    data: torch.Tensor
    nbytes: int
    # True only when the pages are really locked (CUDA). Planned-pinned buffers on machines
    # without CUDA are allocated pageable and say so here.
    page_locked: bool


def allocate_host_buffer(nbytes: int, *, pin: bool, device: torch.device) -> HostBuffer:
    """Allocate ``nbytes`` of anonymous host memory; page-lock it if ``pin`` and ``device`` is CUDA."""
    data = torch.empty(int(nbytes), dtype=torch.uint8)
    if not (pin and device.type == "cuda" and nbytes > 0):
        return HostBuffer(data, int(nbytes), page_locked=False)
    rc = torch.cuda.cudart().cudaHostRegister(data.data_ptr(), int(nbytes), 0)
    if int(rc) != 0:
        raise PinError(f"cudaHostRegister of {nbytes} B failed with CUDA error {int(rc)}")
    return HostBuffer(data, int(nbytes), page_locked=True)


def free_host_buffer(buffer: HostBuffer) -> None:
    """Unlock a page-locked buffer. The memory itself goes when the last tensor view goes."""
    if buffer.page_locked:
        rc = torch.cuda.cudart().cudaHostUnregister(buffer.data.data_ptr())
        if int(rc) != 0:
            raise PinError(f"cudaHostUnregister failed with CUDA error {int(rc)}")
