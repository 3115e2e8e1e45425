"""The background logit lens: one daemon thread per server that computes the lens column of every
position of recent traces while no request is running, so a zoom finds its columns ready. The
columns themselves are app/tabs/explore/views.py's (lens_columns), kept per trace in
app/tabs/explore/view_cache.py; this module holds the thread and its queue (FILLER), which the
Explore tab feeds after each run (schedule) and zoom (focus)."""

from __future__ import annotations

import logging
import threading
import time
import weakref

from app.shared.context import requests_running
from app.tabs.explore import view_cache, views
from model_core.core.cpu_threads import REQUEST_NICE, limit_this_thread, lower_this_thread
from model_core.interp.trace import Trace

log = logging.getLogger(__name__)


class LensFiller:
    """Computes the logit lens of every position of recent traces in the background, a few
    positions at a time and only while no request is running, so that a zoom finds its columns
    already computed (a zoom onto 64 new positions is 64 x 30 passes through the unembedding:
    0.5-1 s on the 2-core CPU). Most recent trace first; traces are held weakly (an evicted trace
    is dropped). One thread for the whole server, running torch on one core (its OpenMP count is set
    to 1 for that thread alone), so a request that arrives meanwhile keeps the other core, and two
    OpenMP teams never fight over two cores (on this machine under load a 2-thread team ran the lens
    4-16x slower than one thread)."""

    CHUNK = 1  # positions per step (x 30 layers: ~20 ms on one core): what a request may find running
    IDLE_S = 0.25  # the server must have been idle this long (chained events of one click come faster)
    KEEP = 4  # traces queued at most

    def __init__(self):
        self.enabled = True
        self._queue: list[weakref.ref] = []
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self.working = False  # a chunk is being computed
        self._last_busy = 0.0  # time.monotonic() when a request was last seen running
        self.one_thread = None  # whether the filler's torch work runs on one core (set by its thread)
        self.yields = None  # whether its thread runs at REQUEST_NICE (set by its thread)

    def schedule(self, tr: Trace) -> None:
        if not self.enabled:
            return
        with self._cv:
            self._queue = [r for r in self._queue if r() is not None and r() is not tr][: self.KEEP - 1]
            self._queue.insert(0, weakref.ref(tr))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="lmscope-lens-filler", daemon=True)
                self._thread.start()
            self._cv.notify_all()

    def focus(self, tr: Trace, lo: int, hi: int) -> None:
        """Positions lo..hi are on screen: fill them first."""
        view_cache.for_trace(tr)["fill_focus"] = (int(lo), int(hi))

    def clear(self) -> None:
        """Forget every queued trace (what is computed stays computed)."""
        with self._cv:
            self._queue = []
            self._cv.notify_all()

    def pending(self) -> int:
        """Traces still queued (for tests and the benchmark)."""
        with self._cv:
            return sum(1 for r in self._queue if r() is not None)

    def wait_idle(self, timeout: float = 600.0) -> bool:
        """Block until nothing is left to fill, or the filler is switched off and between chunks
        (tests, the benchmark)."""
        with self._cv:
            return self._cv.wait_for(lambda: not self.working and (
                not self.enabled or not any(r() is not None for r in self._queue)), timeout)

    def _next(self):
        """(trace, positions of its next chunk), or None when there is nothing to do."""
        with self._cv:
            while True:
                self._queue = [r for r in self._queue if r() is not None]
                if not self._queue or not self.enabled:
                    self._cv.notify_all()
                    return None
                tr = self._queue[0]()
                if tr is None:
                    continue
                done = views.lens_done(tr)
                cache = view_cache.for_trace(tr)
                order = cache.get("fill_order")
                if order is None:
                    order = cache["fill_order"] = views.fill_order(tr.n_tokens)
                lo, hi = cache.get("fill_focus") or (0, -1)
                # the rows on screen first (the next zoom is most likely inside them), then the rest
                todo = [p for p in order if lo <= p <= hi and not done[p]][: self.CHUNK]
                todo = todo or [p for p in order if not done[p]][: self.CHUNK]
                if todo:
                    self.working = True
                    return tr, todo
                self._queue.pop(0)

    def _wait_for_idle(self) -> None:
        """Return once no request has held a model slot for IDLE_S (measured from the last time one
        was seen, so chunk follows chunk while the server stays idle)."""
        while True:
            now = time.monotonic()
            if requests_running():
                self._last_busy = now
            elif now - self._last_busy >= self.IDLE_S:
                return
            time.sleep(0.02)

    def _run(self) -> None:
        self.one_thread = limit_this_thread(1)  # this thread's torch work on one core
        # background work no page waits on: never before the engine's thread (model_core.core.cpu_threads)
        self.yields = lower_this_thread(REQUEST_NICE)
        while True:
            with self._cv:
                self._cv.wait_for(lambda: any(r() is not None for r in self._queue) and self.enabled)
            self._wait_for_idle()
            job = self._next()
            if job is None:
                continue
            tr, todo = job
            try:
                views.lens_columns(tr, todo)
            except Exception as e:  # noqa: BLE001 - a trace that cannot be read is dropped, the server goes on
                log.warning("lens filler dropped a trace: %s: %s", type(e).__name__, e)
                with self._cv:
                    self._queue = [r for r in self._queue if r() is not None and r() is not tr]
            finally:
                del tr
                with self._cv:
                    self.working = False
                    self._cv.notify_all()


FILLER = LensFiller()
