"""The web app's one trace cache: traces live on the server in a bounded LRU; the browser only holds
a key (in gr.State) and receives the slice each view shows. An evicted trace is simply re-run.

Explore puts each trace under a new random key (`put`); tabs that look a trace up by what it is
(the Anatomy tab: model, prompt, chat wrap) use `cached(key, make)` with a tuple key, so both share
one bound (LMSCOPE_TRACE_CACHE_ITEMS traces, 2 GiB of captured tensors)."""

from __future__ import annotations

import threading
import uuid
from collections import OrderedDict
from collections.abc import Callable, Hashable

from model_core.core.settings import current
from model_core.interp.trace import Trace


class TraceStore:
    def __init__(self, max_items: int = 16, max_bytes: int = 2 * 2**30):
        self.max_items, self.max_bytes = max_items, max_bytes
        self._items: OrderedDict[Hashable, Trace] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, tr: Trace, key: Hashable | None = None) -> Hashable:
        """Keep `tr` under `key` (a new random string key when None), evicting the least recently
        used traces beyond the bounds; returns the key."""
        key = uuid.uuid4().hex if key is None else key
        with self._lock:
            self._items[key] = tr
            self._items.move_to_end(key)
            while len(self._items) > self.max_items or (
                len(self._items) > 1 and sum(t.captured_bytes() for t in self._items.values()) > self.max_bytes
            ):
                self._items.popitem(last=False)
        return key

    def get(self, key: Hashable | None) -> Trace | None:
        if key is None or key == "":
            return None
        with self._lock:
            tr = self._items.get(key)
            if tr is not None:
                self._items.move_to_end(key)
            return tr

    def cached(self, key: Hashable, make: Callable[[], Trace]) -> Trace:
        """The trace kept under `key`, else make() kept under it (make runs outside the lock, so two
        requests for the same new key may both run it; the later one is kept)."""
        tr = self.get(key)
        if tr is None:
            tr = make()
            self.put(tr, key)
        return tr

    def __setitem__(self, key: Hashable, tr: Trace) -> None:
        self.put(tr, key)

    def __len__(self) -> int:
        return len(self._items)


STORE = TraceStore(max_items=current().trace_cache_items)
