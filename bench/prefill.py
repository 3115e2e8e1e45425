"""The engine's captured prefill (model_core/serving/cuda_prefill_graphs.py) against the eager prefill it replaces,
in the same run, on the same random prompts: milliseconds of each (host and device, synchronized),
their ratio, and how far the captured one's last-position logits and keys are from the eager ones'.

GPU:  PYTHONPATH=. python bench/prefill.py --device cuda          (random-smollm2-135m, bf16)
CPU:  .venv/bin/python bench/prefill.py   (the same buckets run eagerly: a check of the padding)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from model_core import load_model  # noqa: E402
from model_core.serving.cuda_prefill_graphs import PrefillGraphs, eager_prefill  # noqa: E402


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model", default="random-smollm2-135m")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 3, 17, 32])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    from model_core.serving.engine import _buckets, own_cublas_workspace

    lm = load_model(args.model, device=args.device)
    graphs = PrefillGraphs(lm, _buckets(max(args.rows)), lm.shape.context_length)
    t0 = time.perf_counter()
    graphs.capture(own_cublas_workspace)
    print(f"# bench/prefill.py  {lm.name} on {args.device}, {lm.dtype}; {len(graphs.graphs)} buckets "
          f"captured in {time.perf_counter() - t0:.1f} s")
    print(f"{'rows':>4} {'longest':>7} {'captured ms':>11} {'eager ms':>9} {'eager/captured':>14} "
          f"{'max |logit diff|':>16} {'max |key diff|':>14}  argmax same")
    g = torch.Generator().manual_seed(0)
    for n in args.rows:
        lens = torch.randint(5, 60, (n,), generator=g).tolist()
        ids = [torch.randint(10, lm.shape.vocab_size, (k,), generator=g).tolist() for k in lens]
        x = torch.tensor([r + [0] * (max(lens) - len(r)) for r in ids], device=lm.device)  # [N, T]
        times = {"captured": [], "eager": []}
        with torch.inference_mode():
            for _ in range(args.repeats):
                _sync(lm.device)
                t0 = time.perf_counter()
                cache, logits = graphs.run(x, lens)
                _sync(lm.device)
                t1 = time.perf_counter()
                pre, ref = eager_prefill(lm, x, lens)  # [N, V]
                _sync(lm.device)
                times["captured"].append(t1 - t0)
                times["eager"].append(time.perf_counter() - t1)
            T = max(lens)
            key_diff = max(float((c.keys[:n, :, :T] - e.keys[:, :, :T]).abs().max())
                           for c, e in zip(cache.layers, pre.layers))
        cap, eag = (1000 * statistics.median(times[k]) for k in ("captured", "eager"))
        same = float((logits.argmax(-1) == ref.argmax(-1)).float().mean())
        print(f"{n:>4} {T:>7} {cap:>11.1f} {eag:>9.1f} {eag / cap:>14.2f} {float((logits - ref).abs().max()):>16.4f} "
              f"{key_diff:>14.4f}  {same:.2f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
