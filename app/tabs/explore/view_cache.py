"""Numbers derived from one trace that several Explore views reuse (lens columns, residual norms,
head summaries), kept beside the trace for as long as it lives. The trace's own LRU is for tensors;
this is for what the views compute from them. State of the server process: app/tabs/explore/views.py
reads and fills it, app/tabs/explore/lens_filler.py fills its lens in the background."""

from __future__ import annotations

import threading
import weakref

from model_core.interp.trace import Trace

_CACHES: dict[int, dict] = {}  # id(trace) -> its numbers; a finalizer drops the entry with the trace
_CACHES_LOCK = threading.Lock()


def for_trace(tr: Trace) -> dict:
    """The trace's cache (created empty on first use, with a "lock" for its writers)."""
    key = id(tr)
    with _CACHES_LOCK:
        c = _CACHES.get(key)
        if c is None:
            c = _CACHES[key] = {"lock": threading.Lock()}
            weakref.finalize(tr, _CACHES.pop, key, None)
        return c


def lock(tr: Trace, name: str) -> threading.Lock:
    """A lock of the trace's own named `name`, created once (two threads asking first get the same)."""
    c = for_trace(tr)
    with _CACHES_LOCK:
        return c.setdefault(name, threading.Lock())
