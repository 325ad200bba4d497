"""The live-heap peak of a CPU worker: glibc's bytes in use, sampled by a thread (opt-in, Linux/glibc only).

Why: on a GPU a worker's peak is `torch.cuda.max_memory_allocated`, the live bytes, which is what the cost model
prices. On the CPU the process RSS keeps what glibc does not return: the workers run with `MALLOC_MMAP_MAX_=0`
and never trim (runtime/allocator.py), so freed tensors stay in the RSS and ZeRO's allocation pattern leaves far
more free heap behind its peak than plain DP (BENCHMARKS.md, issue 24). The CPU analogue of CUDA's figure is
the high-water mark of the heap in use, read from `mallinfo2()`: uordblks (allocated from the arenas) + hblkhd
(allocated by mmap). glibc keeps no such high-water mark, so a daemon thread samples it every `interval_s` and
keeps the largest; a peak shorter than the interval can be missed (the figure is a lower bound).

Sampling costs CPU (mallinfo2 walks the arenas' free lists under their locks), so it is off unless the worker's
environment sets BALLAST_HEAP_PEAK=1 (worker.py). Without glibc's mallinfo2 (glibc < 2.33, musl, macOS) nothing
starts and `take_peak()` is 0.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable

ENV = "BALLAST_HEAP_PEAK"
INTERVAL_S = 0.0005


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def _load() -> Callable[[], _Mallinfo2] | None:
    try:
        fn = ctypes.CDLL(None).mallinfo2  # the process's own libc
    except (OSError, AttributeError):
        return None
    fn.restype, fn.argtypes = _Mallinfo2, []
    return fn


_MALLINFO2 = _load()


def live_bytes() -> int | None:
    """glibc's heap in use now (bytes), or None without mallinfo2."""
    if _MALLINFO2 is None:
        return None
    info = _MALLINFO2()
    return int(info.uordblks + info.hblkhd)


class Sampler:
    """A daemon thread keeping the largest `live_bytes()` seen; `samples` counts its reads."""

    def __init__(self, interval_s: float = INTERVAL_S) -> None:
        now = live_bytes()
        if now is None:
            raise OSError("glibc mallinfo2 is not available")
        self.interval_s, self.samples = interval_s, 0
        self._peak, self._lock, self._stop = now, threading.Lock(), threading.Event()
        self._thread = threading.Thread(target=self._loop, name="heap-peak", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            now = live_bytes() or 0
            with self._lock:
                self._peak = max(self._peak, now)
                self.samples += 1

    def take_peak(self) -> int:
        """The peak since the last call (or the start), then reset to the heap in use now."""
        now = live_bytes() or 0
        with self._lock:
            peak, self._peak = max(self._peak, now), now
        return peak

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


_sampler: Sampler | None = None


def start(interval_s: float = INTERVAL_S) -> Sampler | None:
    """Start this process's sampler (once; a second call returns the running one); None without mallinfo2."""
    global _sampler
    if _sampler is None and _MALLINFO2 is not None:
        _sampler = Sampler(interval_s)
    return _sampler


def stop() -> None:
    global _sampler
    if _sampler is not None:
        _sampler.stop()
        _sampler = None


def take_peak() -> int:
    """The live heap's peak since the last call (the first: since `start`); 0 when no sampler runs."""
    return _sampler.take_peak() if _sampler is not None else 0
