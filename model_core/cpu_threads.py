"""OpenMP thread counts per OS thread.

torch.set_num_threads is process-wide; libgomp's omp_set_num_threads is per calling thread. The
server runs torch on several threads (the engine's, Gradio's workers, the lens filler); two OpenMP
teams on two cores slow each other down (docs/PERFORMANCE.md), so a long-lived thread can keep its
own work on fewer threads without changing anyone else's."""

from __future__ import annotations

import ctypes
import glob
import os
import threading

import torch


def limit_this_thread(n: int = 1) -> bool:
    """Make this thread's torch CPU work (ATen's OpenMP regions, MKL's products) use n threads,
    leaving every other thread's count as it is. False where torch does not use libgomp."""
    try:
        # ATen sets a thread's OpenMP count from the process-wide one the first time the thread asks
        # for it (a parallel op, get_num_threads); a count set before that was silently undone
        torch.get_num_threads()
        libs = glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "libgomp*.so*")) + ["libgomp.so.1"]
        for path in libs:
            try:
                ctypes.CDLL(path).omp_set_num_threads(int(n))
                return torch.get_num_threads() == int(n)
            except (OSError, AttributeError):
                continue
    except Exception:  # noqa: BLE001 - another platform: the thread shares the cores as it is
        pass
    return False


_THIS_THREAD = threading.local()


def request_threads(cores: int, engine_threads: int, concurrency: int) -> int:
    """OpenMP threads for one web request's torch work: the cores the engine leaves, shared by the
    requests that may run at once (at least 1). On 2 cores: 1. Two requests each with a team of 2
    beside the engine's thread were five busy threads on two cores; once their forwards and lens
    ran without the interpreter lock (model_core.cpu_graphs, model_core.lens) the 20-user p95 went
    from 3.4 to 5.1 s (docs/PERFORMANCE.md)."""
    return max(1, (cores - engine_threads) // max(1, concurrency))


def limit_request_thread(n: int) -> None:
    """limit_this_thread(n) once per worker thread (Gradio's are pooled: each keeps its count). The
    main thread (a script's, a test's direct call) keeps the count it has."""
    if threading.current_thread() is not threading.main_thread() and getattr(_THIS_THREAD, "n", None) != n:
        limit_this_thread(n)
        _THIS_THREAD.n = n
