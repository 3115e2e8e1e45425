"""One inference engine per loaded model: a single thread owns every generation's torch work.

Request handlers (Gradio callbacks, the CLI, jobs) `submit` a generation and read its records
from a queue; they never run the model themselves. The engine thread loops:

  1. drop cancelled rows, admit waiting requests into free slots (a prefill each, within a token
     budget per loop so a long prompt cannot stall the running rows for long) and draw their
     first token from the prefill's logits;
  2. run one decode step for every running row at once (continuous batching: rows join and leave
     between any two steps), sampling and recording on the device (`model_core.serving.batch_sampling`);
  3. hand each row its packed record (one small host copy per step for the whole batch).

The parts, each in its own module (this one keeps the facade, the thread loop and the one engine
per model):

  scheduler            the waiting queue, the slots and the rows in them, each row's records
  engine_prefill       admission: the prefill and the first token of each admitted request
  engine_step          the decode step on preallocated buffers
  engine_edits         per-row edits (steering, clamps, ablations) in slots the step reads
  engine_launch        launches of the step for the running rows, and the hand-out of their records
  engine_cuda_graphs   the step as CUDA graphs per bucket; compiling it and re-capturing (CUDA)
  engine_cpu_replay    the step, prefills and Explore's traces as TorchScript recordings (CPU)
  engine_types         what they hand each other: requests, records, rows, a launch, the counters

The KV cache is `model_core.serving.slot_cache.SlotCache`, preallocated. On CUDA the decode step is
captured once per (rows, length, stages) bucket at start, and the host processes step n's records
while the GPU runs the next steps; with LMSCOPE_COMPILE (on by default on CUDA) a compiled step
replaces the graphs as it becomes ready. On a CPU (LMSCOPE_RECORD_STEPS, on) the decode step,
one-row prefills and Explore's traces are replayed from recordings per bucket instead.

Rows may carry edits (steering, feature clamps, zero ablations: `engine_edits`), run per row in
the same batched step. Run alone instead (`model_core.serving.generate` keeps its own path for
these): hook edits without a per-row form, a recorder active in the caller's context, models split
over several GPUs, a non-default number of recorded candidates.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys
import threading
import time
import weakref

import torch

from model_core.core import hooks, settings
from model_core.core.cache_api import cache_kwarg, new_cache, sliding_window_of
from model_core.core.cpu_threads import start_thread
from model_core.core.heap import freeze_heap
from model_core.serving.batch_sampling import ALL_STAGES
from model_core.serving.engine_cpu_replay import CpuReplay
from model_core.serving.engine_cuda_graphs import StepGraphs, capture_prefill_graphs, own_cublas_workspace
from model_core.serving.engine_edits import EditSlots
from model_core.serving.engine_fit import engine_fit
from model_core.serving.engine_launch import Launcher
from model_core.serving.engine_prefill import Admission
from model_core.serving.engine_step import (
    GREEDY_ONLY,
    MIN_LENGTH_BUCKET,
    RECORDED,
    DecodeStep,
    StepBuffers,
    StepLayout,
    _buckets,
    _mark_dynamic,
)
from model_core.serving.engine_types import EngineRequest, EngineStats, LaunchResult, Record
from model_core.serving.scheduler import PREFILL_BUDGET, Scheduler

# the names other code imports from here (the parts' own modules hold them)
__all__ = ["ALL_STAGES", "GREEDY_ONLY", "LOOKAHEAD", "MIN_LENGTH_BUCKET", "PREFILL_BUDGET", "RECORDED",
           "STEPS_PER_LAUNCH", "SWITCH_INTERVAL", "Engine", "EngineRequest", "EngineStats", "LaunchResult",
           "Record", "StepBuffers", "_buckets", "_mark_dynamic", "can_use_engine", "engine_for", "engine_threads",
           "existing_engine", "kv_budget_bytes", "max_len_from_env", "own_cublas_workspace", "slots_from_env"]

log = logging.getLogger(__name__)

# Read when an engine is made (bench/batching.py sets them on this module first).
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


class Engine:
    """Owns a model's generation work on one thread. Create through `engine_for(lm)`.

    The work is done by parts it owns: `scheduler` (made here: requests may arrive before the
    thread has sized the slots), `decode` and `step_graphs` (made here too), and once the thread
    has allocated the live buffers the admission, the launcher and, on a CPU with recordings, the
    replay."""

    def __init__(self, lm, slots: int, max_len: int, use_graphs: bool | None = None, compile: bool | None = None,
                 kv_cache_mb: int | None = None, steps_per_launch: int | None = None, record_steps: bool | None = None):
        self._lm = weakref.ref(lm)
        self.name = lm.name
        self.device, self.dtype = lm.device, lm.dtype
        self.max_len = max_len
        self.vocab = lm.shape.vocab_size
        self.use_graphs = (self.device.type == "cuda") if use_graphs is None else use_graphs
        # compile (None: on with CUDA graphs): see model_core.serving.engine_cuda_graphs
        self.compile = self.use_graphs if compile is None else bool(compile)
        # the CPU's decode steps and prefills replayed from TorchScript recordings
        # (model_core.serving.engine_cpu_replay; LMSCOPE_RECORD_STEPS through engine_for)
        self.record_steps = bool(record_steps) and not self.use_graphs
        self._kv_cache_mb = kv_cache_mb  # None: LMSCOPE_KV_CACHE_MB (kv_budget_bytes)
        self.lookahead = LOOKAHEAD if self.use_graphs else 0
        # (None: STEPS_PER_LAUNCH with CUDA graphs; eager launches gain nothing from it)
        self.steps_per_launch = steps_per_launch or (STEPS_PER_LAUNCH if self.use_graphs else 1)
        self.stats = EngineStats()
        self.scheduler = Scheduler(slots)
        self.decode = DecodeStep(lm, self.steps_per_launch, max_len)
        self.step_graphs = StepGraphs(lm, self.decode, self.stats, self.compile, self.use_graphs, self.scheduler.cv)
        self.layout: StepLayout | None = None  # these once the thread has allocated
        self.live: StepBuffers | None = None
        self._replay: CpuReplay | None = None
        self._admission: Admission | None = None
        self._launcher: Launcher | None = None
        self._idle = threading.Event()
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
        return self.scheduler.submit(req)

    @contextlib.contextmanager
    def hold(self):
        """Admit no new request until the block ends (running rows go on): requests submitted
        meanwhile start together in one step (tests, benchmarks)."""
        with self.scheduler.hold():
            yield self

    def waiting(self) -> int:
        with self.scheduler.cv:
            return len(self.scheduler.pending)

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
        self.scheduler.cancel_all()
        return self._idle.wait(timeout) if self._thread.is_alive() else True

    def close(self) -> None:
        """Stop the thread and wait until it has ended. A thread that ends while the interpreter
        finalizes (freeing tensors, so releasing the GIL) aborts the process, so the end is waited
        for here; during finalization itself the thread is left parked instead."""
        if sys.is_finalizing():
            return
        self.scheduler.stop()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=30)
        if self._replay is not None:
            self._replay.close()

    def stats_dict(self) -> dict:
        return self.stats.as_dict(self)

    def recorded_trace(self, token_ids: list[int], layers: frozenset):
        """Explore's instrumented forward replayed from a recording (CpuReplay.recorded_trace), or
        None: not recorded yet, too long, or no recordings on this engine."""
        return None if self._replay is None else self._replay.recorded_trace(token_ids, layers)

    def record_ahead(self) -> None:
        """Record (in the background) the buckets a CPU server's first users need (CpuReplay.record_ahead)."""
        if self._replay is not None:
            self._replay.record_ahead()

    @property
    def compile_state(self) -> str:
        """"compiling" -> "capturing" -> "ready" | "failed: ...", or "off" (StepGraphs.state)."""
        return self.step_graphs.state

    @property
    def slots(self) -> int:
        """Rows of one decode step: as asked, then as many as the KV budget allows once started."""
        return self.scheduler.slots

    # --- the parts' state, by the names tests and benchmarks read and set -------------------------
    @property
    def _recorded(self):
        return None if self._replay is None else self._replay.traced

    @property
    def _length_buckets(self) -> list[int]:
        return self.layout.length_buckets

    @property
    def _shapes(self) -> list[tuple[int, int]]:
        return self.layout.shapes

    @property
    def _graphs(self) -> dict:
        return self.step_graphs.graphs

    @property
    def _prefill_graphs(self):
        return self._admission.prefill_graphs

    @_prefill_graphs.setter
    def _prefill_graphs(self, graphs) -> None:
        self._admission.prefill_graphs = graphs

    @property
    def _fast_forward(self):
        return self.decode.fast_forward

    @_fast_forward.setter
    def _fast_forward(self, fn) -> None:
        self.decode.fast_forward = fn

    @property
    def _fast_sample(self) -> dict:
        return self.decode.fast_sample

    @_fast_sample.setter
    def _fast_sample(self, fns: dict) -> None:
        self.decode.fast_sample = fns

    def _step(self, *args, **kwargs) -> None:
        self.decode.step(*args, **kwargs)

    def _steps(self, *args, **kwargs) -> None:
        self.decode.steps(*args, **kwargs)

    # --- the engine thread ----------------------------------------------------------------------
    def _main(self) -> None:
        threads = engine_threads() if self.device.type == "cpu" else None
        if threads is not None:  # the decode step on part of the cores: see engine_threads
            from model_core.core.cpu_threads import limit_this_thread

            limit_this_thread(threads)
        self._start()
        if self.start_error is None and self.compile:
            self.step_graphs.start_compile(threads)
        self.ready.set()
        self._loop()
        self.scheduler.fail_everything()

    def _start(self) -> None:
        """Allocate the live buffers and make the parts that work on them: the graphs captured
        (CUDA) or the recorder started (a CPU with recordings). A step that cannot be captured (a
        family whose forward reads values back to the host, as some mixtures of experts route) runs
        eagerly instead; on any other failure every request runs on the plain path (generate checks
        start_error)."""
        t0 = time.perf_counter()
        try:
            try:
                self._start_parts()
            except Exception as e:  # noqa: BLE001 - retried without graphs, else the engine is off
                if not self.use_graphs:
                    raise
                log.warning("the decode step of %s cannot be captured as CUDA graphs (%s: %s); its engine runs "
                            "eager steps", self.name, type(e).__name__, e)
                self._eager_steps()
                self._start_parts()
            freeze_heap()
            self.stats.warmup_s = time.perf_counter() - t0
        except BaseException as e:  # noqa: BLE001 - requests run on the plain path instead
            self.start_error = e
            self.step_graphs.state = "off"
            log.warning("the inference engine for %s could not start (%s: %s); generation runs one request "
                        "at a time", self.name, type(e).__name__, e)

    def _start_parts(self) -> None:
        with torch.inference_mode():
            self._allocate()
            lm, prefill_graphs = self._lm(), None
            # captured and recorded prefills end in the adapter's unembedding of the last hidden
            # state; a family whose head does more prefills with its own forward (engine_fit)
            hidden_prefill = engine_fit(lm).hidden_prefill
            if self.use_graphs:
                self.step_graphs.capture_all()
                if hidden_prefill:
                    prefill_graphs = capture_prefill_graphs(lm, self.layout.rows_buckets, self.max_len)
            elif self.record_steps:
                self._replay = CpuReplay(lm, self.decode, self.layout, self.live)
            self._admission = Admission(lm, self.live, self.scheduler, self._replay if hidden_prefill else None,
                                        self.stats, self.max_len, self.vocab, self.edit_slots)
            self._admission.prefill_graphs = prefill_graphs
            self._launcher = Launcher(self.decode, self.layout, self.live, self.step_graphs, self._replay,
                                      self.scheduler, self.stats, self.lookahead, self.use_graphs,
                                      self.request_turn, self.edit_slots)

    def _eager_steps(self) -> None:
        """Give up the captured step and the compile (which re-captures): one eager step per launch,
        on fresh buffers (a failed capture may leave the live ones half written)."""
        lm = self._lm()
        self.use_graphs = self.compile = self._gate = False
        self.lookahead, self.steps_per_launch = 0, 1
        self.decode = DecodeStep(lm, 1, self.max_len)
        self.step_graphs = StepGraphs(lm, self.decode, self.stats, False, False, self.scheduler.cv)
        self.layout = self.live = None
        self.request_turn.set()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    def _allocate(self) -> None:
        """Size the slots within the KV budget (a probe forward gives each layer's cache shape) and
        allocate the live buffers."""
        lm = self._lm()
        probe = new_cache(lm)
        lm.model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=self.device), use_cache=True,
                 logits_to_keep=1, **{cache_kwarg(lm.model): probe})
        shapes = [(l.keys.shape[1], l.keys.shape[3]) for l in probe.layers]
        per_slot = sum(2 * h * d for h, d in shapes) * self.max_len * torch.empty((), dtype=self.dtype).element_size()
        slots = max(1, min(self.slots, kv_budget_bytes(self.device, self._kv_cache_mb) // per_slot))
        self.layout = StepLayout(shapes, slots, self.max_len, self.vocab, self.dtype, self.device,
                                 self.steps_per_launch, sliding_window_of(lm),
                                 getattr(lm.model.config, "layer_types", None) is not None)
        self.live = self.layout.buffers()
        self.edit_slots = EditSlots(slots, self.dtype, self.device, lambda: list(self.scheduler.rows), self.step_graphs)
        self.layer_bytes_per_token = self.live.cache.layer_bytes_per_token()
        self.scheduler.attach(self.live)
        self.step_graphs.attach(self.layout, self.live)

    def _loop(self) -> None:
        """Until close: wait for work, then admit, launch and hand out (see the module docstring)."""
        sched, graphs = self.scheduler, self.step_graphs
        pipeline: list[LaunchResult] = []  # launched steps whose records are not yet handed out
        while True:
            with sched.cv:
                while not sched.stopped and not sched.admissible() and not sched.rows \
                        and not pipeline and not graphs.capture_due():
                    self._idle.set()
                    sched.cv.wait()
                self._idle.clear()
                if sched.stopped:
                    break
                new = sched.take_pending()
            if self.start_error is not None:
                for r in new:
                    sched.fail(r, self.start_error)
                continue
            t0 = time.perf_counter()
            if self._gate:
                self.request_turn.clear()
            try:
                with torch.inference_mode():
                    if graphs.capture_due():
                        self.request_turn.set()  # a capture can take a second: no one waits on it
                        graphs.capture_next()
                        if self._gate:
                            self.request_turn.clear()
                    sched.drop_cancelled()
                    if new:
                        self._admission.admit_all(new)
                    rows = sched.launchable()
                    if rows:
                        pipeline.append(self._launcher.launch(rows))
                    # the records of the step `lookahead` steps before the one just launched
                    while pipeline and (len(pipeline) > self.lookahead or not sched.launchable()):
                        self._launcher.hand_out(pipeline.pop(0), self._gate)
            except BaseException as e:  # noqa: BLE001 - a failed step fails the rows in it, not the engine
                pipeline.clear()
                with torch.inference_mode():  # freeing writes the buffers (inference tensors)
                    sched.fail_running(e)
            finally:
                self.request_turn.set()
            self.stats.busy_s += time.perf_counter() - t0


# ---------------------------------------------------------------------------------------------
# one engine per loaded model

_LOCK = threading.Lock()
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
    if hooks.active_recorder() is not None:
        return False
    return engine_fit(lm).fits  # the slot cache fits the model's cache (decided once, from the model)


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
