"""One inference engine per loaded model: a single thread owns every generation's torch work.

Request handlers (Gradio callbacks, the CLI, jobs) `submit` a generation and read its records
from a queue; they never run the model themselves. The engine thread loops:

  1. drop cancelled rows, admit waiting requests into free slots (a prefill each, within a token
     budget per loop so a long prompt cannot stall the running rows for long) and draw their
     first token from the prefill's logits;
  2. run one decode step for every running row at once (continuous batching: rows join and leave
     between any two steps), sampling and recording on the device (`model_core.serving.batch_sampling`);
  3. hand each row its packed record (one small host copy per step for the whole batch).

The KV cache is `model_core.serving.slot_cache.SlotCache`, preallocated. On CUDA the decode step (forward
+ sampling + records + advancing each row) is captured once per (rows, length, stages) bucket as a
CUDA graph at start, so a step is one graph launch instead of ~1,500 kernel launches from Python,
and the host processes step n's records while the GPU runs the next steps. "stages" is either
every sampling stage or none (every running row greedy without a repetition penalty): the records
are the same, the sorts and draws of unused filters are skipped.

Compiled (LMSCOPE_COMPILE, on by default on CUDA): a background thread compiles the forward and the
sampling with inductor (one graph for one row, one for any other number of rows and any length,
on scratch buffers of the live ones' shapes) while the graphs above serve; the engine thread then
re-captures every bucket from the compiled step, one per loop, and swaps it in.

On a CPU (LMSCOPE_RECORD_STEPS, on) the decode step, one-row prefills and Explore's traces are
replayed from TorchScript recordings (`model_core.serving.torchscript_replay`) per bucket instead: a replay holds
no interpreter lock while it runs, where the eager step waits for it after each torch call.

Run alone instead (`model_core.serving.generate` keeps its own path for these): edits or a recorder active
in the caller's context, models split over several GPUs, a non-default
number of recorded candidates.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import os
import queue
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from model_core.core import hooks, settings
from model_core.core.cache_api import cache_kwarg, new_cache, sliding_window_of
from model_core.core.cpu_threads import start_thread
from model_core.core.heap import freeze_heap
from model_core.serving import decode_attention
from model_core.serving.batch_sampling import (
    ALL_STAGES,
    RowSettings,
    packed_width,
    sample_rows,
    stages_in_use,
)
from model_core.serving.cuda_prefill_graphs import (
    CPU_LENGTHS,
    FlatCache,
    PrefillGraphs,
    eager_prefill,
    flat_prefill,
)
from model_core.serving.slot_cache import SlotCache
from model_core.serving.torchscript_replay import TracedSteps, buffer_tensors

RECORDED = 10  # candidates recorded per step (generate.TOP_K_RECORDED)
PREFILL_BUDGET = 2048  # prompt tokens admitted per engine loop
MIN_LENGTH_BUCKET = 128
SWITCH_INTERVAL = 0.0005  # seconds (sys.setswitchinterval)
LOOKAHEAD = 1  # launches ahead of the one whose records are handed out (CUDA)
# Decode steps per launch (CUDA): one captured graph runs this many steps back to back and its
# records come back in one copy. Every launch needs the interpreter a few times (each torch call
# drops the GIL and must win it back from the request threads turning records into text); at 32
# rows one step per launch left the engine waiting behind them (docs/PERFORMANCE.md). Rows join
# and leave between launches; a row ends exactly at its last token on the device (RowSettings.step
# against its limit) and at most 2 x this - 1 steps late after EOS, a stop string or a cancel
# (the launch in flight and the one after it).
STEPS_PER_LAUNCH = 4
GREEDY_ONLY = frozenset()  # the stages when every running row is greedy without a penalty


@dataclass
class EngineRequest:
    ids: list[int]  # the prompt
    n_steps: int  # tokens to produce at most
    settings: object  # SamplingSettings (validated)
    seed: int
    eos: set[int]
    keep_logits: bool = False
    keep_probs: bool = False
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
class _Row:
    req: EngineRequest
    slot: int
    emitted: int = 0  # records handed out
    launched: int = 0  # records produced or on their way (the prefill's first token included)
    tokens: int = 0  # tokens in the cache once the pending step is done
    t_last: float = 0.0
    done: bool = False


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
    compiled_steps: int = 0  # steps run by the compiled step (a re-captured graph, or compiled eagerly)
    warmup_s: float = 0.0
    compile_s: float = 0.0
    busy_s: float = 0.0
    launch_s: float = 0.0  # host time launching steps
    wait_s: float = 0.0  # host time waiting for the device's records (the host ahead of the device)
    hand_out_s: float = 0.0  # host time turning records into each request's queue
    started: float = field(default_factory=time.perf_counter)

    def as_dict(self, engine: Engine) -> dict:
        up = time.perf_counter() - self.started
        return {"steps": self.steps, "tokens": self.tokens, "admitted": self.admitted,
                "mean_batch": round(self.tokens / self.steps, 2) if self.steps else 0.0,
                "batch_sizes": {str(k): v for k, v in sorted(self.batch_sizes.items())},
                "mean_queue_wait_s": round(self.queue_wait_s / self.admitted, 4) if self.admitted else 0.0,
                "prefills": self.prefills, "captured_prefills": self.captured_prefills,
                "mean_prefill_ms": round(1000 * self.prefill_s / self.prefills, 2) if self.prefills else 0.0,
                "recent_prefills": [list(p) for p in self.recent_prefills],
                "tokens_per_s_busy": round(self.tokens / self.busy_s, 1) if self.busy_s else 0.0,
                "slots": engine.slots, "slots_in_use": len(engine._rows), "waiting": len(engine._pending),
                "cuda_graphs": self.graphs, "compiled": engine.compile_state,
                "recorded_steps": engine._recorded.stats() if engine._recorded is not None else None,
                "compiled_graphs": self.compiled_graphs, "compiled_steps": self.compiled_steps, "warmup_s": round(self.warmup_s, 1),
                "compile_s": round(self.compile_s, 1),
                "host_ms_per_step": {k: round(1000 * getattr(self, k + "_s") / self.steps, 3) if self.steps else 0.0
                                     for k in ("launch", "wait", "hand_out")},
                "uptime_s": round(up, 1)}


def _mark_dynamic(*dims) -> None:
    """(tensor, dim) pairs a compiled step treats as sizes that vary (rows, positions). A size of 1 is
    left alone: one row gets its own graph (torch specializes sizes 0 and 1 anyway)."""
    for t, d in dims:
        if t.shape[d] > 1:
            torch._dynamo.maybe_mark_dynamic(t, d)


def _buckets(limit: int) -> list[int]:
    out, b = [], 1
    while b < limit:
        out.append(b)
        b *= 2
    return out + [limit]


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
                 sliding_window: int | None = None) -> StepBuffers:
        def zeros(*shape, dtype=torch.float32):
            return torch.zeros(*shape, dtype=dtype, device=device)

        return cls(SlotCache(shapes, slots, max_len, dtype, device, sliding_window), zeros(slots, dtype=torch.long),
                   zeros(slots, dtype=torch.long), zeros(slots, dtype=torch.bool), zeros(slots, dtype=torch.long),
                   zeros(slots, vocab, dtype=torch.bool), RowSettings.empty(slots, device),
                   zeros(steps, slots, packed_width(RECORDED)), zeros(steps, slots, vocab), zeros(steps, slots, vocab))


class Engine:
    """Owns a model's generation work on one thread. Create through `engine_for(lm)`."""

    def __init__(self, lm, slots: int, max_len: int, use_graphs: bool | None = None, compile: bool | None = None,
                 kv_cache_mb: int | None = None, steps_per_launch: int | None = None, record_steps: bool | None = None):
        self._lm = weakref.ref(lm)
        self.name = lm.name
        self.device, self.dtype = lm.device, lm.dtype
        self.slots, self.max_len = slots, max_len
        self.vocab = lm.shape.vocab_size
        self.use_graphs = (self.device.type == "cuda") if use_graphs is None else use_graphs
        # compile (None: on with CUDA graphs): see the module docstring
        self.compile = self.use_graphs if compile is None else bool(compile)
        self.compile_state = "compiling" if self.compile else "off"  # -> capturing -> ready | failed: ...
        # the CPU's decode steps and prefills replayed from TorchScript recordings
        # (model_core.serving.torchscript_replay; LMSCOPE_RECORD_STEPS through engine_for)
        self.record_steps = bool(record_steps) and not self.use_graphs
        self._recorded: TracedSteps | None = None
        self._trace_layouts: dict[tuple, tuple] = {}  # recorded trace key -> (capture names, rotary layers)
        self._kv_cache_mb = kv_cache_mb  # None: LMSCOPE_KV_CACHE_MB (kv_budget_bytes)
        self._fast_forward = None  # compiled callables, once the compile thread has them
        self._fast_sample: dict[frozenset, object] = {}  # stage set -> compiled sample_rows
        self._fast_ready = threading.Event()
        self._scratch: StepBuffers | None = None
        self._to_capture: list[tuple] = []  # buckets left to re-capture from the compiled step
        self._compiled_keys: set[tuple] = set()  # buckets whose graph is the compiled step's
        self.lookahead = LOOKAHEAD if self.use_graphs else 0
        # (None: STEPS_PER_LAUNCH with CUDA graphs; eager launches gain nothing from it)
        self.steps_per_launch = steps_per_launch or (STEPS_PER_LAUNCH if self.use_graphs else 1)
        self.stats = EngineStats()
        self._cv = threading.Condition()
        self._pending: list[EngineRequest] = []
        self._rows: dict[int, _Row] = {}  # slot -> row
        self._stop = False
        self._held = False
        self._idle = threading.Event()
        self.live: StepBuffers | None = None
        self._graphs: dict[tuple[int, int, frozenset], torch.cuda.CUDAGraph] = {}
        self._prefill_graphs: PrefillGraphs | None = None  # short prompts' prefills (CUDA)
        # Request threads turn records into text while this thread launches steps: with Python's
        # default 5 ms GIL switch interval a waiting thread can stall a whole decode step.
        sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL))
        # Set while request threads may run (take their steps, their callers' loops). With CUDA graphs this thread clears it
        # while it admits, launches and hands out, and sets it while it waits for the device: each of
        # its torch calls drops the GIL, and with 32 request threads running it waited behind them for
        # each one (docs/PERFORMANCE.md). Request threads wait for it when new records arrive (bounded: see
        # model_core.serving.generate). Eager steps run on this thread's own time: there it stays set.
        self.request_turn = threading.Event()
        self.request_turn.set()
        self._gate = self.use_graphs
        self.ready = threading.Event()
        self.start_error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name=f"lmscope-engine-{lm.name}", daemon=True)
        start_thread(self._thread)  # at full priority, even for an engine a request thread creates

    # --- client side ----------------------------------------------------------------------------
    def submit(self, req: EngineRequest) -> EngineRequest:
        with self._cv:
            if self._stop:
                raise RuntimeError("The model was unloaded; try again.")
            self._pending.append(req)
            self._cv.notify_all()
        return req

    @contextlib.contextmanager
    def hold(self):
        """Admit no new request until the block ends (running rows go on): requests submitted
        meanwhile start together in one step (tests, benchmarks)."""
        with self._cv:
            self._held = True
        try:
            yield self
        finally:
            with self._cv:
                self._held = False
                self._cv.notify_all()

    def waiting(self) -> int:
        with self._cv:
            return len(self._pending)

    def wait_compiled(self, timeout: float | None = None) -> bool:
        """Wait until the compiled step serves every bucket (or compiling failed or is off);
        True when it serves."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.compile_state in ("compiling", "capturing"):
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return self.compile_state == "ready"

    def quiesce(self, timeout: float = 5.0) -> bool:
        """Cancel every request and wait until the thread waits for work (nothing of torch running),
        so the process can exit without this thread inside torch."""
        with self._cv:
            self._held = True
            for r in self._pending:
                r.cancel()
            for row in self._rows.values():
                row.req.cancel()
            self._cv.notify_all()
        return self._idle.wait(timeout) if self._thread.is_alive() else True

    def close(self) -> None:
        """Stop the thread and wait until it has ended. A thread that ends while the interpreter
        finalizes (freeing tensors, so releasing the GIL) aborts the process, so the end is waited
        for here; during finalization itself the thread is left parked instead."""
        if sys.is_finalizing():
            return
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=30)
        if self._recorded is not None:
            self._recorded.close()

    def stats_dict(self) -> dict:
        return self.stats.as_dict(self)

    # --- the engine thread ----------------------------------------------------------------------
    def _main(self) -> None:
        if self.device.type == "cpu":  # the decode step on part of the cores: see engine_threads
            from model_core.core.cpu_threads import limit_this_thread

            limit_this_thread(engine_threads())
        try:
            t0 = time.perf_counter()
            with torch.inference_mode():
                self._allocate()
                if self.use_graphs:
                    self._capture_all()
                elif self.record_steps:
                    self._live_inputs = tuple(buffer_tensors(self.live))  # a recorded step's inputs
                    self._recorded = TracedSteps(self._lm().model, self._recipe, self.name)
            freeze_heap()
            self.stats.warmup_s = time.perf_counter() - t0
        except BaseException as e:  # noqa: BLE001 - requests run on the plain path instead
            self.start_error = e
            self.compile_state = "off"
            print(f"lmscope: the inference engine for {self.name} could not start "
                  f"({type(e).__name__}: {e}); generation runs one request at a time", file=sys.stderr)
        if self.start_error is None and self.compile:
            threading.Thread(target=self._compile, name=f"lmscope-compile-{self.name}", daemon=True).start()
        self.ready.set()
        pipeline: list = []  # launched steps whose records are not yet handed out
        while True:
            with self._cv:
                while not self._stop and not (self._pending and not self._held) and not self._rows \
                        and not pipeline and not self._capture_due():
                    self._idle.set()
                    self._cv.wait()
                self._idle.clear()
                if self._stop:
                    break
                new = [] if self._held else self._take_pending()
            if self.start_error is not None:
                for r in new:
                    self._fail(r, self.start_error)
                continue
            t0 = time.perf_counter()
            if self._gate:
                self.request_turn.clear()
            try:
                with torch.inference_mode():
                    if self._capture_due():
                        self.request_turn.set()  # a capture can take a second: no one waits on it
                        self._capture_next()
                        if self._gate:
                            self.request_turn.clear()
                    self._drop_cancelled()
                    if new:
                        self._admit_all(new)
                    if self._launchable():
                        pipeline.append(self._launch())
                    # the records of the step `lookahead` steps before the one just launched
                    while pipeline and (len(pipeline) > self.lookahead or not self._launchable()):
                        self._hand_out(pipeline.pop(0))
            except BaseException as e:  # noqa: BLE001 - a failed step fails the rows in it, not the engine
                pipeline.clear()
                with torch.inference_mode():  # _free writes the buffers (inference tensors)
                    for row in list(self._rows.values()):
                        self._fail(row.req, e)
                        self._free(row)
                self._rows.clear()
            finally:
                self.request_turn.set()
            self.stats.busy_s += time.perf_counter() - t0
        for row in list(self._rows.values()):
            self._fail(row.req, RuntimeError("The model was unloaded; try again."))
        for r in self._pending:
            self._fail(r, RuntimeError("The model was unloaded; try again."))

    def _take_pending(self) -> list[EngineRequest]:
        free = self.slots - len(self._rows)
        taken, budget = [], PREFILL_BUDGET
        while self._pending and free > 0 and (not taken or budget >= len(self._pending[0].ids)):
            r = self._pending.pop(0)
            budget -= len(r.ids)
            free -= 1
            taken.append(r)
        return taken

    def _launchable(self) -> list[_Row]:
        """Rows that need another step: not finished, and not all their tokens already launched."""
        return [r for r in self._rows.values() if not r.done and r.launched < r.req.n_steps]

    def _fail(self, req: EngineRequest, e: BaseException) -> None:
        req.error = e
        req.out.put(None)

    def _allocate(self) -> None:
        lm = self._lm()
        probe = new_cache(lm)
        lm.model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=self.device), use_cache=True,
                 logits_to_keep=1, **{cache_kwarg(lm.model): probe})
        self._shapes = [(l.keys.shape[1], l.keys.shape[3]) for l in probe.layers]
        per_slot = sum(2 * h * d for h, d in self._shapes) * self.max_len * torch.empty((), dtype=self.dtype).element_size()
        self.slots = max(1, min(self.slots, kv_budget_bytes(self.device, self._kv_cache_mb) // per_slot))
        self._sliding_window = sliding_window_of(lm)
        self.live = StepBuffers.allocate(self._shapes, self.slots, self.max_len, self.vocab, self.dtype, self.device,
                                         self.steps_per_launch, self._sliding_window)
        self.layer_bytes_per_token = self.live.cache.layer_bytes_per_token()
        S, dev = self.slots, self.device
        # a ring of host buffers for the steps in flight, with a numpy view and an event each: every
        # torch call on this thread lets the request threads take the interpreter (they hold it
        # while turning records into text), so a step makes as few as it can
        self._pinned = [torch.zeros(self.steps_per_launch, S, packed_width(RECORDED), pin_memory=dev.type == "cuda")
                        for _ in range(self.lookahead + 2)]
        self._pinned_np = [b.numpy() for b in self._pinned]
        self._events = [torch.cuda.Event() if dev.type == "cuda" else None for _ in self._pinned]
        self._launches = 0
        self._rows_buckets = _buckets(S)
        self._length_buckets = [b for b in _buckets(self.max_len) if b >= MIN_LENGTH_BUCKET] or [self.max_len]

    # --- admission: prefill + the first token ----------------------------------------------------
    def _admit_all(self, reqs: list[EngineRequest]) -> None:
        """Prefill every admitted request in one right-padded forward (causal attention never sees
        the padding after a row's last token, so each row's keys, values and last logits are its
        solo ones up to float rounding), draw each first token, and start the rows. If the batch
        fails, each request is tried alone and fails only with its own error."""
        live = []
        for r in reqs:
            self.stats.queue_wait_s += time.perf_counter() - r.submitted
            self.stats.admitted += 1
            if r.cancelled.is_set():
                r.out.put(None)
            elif len(r.ids) + r.n_steps > self.max_len:
                self._fail(r, ValueError(f"The prompt plus new tokens exceed this server's {self.max_len}-token slots."))
            else:
                live.append(r)
        if len(live) > 1:
            try:
                self._prefill(live)
                return
            except Exception:  # noqa: BLE001 - retried one by one below
                for slot in [s for s, row in self._rows.items() if row.req in live]:
                    self._free(self._rows[slot])
        for r in live:
            try:
                self._prefill([r])
            except BaseException as e:  # noqa: BLE001 - this request fails alone
                self._fail(r, e)

    def _prefill(self, reqs: list[EngineRequest]) -> None:
        lm, b = self._lm(), self.live
        t0 = time.perf_counter()
        free = sorted(set(range(self.slots)) - set(self._rows))
        slots = free[: len(reqs)]
        lens = [len(r.ids) for r in reqs]
        ids = torch.tensor([r.ids + [0] * (max(lens) - n) for r, n in zip(reqs, lens)]).to(self.device)  # [N, T]
        idx = torch.tensor(slots, device=self.device)
        if self._recorded is not None and max(lens) <= CPU_LENGTHS[-1]:
            logits = self._prefill_by_row(ids, lens, idx)  # [N, V]
        else:
            captured = None if self._prefill_graphs is None else self._prefill_graphs.run(ids, lens)
            if captured is not None:
                pre, logits = captured  # [N, V]
                self.stats.captured_prefills += 1
            else:
                pre, logits = eager_prefill(lm, ids, lens)  # [N, V]
            # every row at once (one copy per layer and per settings field: 32 users arriving together
            # would otherwise be ~2,000 small copies before anyone's first token)
            b.cache.load_rows(idx, pre, max(lens))
            del pre
        b.row_settings.set_rows(idx, [r.settings for r in reqs], [r.seed for r in reqs])
        in_prompt = (torch.arange(ids.shape[1], device=self.device)[None, :]
                     < torch.tensor(lens, device=self.device)[:, None])  # [N, T]: not padding
        b.seen[idx] = torch.zeros(len(reqs), self.vocab, dtype=torch.int32, device=self.device).scatter_add_(
            1, ids, in_prompt.int()) > 0
        st = RowSettings(*(getattr(b.row_settings, f)[idx] for f in RowSettings.__dataclass_fields__))
        chosen, packed, final = sample_rows(logits, st, b.seen[idx], RECORDED,
                                            stages_in_use(r.settings for r in reqs))
        b.tok_in[idx] = chosen
        b.pos[idx] = torch.tensor(lens, device=self.device)
        b.limit[idx] = torch.tensor([r.n_steps for r in reqs], device=self.device)
        b.row_settings.step[idx] = 1
        host = packed.tolist()
        now = time.perf_counter()
        going_on, puts = [], []
        try:
            for i, (r, slot, n) in enumerate(zip(reqs, slots, lens)):
                row = _Row(req=r, slot=slot, launched=1, tokens=n, t_last=t0)
                self._rows[slot] = row
                r.first_token_at = now
                self._emit(row, host[i], puts, logits[i], final[i])
                if not row.done and row.launched < r.n_steps:
                    going_on.append(slot)
        finally:
            self._deliver(puts)
        if going_on:
            b.active[torch.tensor(going_on, device=self.device)] = True
        self.stats.prefills += 1
        self.stats.prefill_s += time.perf_counter() - t0
        self.stats.recent_prefills.append((len(reqs), sum(lens), round(1000 * (time.perf_counter() - t0), 1)))

    def _prefill_by_row(self, ids: torch.Tensor, lens: list[int], idx: torch.Tensor) -> torch.Tensor:
        """A CPU's prefill with recordings: each row alone, padded to its length bucket (on one
        thread a batched prefill costs what its rows cost one by one), replayed where that bucket
        is recorded and run eagerly at the same bucket until it is; each row's keys and values go
        to its slot. -> each row's last-position logits [N, V] float32."""
        lm, last = self._lm(), []
        for i, n in enumerate(lens):
            padded = self._padded_row(ids[i, :n])  # [1, T]
            flat = self._recorded.run(("prefill", 1, padded.shape[1]), (padded,))
            if flat is None:
                flat = flat_prefill(lm, padded)
            self.live.cache.load_rows(idx[i:i + 1], FlatCache(flat), n)
            last.append(flat[-1][:, n - 1])  # [1, d]
        return lm.adapter.logits_from_normed(torch.cat(last)).float()

    def _padded_row(self, ids) -> torch.Tensor:
        """One prompt's ids (a list or a 1-D tensor, at most CPU_LENGTHS[-1]) right-padded with
        zeros to its length bucket: [1, T], what a recorded prefill or trace takes."""
        n = len(ids)
        padded = torch.zeros(1, next(t for t in CPU_LENGTHS if t >= n), dtype=torch.long, device=self.device)
        padded[0, :n] = torch.as_tensor(ids, dtype=torch.long)
        return padded

    # --- one decode step for every running row ---------------------------------------------------
    def _steps(self, B: int, L: int, b: StepBuffers, stages: frozenset, fast: bool = False) -> None:
        """One launch: `steps_per_launch` decode steps back to back (a CUDA graph captures them all)."""
        for k in range(self.steps_per_launch):
            self._step(B, L, b, stages, fast, k)

    def _step(self, B: int, L: int, b: StepBuffers, stages: frozenset, fast: bool = False, k: int = 0) -> None:
        """Everything one decode step does, on the first B slots of `b`, attending over L positions,
        running the sampling stages `stages` (the records are complete either way), its records
        written to the launch's k-th place. Only tensor operations on preallocated buffers (a CUDA
        graph replays exactly this). fast: the compiled forward and sampling."""
        lm = self._lm()
        tok, pos, seen = b.tok_in[:B], b.pos[:B], b.seen[:B]
        act = b.active[:B] & (b.row_settings.step[:B] < b.limit[:B])  # [B]: rows that take this step
        # the token going in joins the context the repetition penalty sees
        seen.scatter_(1, tok[:, None], seen.gather(1, tok[:, None]) | act[:, None])
        mask = b.cache.window(B, L, pos)
        input_ids, position_ids = tok[:, None], pos[:, None]  # [B, 1]
        forward, sample, extra = lm.model, sample_rows, {}
        if fast:
            forward, sample = self._fast_forward, self._fast_sample.get(stages, sample_rows)
            extra = {decode_attention.SLOT_DECODE: True}
            masks = mask.values() if isinstance(mask, dict) else [mask]  # one per layer type with sliding windows
            _mark_dynamic((input_ids, 0), (position_ids, 0), *((m, d) for m in masks for d in (0, 3)),
                          (b.cache.write_pos, 0), (b.cache.span, 0))
        logits = forward(input_ids=input_ids, position_ids=position_ids, attention_mask=mask, use_cache=True,
                         logits_to_keep=1, **{cache_kwarg(lm.model): b.cache}, **extra).logits[:, -1].float()
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

    def _recipe(self, key: tuple):
        """What cpu_graphs records for a bucket: ("step", rows, length, stages) -> the eager decode
        step on scratch buffers of that length, and those buffers; ("prefill", rows, length) ->
        flat_prefill, and ids of that shape."""
        if key[0] == "step":
            _, B, L, stages = key
            b = self._scratch_for(L)

            def step(*_buffers) -> torch.Tensor:  # the buffers come in as the trace's inputs
                self._steps(B, L, b, stages)
                return b.out_packed

            return step, tuple(buffer_tensors(b))
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
        if self._recorded is None or n > CPU_LENGTHS[-1] or len(layers) != self._lm().shape.n_layers:
            return None  # (a subset of layers: rare, and each would be a recording of its own)
        ids = self._padded_row(token_ids)  # [1, T]
        key = ("trace", ids.shape[1], frozenset(layers))
        with torch.inference_mode():
            out = self._recorded.run(key, (ids,))
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
        if self._recorded is None:
            return
        L, rows = self._length_buckets[0], self._rows_buckets
        every_layer = frozenset(range(self._lm().shape.n_layers))
        self._recorded.want([("step", B, L, GREEDY_ONLY) for B in rows] + [("prefill", 1, T) for T in CPU_LENGTHS[:3]]
                            + [("trace", T, every_layer) for T in CPU_LENGTHS[:3]]
                            + [("step", B, L, ALL_STAGES) for B in rows] + [("prefill", 1, T) for T in CPU_LENGTHS[3:]])

    def _scratch_for(self, length: int) -> StepBuffers:
        """Buffers shaped as the live ones, for positions [0, length): what a recording steps."""
        return StepBuffers.allocate(self._shapes, self.slots, length, self.vocab, self.dtype, self.device,
                                    self.steps_per_launch, self._sliding_window)

    def _bucket(self, rows: list[_Row]) -> tuple[int, int]:
        top = max(r.slot for r in rows) + 1
        B = next(b for b in self._rows_buckets if b >= top)
        need = min(max(r.tokens for r in rows) + self.steps_per_launch, self.max_len)  # positions the launch attends over
        if not self.use_graphs and self._recorded is None:
            return B, need  # eager: exactly the positions in use
        return B, next(b for b in self._length_buckets if b >= need)

    def _stages(self, rows: list[_Row]) -> frozenset:
        used = stages_in_use(r.req.settings for r in rows)
        if not self.use_graphs and self._recorded is None and self.compile_state != "ready":
            return used  # eager: exactly the stages in use (compiled: the two sets it was compiled for)
        return GREEDY_ONLY if not used else ALL_STAGES

    def _launch(self):
        t0 = time.perf_counter()
        rows = self._launchable()
        B, L = self._bucket(rows)
        stages = self._stages(rows)
        graph = self._graphs.get((B, L, stages))
        fast = (B, L, stages) in self._compiled_keys if graph is not None else self.compile_state == "ready"
        if graph is not None:
            graph.replay()
        elif fast or self._recorded is None or self._recorded.run(("step", B, L, stages), self._live_inputs) is None:
            self._steps(B, L, self.live, stages, fast=fast)
        K = self.steps_per_launch
        self.stats.compiled_steps += K * fast
        ring = self._launches % len(self._pinned)
        self._launches += 1
        self._pinned[ring].copy_(self.live.out_packed, non_blocking=True)  # every step and slot: one call
        event = self._events[ring]
        if event is not None:
            event.record()
        want = [r for r in rows if r.req.keep_logits or r.req.keep_probs]
        extra = {r.slot: (self.live.out_logits[:, r.slot].to("cpu", copy=True),
                          self.live.out_final[:, r.slot].to("cpu", copy=True)) for r in want}
        useful = []  # per row, the launch's steps it takes (the device stops it at its limit)
        starts = [r.tokens for r in rows]  # per row, tokens in its cache before this launch
        for r in rows:
            n = min(K, r.req.n_steps - r.launched)
            useful.append(n)
            r.tokens += n
            r.launched += n
        self.stats.steps += K
        self.stats.tokens += sum(useful)
        self.stats.batch_sizes[len(rows)] = self.stats.batch_sizes.get(len(rows), 0) + K
        self.stats.launch_s += time.perf_counter() - t0
        return rows, useful, starts, B, ring, event, extra

    def _hand_out(self, launched) -> None:
        rows, useful, starts, B, ring, event, extra = launched
        t0 = time.perf_counter()
        if event is not None:
            if self._gate:  # the request threads' turn while the device works
                self.request_turn.set()
                event.synchronize()
                self.request_turn.clear()
            else:
                event.synchronize()
        t1 = time.perf_counter()
        host = self._pinned_np[ring][:, :B].tolist()  # [K][B] records
        puts: list = []
        try:
            for r, n, start in zip(rows, useful, starts):
                lg, fin = extra.get(r.slot, (None, None))
                for k in range(n):
                    if r.done:
                        break  # finished at a step before (seen only now: EOS, a cancel)
                    self._emit(r, host[k][r.slot], puts, None if lg is None else lg[k],
                               None if fin is None else fin[k], tokens_cached=start + k + 1)
        finally:  # rows that ended here are no longer the engine's to fail: theirs go out whatever happens
            self._deliver(puts)
        self.stats.wait_s += t1 - t0
        self.stats.hand_out_s += time.perf_counter() - t1

    def _emit(self, row: _Row, packed: list[float], puts: list, logits=None, final=None,
              tokens_cached: int | None = None) -> None:
        """Make a row's record (converted where the request asks) and add it to `puts`, the (queue,
        item) pairs _deliver puts once every row's are made; tokens_cached: the row's cache's tokens
        once this step's token was fed back (None: as the row stands, the prefill's record)."""
        req, now = row.req, time.perf_counter()
        chosen = int(packed[0])
        last = (chosen in req.eos or row.emitted + 1 >= req.n_steps or req.cancelled.is_set())
        rec = Record(index=row.emitted, packed=packed, seconds=now - row.t_last, tokens_cached=row.tokens if tokens_cached is None else tokens_cached,
                     last=last)
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
                self._free(row)
                req.error = e
                puts.append((req.out, None))
                return
        if last:
            self._free(row)
        puts.append((req.out, item))
        if last:
            puts.append((req.out, None))

    @staticmethod
    def _deliver(puts: list) -> None:
        """Queue what _emit made. Only now: a put wakes its request thread, which would take the
        interpreter from this one in the middle of a hand-out (32 times a launch at 32 users)."""
        for q, item in puts:
            q.put(item)

    def _free(self, row: _Row) -> None:
        row.done = True
        self.live.active[row.slot] = False
        self.live.pos[row.slot] = 0
        self._rows.pop(row.slot, None)

    def _drop_cancelled(self) -> None:
        for row in list(self._rows.values()):
            if row.req.cancelled.is_set() and not row.done:
                self._free(row)
                row.req.out.put(None)

    # --- CUDA graphs -----------------------------------------------------------------------------
    def _buckets_all(self) -> list[tuple[int, int, frozenset]]:
        """Every (rows, length, stages) bucket, largest first."""
        return [(B, L, st) for B in reversed(self._rows_buckets) for L in reversed(self._length_buckets)
                for st in (ALL_STAGES, GREEDY_ONLY)]

    def _capture_all(self) -> None:
        """Capture the decode step for every bucket, all slots idle (so the warm-up runs change no
        one's state), sharing one memory pool."""
        self._pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for B, L, st in self._buckets_all():
                self._steps(B, L, self.live, st)  # warm-up: allocations and lazy inits happen outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        for B, L, st in self._buckets_all():
            g = torch.cuda.CUDAGraph()
            with own_cublas_workspace(), torch.cuda.graph(g, pool=self._pool):
                self._steps(B, L, self.live, st)
            self._graphs[(B, L, st)] = g
            self.stats.graphs += 1
        torch.cuda.synchronize()
        lm = self._lm()
        if PrefillGraphs.usable(lm):
            try:
                graphs = PrefillGraphs(lm, self._rows_buckets, self.max_len)
                graphs.capture(own_cublas_workspace)
                self._prefill_graphs = graphs
            except Exception as e:  # noqa: BLE001 - prefills stay eager
                print(f"lmscope: capturing the prefill of {self.name} failed ({type(e).__name__}: {e}); "
                      "prefills run eagerly", file=sys.stderr)

    # --- compiling (its own thread), then re-capturing (this thread, one bucket per loop) ----------
    def _compile(self) -> None:
        """Compile the forward and the sampling with inductor on scratch buffers (the live ones stay
        the graphs' and the rows'), one row and two rows for each stage set: two forward graphs
        (one row; any rows and length) and four small sampling graphs. Then ask the engine thread to
        re-capture every bucket."""
        with _COMPILING:  # one engine compiles or captures at a time (dynamo's config is the process's)
            self._compile_locked()
        freeze_heap()  # compiling made a few hundred thousand objects more
        with self._cv:
            self._cv.notify_all()

    def _compile_locked(self) -> None:
        t0 = time.perf_counter()
        try:
            lm = self._lm()
            if self.device.type == "cpu":  # the engine thread's thread count (a compiled graph guards on it)
                from model_core.core.cpu_threads import limit_this_thread

                limit_this_thread(engine_threads())
            decode_attention.install()
            # rows and length vary (marked in _step); the weights, the cache and the vocabulary don't
            self._fast_forward = torch.compile(lm.model, dynamic=False)
            self._fast_sample = {GREEDY_ONLY: sample_rows, ALL_STAGES: sample_rows}  # compiled below
            stream = torch.cuda.Stream() if self.device.type == "cuda" else None
            with torch.inference_mode(), (torch.cuda.stream(stream) if stream else contextlib.nullcontext()):
                # inference tensors like the live ones (a compiled graph guards on the difference)
                scratch = StepBuffers.allocate(self._shapes, self.slots, self.max_len, self.vocab, self.dtype,
                                               self.device, self.steps_per_launch, self._sliding_window)
                shapes = [(B, st) for B in sorted({1, min(2, self.slots)}) for st in (ALL_STAGES, GREEDY_ONLY)]
                for B, st in shapes:
                    self._step(B, self._length_buckets[0], scratch, st, fast=True)
                # split_reductions off: with one row, inductor splits each reduction over the vocabulary
                # in two kernels and then trips an assertion fusing them (torch 2.11; bench/sampling.py)
                compiled = torch.compile(sample_rows, dynamic=False, options={"split_reductions": False})
                for st in (GREEDY_ONLY, ALL_STAGES):
                    self._fast_sample[st] = compiled
                    try:
                        for B in sorted({1, min(2, self.slots)}):
                            self._step(B, self._length_buckets[0], scratch, st, fast=True)
                    except Exception as e:  # noqa: BLE001 - an inductor failure: this stage set stays uncompiled
                        self._fast_sample[st] = sample_rows
                        print(f"lmscope: compiling the sampling of {self.name} for {'all stages' if st else 'greedy rows'} "
                              f"failed ({type(e).__name__}: {str(e)[:300]}); it runs uncompiled in the compiled step",
                              file=sys.stderr)
                # every bucket once more, here: anything the two shapes above did not cover compiles
                # now, off the engine thread (capturing there refuses to compile)
                for B, L, st in self._buckets_all() if self.use_graphs else []:
                    self._step(B, L, scratch, st, fast=True)
            if stream is not None:
                stream.synchronize()
            self._scratch = scratch
            self.stats.compile_s = time.perf_counter() - t0
            if self.use_graphs:
                self._to_capture = self._buckets_all()
                self._capture_pool = torch.cuda.graph_pool_handle()
                self.compile_state = "capturing"
            else:
                self._scratch = None
                self.compile_state = "ready"
        except BaseException as e:  # noqa: BLE001 - the uncompiled graphs go on serving
            self.compile_state = f"failed: {type(e).__name__}: {str(e)[:200]}"
            self._scratch = None
            print(f"lmscope: compiling the decode step of {self.name} failed ({type(e).__name__}: {e}); "
                  "the uncompiled step goes on serving", file=sys.stderr)
            traceback.print_exc(file=sys.stderr)

    def _capture_due(self) -> bool:
        return self.compile_state == "capturing" and bool(self._to_capture)

    def _capture_next(self) -> None:
        """Re-capture one bucket from the compiled step: warm it up on the scratch buffers (so running
        it changes no row), capture it on the live ones (capturing runs nothing), swap it in. A
        recompile here would mean the compiled graphs do not cover this bucket: give up on them."""
        if not _COMPILING.acquire(blocking=False):  # another engine is compiling: capture later
            time.sleep(0.01)
            return
        B, L, st = self._to_capture.pop(0)
        try:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch._dynamo.config.patch(error_on_recompile=True):
                with torch.cuda.stream(stream):
                    self._steps(B, L, self._scratch, st, fast=True)
                torch.cuda.current_stream().wait_stream(stream)
                g = torch.cuda.CUDAGraph()
                with own_cublas_workspace(), \
                        torch.cuda.graph(g, pool=self._capture_pool, capture_error_mode="thread_local"):
                    self._steps(B, L, self.live, st, fast=True)
            self._graphs[(B, L, st)] = g
            self._compiled_keys.add((B, L, st))
            self.stats.compiled_graphs += 1
        except BaseException as e:  # noqa: BLE001 - the uncompiled graphs go on serving
            self._to_capture.clear()
            self.compile_state = f"failed: {type(e).__name__}: {str(e)[:200]}"
            print(f"lmscope: capturing the compiled decode step of {self.name} failed ({type(e).__name__}: {e}); "
                  "the uncompiled step goes on serving", file=sys.stderr)
            traceback.print_exc(file=sys.stderr)
        finally:
            _COMPILING.release()
        if not self._to_capture:
            self._scratch = None
            if self.compile_state == "capturing":
                self.compile_state = "ready"
                self.stats.compile_s = time.perf_counter() - self.stats.started - self.stats.warmup_s


@contextlib.contextmanager
def own_cublas_workspace():
    """Around a CUDA-graph capture: cuBLAS keeps one workspace per (handle, stream) and the capture
    bakes its address into the graph. A workspace made before the capture (or in another graph's
    pool) can be freed under the graph: the uncompiled graphs' pool goes once the compiled ones
    replace them, and inductor's cudagraph trees (transformers' static-cache `generate`) clear the
    workspaces. Cleared before, the capture makes its own in its pool like any intermediate;
    cleared after, no later work shares it (as cudagraph trees record; docs/PERFORMANCE.md has the
    crash this is the likely cause of)."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()
    try:
        yield
    finally:
        if clear is not None:
            clear()


# ---------------------------------------------------------------------------------------------
# one engine per loaded model

_LOCK = threading.Lock()
_COMPILING = threading.Lock()  # see Engine._compile
_ALL: weakref.WeakSet[Engine] = weakref.WeakSet()


def _stop_all() -> None:
    """At exit, end every engine thread before the interpreter starts finalizing."""
    for eng in list(_ALL):
        eng.quiesce()
        eng.close()


# threading's own exit hook runs before the interpreter starts finalizing (atexit runs too late)
getattr(threading, "_register_atexit", atexit.register)(_stop_all)


def slots_from_env(device) -> int:
    """LMSCOPE_MAX_BATCH (default 32): the most rows of one decode step (the memory budget may allow fewer)."""
    return settings.current().max_batch


def engine_threads() -> int:
    """OpenMP threads of the engine thread's torch work on a CPU: LMSCOPE_ENGINE_THREADS, else half the
    cores (at least 1). On 2 cores a one-token decode step of the default model ran 19.5 tokens/s with
    a 2-thread team beside the web side's work and 21 with one (docs/PERFORMANCE.md)."""
    from model_core.core import settings

    return settings.current().engine_threads or max(1, (os.cpu_count() or 2) // 2)


def kv_budget_bytes(device, kv_cache_mb: int | None = None) -> int:
    """Memory for the engine's KV slots: kv_cache_mb (None: LMSCOPE_KV_CACHE_MB), else a quarter of
    the GPU's free memory or 512 MB of RAM (8 slots of 1,280 tokens for SmolLM2-135M in float32)."""
    mb = kv_cache_mb if kv_cache_mb is not None else settings.current().kv_cache_mb
    if mb:
        return int(mb) * 2**20
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0] // 4
    return 512 * 2**20


def can_use_engine(lm, enabled: bool | None = None) -> bool:
    """Whether generation may run on the model's engine (enabled None: LMSCOPE_ENGINE)."""
    if not (settings.current().engine if enabled is None else enabled):
        return False
    if getattr(lm.model, "hf_device_map", None) and len(set(lm.model.hf_device_map.values())) > 1:
        return False
    types = getattr(lm.model.config, "layer_types", None) or []
    if any(t not in ("full_attention", "sliding_attention") for t in types):
        return False
    return hooks.active_recorder() is None


def max_len_from_env(lm) -> int:
    """Tokens per slot: the longest prompt plus the most new tokens this server allows, within the
    model's context (LMSCOPE_MAX_PROMPT_TOKENS + LMSCOPE_MAX_NEW_TOKENS; longer requests run alone)."""
    s = settings.current()
    return min(s.max_prompt_tokens + s.max_new_tokens, int(lm.shape.context_length))


def engine_for(lm) -> Engine:
    """The model's engine, created on first use (kept in `lm.meta`; closed when the model is freed)
    with the settings of that moment: LMSCOPE_MAX_BATCH slots of max_len_from_env tokens,
    LMSCOPE_COMPILE, LMSCOPE_RECORD_STEPS (a CPU engine starts recording its first buckets)."""
    created = False
    with _LOCK:
        eng = lm.meta.get("engine")
        if eng is None:
            s = settings.current()
            eng = Engine(lm, slots_from_env(lm.device), max_len_from_env(lm), compile=s.compile,
                         kv_cache_mb=s.kv_cache_mb, record_steps=s.record_steps)
            created = True
            lm.meta["engine"] = eng
            _ALL.add(eng)
            # closed when the model is freed; at exit `_stop_all` closes it first
            weakref.finalize(lm, eng.close).atexit = False
    eng.ready.wait()
    if created:
        eng.record_ahead()
    return eng


def existing_engine(lm) -> Engine | None:
    return lm.meta.get("engine")
