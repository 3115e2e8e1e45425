"""One inference engine per loaded model: a single thread owns every generation's torch work.

Request handlers (Gradio callbacks, the CLI, jobs) `submit` a generation and read its records
from a queue; they never run the model themselves. The engine thread loops:

  1. drop cancelled rows, admit waiting requests into free slots (a prefill each, within a token
     budget per loop so a long prompt cannot stall the running rows for long) and draw their
     first token from the prefill's logits;
  2. run one decode step for every running row at once (continuous batching: rows join and leave
     between any two steps), sampling and recording on the device (`model_core.row_sampling`);
  3. hand each row its packed record (one small host copy per step for the whole batch).

The KV cache is `model_core.slot_cache.SlotCache`, preallocated. On CUDA the decode step (forward
+ sampling + records + advancing each row) is captured once per (rows, length) bucket as a CUDA
graph at start, so a step is one graph launch instead of ~1,500 kernel launches from Python, and
the host processes step n's records while the GPU runs step n+1.

Run alone instead (`model_core.generate` keeps its own path for these): edits or a recorder active
in the caller's context, sliding-window models, models split over several GPUs, a non-default
number of recorded candidates.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import queue
import sys
import threading
import time
import weakref
from dataclasses import dataclass, field

import torch

from model_core import hooks, settings
from model_core.cache_api import cache_kwarg, new_cache
from model_core.row_sampling import ALL_STAGES, RowSettings, packed_width, sample_rows, stages_in_use
from model_core.slot_cache import SlotCache, step_mask

RECORDED = 10  # candidates recorded per step (generate.TOP_K_RECORDED)
PREFILL_BUDGET = 2048  # prompt tokens admitted per engine loop
MIN_LENGTH_BUCKET = 128
SWITCH_INTERVAL = 0.0005  # seconds (sys.setswitchinterval)


@dataclass
class EngineRequest:
    ids: list[int]  # the prompt
    n_steps: int  # tokens to produce at most
    settings: object  # SamplingSettings (validated)
    seed: int
    eos: set[int]
    keep_logits: bool = False
    keep_probs: bool = False
    out: queue.Queue = field(default_factory=queue.Queue)  # records, then None
    cancelled: threading.Event = field(default_factory=threading.Event)
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
    graphs: int = 0
    warmup_s: float = 0.0
    busy_s: float = 0.0
    started: float = field(default_factory=time.perf_counter)

    def as_dict(self, engine: Engine) -> dict:
        up = time.perf_counter() - self.started
        return {"steps": self.steps, "tokens": self.tokens, "admitted": self.admitted,
                "mean_batch": round(self.tokens / self.steps, 2) if self.steps else 0.0,
                "batch_sizes": {str(k): v for k, v in sorted(self.batch_sizes.items())},
                "mean_queue_wait_s": round(self.queue_wait_s / self.admitted, 4) if self.admitted else 0.0,
                "tokens_per_s_busy": round(self.tokens / self.busy_s, 1) if self.busy_s else 0.0,
                "slots": engine.slots, "slots_in_use": len(engine._rows), "waiting": len(engine._pending),
                "cuda_graphs": self.graphs, "compiled": engine.compiled, "warmup_s": round(self.warmup_s, 1),
                "uptime_s": round(up, 1)}


def _buckets(limit: int) -> list[int]:
    out, b = [], 1
    while b < limit:
        out.append(b)
        b *= 2
    return out + [limit]


class Engine:
    """Owns a model's generation work on one thread. Create through `engine_for(lm)`."""

    def __init__(self, lm, slots: int, max_len: int, use_graphs: bool | None = None, compile: bool = False,
                 kv_cache_mb: int | None = None):
        self._lm = weakref.ref(lm)
        self.device, self.dtype = lm.device, lm.dtype
        self.slots, self.max_len = slots, max_len
        self.vocab = lm.shape.vocab_size
        self.use_graphs = (self.device.type == "cuda") if use_graphs is None else use_graphs
        # compile (LMSCOPE_COMPILE=1, CUDA): the forward compiled by inductor before it is captured, one
        # shape per batch bucket at full slot length (about 30 s each at start; a step ~1.9x faster)
        self.compiled = self.use_graphs and bool(compile)
        self._kv_cache_mb = kv_cache_mb  # None: LMSCOPE_KV_CACHE_MB (kv_budget_bytes)
        self._forward = torch.compile(lm.model, dynamic=False) if self.compiled else lm.model
        self.lookahead = self.use_graphs  # process step n's records while step n+1 runs
        self.stats = EngineStats()
        self._cv = threading.Condition()
        self._pending: list[EngineRequest] = []
        self._rows: dict[int, _Row] = {}  # slot -> row
        self._stop = False
        self._held = False
        self._idle = threading.Event()
        self._cache: SlotCache | None = None
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        # Request threads turn records into text while this thread launches steps: with Python's
        # default 5 ms GIL switch interval a waiting thread can stall a whole decode step.
        sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL))
        self.ready = threading.Event()
        self.start_error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name=f"lmscope-engine-{lm.name}", daemon=True)
        self._thread.start()

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

    def stats_dict(self) -> dict:
        return self.stats.as_dict(self)

    # --- the engine thread ----------------------------------------------------------------------
    def _main(self) -> None:
        if self.device.type == "cpu":  # the decode step on part of the cores: see engine_threads
            from model_core.cpu_threads import limit_this_thread

            limit_this_thread(engine_threads())
        try:
            t0 = time.perf_counter()
            with torch.inference_mode():
                self._allocate()
                if self.use_graphs:
                    self._capture_all()
            self.stats.warmup_s = time.perf_counter() - t0
        except BaseException as e:  # noqa: BLE001 - requests run on the plain path instead
            self.start_error = e
            print(f"lmscope: the inference engine for {self._lm().name} could not start "
                  f"({type(e).__name__}: {e}); generation runs one request at a time", file=sys.stderr)
        self.ready.set()
        pipeline: list = []  # launched steps whose records are not yet handed out
        while True:
            with self._cv:
                while not self._stop and not (self._pending and not self._held) and not self._rows and not pipeline:
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
            try:
                with torch.inference_mode():
                    self._drop_cancelled()
                    if new:
                        self._admit_all(new)
                    if self._live_rows():
                        pipeline.append(self._launch())
                    # with lookahead, the records of the step before the one just launched
                    while pipeline and (len(pipeline) > 1 or not self.lookahead or not self._live_rows()):
                        self._hand_out(pipeline.pop(0))
            except BaseException as e:  # noqa: BLE001 - a failed step fails the rows in it, not the engine
                pipeline.clear()
                for row in list(self._rows.values()):
                    self._fail(row.req, e)
                self._rows.clear()
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

    def _live_rows(self) -> list[_Row]:
        return [r for r in self._rows.values() if not r.done]

    def _fail(self, req: EngineRequest, e: BaseException) -> None:
        req.error = e
        req.out.put(None)

    def _allocate(self) -> None:
        lm = self._lm()
        probe = new_cache(lm)
        lm.model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=self.device), use_cache=True,
                 logits_to_keep=1, **{cache_kwarg(lm.model): probe})
        shapes = [(l.keys.shape[1], l.keys.shape[3]) for l in probe.layers]
        per_slot = sum(2 * h * d for h, d in shapes) * self.max_len * torch.empty((), dtype=self.dtype).element_size()
        self.slots = max(1, min(self.slots, kv_budget_bytes(self.device, self._kv_cache_mb) // per_slot))
        self._cache = SlotCache(shapes, self.slots, self.max_len, self.dtype, self.device)
        self.layer_bytes_per_token = self._cache.layer_bytes_per_token()
        S, dev = self.slots, self.device
        self.tok_in = torch.zeros(S, dtype=torch.long, device=dev)
        self.pos = torch.zeros(S, dtype=torch.long, device=dev)
        self.active = torch.zeros(S, dtype=torch.bool, device=dev)
        self.seen = torch.zeros(S, self.vocab, dtype=torch.bool, device=dev)
        self.row_settings = RowSettings.empty(S, dev)
        self.out_packed = torch.zeros(S, packed_width(RECORDED), device=dev)
        self.out_logits = torch.zeros(S, self.vocab, device=dev)
        self.out_final = torch.zeros(S, self.vocab, device=dev)
        self._pinned = [torch.zeros(S, packed_width(RECORDED), pin_memory=dev.type == "cuda") for _ in range(2)]
        self._rows_buckets = _buckets(S)
        self._length_buckets = [b for b in _buckets(self.max_len) if b >= MIN_LENGTH_BUCKET] or [self.max_len]
        if self.compiled:  # one compiled shape per batch bucket: attend over the whole slot
            self._length_buckets = [self.max_len]

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
        lm = self._lm()
        t0 = time.perf_counter()
        free = sorted(set(range(self.slots)) - set(self._rows))
        slots = free[: len(reqs)]
        lens = [len(r.ids) for r in reqs]
        ids = torch.zeros(len(reqs), max(lens), dtype=torch.long, device=self.device)
        for i, r in enumerate(reqs):
            ids[i, : lens[i]] = torch.as_tensor(r.ids, dtype=torch.long)
        pre = new_cache(lm)
        keep = sorted({n - 1 for n in lens})
        out = lm.model(input_ids=ids, use_cache=True, logits_to_keep=keep, **{cache_kwarg(lm.model): pre}).logits
        logits = torch.stack([out[i, keep.index(n - 1)] for i, n in enumerate(lens)]).float()  # [N, V]
        for i, (slot, n) in enumerate(zip(slots, lens)):
            self._cache.load(slot, pre, row=i, tokens=n)
            self.row_settings.set_row(slot, reqs[i].settings, reqs[i].seed)
            self.seen[slot].zero_()
            self.seen[slot, ids[i, :n]] = True
        del pre
        idx = torch.tensor(slots, device=self.device)
        st = RowSettings(*(getattr(self.row_settings, f)[idx] for f in RowSettings.__dataclass_fields__))
        chosen, packed, final = sample_rows(logits, st, self.seen[idx], RECORDED,
                                            stages_in_use(r.settings for r in reqs))
        self.tok_in[idx] = chosen
        self.pos[idx] = torch.tensor(lens, device=self.device)
        self.row_settings.step[idx] = 1
        host = packed.tolist()
        now = time.perf_counter()
        for i, (r, slot, n) in enumerate(zip(reqs, slots, lens)):
            row = _Row(req=r, slot=slot, tokens=n, t_last=t0)
            self._rows[slot] = row
            r.first_token_at = now
            self._emit(row, host[i], logits[i], final[i])
            if not row.done:
                self.active[slot] = True

    # --- one decode step for every running row ---------------------------------------------------
    def _step(self, B: int, L: int) -> None:
        """Everything one decode step does, on the first B slots, attending over L positions.
        Only tensor operations on preallocated buffers (a CUDA graph replays exactly this)."""
        lm = self._lm()
        tok, pos, act, seen = self.tok_in[:B], self.pos[:B], self.active[:B], self.seen[:B]
        # the token going in joins the context the repetition penalty sees
        seen.scatter_(1, tok[:, None], seen.gather(1, tok[:, None]) | act[:, None])
        self._cache.window(B, L, pos)
        logits = self._forward(input_ids=tok[:, None], position_ids=pos[:, None], attention_mask=step_mask(pos, L, self.dtype),
                          use_cache=True, logits_to_keep=1, **{cache_kwarg(lm.model): self._cache}).logits[:, -1].float()
        st = self.row_settings.rows(slice(0, B))
        # eager: only the stages some running row uses; a captured graph must serve any row
        stages = ALL_STAGES if self.use_graphs else stages_in_use(r.req.settings for r in self._live_rows())
        chosen, packed, final = sample_rows(logits, st, seen, RECORDED, stages)
        self.out_packed[:B].copy_(packed)
        self.out_logits[:B].copy_(logits)
        self.out_final[:B].copy_(final)
        tok.copy_(torch.where(act, chosen, tok))
        st.step.add_(act.long())
        pos.copy_(torch.where(act, (pos + 1).clamp(max=self.max_len - 1), pos))

    def _bucket(self, rows: list[_Row]) -> tuple[int, int]:
        top = max(r.slot for r in rows) + 1
        B = next(b for b in self._rows_buckets if b >= top)
        need = max(r.tokens for r in rows) + 1  # the positions the step attends over
        if not self.use_graphs:
            return B, need  # eager: exactly the positions in use
        return B, next(b for b in self._length_buckets if b >= need)

    def _launch(self):
        rows = self._live_rows()
        B, L = self._bucket(rows)
        graph = self._graphs.get((B, L))
        if graph is not None:
            graph.replay()
        else:
            self._step(B, L)
        buf = self._pinned[self.stats.steps % 2]
        buf[:B].copy_(self.out_packed[:B], non_blocking=True)
        event = torch.cuda.Event() if self.device.type == "cuda" else None
        if event is not None:
            event.record()
        want = [r for r in rows if r.req.keep_logits or r.req.keep_probs]
        extra = {r.slot: (self.out_logits[r.slot].to("cpu", copy=True), self.out_final[r.slot].to("cpu", copy=True))
                 for r in want}
        for r in rows:
            r.tokens += 1
        self.stats.steps += 1
        self.stats.tokens += len(rows)
        self.stats.batch_sizes[len(rows)] = self.stats.batch_sizes.get(len(rows), 0) + 1
        return rows, buf, event, extra

    def _hand_out(self, launched) -> None:
        rows, buf, event, extra = launched
        if event is not None:
            event.synchronize()
        host = buf.tolist()
        for r in rows:
            if r.done:
                continue  # finished at the step before (seen only now, with lookahead)
            lg, fin = extra.get(r.slot, (None, None))
            self._emit(r, host[r.slot], lg, fin)

    def _emit(self, row: _Row, packed: list[float], logits=None, final=None) -> None:
        req, now = row.req, time.perf_counter()
        chosen = int(packed[0])
        last = (chosen in req.eos or row.emitted + 1 >= req.n_steps or req.cancelled.is_set())
        rec = Record(index=row.emitted, packed=packed, seconds=now - row.t_last, tokens_cached=row.tokens,
                     last=last)
        if req.keep_logits and logits is not None:
            rec.logits = logits.detach().to("cpu", copy=True)
        if req.keep_probs and final is not None:
            rec.probs = torch.softmax(final.detach().float(), -1).cpu()
        row.emitted += 1
        row.t_last = now
        if last:
            self._free(row)
        req.out.put(rec)
        if last:
            req.out.put(None)

    def _free(self, row: _Row) -> None:
        row.done = True
        self.active[row.slot] = False
        self.pos[row.slot] = 0
        self._rows.pop(row.slot, None)

    def _drop_cancelled(self) -> None:
        for row in list(self._rows.values()):
            if row.req.cancelled.is_set() and not row.done:
                self._free(row)
                row.req.out.put(None)

    # --- CUDA graphs -----------------------------------------------------------------------------
    def _capture_all(self) -> None:
        """Capture the decode step for every (rows, length) bucket, all slots idle (so the warm-up
        runs change no one's state), sharing one memory pool."""
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for B in self._rows_buckets:
                for L in self._length_buckets:
                    self._step(B, L)  # warm-up: allocations and lazy inits happen outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        for B in reversed(self._rows_buckets):
            for L in reversed(self._length_buckets):
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pool):
                    self._step(B, L)
                self._graphs[(B, L)] = g
                self.stats.graphs += 1
        torch.cuda.synchronize()


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
    from model_core import settings

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
    if any(t != "full_attention" for t in types):
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
    LMSCOPE_COMPILE."""
    with _LOCK:
        eng = lm.meta.get("engine")
        if eng is None:
            s = settings.current()
            eng = Engine(lm, slots_from_env(lm.device), max_len_from_env(lm), compile=s.compile,
                         kv_cache_mb=s.kv_cache_mb)
            lm.meta["engine"] = eng
            _ALL.add(eng)
            # closed when the model is freed; at exit `_stop_all` closes it first
            weakref.finalize(lm, eng.close).atexit = False
    eng.ready.wait()
    return eng


def existing_engine(lm) -> Engine | None:
    return lm.meta.get("engine")
