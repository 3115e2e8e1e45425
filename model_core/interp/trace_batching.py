"""Batched traces across concurrent requests (Explore's instrumented forwards).

A forward pass over a short prompt is bound by reading the weights (CPU) or launching kernels
(GPU), not by arithmetic: ten users' traces cost about what two cost if they go through the model
together. So traces that arrive while the model is busy wait for the current pass and then go
together in the next one, right-padded: with causal attention a token never sees the padding after
it, so no mask is needed and every row's activations are its solo activations (up to float
rounding); each row is cut back to its own length.

A request alone runs exactly as before (nothing padded, no waiting). Tests check batched rows
against solo runs and against transformers. Generation is batched by `model_core.serving.engine`
(continuous batching over a slot cache), not here.

Not batched (run alone): interventions (edits), a recorder already active in the caller's context.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from model_core.core import hooks, settings
from model_core.core.hook_names import layer_of

MAX_BATCH = 32
TOKEN_BUDGET = 4096  # padded tokens (rows x longest) per batched trace


@dataclass
class _Request:
    kind: str  # "trace" (stats keep the kind)
    payload: tuple
    n_tokens: int
    solo: Callable  # runs this request alone: solo(request) -> result
    result: object = None
    error: BaseException | None = None
    done: bool = False


@dataclass
class BatchStats:
    requests: int = 0
    batches: int = 0
    batched_requests: int = 0  # requests that ran in a batch of two or more
    max_batch: int = 0
    sizes: dict = field(default_factory=dict)  # (kind, batch size) -> count

    def as_dict(self) -> dict:
        return {"requests": self.requests, "batches": self.batches, "batched_requests": self.batched_requests,
                "max_batch": self.max_batch}


class ForwardBatcher:
    """One per loaded model; `run(...)` is called from many threads at once."""

    def __init__(self, lm, max_batch: int = MAX_BATCH, token_budget: int = TOKEN_BUDGET):
        self._lm = weakref.ref(lm)
        self.max_batch = max_batch
        self.token_budget = token_budget
        self._cv = threading.Condition()
        self._pending: list[_Request] = []
        self._busy = False
        self._solo_only = False  # set once a layer call showed no rows to cut (ALiBi): forwards run alone
        self.stats = BatchStats()

    # --- the one kind ---------------------------------------------------------------------------
    def trace(self, token_ids: list[int], layers: frozenset[int], solo: Callable):
        """-> (store, rope, logits [T, V]) of one instrumented forward, as `solo(token_ids, layers)`."""
        return self._run(_Request("trace", (token_ids, layers), len(token_ids), lambda r: solo(*r.payload)))

    # --- scheduling ---------------------------------------------------------------------------
    def _run(self, me: _Request):
        with self._cv:
            if not self._busy and not self._pending:
                batch = [me]
                self._busy = True
            else:
                self._pending.append(me)
                batch = self._wait_for_turn(me)
        if batch is not None:
            self._execute(batch)
        if me.error is not None:
            raise me.error
        return me.result

    @staticmethod
    def _alone(r: _Request) -> None:
        try:
            r.result = r.solo(r)
        except Exception as e:  # noqa: BLE001 - handed to its caller
            r.error = e

    def _wait_for_turn(self, me: _Request) -> list[_Request] | None:
        """Holding the lock: returns the batch this thread is to run, or None once another
        thread has run this request."""
        while not me.done:
            if not self._busy and self._pending and self._pending[0] is me:
                batch = self._take(me.kind)
                self._busy = True
                return batch
            self._cv.wait()
        return None

    def _take(self, kind: str) -> list[_Request]:
        """The head of the queue and every later request of its kind that fits the budget."""
        batch, longest = [], 0
        for r in self._pending:
            if r.kind != kind or len(batch) >= self.max_batch:
                continue
            new_longest = max(longest, r.n_tokens)
            if batch and new_longest * (len(batch) + 1) > self.token_budget:
                continue
            batch.append(r)
            longest = new_longest
        ids = {id(r) for r in batch}
        self._pending = [r for r in self._pending if id(r) not in ids]
        return batch

    def _execute(self, batch: list[_Request]) -> None:
        try:
            if len(batch) == 1 or self._solo_only:
                for r in batch:
                    self._alone(r)
            else:
                try:
                    for r, res in zip(batch, self._trace_batch(batch)):
                        r.result = res
                except Exception:  # noqa: BLE001
                    # The batch failed (out of memory, say): each request alone may still
                    # succeed, and fails only with its own error.
                    for r in batch:
                        self._alone(r)
        except BaseException as e:  # noqa: BLE001 - every request of the batch gets it
            for r in batch:
                r.error = r.error or e
        finally:
            with self._cv:
                self._busy = False
                for r in batch:
                    r.done = True
                st = self.stats
                st.requests += len(batch)
                st.batches += 1
                st.batched_requests += len(batch) if len(batch) > 1 else 0
                st.max_batch = max(st.max_batch, len(batch))
                key = (batch[0].kind, len(batch))
                st.sizes[key] = st.sizes.get(key, 0) + 1
                self._cv.notify_all()

    # --- batched forwards ---------------------------------------------------------------------
    def _right_padded(self, seqs: list[list[int]]) -> tuple[torch.Tensor, list[int]]:
        lm = self._lm()
        lens = [len(s) for s in seqs]
        ids = torch.zeros(len(seqs), max(lens), dtype=torch.long, device=lm.device)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = torch.as_tensor(s, dtype=torch.long)
        return ids, lens

    def _trace_batch(self, batch: list[_Request]) -> list[tuple]:
        lm = self._lm()
        layers = frozenset().union(*(r.payload[1] for r in batch))
        ids, lens = self._right_padded([r.payload[0] for r in batch])
        rec = hooks.Recorder(layers=layers)
        with torch.inference_mode(), hooks.recording(rec):
            out = lm.model(input_ids=ids, use_cache=False)
        results = []
        for i, (r, n) in enumerate(zip(batch, lens)):
            own = r.payload[1]
            store = {name: t[i: i + 1, :n].clone() for name, t in rec.store.items()
                     if layer_of(name) is None or layer_of(name) in own}
            try:
                rope = {l: pe.row(i, n, len(batch), ids.shape[1]).map(torch.clone) if isinstance(pe, hooks.LayerCall)
                        else tuple(x[:1, :n].clone() for x in pe) for l, pe in rec.rope.items() if l in own}
            except hooks.NoRows:
                self._solo_only = True  # the caller runs this batch's requests one by one, and later ones too
                raise
            results.append((store, rope, out.logits[i, :n]))
        return results


_BATCHERS: weakref.WeakKeyDictionary[torch.nn.Module, ForwardBatcher] = weakref.WeakKeyDictionary()
_BATCHERS_LOCK = threading.Lock()


def stats_for(lm) -> dict | None:
    """How many of this model's requests shared a forward (None before its first request)."""
    b = _BATCHERS.get(lm.model)
    return b.stats.as_dict() if b is not None else None


def max_batch_from_env() -> int:
    """LMSCOPE_MAX_BATCH: requests per shared forward (1 turns batching off)."""
    return settings.current().max_batch


def batcher_for(lm) -> ForwardBatcher:
    with _BATCHERS_LOCK:
        b = _BATCHERS.get(lm.model)
        if b is None:
            b = _BATCHERS[lm.model] = ForwardBatcher(lm, max_batch=max_batch_from_env())
        return b
