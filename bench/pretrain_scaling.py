"""A scaling sweep outside the job queue (model_core.training.pretrain.run_scaling), on the CPU or a GPU: each
width trained for the same tokens on the built-in corpus, then the fitted exponent α, its standard
error and R², the offset fit with four or more widths, tokens/s and wall time per width.

    python bench/pretrain_scaling.py --widths 64,128,256 --layers 2 --tokens 400000
    python bench/pretrain_scaling.py --widths 64,128,256,512,1024 --layers 4 --tokens 1500000 --batch-size 64

The built-in training text is ~1.5 M bytes: past that many tokens the larger widths see the same text
again and the sweep measures memorising, not L(N). Models register under LMSCOPE_DATA_DIR
(default ./data), named bench-<time>-d<width>.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--widths", default="64,128,256")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=400_000)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--device", default=None)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    ap.add_argument("--out", default=None, help="also write the result as JSON here")
    a = ap.parse_args()

    import torch

    from model_core.training import pretrain as pt
    from tasks import corpus

    if a.threads:
        torch.set_num_threads(a.threads)
    train, held = corpus.builtin_docs("train"), corpus.builtin_docs("heldout")
    base = {"layers": a.layers, "batch_size": a.batch_size, "context": a.context, "learning_rate": a.lr,
            "device": a.device}
    t0 = time.time()
    res = pt.run_scaling(a.widths, a.tokens, base, train, held, f"bench-{time.strftime('%H%M%S')}",
                         log=lambda m: print(m, flush=True))
    wall = time.time() - t0
    dev = torch.cuda.get_device_name(0) if torch.cuda.is_available() and (a.device or "cuda").startswith("cuda") \
        else f"cpu x{torch.get_num_threads()} threads"
    print(f"\n{dev}; torch {torch.__version__}; {len(res['points'])} widths x {res['tokens']:,} tokens, {wall:.0f} s")
    print(f"{'width':>6} {'N non-emb':>11} {'N all':>11} {'loss':>7} {'bits/B':>7} {'tok/s':>9} {'s':>7}")
    for p in res["points"]:
        tps = p["tokens"] / max(p["train_seconds"], 1e-9)
        print(f"{p['width']:>6} {p['n_non_embedding']:>11,} {p['n_total']:>11,} {p['final_eval_loss']:>7.4f} "
              f"{p['final_eval_loss'] / 0.6931471805599453:>7.4f} {tps:>9,.0f} {p['train_seconds']:>7.1f}")
    f = res["fit"]
    se = f" ± {f['alpha_stderr']:.4f}" if f["alpha_stderr"] is not None else ""
    print(f"power law: L = {f['a']:.4g} N^-{f['alpha']:.4f}{se}, R² {f['r2']:.4f}")
    if res["fit_offset"]:
        o = res["fit_offset"]
        print(f"with an irreducible term: L = {o['E']:.3f} + {o['A']:.4g} N^-{o['alpha']:.4f}")
    print("published (their data): Kaplan et al. 2020 α_N = 0.076; Hoffmann et al. 2022 α = 0.34")
    if a.out:
        Path(a.out).write_text(json.dumps({**res, "device": dev, "wall_seconds": wall}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
