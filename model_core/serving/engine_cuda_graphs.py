"""The engine's decode step as CUDA graphs, and the compiled step that replaces them.

On CUDA the decode step (forward + sampling + records + advancing each row, `steps_per_launch`
times) is captured once per (rows, length, stages) bucket at start, so a launch is one graph
replay instead of ~1,500 kernel launches from Python. "stages" is either every sampling stage or
none (every running row greedy without a repetition penalty): the records are the same, the sorts
and draws of unused filters are skipped.

Compiled (LMSCOPE_COMPILE, on by default on CUDA): a background thread compiles the forward and
the sampling with inductor (one graph for one row, one for any other number of rows and any
length, on scratch buffers of the live ones' shapes) while the graphs above serve; the engine
thread then re-captures every bucket from the compiled step, one per loop, and swaps it in. On a
CPU the compile runs too (without graphs): the compiled step then runs eagerly.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import weakref

import torch

from model_core.core.heap import freeze_heap
from model_core.serving import decode_attention
from model_core.serving.batch_sampling import ALL_STAGES, sample_rows
from model_core.serving.cuda_prefill_graphs import PrefillGraphs
from model_core.serving.engine_step import GREEDY_ONLY, DecodeStep, StepBuffers, StepLayout, compiled_forwards
from model_core.serving.engine_types import EngineStats

log = logging.getLogger(__name__)

_COMPILING = threading.Lock()  # one engine compiles or captures at a time (dynamo's config is the process's)


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


def capture_prefill_graphs(lm, rows_buckets: list[int], max_len: int) -> PrefillGraphs | None:
    """Short prompts' prefills captured (model_core.serving.cuda_prefill_graphs), or None where the
    model cannot have them or capturing failed (its prefills then run eagerly)."""
    if not PrefillGraphs.usable(lm):
        return None
    try:
        graphs = PrefillGraphs(lm, rows_buckets, max_len)
        graphs.capture(own_cublas_workspace)
        return graphs
    except Exception as e:  # noqa: BLE001 - prefills stay eager
        log.warning("capturing the prefill of %s failed (%s: %s); prefills run eagerly", lm.name, type(e).__name__, e)
        return None


class StepGraphs:
    """An engine's decode-step graphs by bucket and its compiled step.

    `state` goes "compiling" -> "capturing" -> "ready" (or "failed: ..."), or is "off". `attach`
    gives it the layout and the live buffers once the engine thread has allocated them; `wake` is
    the condition the engine thread waits on (told when the compile is done)."""

    def __init__(self, lm, decode: DecodeStep, stats: EngineStats, compile: bool, use_graphs: bool,
                 wake: threading.Condition):
        self._lm = weakref.ref(lm)  # as the engine holds it: an unloaded model is freed
        self.name = lm.name
        self.decode, self.stats, self.use_graphs, self._wake = decode, stats, use_graphs, wake
        self.state = "compiling" if compile else "off"
        self.graphs: dict[tuple[int, int, frozenset], torch.cuda.CUDAGraph] = {}
        self.compiled_keys: set[tuple] = set()  # buckets whose graph is the compiled step's
        self._to_capture: list[tuple] = []  # buckets left to re-capture from the compiled step
        self._edited_failed: set[tuple] = set()  # edited buckets that could not be captured
        self.edited_compiled = False  # the edited step compiled and warmed up (_compile_edited)
        self._scratch: StepBuffers | None = None
        self.layout: StepLayout | None = None
        self.live: StepBuffers | None = None

    def attach(self, layout: StepLayout, live: StepBuffers) -> None:
        self.layout, self.live = layout, live

    def lookup(self, key: tuple[int, int, frozenset]) -> tuple[torch.cuda.CUDAGraph | None, bool]:
        """(the bucket's graph or None, whether the compiled step runs it: its graph is the compiled
        step's, or, with no graph, the compiled step is ready)."""
        graph = self.graphs.get(key)
        return graph, (key in self.compiled_keys if graph is not None else self.state == "ready")

    def capture_all(self) -> None:
        """Capture the decode step for every bucket, all slots idle (so the warm-up runs change no
        one's state), sharing one memory pool."""
        self._pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for B, L, st in self.layout.buckets_all():
                self.decode.steps(B, L, self.live, st)  # warm-up: allocations and lazy inits happen outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        for B, L, st in self.layout.buckets_all():
            g = torch.cuda.CUDAGraph()
            with own_cublas_workspace(), torch.cuda.graph(g, pool=self._pool):
                self.decode.steps(B, L, self.live, st)
            self.graphs[(B, L, st)] = g
            self.stats.graphs += 1
        torch.cuda.synchronize()

    # --- compiling (its own thread), then re-capturing (the engine thread, one bucket per loop) ---
    def start_compile(self, threads: int | None) -> None:
        """Compile on a thread of its own; threads: the OpenMP threads it may use (a CPU's engine
        thread's count: a compiled graph guards on it), None to leave them."""
        threading.Thread(target=self._compile, args=(threads,), name=f"lmscope-compile-{self.name}",
                         daemon=True).start()

    def _compile(self, threads: int | None) -> None:
        """Compile the forward and the sampling with inductor on scratch buffers (the live ones stay
        the graphs' and the rows'), one row and two rows for each stage set: two forward graphs
        (one row; any rows and length) and four small sampling graphs. Then ask the engine thread to
        re-capture every bucket."""
        with _COMPILING:
            self._compile_locked(threads)
        freeze_heap()  # compiling made a few hundred thousand objects more
        with self._wake:
            self._wake.notify_all()

    def _compile_locked(self, threads: int | None) -> None:
        t0 = time.perf_counter()
        layout, decode = self.layout, self.decode
        try:
            lm = self._lm()
            if threads is not None:
                from model_core.core.cpu_threads import limit_this_thread

                limit_this_thread(threads)
            decode_attention.install()
            # rows and length vary (marked in DecodeStep.step); the weights, the cache and the vocabulary don't
            decode.fast_forward, decode.fast_forward_hooks = compiled_forwards(lm.model)
            decode.fast_sample = {GREEDY_ONLY: sample_rows, ALL_STAGES: sample_rows}  # compiled below
            stream = torch.cuda.Stream() if layout.device.type == "cuda" else None
            with torch.inference_mode(), (torch.cuda.stream(stream) if stream else contextlib.nullcontext()):
                # inference tensors like the live ones (a compiled graph guards on the difference)
                scratch = layout.buffers()
                two = sorted({1, min(2, layout.slots)})
                for B, st in [(B, st) for B in two for st in (ALL_STAGES, GREEDY_ONLY)]:
                    decode.step(B, layout.length_buckets[0], scratch, st, fast=True)
                # split_reductions off: with one row, inductor splits each reduction over the vocabulary
                # in two kernels and then trips an assertion fusing them (torch 2.11; bench/sampling.py)
                compiled = torch.compile(sample_rows, dynamic=False, options={"split_reductions": False})
                for st in (GREEDY_ONLY, ALL_STAGES):
                    decode.fast_sample[st] = compiled
                    try:
                        for B in two:
                            decode.step(B, layout.length_buckets[0], scratch, st, fast=True)
                    except Exception as e:  # noqa: BLE001 - an inductor failure: this stage set stays uncompiled
                        decode.fast_sample[st] = sample_rows
                        log.warning("compiling the sampling of %s for %s failed (%s: %s); it runs uncompiled in "
                                    "the compiled step", self.name, "all stages" if st else "greedy rows",
                                    type(e).__name__, str(e)[:300])
                # every bucket once more, here: anything the two shapes above did not cover compiles
                # now, off the engine thread (capturing there refuses to compile)
                for B, L, st in layout.buckets_all() if self.use_graphs else []:
                    decode.step(B, L, scratch, st, fast=True)
            if stream is not None:
                stream.synchronize()
            self._scratch = scratch
            self.stats.compile_s = time.perf_counter() - t0
            if self.use_graphs:
                self._to_capture = layout.buckets_all()
                self._capture_pool = torch.cuda.graph_pool_handle()
                self.state = "capturing"
            else:
                self._scratch = None
                self.state = "ready"
        except BaseException as e:  # noqa: BLE001 - the uncompiled graphs go on serving
            self.state = f"failed: {type(e).__name__}: {str(e)[:200]}"
            self._scratch = None
            log.warning("compiling the decode step of %s failed (%s: %s); the uncompiled step goes on serving",
                        self.name, type(e).__name__, e, exc_info=True)

    def _compile_edited(self) -> None:
        """On a thread of its own once the plain step's compiled graphs serve: warm the edited step
        (hooks running, no edit) up on every bucket on scratch buffers, so an edited launch captures
        it without compiling; until then, or where this fails, edited launches capture the
        uncompiled step. Between the hooks each layer's attention is a frame of its own, compiled per
        layer (its index is a constant) and per kind of size (one row; rows and length first fixed,
        then varying): about 5 per layer, past dynamo's default limit of 8 per function, beyond
        which the rest would run eagerly."""
        limit = 6 * len(self.layout.shapes) + 16
        with _COMPILING:
            t0 = time.perf_counter()
            try:
                stream = torch.cuda.Stream()
                with torch.inference_mode(), torch.cuda.stream(stream), \
                        torch._dynamo.config.patch(recompile_limit=limit, accumulated_recompile_limit=max(256, limit)):
                    scratch = self.layout.buffers()
                    for B, L, st in self.layout.buckets_all():
                        self.decode.step(B, L, scratch, st, fast=True, edits={})
                stream.synchronize()
                del scratch
                self.stats.edited_compile_s = time.perf_counter() - t0
                self.edited_compiled = True
            except Exception as e:  # noqa: BLE001 - the plain compiled step is unaffected
                log.warning("compiling the edited decode step of %s failed (%s: %s); edited rows run the "
                            "uncompiled step", self.name, type(e).__name__, str(e)[:300])
        freeze_heap()

    def edited(self, key: tuple, run) -> torch.cuda.CUDAGraph | None:
        """The captured step of an edited launch, key (rows, length, stages, edit signature, fast),
        captured from `run(fast)` (the step with the slots' hook edits, compiled where fast) on first
        use; None where that capture failed (the caller then runs it uncompiled). The compiled step
        was warmed up on every bucket with the hooks running (`_compile_edited`): a recompile here
        would be a shape it missed, and fails the capture. Capturing runs nothing: the caller replays."""
        graph = self.graphs.get(key)
        if graph is not None or key in self._edited_failed:
            return graph
        fast = key[4]
        # the capture's dynamo patch is the process's: not while another engine compiles (None now:
        # this launch takes the uncompiled capture, a later one the compiled)
        if fast and not _COMPILING.acquire(blocking=False):
            return None
        try:
            graph = torch.cuda.CUDAGraph()
            with torch._dynamo.config.patch(error_on_recompile=True) if fast else contextlib.nullcontext(), \
                    own_cublas_workspace(), \
                    torch.cuda.graph(graph, pool=self._capture_pool if fast else self._pool,
                                     capture_error_mode="thread_local"):
                run(fast)
        except Exception as e:  # noqa: BLE001 - this bucket's edited steps run uncompiled / eagerly
            self._edited_failed.add(key)
            log.warning("capturing an edited decode step of %s%s failed (%s: %s)", self.name,
                        " (compiled)" if fast else "", type(e).__name__, e)
            return None
        finally:
            if fast:
                _COMPILING.release()
        self.graphs[key] = graph
        if fast:  # its uncompiled capture, from before the compiled one was ready, is not read again
            self.graphs.pop(key[:4] + (False,), None)
        self.stats.edited_graphs += 1
        self.stats.edited_compiled_graphs += fast
        return graph

    def edited_fast(self) -> bool:
        """Whether edited launches use the compiled step (compiled and captured for every bucket)."""
        return self.state == "ready" and self.use_graphs and self.edited_compiled

    def drop_edited(self, keys: set) -> None:
        """Forget the captured steps that read dropped edit slots (their buffers are gone)."""
        for key in [k for k in self.graphs if len(k) > 3 and keys & set(k[3])]:
            del self.graphs[key]
        self._edited_failed = {k for k in self._edited_failed if not keys & set(k[3])}

    def capture_due(self) -> bool:
        return self.state == "capturing" and bool(self._to_capture)

    def capture_next(self) -> None:
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
                    self.decode.steps(B, L, self._scratch, st, fast=True)
                torch.cuda.current_stream().wait_stream(stream)
                g = torch.cuda.CUDAGraph()
                with own_cublas_workspace(), \
                        torch.cuda.graph(g, pool=self._capture_pool, capture_error_mode="thread_local"):
                    self.decode.steps(B, L, self.live, st, fast=True)
            self.graphs[(B, L, st)] = g
            self.compiled_keys.add((B, L, st))
            self.stats.compiled_graphs += 1
        except BaseException as e:  # noqa: BLE001 - the uncompiled graphs go on serving
            self._to_capture.clear()
            self.state = f"failed: {type(e).__name__}: {str(e)[:200]}"
            log.warning("capturing the compiled decode step of %s failed (%s: %s); the uncompiled step goes on "
                        "serving", self.name, type(e).__name__, e, exc_info=True)
        finally:
            _COMPILING.release()
        if not self._to_capture:
            self._scratch = None
            if self.state == "capturing":
                self.state = "ready"
                threading.Thread(target=self._compile_edited, name=f"lmscope-compile-edited-{self.name}",
                                 daemon=True).start()
                self.stats.compile_s = time.perf_counter() - self.stats.started - self.stats.warmup_s
