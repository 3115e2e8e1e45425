"""Small timing helpers shared by the benchmarks: interleaved repeats and medians, because these
machines are noisy and only ratios measured in the same run mean anything."""

from __future__ import annotations

import statistics
import time

import torch


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def interleaved(fns: dict, repeats: int, device="cpu", warmup: int = 1) -> dict[str, float]:
    """Median seconds per function, running them round-robin so drift hits all alike."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
            sync(device)
    times = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            sync(device)
            t0 = time.perf_counter()
            fn()
            sync(device)
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def row_rate(a: dict, b: dict) -> float:
    """Training tokens/s between two of a job's progress rows (tokens_seen, elapsed_s since training
    began); nan when no time passed between them."""
    dt = b["elapsed_s"] - a["elapsed_s"]
    return (b["tokens_seen"] - a["tokens_seen"]) / dt if dt > 0 else float("nan")


def device_info(device=None) -> str:
    """What a run is measured on: `device` (a name or torch.device; default: CUDA when present)."""
    kind = torch.device(device).type if device is not None else ("cuda" if torch.cuda.is_available() else "cpu")
    if kind == "cuda":
        return f"cuda: {torch.cuda.get_device_name(0)}, torch {torch.__version__}"
    return f"cpu: {torch.get_num_threads()} threads, torch {torch.__version__}"


def graph_ms(g, n: int = 200) -> float:
    """Milliseconds per replay of a captured CUDA graph (one replay first, then n timed)."""
    g.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        g.replay()
    torch.cuda.synchronize()
    return 1000 * (time.perf_counter() - t0) / n


def capture(fn):
    """fn run once on a side stream (lazy inits outside the capture), then captured as a CUDA graph
    with its own cuBLAS workspace (model_core.serving.engine.own_cublas_workspace)."""
    from model_core.serving.engine import own_cublas_workspace

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with own_cublas_workspace(), torch.cuda.graph(g):
        fn()
    return g


def captured_ms(fn, n: int = 200) -> float:
    """graph_ms of fn captured as a CUDA graph (`capture`)."""
    return graph_ms(capture(fn), n)
