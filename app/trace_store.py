"""Traces live on the server, keyed, in a bounded LRU; the browser only holds the key (in gr.State)
and receives the slice each view shows. An evicted trace is simply re-run from the state."""

from __future__ import annotations

import os
import threading
import uuid
from collections import OrderedDict

from model_core.trace import Trace


class TraceStore:
    def __init__(self, max_items: int = 16, max_bytes: int = 2 * 2**30):
        self.max_items, self.max_bytes = max_items, max_bytes
        self._items: "OrderedDict[str, Trace]" = OrderedDict()
        self._lock = threading.Lock()

    def put(self, tr: Trace) -> str:
        key = uuid.uuid4().hex
        with self._lock:
            self._items[key] = tr
            while len(self._items) > self.max_items or (
                len(self._items) > 1 and sum(t.captured_bytes() for t in self._items.values()) > self.max_bytes
            ):
                self._items.popitem(last=False)
        return key

    def get(self, key: str | None) -> Trace | None:
        if not key:
            return None
        with self._lock:
            tr = self._items.get(key)
            if tr is not None:
                self._items.move_to_end(key)
            return tr

    def __len__(self) -> int:
        return len(self._items)


STORE = TraceStore(max_items=int(os.environ.get("LMSCOPE_TRACE_CACHE_ITEMS", "16")))
