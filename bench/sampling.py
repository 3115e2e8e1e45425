"""The sampling pipeline + per-step records alone (model_core.serving.batch_sampling.sample_rows), eager against
compiled by inductor, per number of rows and stage set, each captured as a CUDA graph and replayed.

Every variant compiles in its own process (an inductor failure in one says nothing of the others).
GPU:  PYTHONPATH=. python bench/sampling.py [--options '{"split_reductions": false}']
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import captured_ms  # noqa: E402

VOCAB = 49152  # SmolLM2's


def one(rows: int, stages: str, options: dict | None, n: int = 200) -> dict:
    import torch

    from model_core.serving.batch_sampling import ALL_STAGES, RowSettings, sample_rows

    st_set = ALL_STAGES if stages == "all" else frozenset()
    logits = torch.randn(rows, VOCAB, device="cuda") * 3
    seen = torch.zeros(rows, VOCAB, dtype=torch.bool, device="cuda")
    st = RowSettings.empty(rows, "cuda")
    fn = sample_rows if options is None else torch.compile(sample_rows, dynamic=False, options=options)
    t0 = time.perf_counter()
    with torch.inference_mode():
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            ref = sample_rows(logits, st, seen, 10, st_set)
            out = fn(logits, st, seen, 10, st_set)
        torch.cuda.current_stream().wait_stream(s)
        compile_s = time.perf_counter() - t0
        same = bool(torch.equal(ref[0], out[0])) and bool(torch.allclose(ref[1], out[1], atol=1e-4, rtol=1e-4))
        ms = captured_ms(lambda: fn(logits, st, seen, 10, st_set), n)
    return {"ms": ms, "compile_s": compile_s, "same_as_eager": same}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--one", nargs=3, metavar=("ROWS", "STAGES", "OPTIONS"), help=argparse.SUPPRESS)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 32])
    ap.add_argument("--stages", nargs="+", default=["greedy", "all"], choices=["greedy", "all"])
    ap.add_argument("--options", action="append", default=None,
                    help="inductor options as JSON (repeatable); default: eager, {} and split_reductions off")
    args = ap.parse_args()
    if args.one:
        rows, stages, options = args.one
        print(json.dumps(one(int(rows), stages, json.loads(options))))
        return 0
    variants = args.options or ["null", "{}", '{"split_reductions": false}']
    print(f"{'variant':>30} {'rows':>4} {'stages':>7} {'ms/step':>8} {'compile s':>9}  same as eager")
    for v in variants:
        for rows in args.rows:
            for stages in args.stages:
                r = subprocess.run([sys.executable, __file__, "--one", str(rows), stages, v], capture_output=True, text=True)
                label = "eager" if v == "null" else f"compiled {v}"
                if r.returncode == 0:
                    d = json.loads(r.stdout.strip().splitlines()[-1])
                    print(f"{label:>30} {rows:>4} {stages:>7} {d['ms']:>8.3f} {d['compile_s']:>9.1f}  {d['same_as_eager']}",
                          flush=True)
                else:
                    err = [ln for ln in r.stderr.splitlines() if "Error" in ln][-1:] or r.stderr.splitlines()[-1:]
                    print(f"{label:>30} {rows:>4} {stages:>7}   failed: {err[0][:150] if err else '?'}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
