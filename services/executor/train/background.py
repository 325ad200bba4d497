"""One checkpoint write in flight beside training (issue 16, Varuna §4.5): the boundary only copies the tensors.

The write of the checkpoint taken at boundary k overlaps iteration k + 1, and that iteration is reported only
once the checkpoint is complete (trainer.py): a failure then trains at most the checkpoint interval again, as
with a synchronous write, while the write itself runs beside compute instead of stalling it.

The thread never enters a collective (a rank's writer and its training loop would race on the process group);
rank 0 learns that its peers are done from the files they wrote. An error in the thread is raised by the next
`wait()`, at a boundary, where every rank is between iterations.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable

WRITER_NICE = 19  # Linux: a thread's own nice value; the write waits for CPU the training leaves idle


class BackgroundWriter:
    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._cancel_at: float | None = None  # monotonic time after which rank 0 stops waiting for peers
        self._native_id = 0  # the writer thread's kernel id, for its priority

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def cancelled(self) -> bool:
        return self._cancel_at is not None and time.monotonic() >= self._cancel_at

    def start(self, write: Callable[[], None]) -> None:
        """Run `write` in the background; the previous write must have been waited for."""
        if self.busy:
            raise RuntimeError("a checkpoint write is still in flight; wait() for it before starting another")

        def run() -> None:
            try:
                self._native_id = threading.get_native_id()
                with contextlib.suppress(OSError, AttributeError):  # training's threads come first for the CPU
                    os.setpriority(os.PRIO_PROCESS, self._native_id, WRITER_NICE)
                write()
            except BaseException as e:  # kept for wait(): a thread's exception would otherwise only be printed
                self._error = e

        self._thread = threading.Thread(target=run, name="checkpoint-writer", daemon=True)
        self._thread.start()

    def hurry(self) -> None:
        """Training now waits for the write: give it back a normal priority (where this process may raise it;
        an unprivileged one keeps the low priority and the write only takes longer)."""
        if self.busy and self._native_id:
            with contextlib.suppress(OSError, AttributeError):
                os.setpriority(os.PRIO_PROCESS, self._native_id, 0)

    def wait(self) -> None:
        """Block until the write in flight (if any) finished; raise its error."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise error

    def abandon(self, timeout_s: float, grace_s: float = 0.0) -> None:
        """On a stop or a lost peer: rank 0 waits at most `grace_s` more for its peers' layers (a peer that died
        after writing them still completes the checkpoint in flight, so less is trained again); this rank's own
        files get `timeout_s`."""
        self._cancel_at = time.monotonic() + grace_s
        if self._thread is not None:
            self._thread.join(timeout_s)
        self._error = None
