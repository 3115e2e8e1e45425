"""The engine's decode step on a CPU as a TorchScript trace, one per (rows, length, stages) bucket.

Eager, one decode step of SmolLM2-135M is ~1,500 torch calls. Each gives up the interpreter lock
while its kernel runs and takes it back after; in the server the web side (Gradio, the views) runs
Python in between, and every take-back waits until that thread lets go (up to the switch
interval). In a script a step beside a thread running plain Python went from 72 ms to 11 s at
Python's default 5 ms interval; in the server under 20 users (0.5 ms) from ~40 to ~150 ms
(docs/PERFORMANCE.md). A traced step is one call: TorchScript's interpreter runs the same ATen
kernels in the same order without the Python interpreter, holding no lock until it returns.

This is the CPU's counterpart of the CUDA graphs in `model_core.engine`, with the same contract:
the step only does tensor operations on the engine's preallocated buffers, so recording it once
per bucket and replaying it is the same computation. The buffers are the trace's inputs (passed
again, the same tensors, at every replay) and the model a submodule, so nothing is baked in as a
constant; the graph executor's optimizations are off on the engine thread (`run` and `record`), so
no pass fuses or reorders a kernel: a replay is bit-identical to the eager step at that bucket.

A bucket is recorded on a thread of its own after a launch first needed it (`TracedSteps`); if
recording fails, the bucket stays eager.
"""

from __future__ import annotations

import dataclasses
import sys
import threading
import time
import warnings
from collections.abc import Callable

import torch


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


class _Step(torch.nn.Module):
    """The traced root: the model as a submodule (its weights are read as attributes, not copied
    in as constants) and the step's buffers as inputs."""

    def __init__(self, model: torch.nn.Module, step: Callable[[], torch.Tensor]):
        super().__init__()
        self.model = model
        self._step = step

    def forward(self, *buffers: torch.Tensor) -> torch.Tensor:
        return self._step()


class TracedSteps:
    """Recorded decode steps by bucket, replayed on one engine's live buffers.

    Recording a bucket takes 1.3-3 s (the tracer runs the step in Python) and its first run twice a
    step, so it happens on a thread of its own, on scratch buffers of the bucket's size (the trace
    takes the buffers as inputs, so it replays on the live ones): the buckets launches asked for, in
    that order. Until a bucket is recorded its steps run eagerly at the same bucket (the same
    computation, so a request's tokens never depend on which ran)."""

    def __init__(self, model: torch.nn.Module, live, scratch_for: Callable[[int], object],
                 step_on: Callable[[object, tuple], Callable[[], torch.Tensor]], name: str = "model"):
        """scratch_for(length) -> buffers shaped as the live ones for positions [0, length);
        step_on(buffers, key) -> the eager step of bucket `key` on those buffers."""
        self._model = model
        self._inputs = tuple(buffer_tensors(live))
        self._scratch_for, self._step_on = scratch_for, step_on
        self._traced: dict[tuple, torch.jit.ScriptModule] = {}
        self._eager: set[tuple] = set()  # buckets whose recording failed
        self._cv = threading.Condition()
        self._wanted: list[tuple] = []  # buckets to record, in order
        self._stop = False
        self.recorded = 0
        self.replays = 0
        self.record_s = 0.0
        self._thread = threading.Thread(target=self._record_loop, name=f"lmscope-record-{name}", daemon=True)
        self._thread.start()

    def stats(self) -> dict:
        """/metrics: buckets recorded, steps replayed from them, buckets waiting or left eager."""
        return {"buckets": self.recorded, "replays": self.replays, "waiting": len(self._wanted),
                "eager_buckets": len(self._eager), "record_s": round(self.record_s, 1)}

    def run(self, key: tuple) -> bool:
        """Replay the step of `key` on the live buffers; False when it is not recorded yet (the
        caller runs it eagerly; it is recorded meanwhile)."""
        traced = self._traced.get(key)
        if traced is None:
            with self._cv:
                if key not in self._eager and key not in self._wanted:
                    self._wanted.append(key)
                    self._cv.notify_all()
            return False
        with torch.jit.optimized_execution(False):
            traced(*self._inputs)
        self.replays += 1
        return True

    def want(self, keys) -> None:
        """Record these buckets (rows, length, stages) ahead of the launches that will need them."""
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
        from model_core.cpu_threads import limit_this_thread

        limit_this_thread(1)  # beside the engine's thread and the web side, not over them
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
                scratch = self._scratch_for(key[1])
                inputs = tuple(buffer_tensors(scratch))
                with torch.jit.optimized_execution(False):
                    traced = torch.jit.trace(_Step(self._model, self._step_on(scratch, key)), inputs,
                                             check_trace=False, strict=False)
                    traced(*inputs)  # the first run profiles the graph: twice a step's time
            except Exception as e:  # noqa: BLE001 - the bucket stays eager
                self._eager.add(key)
                print(f"lmscope: recording the CPU decode step {key[:2]} failed ({type(e).__name__}: "
                      f"{str(e)[:200]}); it runs eagerly", file=sys.stderr)
                return
            finally:
                self.record_s += time.perf_counter() - t0
        self._traced[key] = traced
        self.recorded += 1
