"""OpenMP thread counts per OS thread.

torch.set_num_threads is process-wide; libgomp's omp_set_num_threads is per calling thread. The
server runs torch on several threads (the engine's, Gradio's workers, the lens filler); two OpenMP
teams on two cores slow each other down (docs/PERFORMANCE.md), so a long-lived thread can keep its
own work on fewer threads without changing anyone else's."""

from __future__ import annotations

import ctypes
import glob
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

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
    ran without the interpreter lock (model_core.serving.torchscript_replay, model_core.interp.lens) the 20-user p95 went
    from 3.4 to 5.1 s (docs/PERFORMANCE.md)."""
    return max(1, (cores - engine_threads) // max(1, concurrency))


# Linux nice values: who yields the cores to whom when they are all busy. The engine's thread (0)
# runs one decode step for every generating user; a web request's thread works for one user; a
# job's process works for no one waiting on a page. At equal priority on the 2-core CPU the engine
# and two requests shared the cores evenly and 20 users' p95 was 2.3-4.3 s; with requests at 10,
# 1.3-1.7 s, Explore's traces no slower (docs/PERFORMANCE.md). Jobs below requests, so a
# fine-tuning run does not take a request's core now that requests yield.
REQUEST_NICE = 10
JOB_NICE = 15


def limit_request_thread(n: int) -> None:
    """limit_this_thread(n), and REQUEST_NICE for this thread, once per worker thread (Gradio's are
    pooled: each keeps both). The main thread (a script's, a test's direct call) keeps its count and
    its priority."""
    if threading.current_thread() is threading.main_thread() or getattr(_THIS_THREAD, "n", None) == n:
        return
    limit_this_thread(n)
    _THIS_THREAD.n = n
    if not getattr(_THIS_THREAD, "yields", False):
        _starter()  # started before this thread yields, so at the priority threads start with
        _THIS_THREAD.yields = lower_this_thread(REQUEST_NICE)


def lower_this_thread(nice: int) -> bool:
    """Raise this thread's nice value to `nice` (an unprivileged thread can lower its own priority,
    never raise it back). False where the platform has no per-thread priority (only Linux takes a
    thread's id where setpriority asks for a process's)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, max(nice, os.getpriority(os.PRIO_PROCESS, tid)))
        return True
    except (AttributeError, OSError):
        return False


def start_thread(thread: threading.Thread) -> None:
    """thread.start(), at the priority threads start with even when called from a request thread that
    yields (a Linux thread inherits its creator's nice value: an engine started by the first request
    for a model would otherwise run at the requests' priority and lose the cores to them)."""
    if getattr(_THIS_THREAD, "yields", False):
        _starter().submit(thread.start).result()
    else:
        thread.start()


_STARTER: ThreadPoolExecutor | None = None
_STARTER_LOCK = threading.Lock()


def _starter() -> ThreadPoolExecutor:
    """One thread, created by a thread that has not yielded, that starts threads for those that have."""
    global _STARTER
    with _STARTER_LOCK:
        if _STARTER is None:
            _STARTER = ThreadPoolExecutor(1, thread_name_prefix="lmscope-thread-starter")
            _STARTER.submit(int).result()  # its thread exists now, created by this one
        return _STARTER
