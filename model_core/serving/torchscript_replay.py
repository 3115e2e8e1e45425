"""The engine's decode step and prefill on a CPU as TorchScript traces, one per bucket.

Eager, one decode step of SmolLM2-135M is ~1,500 torch calls. Each gives up the interpreter lock
while its kernel runs and takes it back after; in the server the web side (Gradio, the views) runs
Python in between, and every take-back waits until that thread lets go (up to the switch
interval). In a script a step beside a thread running plain Python went from 72 ms to 11 s at
Python's default 5 ms interval; in the server under 20 users (0.5 ms) from ~40 to ~150 ms
(docs/PERFORMANCE.md). A traced step is one call: TorchScript's interpreter runs the same ATen
kernels in the same order without the Python interpreter, holding no lock until it returns.

This is the CPU's counterpart of the CUDA graphs in `model_core.serving.engine_cuda_graphs`, with the same
contract (`model_core.serving.engine_cpu_replay` says what the engine records):
the step only does tensor operations on the engine's preallocated buffers, so recording it once
per bucket and replaying it is the same computation. The buffers are the trace's inputs (passed
again, the same tensors, at every replay) and the model a submodule, so nothing is baked in as a
constant; the graph executor's optimizations are off on the engine thread (`run` and `record`), so
no pass fuses or reorders a kernel: a replay is bit-identical to the eager step at that bucket.

A prefill is recorded the same way, one per prompt-length bucket of one row: its output is every
layer's keys and values and the last hidden states (no DynamicCache comes out of a trace), and the
engine pads a prompt to its bucket whether the bucket is recorded yet or not.

A bucket is recorded on a thread of its own, ahead of use (`TracedSteps.want`, the server's
buckets at start) or after a launch first needed it; if recording fails, the bucket stays eager.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import warnings
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)


def buffer_tensors(obj) -> list[torch.Tensor]:
    """Every tensor a step's buffers hold (dataclass fields, the cache's per-layer lists and dicts),
    once each, in a fixed order: the trace's inputs."""
    out: list[torch.Tensor] = []
    seen: set[int] = set()

    def walk(x) -> None:
        if isinstance(x, torch.Tensor):
            if id(x) not in seen:
                seen.add(id(x))
                out.append(x)
        elif dataclasses.is_dataclass(x) and not isinstance(x, type):
            for f in dataclasses.fields(x):
                walk(getattr(x, f.name))
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)
        elif isinstance(x, dict):
            for k in sorted(x, key=str):
                walk(x[k])
        elif hasattr(x, "__dict__") and not isinstance(x, torch.nn.Module):
            for k in sorted(vars(x)):
                walk(vars(x)[k])

    walk(obj)
    return out


class _Traced(torch.nn.Module):
    """The traced root: the model as a submodule (its weights are read as attributes, not copied
    in as constants) and the call's tensors as inputs (a decode step reads its buffers from its
    closure: the tracer maps those tensors to the inputs by identity)."""

    def __init__(self, model: torch.nn.Module, fn: Callable):
        super().__init__()
        self.model = model
        self._fn = fn

    def forward(self, *inputs: torch.Tensor):
        return self._fn(*inputs)


class TracedSteps:
    """An engine's recorded calls (decode steps, prefills) by bucket key, replayed on live inputs.

    Recording a bucket takes 1.3-3 s (the tracer runs the call in Python) and its first run twice a
    call, so it happens on a thread of its own, on example inputs of the bucket's shape (a decode
    step's are scratch buffers: the trace takes the buffers as inputs, so it replays on the live
    ones): the buckets asked for, in that order. Until a bucket is recorded the engine runs its call
    eagerly at the same bucket (the same computation, so a request's tokens never depend on which
    ran)."""

    def __init__(self, model: torch.nn.Module, recipe: Callable[[tuple], tuple[Callable, tuple]],
                 name: str = "model"):
        """recipe(key) -> (the eager call of bucket `key`, example inputs of its shape)."""
        self._model = model
        self._recipe = recipe
        self._traced: dict[tuple, torch.jit.ScriptModule] = {}
        self._eager: set[tuple] = set()  # buckets whose recording failed
        self._cv = threading.Condition()
        self._wanted: list[tuple] = []  # buckets to record, in order
        self._stop = False
        self.recorded = 0
        self.replays: dict[str, int] = {}  # kind (a key's first item: "step", "prefill") -> calls replayed
        self.record_s = 0.0
        self._thread = threading.Thread(target=self._record_loop, name=f"lmscope-record-{name}", daemon=True)
        self._thread.start()

    def stats(self) -> dict:
        """/metrics: buckets recorded, calls replayed from them by kind, buckets waiting or left eager."""
        return {"buckets": self.recorded, "replays": dict(self.replays), "waiting": len(self._wanted),
                "eager_buckets": len(self._eager), "record_s": round(self.record_s, 1)}

    def run(self, key: tuple, inputs: tuple):
        """Replay the call of `key` on `inputs`: its output, or None when it is not recorded yet
        (the caller runs it eagerly; it is recorded meanwhile)."""
        traced = self._traced.get(key)
        if traced is None:
            with self._cv:
                if key not in self._eager and key not in self._wanted:
                    self._wanted.append(key)
                    self._cv.notify_all()
            return None
        with torch.jit.optimized_execution(False):
            out = traced(*inputs)
        self.replays[key[0]] = self.replays.get(key[0], 0) + 1
        return out

    def want(self, keys) -> None:
        """Record these buckets ahead of the calls that will need them."""
        with self._cv:
            self._wanted += [k for k in keys if k not in self._traced and k not in self._wanted]
            self._cv.notify_all()

    def wait_recorded(self, timeout: float) -> bool:
        """Wait until no bucket is waiting to be recorded; False on timeout."""
        deadline = time.monotonic() + timeout
        while self._wanted:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    def close(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=30)

    def _record_loop(self) -> None:
        from model_core.core.cpu_threads import REQUEST_NICE, limit_this_thread, lower_this_thread

        limit_this_thread(1)  # beside the engine's thread and the web side, not over them
        lower_this_thread(REQUEST_NICE)  # and behind the engine's thread: it serves eagerly meanwhile
        while True:
            with self._cv:
                while not self._stop and not self._wanted:
                    self._cv.wait()
                if self._stop:
                    return
                key = self._wanted[0]
            self._record(key)
            with self._cv:
                self._wanted.remove(key)

    def _record(self, key: tuple) -> None:
        t0 = time.perf_counter()
        with warnings.catch_warnings(), torch.inference_mode():
            warnings.simplefilter("ignore")  # TracerWarnings: the step's Python ints are its bucket's
            try:
                fn, inputs = self._recipe(key)
                with torch.jit.optimized_execution(False):
                    traced = torch.jit.trace(_Traced(self._model, fn), inputs, check_trace=False, strict=False)
                    traced(*inputs)  # the first run profiles the graph: twice a call's time
            except Exception as e:  # noqa: BLE001 - the bucket stays eager
                self._eager.add(key)
                log.warning("recording the CPU %s %s failed (%s: %s); it runs eagerly", key[0], key[1:3],
                            type(e).__name__, str(e)[:200])
                return
            finally:
                self.record_s += time.perf_counter() - t0
        self._traced[key] = traced
        self.recorded += 1
