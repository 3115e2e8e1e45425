"""Full layers x positions residual-patching sweep, timed as a ratio to one forward pass.

    PYTHONPATH=. python bench/patching.py                      # CPU, default model, 64 tokens
    PYTHONPATH=. python bench/patching.py --model random-smollm2-135m   # on a GPU machine
    PYTHONPATH=. python bench/patching.py --layers 3            # time 3 evenly spaced layers only

A sweep has layers x positions cells (30 x 64 = 1920 for SmolLM2); each cell is one corrupted
copy in a batch, so its cost is roughly cells x (one forward of one row). The ratios printed:
  sweep / forward        the whole sweep against one plain forward pass of the 64-token prompt
  per-cell / forward     the same divided by the number of cells (what batching buys: < 1 means a
                         patched row costs less than a lone forward pass)
With --layers k < all, the sweep is timed on k layers and the full-sweep time is extrapolated
linearly (marked "extrapolated").
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from model_core import load_model  # noqa: E402
from model_core.interp.interventions import Metric, patch_residual  # noqa: E402


def _sync(lm):
    if lm.device.type == "cuda":
        torch.cuda.synchronize()


def _time(fn, lm, repeat: int) -> float:
    fn()
    _sync(lm)
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        _sync(lm)
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: smollm2-135m-instruct on CPU, random-smollm2-135m on GPU")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--layers", type=int, default=0, help="time only this many evenly spaced layers (0 = all)")
    ap.add_argument("--batch-size", type=int, default=0, help="rows per patched batch (0 = the library default)")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available() and os.environ.get("LMSCOPE_DEVICE", "") != "cpu"
    name = args.model or ("random-smollm2-135m" if cuda else "smollm2-135m-instruct")
    if not cuda:
        torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    lm = load_model(name)
    s = lm.shape
    g = torch.Generator().manual_seed(0)
    clean = torch.randint(0, min(s.vocab_size, 40000), (args.tokens,), generator=g).tolist()
    corrupted = list(clean)
    for p in (3, 4, 5):  # a "subject" span that differs
        corrupted[p] = (clean[p] + 1 + p) % min(s.vocab_size, 40000)
    metric = Metric(target=clean[-1], other=corrupted[3], kind="logit_diff")
    ids = torch.tensor([clean], device=lm.device)

    with torch.inference_mode():
        fwd = _time(lambda: lm.model(input_ids=ids, use_cache=False), lm, args.repeat)
        fwd1 = _time(lambda: lm.model(input_ids=ids, use_cache=False, logits_to_keep=1), lm, args.repeat)

    L = s.n_layers
    if args.layers and args.layers < L:
        k = args.layers
        layers = sorted({round(i * (L - 1) / max(1, k - 1)) for i in range(k)})
    else:
        layers = list(range(L))
    patch_residual(lm, clean, corrupted, metric, layers=layers[:1], positions=[0, 1],
                   batch_size=args.batch_size or None)  # warm-up
    _sync(lm)
    t0 = time.perf_counter()
    res = patch_residual(lm, clean, corrupted, metric, layers=layers, batch_size=args.batch_size or None)
    _sync(lm)
    sweep = time.perf_counter() - t0
    cells = len(layers) * args.tokens
    full_cells = L * args.tokens
    full = sweep * full_cells / cells
    tag = "" if len(layers) == L else f" (extrapolated from {len(layers)} of {L} layers)"
    print(f"model {name} on {lm.device} ({str(lm.dtype).replace('torch.', '')}), {args.tokens} tokens, "
          f"{L} layers x {args.tokens} positions = {full_cells} cells, batch {res.batch_size} rows")
    print(f"one forward pass (full logits):        {fwd * 1e3:9.1f} ms")
    print(f"one forward pass (last logits only):   {fwd1 * 1e3:9.1f} ms")
    print(f"patching sweep, {cells} cells timed:    {sweep:9.2f} s in {res.n_forward} forward passes")
    print(f"full sweep{tag}: {full:.2f} s")
    print(f"ratio sweep / forward:                 {full / fwd:9.1f}x")
    print(f"ratio per cell / forward:              {full / full_cells / fwd:9.3f}x")
    print(f"ratio sweep / forward (last logits):   {full / fwd1:9.1f}x")


if __name__ == "__main__":
    main()
