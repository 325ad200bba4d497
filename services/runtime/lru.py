"""A bounded, thread-safe map of serialized values, least recently used out first.

What the services keep of immutable protos (a stored job's spec, a search's plan) is kept as bytes: a hit parses
its own copy, so no caller can change what the next one gets, and the bytes held are the bound.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable


class BytesLRU:
    """At most `items` values and `max_bytes` bytes of them; a value larger than `max_bytes` is not kept."""

    def __init__(self, items: int, max_bytes: int | None = None) -> None:
        self.items, self.max_bytes = items, max_bytes
        self._values: OrderedDict[Hashable, bytes] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._values)

    def get(self, key: Hashable) -> bytes | None:
        with self._lock:
            value = self._values.get(key)
            if value is not None:
                self._values.move_to_end(key)
            return value

    def put(self, key: Hashable, value: bytes) -> None:
        if self.max_bytes is not None and len(value) > self.max_bytes:
            return
        with self._lock:
            old = self._values.pop(key, None)
            self._bytes += len(value) - (len(old) if old is not None else 0)
            self._values[key] = value
            while len(self._values) > self.items or (self.max_bytes is not None and self._bytes > self.max_bytes):
                self._bytes -= len(self._values.popitem(last=False)[1])

    def clear(self) -> None:
        with self._lock:
            self._values.clear()
            self._bytes = 0
