"""The simulator's host threads: the launch thread's name, copier threads on their own clocks, and the
mode that puts every ``copy_`` a simulated thread issues on the clock.

Tests and benches only (``testing.sim``'s :class:`~testing.sim.SimDevice` owns the clocks these
advance; a copier job runs at once, in program order, so the data stays exact).
"""
from __future__ import annotations

from typing import Any, Callable

from torch.overrides import TorchFunctionMode

from offload_core.streaming.copier import CopyJob, copy_pairs

# testing.sim.SimDevice, whose clocks these advance (not imported: it imports this module).
SimDevice = Any

LAUNCH_THREAD = "launch"  # the host thread that runs the forward and launches kernels


class InterceptCopies(TorchFunctionMode):
    """Routes every ``copy_`` issued inside it through the simulator's clock (then does it for real)."""

    def __init__(self, sim: SimDevice, host_memcpy: bool):
        super().__init__()
        self._sim = sim
        self._host_memcpy = host_memcpy
        # A copier job runs inside the launch thread's copy-stream context (in program order):
        # each mode acts only for the simulated thread it was opened on.
        self._thread = sim._thread

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") == "copy_" and self._sim._thread == self._thread:
            dst, src = args[0], args[1]
            non_blocking = (kwargs or {}).get("non_blocking", args[2] if len(args) > 2 else False)
            if self._host_memcpy:
                self._sim._host_memcpy(dst, src)
            else:
                self._sim._h2d_copy(dst, src, bool(non_blocking))
        return func(*args, **(kwargs or {}))



class _SimJob:
    """A finished host-copier job: waiting for it moves the waiting thread's clock to its end."""

    def __init__(self, sim: SimDevice, done_at: float, error: BaseException | None):
        self._sim, self.done_at, self._error = sim, done_at, error

    def result(self, timeout: float | None = None) -> None:
        sim, thread = self._sim, self._sim._thread
        waited = max(0.0, self.done_at - sim._clocks[thread])
        if thread == LAUNCH_THREAD:  # the thread that launches kernels stood still meanwhile
            sim.blocked_s += waited
            sim.copier_wait_s += waited
        sim._clocks[thread] += waited
        if self._error is not None:
            raise self._error

    def done(self) -> bool:
        """Whether it ended by the asking thread's clock (its data was copied at once, in program order)."""
        return self.done_at <= self._sim._clocks[self._sim._thread]

    def cancel(self) -> bool:
        return False


class SimCopier:
    """A host copier thread on its own virtual clock; each job runs at once (data in program order).

    A job cannot start before it was submitted, nor before its thread finished the previous one;
    its host memcpys and waits advance its own clock, not the launch thread's.
    """

    def __init__(self, sim: SimDevice, name: str, threads: int = 1):
        self._sim, self.name, self.threads = sim, name, threads
        self.cpu_s = 0.0  # the copier's virtual busy time is its clock; no host CPU is simulated
        sim._clocks.setdefault(name, 0.0)

    def submit(self, job: Callable[[], None]) -> CopyJob:
        sim = self._sim
        caller, sim._thread = sim._thread, self.name
        sim._clocks[self.name] = max(sim._clocks[self.name], sim._clocks[caller])
        error = None
        try:
            with InterceptCopies(sim, host_memcpy=True):
                job()
        except BaseException as failure:  # handed to result(), as a thread's future would
            error = failure
        finally:
            sim._thread = caller
        return _SimJob(sim, sim._clocks[self.name], error)

    def copy(self, pairs) -> int:
        """A fill split over the copier's threads: the copies run in order (data in program order), each
        host memcpy charged at the rate ``threads`` threads reach together (``SimLink.memcpy_Bps``)."""
        sim = self._sim
        previous, sim._memcpy_threads = sim._memcpy_threads, self.threads
        try:
            return copy_pairs(pairs)
        finally:
            sim._memcpy_threads = previous

    def close(self, wait: bool = True) -> None:
        """Nothing runs in the background."""
