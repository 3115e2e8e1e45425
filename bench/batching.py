"""Many users at once: lmscope's engine against transformers' own batched generate, in one process.

Generation: N threads at once, each one user asking for --new-tokens greedy tokens with every step
recorded, through model_core.serving.generate (the engine: continuous batching over a slot cache, CUDA
graphs on a GPU). Baseline in the same run: transformers' `generate` on all N prompts as one batch
(static cache on CUDA, which compiles the forward; dynamic cache on the CPU), which records
nothing. Prints aggregate tokens/s of both, their ratio, p50/p95 time to first token of the
engine's users, and how many greedy generations differ from transformers' (0 on the CPU in
float32; in bf16 on a GPU a near-tie may go the other way, so the count is reported).

Traces: N threads at once, each a trace of a ~30-token prompt, batched (model_core.interp.trace_batching) and
one forward at a time (max_batch 1), interleaved; traces/s and the ratio.

CPU:  .venv/bin/python bench/batching.py                 (the real default model)
GPU:  PYTHONPATH=. python bench/batching.py --random --device cuda --users 1 8 16 32
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

from model_core import (
    load_model,  # noqa: E402
    trace,
)
from model_core.interp.trace_batching import batcher_for  # noqa: E402

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


def _hf_batch(lm, ids: list[list[int]], n_new: int, static: bool):
    x = torch.tensor(ids, device=lm.device)
    kw = dict(max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False, attention_mask=torch.ones_like(x),
              pad_token_id=lm.tokenizer.pad_token_id or 0, temperature=None, top_k=None, top_p=None)
    if static:
        kw["cache_implementation"] = "static"
    with torch.inference_mode():
        return lm.model.generate(x, **kw)[:, x.shape[1]:].tolist()


def _user(lm, ids, n_new):
    """One user's recorded generation; returns (tokens, seconds to the first token)."""
    from model_core.serving.generate import iter_generate

    t0 = time.perf_counter()
    ttft, gen = None, None
    for _, gen in iter_generate(lm, token_ids=ids, max_new_tokens=n_new, ignore_eos=True):  # noqa: B007 - the last is returned
        ttft = ttft or time.perf_counter() - t0
    return gen.token_ids, ttft


def _before_eos(toks, eos):
    return next((toks[:i] for i, t in enumerate(toks) if t in eos), toks)


def _pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--random", action="store_true", help="random-smollm2-135m instead of the real default model")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--users", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--no-traces", action="store_true")
    ap.add_argument("--lookahead", type=int, nargs="+", default=None,
                    help="the engine's launches of lookahead, each measured in turn (default: its own)")
    ap.add_argument("--gate", nargs="+", choices=["on", "off"], default=None,
                    help="request threads wait for the engine's turn (Engine.request_turn), each measured in turn "
                         "(default: the engine's)")
    ap.add_argument("--steps-per-launch", type=int, default=None,
                    help="decode steps per graph launch (default: the engine's own)")
    ap.add_argument("--switch-interval", type=float, nargs="+", default=None,
                    help="seconds between the interpreter's thread switches, each measured in turn (default: the engine's)")
    args = ap.parse_args(argv)
    import model_core.serving.engine

    if args.lookahead is not None:
        model_core.serving.engine.LOOKAHEAD = max(args.lookahead)  # its ring of host buffers fits the most
    if args.steps_per_launch is not None:
        model_core.serving.engine.STEPS_PER_LAUNCH = args.steps_per_launch
    if args.switch_interval is not None:
        model_core.serving.engine.SWITCH_INTERVAL = max(args.switch_interval)  # the engine only lowers it
    lm = load_model("random-smollm2-135m" if args.random else "smollm2-135m-instruct", device=args.device)
    b = batcher_for(lm)
    static = lm.device.type == "cuda"
    dev = torch.cuda.get_device_name(0) if lm.device.type == "cuda" else f"cpu, {torch.get_num_threads()} threads"
    print(f"# bench/batching.py  {lm.name} on {dev}, {lm.dtype}; {args.new_tokens} new tokens per generation")
    P = 24
    ids = [lm.tokenizer(prompt(i, 40))["input_ids"][:P] for i in range(max(args.users))]  # equal lengths: no padding

    global _POOL
    _POOL = ThreadPoolExecutor(max(args.users))
    concurrently(lambda i: _user(lm, ids[i], 4), max(args.users))  # warm every thread and the engine
    from model_core.serving.engine import engine_for
    from model_core.serving.generate import eos_ids

    eng = engine_for(lm)
    t0 = time.perf_counter()
    eng.wait_compiled(900)  # measured as it serves once started (compiled on CUDA)
    print(f"# engine compiled: {eng.compile_state} (waited {time.perf_counter() - t0:.0f} s more)", flush=True)
    eos = set(eos_ids(lm))
    hf_name = "hf static" if static else "hf dynamic"
    intervals = args.switch_interval or [sys.getswitchinterval()]
    gates = [g == "on" for g in args.gate] if args.gate else [eng._gate]
    lookaheads = args.lookahead or [eng.lookahead]
    default = (sys.getswitchinterval(), eng._gate, eng.lookahead)
    print(f"# {eng.steps_per_launch} decode steps per launch")
    print(f"{'users':>5} {'switch ms':>9} {'gate':>4} {'ahead':>5} {'engine tok/s':>12} {hf_name + ' tok/s':>16} {'ratio':>6} "
          f"{'ttft p50/p95 ms':>16}  differ  each run (engine tok/s)  batch sizes")
    for n, si, gate, ahead in [(n, si, g, a) for n in args.users for si in intervals for g in gates for a in lookaheads]:
        sys.setswitchinterval(si)
        eng._gate, eng.lookahead = gate, ahead
        _hf_batch(lm, ids[:n], args.new_tokens, static), _hf_batch(lm, ids[:n], args.new_tokens, static)  # compile
        ours_r, hf_r, ttfts, differ = [], [], [], 0
        before = dict(eng.stats.batch_sizes)
        for _ in range(args.repeats):
            out, wall, _lat = concurrently(lambda i: _user(lm, ids[i], args.new_tokens), n)
            ours_r.append(n * args.new_tokens / wall)
            ttfts += [t for _, t in out]
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            ref = _hf_batch(lm, ids[:n], args.new_tokens, static)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            hf_r.append(n * args.new_tokens / (time.perf_counter() - t0))
            # transformers' min_new_tokens masks EOS, the engine (ignore_eos) may pick it: compare before it
            differ += sum(_before_eos(toks, eos) != _before_eos(r, eos)[: len(_before_eos(toks, eos))]
                          for (toks, _), r in zip(out, ref))
        sizes = {k: v - before.get(k, 0) for k, v in eng.stats.batch_sizes.items() if v - before.get(k, 0)}
        to, th = statistics.median(ours_r), statistics.median(hf_r)
        shown = ", ".join(f"{k}:{v}" for k, v in sorted(sizes.items()))
        each = " ".join(f"{r:.0f}" for r in ours_r)
        print(f"{n:>5} {1000 * si:>9.2f} {'on' if gate else 'off':>4} {ahead:>5} {to:>12.1f} {th:>16.1f} {to / th:>6.2f} "
              f"{1000 * _pct(ttfts, .5):>7.0f} / {1000 * _pct(ttfts, .95):<6.0f}  {differ:>3}/{n * args.repeats}  "
              f"{each:<23} {shown}", flush=True)
    sys.setswitchinterval(default[0])
    eng._gate, eng.lookahead = default[1], default[2]
    # the engine alone: requests submitted directly, records drained without turning them into text
    from model_core.core.sampling import SamplingSettings
    from model_core.serving.engine import EngineRequest

    for n in args.users:
        reqs = [EngineRequest(ids=ids[i], n_steps=args.new_tokens, settings=SamplingSettings(temperature=0), seed=0,
                              eos=set()) for i in range(n)]
        t0 = time.perf_counter()
        for r in reqs:
            eng.submit(r)
        for r in reqs:
            while r.out.get() is not None:
                pass
        print(f"engine alone, {n:>3} users: {n * args.new_tokens / (time.perf_counter() - t0):9.1f} tok/s", flush=True)
    print("engine:", eng.stats_dict())
    if args.no_traces:
        return 0

    def tr(i):
        return trace(lm, prompt(i, 30)).n_tokens

    print(f"{'users':>5} {'traces batched':>15} {'one at a time':>14} {'ratio':>6}")
    for n in args.users:
        runs = {"batched": [], "unbatched": []}
        for _ in range(args.repeats):
            for mode in ("batched", "unbatched"):
                b.max_batch = 1 if mode == "unbatched" else 32
                _, wall, _ = concurrently(tr, n)
                runs[mode].append(n / wall)
        b.max_batch = 32
        tb, tu = statistics.median(runs["batched"]), statistics.median(runs["unbatched"])
        print(f"{n:>5} {tb:>10.1f} tr/s {tu:>9.1f} tr/s {tb / tu:>6.2f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
