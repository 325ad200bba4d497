"""Activation swap (vPipe §3, Harmony): a layer's tensors saved for backward leave the device after its forward
and come back before its backward.

`SwapPool.saving(micro_batch)` is a `torch.autograd.graph.saved_tensors_hooks` context: every tensor autograd
saves inside it is copied into a pooled host buffer (pack) and the saved slot holds only a small handle, so
the device copy is freed as soon as the forward drops it. `prefetch(micro_batch)` starts copying that
micro-batch's tensors back (the trainer calls it when the schedule's next task is that micro-batch's
backward, and again when the backward starts); `unpack` returns the restored tensor, copying synchronously
whatever was not prefetched. `finish(micro_batch)` drops anything backward did not use.

On CUDA the host buffers are pinned and both directions run non_blocking on one side stream (so a host
buffer is reused only after its previous copy, by stream order; the device tensors are protected with
`record_stream` and events). On the CPU the same path runs with plain copies into separate pooled tensors,
so tests exercise the logic. Leaf tensors that require grad (parameters, received activations) are not
swapped: something else holds them anyway. Host buffers are pooled by (dtype, numel) and reused across
micro-batches and iterations.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor

Handle = tuple[int, int]  # (micro-batch, sequence number)


@dataclass
class _Entry:
    host: Tensor  # pooled flat host buffer; the first numel elements hold the tensor
    shape: torch.Size
    stride: tuple[int, ...]  # the layout empty_like would give the original
    dtype: torch.dtype
    restored: Tensor | None = None
    ready: object = None  # CUDA event after the restoring copy


class SwapPool:
    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._free: dict[tuple[torch.dtype, int], list[Tensor]] = {}
        self._entries: dict[int, dict[int, _Entry]] = {}
        self._next = 0
        self.swapped_bytes = 0  # bytes packed since the last `take_bytes`
        self.host_bytes = 0  # host memory the pool owns (in use or free)

    def take_bytes(self) -> int:
        out, self.swapped_bytes = self.swapped_bytes, 0
        return out

    @property
    def outstanding(self) -> int:
        return sum(len(e) for e in self._entries.values())

    @contextmanager
    def saving(self, micro_batch: int) -> Iterator[None]:
        with torch.autograd.graph.saved_tensors_hooks(lambda t: self.pack(micro_batch, t), self.unpack):
            yield

    def _buffer(self, dtype: torch.dtype, numel: int) -> Tensor:
        free = self._free.get((dtype, numel))
        if free:
            return free.pop()
        self.host_bytes += numel * torch.empty((), dtype=dtype).element_size()
        return torch.empty(numel, dtype=dtype, pin_memory=self.cuda)

    def _release(self, entry: _Entry) -> None:
        self._free.setdefault((entry.dtype, entry.host.numel()), []).append(entry.host)

    def pack(self, micro_batch: int, t: Tensor) -> Tensor | Handle:
        if (t.is_leaf and t.requires_grad) or t.device != self.device or t.numel() == 0:
            return t
        host = self._buffer(t.dtype, t.numel())
        entry = _Entry(host, t.shape, torch.empty_like(t, device="meta").stride(), t.dtype)
        view = host.view(t.shape)
        if self.cuda:
            assert self.stream is not None
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                view.copy_(t, non_blocking=True)
            t.record_stream(self.stream)  # its memory is not reused before the copy ran
        else:
            view.copy_(t)
        handle = (micro_batch, self._next)
        self._next += 1
        self._entries.setdefault(micro_batch, {})[handle[1]] = entry
        self.swapped_bytes += t.numel() * t.element_size()
        return handle

    def _restore(self, entry: _Entry) -> None:
        if entry.restored is not None:
            return
        source = entry.host.view(entry.shape)
        if self.cuda:
            assert self.stream is not None
            with torch.cuda.stream(self.stream):
                restored = torch.empty_strided(entry.shape, entry.stride, dtype=entry.dtype, device=self.device)
                restored.copy_(source, non_blocking=True)
                entry.ready = torch.cuda.Event()
                entry.ready.record(self.stream)
        else:
            restored = torch.empty_strided(entry.shape, entry.stride, dtype=entry.dtype, device=self.device)
            restored.copy_(source)
        entry.restored = restored
        self._release(entry)  # reusable: a later copy into it queues behind this one on the same stream

    def prefetch(self, micro_batch: int) -> None:
        """Start bringing back every tensor of `micro_batch` packed so far."""
        for entry in self._entries.get(micro_batch, {}).values():
            self._restore(entry)

    def unpack(self, saved: Tensor | Handle) -> Tensor:
        if isinstance(saved, Tensor):
            return saved
        micro_batch, key = saved
        entries = self._entries.get(micro_batch, {})
        if key not in entries:
            raise RuntimeError(f"swap: saved tensor {saved} of micro-batch {micro_batch} was already released "
                               "(a second backward through a swapped layer is not supported)")
        entry = entries.pop(key)
        self._restore(entry)
        restored = entry.restored
        assert restored is not None
        if self.cuda:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(entry.ready)
            restored.record_stream(current)
        return restored

    def finish(self, micro_batch: int) -> None:
        """After the micro-batch's backward: return buffers of tensors backward never unpacked."""
        for entry in self._entries.pop(micro_batch, {}).values():
            if entry.restored is None:
                self._release(entry)

    def clear(self) -> None:
        for micro_batch in list(self._entries):
            self.finish(micro_batch)
