"""What the engine's parts hand each other: a request and its records, a running row, the record of
one launch, and the engine's counters.

A request handler builds an `EngineRequest` and reads `Record`s from its queue (see
`model_core.serving.engine`); the scheduler keeps a `Row` per admitted request; a launch of decode
steps returns a `LaunchResult` that its hand-out turns into records once the device is done.
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch


@dataclass
class EngineRequest:
    ids: list[int]  # the prompt
    n_steps: int  # tokens to produce at most
    settings: object  # SamplingSettings (validated)
    seed: int
    eos: set[int]
    keep_logits: bool = False
    keep_probs: bool = False
    edits: dict | None = None  # {hook name: RowEdit} (model_core.core.row_edits), this request's rows only
    # records, then None. A C-level queue: a put and a get cost 0.15 us against queue.Queue's 3.3 us
    # on 2 cores, and one of each happens per token. Unbounded, yet never longer than n_steps
    # records, so a slow reader never blocks the engine.
    out: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    # Called on the engine thread with each Record, in order; what it returns is queued instead.
    # model_core.serving.generate turns records into steps and text here: on 32 request threads that work
    # kept this thread waiting for the GIL (docs/PERFORMANCE.md). An exception fails this request alone.
    convert: Callable[[Record], object] | None = None
    error: BaseException | None = None
    submitted: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None

    def cancel(self) -> None:
        self.cancelled.set()


@dataclass
class Record:
    index: int
    packed: list[float]
    seconds: float
    tokens_cached: int
    logits: torch.Tensor | None = None
    probs: torch.Tensor | None = None
    last: bool = False


@dataclass
class Row:
    """An admitted request in its slot of the KV cache."""

    req: EngineRequest
    slot: int
    emitted: int = 0  # records handed out
    launched: int = 0  # records produced or on their way (the prefill's first token included)
    tokens: int = 0  # tokens in the cache once the pending step is done
    t_last: float = 0.0
    done: bool = False


@dataclass
class LaunchResult:
    """One launch of decode steps, as its hand-out needs it once the device has run it."""

    rows: list[Row]  # the rows that took part, in launch order
    useful: list[int]  # per row, the launch's steps it takes (the device stops it at its limit)
    starts: list[int]  # per row, tokens in its cache before this launch
    rows_bucket: int  # B: the first B slots ran
    ring: int  # which host buffer of the ring the launch's records were copied into
    event: torch.cuda.Event | None  # recorded after that copy (CUDA), else None (the copy is done)
    # slot -> (logits [K, V], final [K, V]) on the host, for rows that keep them
    extra: dict[int, tuple[torch.Tensor, torch.Tensor]]


@dataclass
class EngineStats:
    steps: int = 0
    tokens: int = 0
    admitted: int = 0
    batch_sizes: dict = field(default_factory=dict)  # rows per step -> count
    queue_wait_s: float = 0.0
    prefills: int = 0  # prefill forwards (each admits one or more requests)
    prefill_s: float = 0.0  # host time in them, up to each admitted row's first record
    captured_prefills: int = 0  # of them, replays of a captured prefill (model_core.serving.cuda_prefill_graphs)
    recent_prefills: collections.deque = field(default_factory=lambda: collections.deque(maxlen=8))  # (rows, tokens, ms)
    graphs: int = 0
    compiled_graphs: int = 0
    edited_graphs: int = 0  # steps with edited rows captured (per bucket and edit signature)
    edited_compiled_graphs: int = 0  # ... of them from the compiled step
    edited_compile_s: float = 0.0  # the edited step's compile (after the plain step's)
    edited_eager_steps: int = 0  # decode steps with edited rows run eagerly (not captured / recorded yet)
    compiled_steps: int = 0  # steps run by the compiled step (a re-captured graph, or compiled eagerly)
    warmup_s: float = 0.0
    compile_s: float = 0.0
    busy_s: float = 0.0
    launch_s: float = 0.0  # host time launching steps
    wait_s: float = 0.0  # host time waiting for the device's records (the host ahead of the device)
    hand_out_s: float = 0.0  # host time turning records into each request's queue
    started: float = field(default_factory=time.perf_counter)

    def as_dict(self, engine) -> dict:
        """These counts with the state of `engine` (the Engine they count for), as /metrics shows them."""
        up = time.perf_counter() - self.started
        recorded = engine._recorded
        return {"steps": self.steps, "tokens": self.tokens, "admitted": self.admitted,
                "mean_batch": round(self.tokens / self.steps, 2) if self.steps else 0.0,
                "batch_sizes": {str(k): v for k, v in sorted(self.batch_sizes.items())},
                "mean_queue_wait_s": round(self.queue_wait_s / self.admitted, 4) if self.admitted else 0.0,
                "prefills": self.prefills, "captured_prefills": self.captured_prefills,
                "mean_prefill_ms": round(1000 * self.prefill_s / self.prefills, 2) if self.prefills else 0.0,
                "recent_prefills": [list(p) for p in self.recent_prefills],
                "tokens_per_s_busy": round(self.tokens / self.busy_s, 1) if self.busy_s else 0.0,
                "slots": engine.slots, "slots_in_use": len(engine.scheduler.rows),
                "waiting": len(engine.scheduler.pending),
                "cuda_graphs": self.graphs, "compiled": engine.compile_state,
                "recorded_steps": recorded.stats() if recorded is not None else None,
                "compiled_graphs": self.compiled_graphs, "edited_graphs": self.edited_graphs,
                "edited_compiled_graphs": self.edited_compiled_graphs,
                "edited_eager_steps": self.edited_eager_steps, "compiled_steps": self.compiled_steps, "warmup_s": round(self.warmup_s, 1),
                "compile_s": round(self.compile_s, 1), "edited_compile_s": round(self.edited_compile_s, 1),
                "host_ms_per_step": {k: round(1000 * getattr(self, k + "_s") / self.steps, 3) if self.steps else 0.0
                                     for k in ("launch", "wait", "hand_out")},
                "uptime_s": round(up, 1)}
