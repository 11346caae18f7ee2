"""Recent: a small, thread-safe map that keeps the values put last (oldest dropped first)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class Recent(Generic[K, V]):
    """At most `size` entries; `put` past that drops the oldest. A version's manifest and
    its built pieces are asked for by a whole fleet within a second, then never again, so
    insertion order is the right eviction order and reads need no bookkeeping."""

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        self.size = size
        self._items: OrderedDict[K, V] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: K) -> V | None:
        return self._items.get(key)

    def __contains__(self, key: K) -> bool:
        return key in self._items

    def __len__(self) -> int:
        return len(self._items)

    def put(self, key: K, value: V) -> None:
        with self._lock:
            self._items[key] = value
            self._items.move_to_end(key)  # put again: the newest
            while len(self._items) > self.size:
                self._items.popitem(last=False)

    def discard(self, key: K) -> None:
        with self._lock:
            self._items.pop(key, None)

    def discard_where(self, doomed: Callable[[K], bool]) -> None:
        """Drops every entry whose key `doomed` accepts (a deleted session's)."""
        with self._lock:
            for key in [k for k in self._items if doomed(k)]:
                del self._items[key]

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
