"""Batched forward passes across concurrent requests (continuous batching, the simple kind).

A forward pass of a few tokens is bound by reading the weights (CPU) or launching kernels
(GPU), not by arithmetic: ten users' passes cost about what two cost if they go through the
model together. So requests that arrive while the model is busy wait for the current pass and
then go together in the next one. Three kinds are batched, each only with its own kind:

- decode steps of running generations (one token each). Each generation keeps its own
  transformers `DynamicCache`; the caches are left-padded to a common length and stacked, the
  step runs with an attention mask and per-row positions, and each row's new key/value goes
  back into its own cache through the cache's own `update`. A waiting step also waits up to
  GATHER_SECONDS for the other running generations, so they stay in step;
- prefills of new generations, and
- traces (the instrumented forward of Explore): both right-padded. With causal attention a
  token never sees the padding after it, so no mask is needed and every row's activations are
  its solo activations (up to float rounding); each row is cut back to its own length.

A request alone runs exactly as before (nothing padded, no waiting). Tests check batched rows
against solo runs and against transformers.

Not batched (run alone): sliding-window caches, interventions (edits), a recorder already
active in the caller's context.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

from model_core import hooks

MAX_BATCH = 32
TOKEN_BUDGET = 4096  # padded tokens (rows x longest) per batched prefill or trace
GATHER_SECONDS = 0.020  # how long a decode step waits for the other running generations


@dataclass
class _Request:
    kind: str  # "decode" | "prefill" | "trace"
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

    def __init__(self, lm, max_batch: int = MAX_BATCH, gather_seconds: float = GATHER_SECONDS,
                 token_budget: int = TOKEN_BUDGET):
        self._lm = weakref.ref(lm)
        self.max_batch = max_batch
        self.gather_seconds = gather_seconds
        self.token_budget = token_budget
        self._cv = threading.Condition()
        self._pending: list[_Request] = []
        self._busy = False
        self._active = 0  # generations between their prefill and their last step
        self._writing_caches = False  # set by a batch once it starts writing per-request caches
        self.stats = BatchStats()

    # --- generations announce themselves, so a waiting decode step knows whom to wait for -----
    def enter(self) -> None:
        with self._cv:
            self._active += 1

    def leave(self) -> None:
        with self._cv:
            self._active -= 1
            self._cv.notify_all()

    # --- the three kinds ----------------------------------------------------------------------
    def decode(self, ids: torch.Tensor, cache, solo: Callable) -> torch.Tensor:
        """ids [1, 1], this generation's DynamicCache -> logits [V] float32; the cache grows by one.
        solo(lm, ids, cache) is the unbatched step."""
        return self._run(_Request("decode", (ids, cache), 1, lambda r: solo(self._lm(), *r.payload)))

    def prefill(self, ids: torch.Tensor, cache, solo: Callable) -> torch.Tensor:
        """ids [1, t] into an empty cache -> logits of the last position [V] float32."""
        return self._run(_Request("prefill", (ids, cache), ids.shape[1], lambda r: solo(self._lm(), *r.payload)))

    def trace(self, token_ids: list[int], layers: frozenset[int], solo: Callable):
        """-> (store, rope, logits [T, V]) of one instrumented forward, as `solo(token_ids, layers)`."""
        return self._run(_Request("trace", (token_ids, layers), len(token_ids), lambda r: solo(*r.payload)))

    # --- scheduling ---------------------------------------------------------------------------
    def _run(self, me: _Request):
        with self._cv:
            if not self._busy and not self._pending and not (me.kind == "decode" and self._active > 1):
                batch = [me]
                self._busy = True
            else:
                self._pending.append(me)
                self._cv.notify_all()  # a head waiting for the other generations' steps: here is one
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
        deadline = None
        while not me.done:
            if not self._busy and self._pending and self._pending[0] is me:
                if me.kind == "decode":
                    waiting = sum(r.kind == "decode" for r in self._pending)
                    if waiting < min(self._active, self.max_batch):  # others are on their way
                        now = time.monotonic()
                        deadline = deadline or now + self.gather_seconds
                        if now < deadline:
                            self._cv.wait(deadline - now)
                            continue
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
            if len(batch) == 1:
                self._alone(batch[0])
            else:
                run = {"decode": self._decode_batch, "prefill": self._prefill_batch, "trace": self._trace_batch}
                self._writing_caches = False
                try:
                    for r, res in zip(batch, run[batch[0].kind](batch)):
                        r.result = res
                except Exception:  # noqa: BLE001
                    # The batch failed (out of memory, say) before any cache was touched: each
                    # request alone may still succeed, and fails only with its own error.
                    if self._writing_caches:
                        raise
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
    def _decode_batch(self, batch: list[_Request]) -> list[torch.Tensor]:
        from model_core.generate import _cache_kwarg, new_cache

        lm = self._lm()
        caches = [r.payload[1] for r in batch]
        lens = [c.get_seq_length() for c in caches]
        T = max(lens)
        stacked = new_cache(lm)
        with torch.inference_mode():
            for l in range(len(caches[0].layers)):
                ks = [F.pad(c.layers[l].keys, (0, 0, T - n, 0)) for c, n in zip(caches, lens)]
                vs = [F.pad(c.layers[l].values, (0, 0, T - n, 0)) for c, n in zip(caches, lens)]
                stacked.update(torch.cat(ks), torch.cat(vs), l)
            dev = lm.device
            mask = torch.zeros(len(batch), T + 1, dtype=torch.long, device=dev)
            for i, n in enumerate(lens):
                mask[i, T - n:] = 1
            out = lm.model(input_ids=torch.cat([r.payload[0].to(dev) for r in batch]), attention_mask=mask,
                           position_ids=torch.tensor(lens, device=dev)[:, None], use_cache=True,
                           logits_to_keep=1, **{_cache_kwarg(lm.model): stacked})
            logits = out.logits[:, -1].float()
            new = [(stacked.layers[l].keys[:, :, -1:], stacked.layers[l].values[:, :, -1:])
                   for l in range(len(caches[0].layers))]
            self._writing_caches = True  # from here on a failure cannot be retried alone
            for l, (k, v) in enumerate(new):
                for i, c in enumerate(caches):
                    c.update(k[i: i + 1], v[i: i + 1], l)
        return [logits[i] for i in range(len(batch))]

    def _right_padded(self, seqs: list[list[int]]) -> tuple[torch.Tensor, list[int]]:
        lm = self._lm()
        lens = [len(s) for s in seqs]
        ids = torch.zeros(len(seqs), max(lens), dtype=torch.long, device=lm.device)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = torch.as_tensor(s, dtype=torch.long)
        return ids, lens

    def _prefill_batch(self, batch: list[_Request]) -> list[torch.Tensor]:
        from model_core.generate import _cache_kwarg, new_cache

        lm = self._lm()
        ids, lens = self._right_padded([r.payload[0][0].tolist() for r in batch])
        stacked = new_cache(lm)
        with torch.inference_mode():
            keep = sorted({n - 1 for n in lens})
            # a plain list: accelerate moves tensor arguments to the first GPU, while a split
            # model's last layer (where the indices are used) may be on another
            out = lm.model(input_ids=ids, use_cache=True, **{_cache_kwarg(lm.model): stacked},
                           logits_to_keep=keep)
            logits = [out.logits[i, keep.index(n - 1)].float() for i, n in enumerate(lens)]
            self._writing_caches = True
            for l in range(len(stacked.layers)):
                k, v = stacked.layers[l].keys, stacked.layers[l].values
                for i, (r, n) in enumerate(zip(batch, lens)):
                    r.payload[1].update(k[i: i + 1, :, :n], v[i: i + 1, :, :n], l)  # update copies
        return logits

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
                     if _layer_of(name) is None or _layer_of(name) in own}
            rope = {l: tuple(x[:1, :n].clone() for x in pe) for l, pe in rec.rope.items() if l in own}
            results.append((store, rope, out.logits[i, :n]))
        return results


def _layer_of(name: str) -> int | None:
    return int(name.split(".")[1]) if name.startswith("blocks.") else None


_BATCHERS: "weakref.WeakKeyDictionary[torch.nn.Module, ForwardBatcher]" = weakref.WeakKeyDictionary()
_BATCHERS_LOCK = threading.Lock()


def stats_for(lm) -> dict | None:
    """How many of this model's requests shared a forward (None before its first request)."""
    b = _BATCHERS.get(lm.model)
    return b.stats.as_dict() if b is not None else None


def max_batch_from_env() -> int:
    """LMSCOPE_MAX_BATCH: requests per shared forward (1 turns batching off)."""
    try:
        return max(1, int(os.environ.get("LMSCOPE_MAX_BATCH", "") or MAX_BATCH))
    except ValueError:
        return MAX_BATCH


def batcher_for(lm) -> ForwardBatcher:
    with _BATCHERS_LOCK:
        b = _BATCHERS.get(lm.model)
        if b is None:
            b = _BATCHERS[lm.model] = ForwardBatcher(lm, max_batch=max_batch_from_env())
        return b


def can_batch_model(lm) -> bool:
    """Can this model's requests share forwards here: a DynamicCache of full-attention layers only
    (sliding windows keep per-row windows), and no recorder or edits active in this context."""
    from model_core.generate import new_cache

    key = "_lmscope_batchable"
    if key not in lm.meta:
        from transformers.cache_utils import DynamicLayer

        layers = getattr(new_cache(lm), "layers", None)
        lm.meta[key] = bool(layers) and all(type(layer) is DynamicLayer for layer in layers)
    return lm.meta[key] and hooks.active_recorder() is None
