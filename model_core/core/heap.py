"""The cyclic garbage collector and a long-running server's heap."""

import gc


def freeze_heap() -> None:
    """Collect, then move every object alive now out of the cyclic collector's reach (`gc.freeze`).
    A full collection scans every object the process holds, with the GIL: after torch, transformers
    and the app start that took 0.12-0.30 s each time on the CPU server (370k objects; more after
    compiling), and 32 users' Steps set one off every few seconds, stalling the engine and every
    request with it (bench/hand_out.py: 2 such pauses in one 32-user run, 33 ms at most once frozen).
    Objects made later (each request's) are collected as usual."""
    gc.collect()
    gc.freeze()
