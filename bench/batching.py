"""Concurrent requests with and without batched forwards (model_core.batching), in one process.

N threads at once, each one user: a generation of --new-tokens greedy tokens, or a trace of a
~30-token prompt. For each N the same work runs twice in the same run, batched (the server's
default) and with batching off (LMSCOPE_MAX_BATCH=1: one forward at a time), interleaved, and
prints aggregate tokens/s (generation) or traces/s, the median latency, the batched / unbatched
throughput ratio, and the batch sizes seen. Batched greedy tokens are also compared with the
unbatched ones (equal on the CPU in float32; in bf16 on a GPU, batched rows round differently
and a near-tie may go the other way: the count of differing generations is printed).

CPU:  .venv/bin/python bench/batching.py                 (the real default model)
GPU:  PYTHONPATH=. python bench/batching.py --random --device cuda
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from model_core import load_model, trace  # noqa: E402
from model_core.batching import batcher_for  # noqa: E402
from model_core.generate import generate  # noqa: E402

WORDS = ("the quick brown fox jumps over a lazy dog while seven curious students measure how far "
         "sound travels in warm air and cold water before the evening bell").split()


def prompt(i: int, n_words: int = 24) -> str:
    return " ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(n_words))


_POOL: ThreadPoolExecutor | None = None


def concurrently(fn, n: int):
    """fn(0..n-1) at once, each on its own thread of a pool that lives for the whole run (like a
    server's: a thread's first CUDA use or OpenMP team costs much more than later ones)."""
    out, lat = [None] * n, [0.0] * n
    start = threading.Barrier(n + 1)

    def run(i):
        start.wait()
        t0 = time.perf_counter()
        out[i] = fn(i)
        lat[i] = time.perf_counter() - t0

    futures = [_POOL.submit(run, i) for i in range(n)]
    start.wait()
    t0 = time.perf_counter()
    for f in futures:
        f.result()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return out, time.perf_counter() - t0, lat


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--random", action="store_true", help="random-smollm2-135m instead of the real default model")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--users", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args(argv)
    lm = load_model("random-smollm2-135m" if args.random else "smollm2-135m-instruct", device=args.device)
    b = batcher_for(lm)
    dev = torch.cuda.get_device_name(0) if lm.device.type == "cuda" else f"cpu, {torch.get_num_threads()} threads"
    print(f"# bench/batching.py  {lm.name} on {dev}, {lm.dtype}; {args.new_tokens} new tokens per generation")

    def gen(i):
        return generate(lm, prompt(i), max_new_tokens=args.new_tokens, ignore_eos=True).token_ids

    def tr(i):
        return trace(lm, prompt(i, 30)).n_tokens

    global _POOL
    _POOL = ThreadPoolExecutor(max(args.users))
    b.max_batch = 1
    concurrently(lambda i: (gen(i), tr(i)), max(args.users))  # warm every thread of the pool, alone
    b.max_batch = 32
    print(f"{'work':>5} {'users':>5} {'batched':>13} {'unbatched':>13} {'ratio':>6} {'p50 latency b / u':>18}  batch sizes")
    for kind, fn, unit in (("gen", gen, args.new_tokens), ("trace", tr, 1)):
        for n in args.users:
            runs = {"batched": [], "unbatched": []}
            sizes: dict = {}
            differ = 0
            for _ in range(args.repeats):
                results = {}
                for mode in ("batched", "unbatched"):
                    b.max_batch = 1 if mode == "unbatched" else 32
                    before = dict(b.stats.sizes)
                    out, wall, lat = concurrently(fn, n)
                    runs[mode].append((n * unit / wall, statistics.median(lat)))
                    results[mode] = out
                    if mode == "batched":
                        for k, v in b.stats.sizes.items():
                            if v - before.get(k, 0) and k[1] > 1:
                                sizes[k] = sizes.get(k, 0) + v - before.get(k, 0)
                if kind == "gen":
                    differ += sum(x != y for x, y in zip(results["batched"], results["unbatched"]))
            b.max_batch = 32
            tb = statistics.median(r[0] for r in runs["batched"])
            tu = statistics.median(r[0] for r in runs["unbatched"])
            lb = statistics.median(r[1] for r in runs["batched"])
            lu = statistics.median(r[1] for r in runs["unbatched"])
            shown = ", ".join(f"{k[0]}x{k[1]}:{v}" for k, v in sorted(sizes.items())) or "-"
            per = "tok/s" if kind == "gen" else "tr/s"
            print(f"{kind:>5} {n:>5} {tb:>7.1f} {per:<5} {tu:>7.1f} {per:<5} {tb / tu:>6.2f} {lb:>8.2f} / {lu:.2f} s   {shown}"
                  + (f"  ({differ} of {n * args.repeats} generations differ)" if kind == "gen" and differ else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
