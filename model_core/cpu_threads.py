"""OpenMP thread counts per OS thread.

torch.set_num_threads is process-wide; libgomp's omp_set_num_threads is per calling thread. The
server runs torch on several threads (the engine's, Gradio's workers, the lens filler); two OpenMP
teams on two cores slow each other down (docs/PERFORMANCE.md), so a long-lived thread can keep its
own work on fewer threads without changing anyone else's."""

from __future__ import annotations

import ctypes
import glob
import os

import torch


def limit_this_thread(n: int = 1) -> bool:
    """Make this thread's torch CPU work (ATen's OpenMP regions, MKL's products) use n threads,
    leaving every other thread's count as it is. False where torch does not use libgomp."""
    try:
        torch.ones(8, 8) @ torch.ones(8, 8)  # ATen sets this thread's OpenMP count on its first op
        libs = glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "libgomp*.so*")) + ["libgomp.so.1"]
        for path in libs:
            try:
                ctypes.CDLL(path).omp_set_num_threads(int(n))
                return True
            except (OSError, AttributeError):
                continue
    except Exception:  # noqa: BLE001 - another platform: the thread shares the cores as it is
        pass
    return False
