"""The engine's decode step: forward, sampling and per-step records on preallocated buffers.

`DecodeStep` is only tensor operations on a `StepBuffers` (a CUDA graph or a TorchScript recording
replays exactly it: `model_core.serving.engine_cuda_graphs`, `model_core.serving.engine_cpu_replay`);
`StepLayout` holds the shapes every set of buffers and every bucket of an engine share. Launches of
the step and their hand-out are `model_core.serving.engine_launch`.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass

import torch

from model_core.core.cache_api import cache_kwarg
from model_core.core.hooks import Recorder, instrument, recording
from model_core.serving import decode_attention
from model_core.serving.batch_sampling import (
    ALL_STAGES,
    RowSettings,
    packed_width,
    sample_rows,
)
from model_core.serving.slot_cache import SlotCache

RECORDED = 10  # candidates recorded per step (generate.TOP_K_RECORDED)
MIN_LENGTH_BUCKET = 128
GREEDY_ONLY = frozenset()  # the stages when every running row is greedy without a penalty


def _mark_dynamic(*dims) -> None:
    """(tensor, dim) pairs a compiled step treats as sizes that vary (rows, positions). A size of 1 is
    left alone: one row gets its own graph (torch specializes sizes 0 and 1 anyway)."""
    for t, d in dims:
        if t.shape[d] > 1:
            torch._dynamo.maybe_mark_dynamic(t, d)


def _buckets(limit: int) -> list[int]:
    """Powers of two below limit, then limit: [1, 2, 4, ..., limit]."""
    out, b = [], 1
    while b < limit:
        out.append(b)
        b *= 2
    return out + [limit]


def compiled_forwards(model) -> tuple:
    """The decode step's forward compiled twice, each from a top frame of its own: one that leaves
    the hooks out (the plain step: one graph) and one that runs them between graphs (the edited
    step, `step_hooks`). Dynamo keeps compiled code per code object and tries the entries it has
    before compiling; a graph break leaves entries guarded only on what was read before it, which
    would serve a plain call from the edited path's pieces if the two shared a top frame."""
    def plain(**kwargs):
        return model(**kwargs)

    def with_hooks(**kwargs):
        return model(**kwargs)

    # the edited step's frames below a graph break get fresh tensors each call (the marks of
    # `_mark_dynamic` do not reach them): automatic dynamic sizes there, or every (layer, rows,
    # length) would be a compile of its own
    return torch.compile(plain, dynamic=False), torch.compile(with_hooks, dynamic=None)


@contextlib.contextmanager
def step_hooks(lm, compiled: bool, edits: dict | None):
    """Around a decode step's forward: the hooks active with `edits` (None: none, and a compiled
    forward leaves them out of its graph; {}: running, with no edit); compiled: the forward is the
    compiled one, which then runs them as plain Python between its graphs (hooks._hook)."""
    if edits is None:
        yield
        return
    inst = instrument(lm.adapter)
    if compiled:  # (an uncompiled step leaves it alone: a compile may be tracing on another thread)
        inst.compiled_hooks = True
    try:
        with recording(Recorder(capture=False, edits=edits)):
            yield
    finally:
        if compiled:
            inst.compiled_hooks = False


@dataclass
class StepBuffers:
    """Everything a decode step reads and writes, preallocated once: a captured graph holds these
    addresses. The engine has the live set; a compile warms up on a scratch set of the same shapes."""

    cache: SlotCache
    tok_in: torch.Tensor  # [S] int64: each slot's next input token
    pos: torch.Tensor  # [S] int64: where that token goes
    active: torch.Tensor  # [S] bool: the slot advances at the next step (while its step < limit)
    limit: torch.Tensor  # [S] int64: the slot's tokens at most (RowSettings.step counts those drawn)
    seen: torch.Tensor  # [S, V] bool: tokens in the slot's context (repetition penalty)
    row_settings: RowSettings
    out_packed: torch.Tensor  # [K, S, packed_width(RECORDED)]: each of a launch's K steps' records
    out_logits: torch.Tensor  # [K, S, V]
    out_final: torch.Tensor  # [K, S, V]

    @classmethod
    def allocate(cls, shapes, slots: int, max_len: int, vocab: int, dtype, device, steps: int = 1,
                 sliding_window: int | None = None, per_layer_type: bool = True) -> StepBuffers:
        def zeros(*shape, dtype=torch.float32):
            return torch.zeros(*shape, dtype=dtype, device=device)

        return cls(SlotCache(shapes, slots, max_len, dtype, device, sliding_window, per_layer_type), zeros(slots, dtype=torch.long),
                   zeros(slots, dtype=torch.long), zeros(slots, dtype=torch.bool), zeros(slots, dtype=torch.long),
                   zeros(slots, vocab, dtype=torch.bool), RowSettings.empty(slots, device, vocab),
                   zeros(steps, slots, packed_width(RECORDED)), zeros(steps, slots, vocab), zeros(steps, slots, vocab))


@dataclass(frozen=True)
class StepLayout:
    """The shapes an engine's step buffers share, fixed once its thread has sized the slots: what a
    scratch set, a capture or a recording needs to match the live buffers."""

    shapes: list[tuple[int, int]]  # per layer: (kv heads, head dim)
    slots: int
    max_len: int
    vocab: int
    dtype: torch.dtype
    device: torch.device
    steps_per_launch: int
    sliding_window: int | None
    per_layer_type: bool = True  # the model takes one mask per layer type (SlotCache.window)

    @property
    def rows_buckets(self) -> list[int]:
        return _buckets(self.slots)

    @property
    def length_buckets(self) -> list[int]:
        return [b for b in _buckets(self.max_len) if b >= MIN_LENGTH_BUCKET] or [self.max_len]

    def buffers(self, length: int | None = None) -> StepBuffers:
        """A set of buffers shaped as the live ones, for positions [0, length) (None: max_len)."""
        return StepBuffers.allocate(self.shapes, self.slots, length or self.max_len, self.vocab, self.dtype,
                                    self.device, self.steps_per_launch, self.sliding_window,
                                    self.per_layer_type)

    def buckets_all(self) -> list[tuple[int, int, frozenset]]:
        """Every (rows, length, stages) bucket, largest first."""
        return [(B, L, st) for B in reversed(self.rows_buckets) for L in reversed(self.length_buckets)
                for st in (ALL_STAGES, GREEDY_ONLY)]


class DecodeStep:
    """One decode step for the first B slots of a StepBuffers: the forward, the sampling and the
    records, then each row advanced. `fast_forward` and `fast_sample` are the compiled callables
    once a compile has made them (`model_core.serving.engine_cuda_graphs`)."""

    def __init__(self, lm, steps_per_launch: int, max_len: int):
        self._lm = weakref.ref(lm)  # as the engine holds it: an unloaded model is freed
        self.steps_per_launch = steps_per_launch
        self.max_len = max_len
        self.fast_forward = None
        self.fast_forward_hooks = None  # the compiled forward of edited steps (compiled_forwards)
        self.fast_sample: dict[frozenset, object] = {}  # stage set -> compiled sample_rows

    def steps(self, B: int, L: int, b: StepBuffers, stages: frozenset, fast: bool = False,
              edits: dict | None = None) -> None:
        """One launch: `steps_per_launch` decode steps back to back (a CUDA graph captures them all)."""
        for k in range(self.steps_per_launch):
            self.step(B, L, b, stages, fast, k, edits)

    def step(self, B: int, L: int, b: StepBuffers, stages: frozenset, fast: bool = False, k: int = 0,
             edits: dict | None = None) -> None:
        """Everything one decode step does, on the first B slots of `b`, attending over L positions,
        running the sampling stages `stages` (the records are complete either way), its records
        written to the launch's k-th place. Only tensor operations on preallocated buffers (a CUDA
        graph replays exactly this). fast: the compiled forward and sampling. edits: hook edits
        active in the forward (model_core.serving.engine_edits: per-row slots; {} runs the hooks with
        none, as a compile's warm-up of the edited step does); compiled, they run as plain Python
        between the compiled graphs (model_core.core.hooks._hook), the same graphs for any edits."""
        lm = self._lm()
        tok, pos, seen = b.tok_in[:B], b.pos[:B], b.seen[:B]
        act = b.active[:B] & (b.row_settings.step[:B] < b.limit[:B])  # [B]: rows that take this step
        # the token going in joins the context the repetition penalty sees
        seen.scatter_(1, tok[:, None], seen.gather(1, tok[:, None]) | act[:, None])
        if "presence_frequency" in stages:
            # ... and, being a generated token (the prefill drew the first), the counts of the presence
            # and frequency penalties; a launch where no row has them skips this (set_rows zeroes a
            # row's counts when it starts, so what is skipped is never read)
            b.row_settings.counts[:B].scatter_add_(1, tok[:, None], act[:, None].float())
        mask = b.cache.window(B, L, pos)
        input_ids, position_ids = tok[:, None], pos[:, None]  # [B, 1]
        forward, sample, extra = lm.model, sample_rows, {}
        if fast:
            forward = self.fast_forward if edits is None else self.fast_forward_hooks
            sample = self.fast_sample.get(stages, sample_rows)
            extra = {decode_attention.SLOT_DECODE: True}
            masks = mask.values() if isinstance(mask, dict) else [mask]  # one per layer type with sliding windows
            _mark_dynamic((input_ids, 0), (position_ids, 0), *((m, d) for m in masks for d in (0, 3)),
                          (b.cache.write_pos, 0), (b.cache.span, 0))
        with step_hooks(lm, fast, edits):
            logits = forward(input_ids=input_ids, position_ids=position_ids, attention_mask=mask, use_cache=True,
                             logits_to_keep=1, **{cache_kwarg(lm.model): b.cache}, **extra).logits[:, -1].float()  # [B, V]
        st = b.row_settings.rows(slice(0, B))
        if fast:
            _mark_dynamic((logits, 0), (seen, 0), *((getattr(st, f), 0) for f in RowSettings.__dataclass_fields__))
        chosen, packed, final = sample(logits, st, seen, RECORDED, stages)
        b.out_packed[k, :B].copy_(packed)
        b.out_logits[k, :B].copy_(logits)
        b.out_final[k, :B].copy_(final)
        tok.copy_(torch.where(act, chosen, tok))
        st.step.add_(act.long())
        pos.copy_(torch.where(act, (pos + 1).clamp(max=self.max_len - 1), pos))
