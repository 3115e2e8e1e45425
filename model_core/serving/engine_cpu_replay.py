"""The CPU engine's TorchScript recordings: decode steps, one-row prefills and Explore's traces.

On a CPU (LMSCOPE_RECORD_STEPS) the engine replays each bucket's call from a recording
(`model_core.serving.torchscript_replay`: a replay holds no interpreter lock while it runs, where
the eager step waits for it after each torch call). `CpuReplay` says what is recorded per bucket
key (its recipe) and replays on the live inputs:

  ("step", rows, length, stages)  the decode step (`engine_step.DecodeStep.steps`) on scratch buffers
  ("prefill", 1, length)          one prompt's prefill padded to its length bucket (CPU_LENGTHS)
  ("trace", length, layers)       Explore's instrumented forward of one row (model_core.interp.trace)

Until a bucket is recorded its call runs eagerly at the same bucket: the same computation, so a
request's tokens never depend on which ran.
"""

from __future__ import annotations

import weakref

import torch

from model_core.core import hooks
from model_core.serving.batch_sampling import ALL_STAGES
from model_core.serving.cuda_prefill_graphs import CPU_LENGTHS, FlatCache, flat_prefill
from model_core.serving.engine_edits import hook_edits, slot_tensors
from model_core.serving.engine_step import GREEDY_ONLY, DecodeStep, StepBuffers, StepLayout
from model_core.serving.slot_cache import SlotCache
from model_core.serving.torchscript_replay import TracedSteps, buffer_tensors


class CpuReplay:
    """An engine's recordings (`traced`, recorded on a thread of their own) and their replay."""

    def __init__(self, lm, decode: DecodeStep, layout: StepLayout, live: StepBuffers):
        self._lm = weakref.ref(lm)  # as the engine holds it: an unloaded model is freed
        self.decode, self.layout = decode, layout
        self.device = layout.device
        self._live_inputs = tuple(buffer_tensors(live))  # a recorded step's inputs
        self._trace_layouts: dict[tuple, tuple] = {}  # recorded trace key -> (capture names, rotary layers)
        self._edit_slots: dict[tuple, list] = {}  # edit signature -> the live slots it was last run with
        self.traced = TracedSteps(lm.model, self.recipe, lm.name)

    def close(self) -> None:
        self.traced.close()

    def run_step(self, B: int, L: int, stages: frozenset, signature: tuple = (), slots=()) -> bool:
        """Replay a launch's decode steps on the live buffers (and, for edited rows, the live edit
        slots of `signature`); False where that bucket is not recorded yet (the caller runs it
        eagerly; it is recorded meanwhile)."""
        if not signature:
            return self.traced.run(("step", B, L, stages), self._live_inputs) is not None
        self._edit_slots[signature] = list(slots)  # what the recipe records on (scratch copies of)
        inputs = self._live_inputs + tuple(slot_tensors(slots))
        return self.traced.run(("step", B, L, stages, signature), inputs) is not None

    def prefill_rows(self, ids: torch.Tensor, lens: list[int], idx: torch.Tensor, cache: SlotCache) -> torch.Tensor:
        """A CPU's prefill with recordings: each row alone, padded to its length bucket (on one
        thread a batched prefill costs what its rows cost one by one), replayed where that bucket
        is recorded and run eagerly at the same bucket until it is; each row's keys and values go
        to its slot of `cache`. -> each row's last-position logits [N, V] float32."""
        lm, last = self._lm(), []
        for i, n in enumerate(lens):
            padded = self.padded_row(ids[i, :n])  # [1, T]
            flat = self.traced.run(("prefill", 1, padded.shape[1]), (padded,))
            if flat is None:
                flat = flat_prefill(lm, padded)
            cache.load_rows(idx[i:i + 1], FlatCache(flat), n)
            last.append(flat[-1][:, n - 1])  # [1, d]
        return lm.adapter.logits_from_normed(torch.cat(last)).float()

    def padded_row(self, ids) -> torch.Tensor:
        """One prompt's ids (a list or a 1-D tensor, at most CPU_LENGTHS[-1]) right-padded with
        zeros to its length bucket: [1, T], what a recorded prefill or trace takes."""
        n = len(ids)
        padded = torch.zeros(1, next(t for t in CPU_LENGTHS if t >= n), dtype=torch.long, device=self.device)
        padded[0, :n] = torch.as_tensor(ids, dtype=torch.long)
        return padded

    def recipe(self, key: tuple):
        """What TracedSteps records for a bucket: ("step", rows, length, stages) -> the eager decode
        step on scratch buffers of that length, and those buffers; ("prefill", rows, length) ->
        flat_prefill, and ids of that shape; ("trace", ...) -> see _trace_recipe."""
        if key[0] == "step":
            B, L, stages = key[1:4]
            b = self.layout.buffers(L)  # shaped as the live ones, for positions [0, L)
            slots = [s.scratch() for s in self._edit_slots.get(key[4], [])] if len(key) > 4 else []
            edits = hook_edits(slots) if slots else None

            def step(*_buffers) -> torch.Tensor:  # the buffers (and edit slots) come in as the trace's inputs
                self.decode.steps(B, L, b, stages, edits=edits)
                return b.out_packed

            return step, tuple(buffer_tensors(b)) + tuple(slot_tensors(slots))
        if key[0] == "trace":
            return self._trace_recipe(key)
        _, rows, T = key
        return (lambda ids: flat_prefill(self._lm(), ids)), (torch.zeros(rows, T, dtype=torch.long, device=self.device),)

    def _trace_recipe(self, key: tuple):
        """("trace", length, layers): Explore's instrumented forward of one row (model_core.interp.trace)
        as tensors: every capture by name, then the rotary (cos, sin) per layer, then the logits.
        Which is which goes to `_trace_layouts[key]` when the tracer runs the forward."""
        _, T, layers = key
        lm = self._lm()
        hooks.instrument(lm.adapter)

        def forward(ids: torch.Tensor):
            rec = hooks.Recorder(layers=layers)
            with hooks.recording(rec):
                logits = self._lm().model(input_ids=ids, use_cache=False).logits  # [1, T, V]
            names, rope = sorted(rec.store), sorted(rec.rope)
            self._trace_layouts[key] = (names, [(l, len(rec.rope[l])) for l in rope])
            return (*(rec.store[n] for n in names), *(x for l in rope for x in rec.rope[l]), logits)

        return forward, (torch.zeros(1, T, dtype=torch.long, device=self.device),)

    def recorded_trace(self, token_ids: list[int], layers: frozenset):
        """Explore's instrumented forward of token_ids replayed from a recording (padded to its
        length bucket: causal attention never lets a position see the padding after it), as
        model_core.interp.trace's forward returns it: (captures [1, T, ...] by name, rotary per layer,
        logits [T, V]); None where it is not recorded (it is recorded meanwhile) or too long.
        Called on the request's thread: a replay holds no interpreter lock while it runs."""
        n = len(token_ids)
        if n > CPU_LENGTHS[-1] or len(layers) != self._lm().shape.n_layers:
            return None  # (a subset of layers: rare, and each would be a recording of its own)
        ids = self.padded_row(token_ids)  # [1, T]
        key = ("trace", ids.shape[1], frozenset(layers))
        with torch.inference_mode():
            out = self.traced.run(key, (ids,))
        if out is None:
            return None
        names, rope = self._trace_layouts[key]
        store = {name: out[j][:, :n] for j, name in enumerate(names)}  # views: the padding stays unread
        pe, j = {}, len(names)
        for layer, count in rope:
            pe[layer] = tuple(x[:, :n] for x in out[j: j + count])
            j += count
        return store, pe, out[-1][0, :n]

    def record_ahead(self) -> None:
        """Record (in the background) the buckets a CPU server's first users need: decode steps of
        every rows bucket over the shortest length, greedy and sampled, one-row prefills, and
        Explore's traces of short prompts (longer ones are recorded when first asked for). (A
        step's rows bucket is its highest slot's, not its count: under load rows come and go, and
        two rows can sit in slots 1 and 9.)"""
        L, rows = self.layout.length_buckets[0], self.layout.rows_buckets
        every_layer = frozenset(range(self._lm().shape.n_layers))
        self.traced.want([("step", B, L, GREEDY_ONLY) for B in rows] + [("prefill", 1, T) for T in CPU_LENGTHS[:3]]
                         + [("trace", T, every_layer) for T in CPU_LENGTHS[:3]]
                         + [("step", B, L, ALL_STAGES) for B in rows] + [("prefill", 1, T) for T in CPU_LENGTHS[3:]])
