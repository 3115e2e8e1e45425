"""Short prompts' prefills as CUDA graphs, one per (rows, length) bucket, for the engine.

Eager, a 24-token prefill of the default model is ~1,200 kernel launches and ~6,000 torch calls:
22-48 ms of host time on an H200 machine where the GPU works 3-4 ms, and each call needs the
interpreter, so with 32 request threads starting at once a prefill took up to 125 ms and was most
of their time to first token (docs/PERFORMANCE.md). A replay is one call.

Rows are right-padded to the bucket's length and the bucket's rows (padding rows are all token 0):
causal attention never lets a row's real positions see its padding or another row, so each row's
keys, values and last hidden state are its own, up to the rounding of a differently shaped matmul.
The captured forward is the decoder without its head (the hidden states of every position come
back); each row's last position goes through the adapter's unembedding (final logit softcapping
included) outside the graph. Longer prompts, and models with sliding-window layers, prefill eagerly.
Each bucket keeps its own outputs (its cache and hidden states: ~140 MB in all for the default
model in bf16, not counted in the KV budget); one shared output buffer would take the largest's.
"""

from __future__ import annotations

import contextlib
import weakref

import torch

from model_core.core.cache_api import cache_kwarg, full_prefill_cache, sliding_window_of

LENGTHS = (32, 64)  # prompt-length buckets captured; longer prompts prefill eagerly
MAX_ROWS = 32  # rows buckets captured: powers of two up to this (and the engine's slots)
# A CPU's recorded prefills (model_core.serving.torchscript_replay): one row each, padded to one of these lengths.
# A CPU prefill's time grows with its tokens (1 thread, the default model: 8 tokens 88 ms, 16 123,
# 32 170, 64 260), so the steps are finer than the GPU's, where a short prefill costs its launches.
CPU_LENGTHS = (8, 16, 24, 32, 48, 64)


def eager_prefill(lm, ids: torch.Tensor, lens: list[int]):
    """ids [N, T] right-padded -> (a DynamicCache keeping every position, each row's last-position
    logits [N, V] float32): one plain forward, what a captured prefill replaces and is checked against."""
    cache = full_prefill_cache(lm)
    keep = sorted({n - 1 for n in lens})
    out = lm.model(input_ids=ids, use_cache=True, logits_to_keep=keep, **{cache_kwarg(lm.model): cache}).logits
    return cache, torch.stack([out[i, keep.index(n - 1)] for i, n in enumerate(lens)]).float()


def decoder_prefill(lm, ids: torch.Tensor):
    """ids [N, T] -> (a DynamicCache keeping every position, the decoder's normed hidden states
    [N, T, d]): the forward without its head."""
    decoder = lm.model.base_model
    cache = full_prefill_cache(lm)
    out = decoder(input_ids=ids, use_cache=True, **{cache_kwarg(decoder): cache})
    return cache, out.last_hidden_state


def flat_prefill(lm, ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """decoder_prefill as tensors only (what a trace can return): (layer 0's keys, its values, layer
    1's keys, ..., hidden [N, T, d])."""
    cache, hidden = decoder_prefill(lm, ids)
    return (*(t for layer in cache.layers for t in (layer.keys, layer.values)), hidden)


class FlatCache:
    """flat_prefill's keys and values as the `.layers[l].keys / .values` that SlotCache.load_rows reads."""

    class Layer:
        def __init__(self, keys: torch.Tensor, values: torch.Tensor):
            self.keys, self.values = keys, values

    def __init__(self, flat: tuple[torch.Tensor, ...]):
        self.layers = [self.Layer(flat[i], flat[i + 1]) for i in range(0, len(flat) - 1, 2)]


class PrefillGraphs:
    def __init__(self, lm, rows_buckets: list[int], max_len: int):
        self._lm = weakref.ref(lm)  # as the engine holds it: an unloaded model is freed (and its engine closed)
        self.rows = [b for b in rows_buckets if b <= MAX_ROWS]
        self.lengths = [t for t in LENGTHS if t <= min(max_len, lm.shape.context_length)]
        self.ids = torch.zeros(max(self.rows), max(LENGTHS), dtype=torch.long, device=lm.device)  # static input
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, object, torch.Tensor]] = {}

    @staticmethod
    def usable(lm) -> bool:
        return lm.device.type == "cuda" and sliding_window_of(lm) is None

    def _forward(self, rows: int, length: int):
        """The decoder on the first rows x length static ids: (its DynamicCache, hidden [rows, length, d])."""
        return decoder_prefill(self._lm(), self.ids[:rows, :length])

    def capture(self, cublas_workspace=contextlib.nullcontext) -> None:
        """Capture every bucket, largest first, in a pool of their own (each bucket's outputs stay
        referenced, so no later capture reuses them). On the CPU (tests of the padding and the
        buckets) each bucket's forward runs eagerly at each prefill instead."""
        buckets = [(r, t) for r in reversed(self.rows) for t in reversed(self.lengths)]
        if self._lm().device.type != "cuda":
            self.graphs = {key: (None, None, None) for key in buckets}
            return
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for r, t in buckets:
                self._forward(r, t)  # warm-up: lazy inits and workspaces outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        for r, t in buckets:
            g = torch.cuda.CUDAGraph()
            with cublas_workspace(), torch.cuda.graph(g, pool=pool, capture_error_mode="thread_local"):
                cache, hidden = self._forward(r, t)
            self.graphs[(r, t)] = (g, cache, hidden)
        torch.cuda.synchronize()

    def bucket(self, n_rows: int, length: int) -> tuple[int, int] | None:
        r = next((b for b in self.rows if b >= n_rows), None)
        t = next((b for b in self.lengths if b >= length), None)
        return None if r is None or t is None or (r, t) not in self.graphs else (r, t)

    def run(self, ids: torch.Tensor, lens: list[int]):
        """ids [N, T] right-padded on the device -> (the DynamicCache of the bucket's rows, each
        row's last-position logits [N, V] float32), or None where no bucket holds it."""
        n, length = ids.shape
        key = self.bucket(n, length)
        if key is None:
            return None
        g, cache, hidden = self.graphs[key]
        r, t = key
        self.ids[:r, :t].zero_()
        self.ids[:n, :length].copy_(ids)
        if g is None:
            cache, hidden = self._forward(r, t)
        else:
            g.replay()
        last = hidden[torch.arange(n, device=ids.device), torch.tensor(lens, device=ids.device) - 1]  # [N, d]
        return cache, self._lm().adapter.logits_from_normed(last).float()
