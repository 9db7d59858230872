"""One forward at a time per streamed model: which thread's forward is inside a layer now.

The ring holds one model's layers at a time: a second forward entering a layer would release the
running layer's weights under it (on CUDA, overwrite its slot while kernels still read it). The
engine's pre-hook claims the layer for its thread; the post-hook (and ``finish_use``) clears the
claim. Runs in the process that streams the model, on the threads that run its forwards.
"""
from __future__ import annotations

import threading
from typing import Protocol


class ConcurrentForwardError(RuntimeError):
    """A second thread entered a streamed layer while another thread's layer was running.

    The ring holds one model's layers at a time: a second forward would release the running
    layer's weights under it (on CUDA, overwrite its slot while kernels still read it).
    """


class Claimed(Protocol):
    key: str


class ForwardClaim:
    """The (thread, layer) inside a forward of one model, or None between layers."""

    def __init__(self, model_name: str):
        self._model_name = model_name
        self._running: tuple[int, Claimed] | None = None
        self._lock = threading.Lock()

    def claim(self, layer: Claimed) -> None:
        """``layer`` runs in this thread now; another live thread's claim refuses it."""
        me = threading.get_ident()
        with self._lock:  # check and set in one step
            running = self._running
            if running is not None and running[0] != me and _thread_alive(running[0]):
                raise ConcurrentForwardError(
                    f"{self._model_name}: layer {layer.key} entered by thread {me} while "
                    f"{running[1].key} runs in thread {running[0]}; serialize forwards "
                    "of a streamed model (one request at a time per replica)")
            self._running = (me, layer)

    def owns(self, layer: Claimed) -> bool:
        """Whether this thread claimed ``layer`` (no lock: reading the one reference is atomic)."""
        running = self._running
        return running is not None and running[1] is layer and running[0] == threading.get_ident()

    def in_this_thread(self) -> bool:
        """Whether this thread is inside a layer (a step cache deciding from inside one)."""
        running = self._running
        return running is not None and running[0] == threading.get_ident()

    def clear(self) -> None:
        self._running = None  # replacing the one reference is atomic


def _thread_alive(ident: int) -> bool:
    """Whether a thread with ``ident`` still runs (a claim left by a thread that died is stale)."""
    return any(thread.ident == ident for thread in threading.enumerate())
