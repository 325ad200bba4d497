"""glibc malloc settings for steady timings, shared by the processes that measure and those that train.

glibc hands blocks above its (dynamic) mmap threshold back to the kernel, so a layer's large tensors
are page-faulted afresh on every call once they cross it: times jump with the micro-batch size and no
regression follows them (BENCHMARKS.md, profiler run 4). Serving every allocation from the reused heap
makes times linear in the micro-batch size, as on a GPU's caching allocator. The profiling worker and
the executor's training workers both run with these settings, so measured and trained numbers agree;
it lives here rather than in either service so neither imports the other. Set values in the
environment win: merge as {**STEADY_ALLOCATOR, **os.environ}.
"""

from __future__ import annotations

STEADY_ALLOCATOR: dict[str, str] = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(16 * 2**30)}
