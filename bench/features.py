"""Sparse-autoencoder training on the real default model (SmolLM2-135M-Instruct): tokens/s of the
whole loop (the forward pass up to the hook point, which stops there, plus the autoencoder's step),
the share of it spent in the model's forward, and the held-out quality (1 - FVU, CE recovered).

  python bench/features.py                                  # layer 6 resid_post, 100k tokens, CPU
  python bench/features.py --tokens 200000 --device cuda    # on a GPU (bf16 model, fp32 autoencoder)
  python bench/features.py --tokens 20000 --layer 3 --hook mlp_out --expansion 16 --k 64

Runs model_core.interp.features.train_features (the function the 'features' job calls) without saving
and without the top-context scan. Not part of the test suite: 100k tokens take minutes on a CPU.

Measured (CPU, 2 threads shared with other jobs (load 5-7), torch 2.13 CPU, eai-sparsify 1.3.3;
layer 6 resid_post, 4608 features, k 32, 8 x 128-token windows a step, 98 steps, 99,968 tokens;
held-out: 4,064 predictions of the built-in corpus's held-out split; CE clean 3.571, zero-ablated 13.947):
  sign-SGD (sparsify's default), file order: 137 tokens/s (73 % in the model's forward, which stops
    at block 7 of 30); explained 0.715, CE with features 4.062, CE recovered 0.953, dead 0.054
  sign-SGD, shuffled documents: 103 tokens/s (heavier load); explained 0.592, CE recovered 0.953;
    its training FVU fell to ~0.15 by step 25 and rose to 0.43 by step 98 (drift: hence Adam)
  Adam lr 1e-3 (the default now), shuffled, 30 steps / 29,952 tokens, 1 thread on a quieter machine:
    268 tokens/s (66 % in the forward); explained 0.672, CE with features 4.663, CE recovered 0.895,
    dead 0.056, alive on held-out 0.940 (the 100k Adam run was killed by a machine cleanup)
On 60k cached activations of the same hook (file order), held-out FVU after one pass (59 steps):
sign-SGD lr 9.4e-3 0.192, lr 2e-3 0.236; Adam lr 1e-3 0.196, lr 3.8e-4 0.389; schedule-free AdamW
1e-3 0.273. After two passes (118 steps): sign-SGD 0.325 (drifts), Adam 1e-3 0.153 (keeps improving).
On an H200 (the real model's GGUF carried in two halves; docs/PERFORMANCE.md), Adam, the whole
built-in corpus (337,920 tokens), 16,256 held-out predictions: batch 8 15,405 tokens/s, explained
0.907, CE recovered 0.989; batch 32 48,993 tokens/s, explained 0.876, CE recovered 0.976.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda when present, else cpu)")
    ap.add_argument("--layer", type=int, default=6)
    ap.add_argument("--hook", default="resid_post")
    ap.add_argument("--tokens", type=int, default=100_000)
    ap.add_argument("--expansion", type=int, default=8)
    ap.add_argument("--k", type=int, default=32)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--eval-tokens", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's)")
    ap.add_argument("--json", action="store_true", help="print the whole record as JSON")
    a = ap.parse_args()

    import torch

    if a.threads:
        torch.set_num_threads(a.threads)
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    os.environ["LMSCOPE_DEVICE"] = device
    from bench.common import device_info
    from model_core.interp import features as F

    print(f"device: {device_info(device)}", flush=True)
    t0 = time.time()
    last = [0.0]

    def progress(step, total, m):
        if m.get("phase") == "training" and (time.time() - last[0] > 10 or step == total):
            last[0] = time.time()
            print(f"  step {step}/{total}: fvu {m['fvu']:.3f}, dead {m['dead_share']:.3f}, "
                  f"{m['tokens_per_s']:.0f} tokens/s", flush=True)
        elif m.get("phase") != "training":
            print(f"  {m['phase']}", flush=True)

    run = F.train_features(a.model, a.layer, a.hook, "builtin", a.tokens, expansion_factor=a.expansion, k=a.k,
                           batch_size=a.batch_size, context=a.context, eval_tokens=a.eval_tokens, context_tokens=0,
                           device=device, save=False, progress=progress)
    r = run.record
    q = r["quality"] or {}
    if a.json:
        print(json.dumps({k: v for k, v in r.items() if k != "history"}, indent=1))
    print(f"{r['hook_name']} of {r['model']}: {r['num_latents']} features, k {r['k']}, {r['steps']} steps, "
          f"{r['tokens']} tokens ({r['memory']['statement']})")
    print(f"training: {r['train_seconds']:.1f} s, {r['tokens_per_s']:.0f} tokens/s "
          f"({r['forward_seconds'] / max(r['train_seconds'], 1e-9):.0%} of it in the model's forward), "
          f"dead share {r['dead_share']:.3f}")
    if q:
        print(f"held-out ({q['predictions']} predictions): explained {q['explained']:.4f} (FVU {q['fvu']:.4f}), "
              f"CE clean {q['ce_clean']:.4f}, with features {q['ce_sae']:.4f}, zero-ablated {q['ce_zero']:.4f}, "
              f"CE recovered {q['ce_recovered']:.4f}, L0 {q['l0']:.1f}, alive {q['alive_share']:.3f}")
    print(f"wall {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
