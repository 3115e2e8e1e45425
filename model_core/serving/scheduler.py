"""The engine's scheduling: the waiting queue, the slots of the KV cache and the rows in them.

Continuous batching: requests wait in `pending` until the engine thread takes them into free
slots (within a prompt-token budget per loop, so a long prompt cannot stall the running rows for
long); a running row takes part in every launch until its last record, and leaves (its slot free
for the next request) between any two launches. `emit` makes a row's records and decides when it
ends: its limit, an EOS token, a cancel, or a failed conversion.
"""

from __future__ import annotations

import contextlib
import threading
import time

import torch

from model_core.serving.engine_step import StepBuffers
from model_core.serving.engine_types import EngineRequest, Record, Row

PREFILL_BUDGET = 2048  # prompt tokens admitted per engine loop
UNLOADED = "The model was unloaded; try again."


class Scheduler:
    """Requests waiting and rows running, guarded by `cv` (request threads submit; the engine
    thread takes, runs and frees). `attach` gives it the live buffers once the engine thread has
    allocated them: freeing a slot stops it on the device."""

    def __init__(self, slots: int):
        self.slots = slots
        self.cv = threading.Condition()
        self.pending: list[EngineRequest] = []
        self.rows: dict[int, Row] = {}  # slot -> row
        self.held = False
        self.stopped = False
        self.live: StepBuffers | None = None

    def attach(self, live: StepBuffers) -> None:
        """The live buffers, sized: as many slots as they hold."""
        self.live = live
        self.slots = live.tok_in.shape[0]

    # --- request threads --------------------------------------------------------------------------
    def submit(self, req: EngineRequest) -> EngineRequest:
        with self.cv:
            if self.stopped:
                raise RuntimeError(UNLOADED)
            self.pending.append(req)
            self.cv.notify_all()
        return req

    @contextlib.contextmanager
    def hold(self):
        """Admit no new request until the block ends (running rows go on)."""
        with self.cv:
            self.held = True
        try:
            yield
        finally:
            with self.cv:
                self.held = False
                self.cv.notify_all()

    def cancel_all(self) -> None:
        """Hold admissions and cancel every request, waiting or running."""
        with self.cv:
            self.held = True
            for r in self.pending:
                r.cancel()
            for row in self.rows.values():
                row.req.cancel()
            self.cv.notify_all()

    def stop(self) -> None:
        with self.cv:
            self.stopped = True
            self.cv.notify_all()

    # --- the engine thread ------------------------------------------------------------------------
    def admissible(self) -> bool:
        """Requests wait and admissions are not held (under cv)."""
        return bool(self.pending) and not self.held

    def take_pending(self) -> list[EngineRequest]:
        """The waiting requests to admit now, in order (under cv): as many as slots are free,
        within PREFILL_BUDGET prompt tokens (the first always)."""
        if self.held:
            return []
        free = self.slots - len(self.rows)
        taken, budget = [], PREFILL_BUDGET
        while self.pending and free > 0 and (not taken or budget >= len(self.pending[0].ids)):
            r = self.pending.pop(0)
            budget -= len(r.ids)
            free -= 1
            taken.append(r)
        return taken

    def free_slots(self, n: int) -> list[int]:
        """The n lowest free slots."""
        return sorted(set(range(self.slots)) - set(self.rows))[:n]

    def launchable(self) -> list[Row]:
        """Rows that need another step: not finished, and not all their tokens already launched."""
        return [r for r in self.rows.values() if not r.done and r.launched < r.req.n_steps]

    def free(self, row: Row) -> None:
        """End a row: its slot stops advancing on the device and takes the next request."""
        row.done = True
        self.live.active[row.slot] = False
        self.live.pos[row.slot] = 0
        self.rows.pop(row.slot, None)

    def drop_cancelled(self) -> None:
        for row in list(self.rows.values()):
            if row.req.cancelled.is_set() and not row.done:
                self.free(row)
                row.req.out.put(None)

    @staticmethod
    def fail(req: EngineRequest, e: BaseException) -> None:
        req.error = e
        req.out.put(None)

    def fail_running(self, e: BaseException) -> None:
        """A launch failed: every running row fails with its error and leaves its slot."""
        for row in list(self.rows.values()):
            self.fail(row.req, e)
            self.free(row)
        self.rows.clear()

    def fail_everything(self) -> None:
        """The engine stopped: every request still running or waiting fails."""
        for row in list(self.rows.values()):
            self.fail(row.req, RuntimeError(UNLOADED))
        for r in self.pending:
            self.fail(r, RuntimeError(UNLOADED))

    # --- records ----------------------------------------------------------------------------------
    def emit(self, row: Row, packed: list[float], puts: list, logits=None, final=None,
             tokens_cached: int | None = None) -> None:
        """Make a row's record (converted where the request asks) and add it to `puts`, the (queue,
        item) pairs `deliver` puts once every row's are made; tokens_cached: the row's cache's tokens
        once this step's token was fed back (None: as the row stands, the prefill's record)."""
        req, now = row.req, time.perf_counter()
        chosen = int(packed[0])
        last = (chosen in req.eos or row.emitted + 1 >= req.n_steps or req.cancelled.is_set())
        rec = Record(index=row.emitted, packed=packed, seconds=now - row.t_last,
                     tokens_cached=row.tokens if tokens_cached is None else tokens_cached, last=last)
        if req.keep_logits and logits is not None:
            rec.logits = logits.detach().to("cpu", copy=True)
        if req.keep_probs and final is not None:
            rec.probs = torch.softmax(final.detach().float(), -1).cpu()
        row.emitted += 1
        row.t_last = now
        item = rec
        if req.convert is not None:
            try:
                item = req.convert(rec)
            except Exception as e:  # noqa: BLE001 - this request fails alone
                self.free(row)
                req.error = e
                puts.append((req.out, None))
                return
        if last:
            self.free(row)
        puts.append((req.out, item))
        if last:
            puts.append((req.out, None))

    @staticmethod
    def deliver(puts: list) -> None:
        """Queue what emit made. Only now: a put wakes its request thread, which would take the
        interpreter from this one in the middle of a hand-out (32 times a launch at 32 users)."""
        for q, item in puts:
            q.put(item)
