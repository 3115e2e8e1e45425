"""A training job on one GPU against the same job on N GPUs (model_core.training.data_parallel), same run:
the SFT job's own function (run_sft_on_gpus: Trainer, the GPU speed options of train_speed), the
built-in data, the same global batch, so the loss curves should agree within bf16 noise.

  PYTHONPATH=. python bench/data_parallel.py --device cuda --processes 1 2 --batch 64 --steps 30
  python bench/data_parallel.py --model random-llama-tiny --processes 1 2 --steps 4   # CPU, gloo

Prints, per process count: seconds, training tokens/s (the Trainer's own count over its training
time), the loss curve, and each curve's largest difference from the first row's.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import device_info, row_rate  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--device", default=None, help="default: cuda when present")
    ap.add_argument("--processes", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--batch", type=int, default=64, help="the whole step's examples")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--train-size", type=int, default=4096, help="built-in examples")
    ap.add_argument("--max-length", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--skip", type=int, default=5, help="steps left out of the steady-state rate")
    ap.add_argument("--compile", choices=["auto", "on", "off"], default="auto")
    ap.add_argument("--packing", nargs="+", choices=["on", "off"], default=["off"],
                    help="padded batches (the job's default) and/or padding-free packed rows, each timed")
    ap.add_argument("--loader-workers", nargs="+", default=["auto"],
                    help="processes building the batches (the setting loader_workers), each timed: auto or a number")
    a = ap.parse_args()
    os.environ.setdefault("LMSCOPE_DATA_DIR", tempfile.mkdtemp(prefix="lmscope-dp-bench-"))
    from model_core.training import sft

    print(f"# {device_info(a.device)} · model {a.model} · batch {a.batch} (whole step) · {a.steps} steps · "
          f"max_length {a.max_length}", flush=True)
    curves = {}
    runs = [(n, p, w) for w in a.loader_workers for p in a.packing for n in a.processes]
    for n, packing, workers in runs:
        rows, logs = [], []
        settings = {"model": a.model, "dataset": "builtin", "builtin_train_size": a.train_size, "batch_size": a.batch,
                    "max_length": a.max_length, "max_steps": a.steps, "learning_rate": a.lr, "accuracy_examples": 0,
                    "eval_fraction": 0.0, "sample_every": 0, "seed": 0, "device": a.device,
                    "torch_compile": {"auto": None, "on": True, "off": False}[a.compile], "packing": packing == "on",
                    "loader_workers": None if workers == "auto" else int(workers),
                    "output_name": f"dp-bench-{n}-{uuid.uuid4().hex[:6]}"}
        t0 = time.time()
        res = sft.run_sft_on_gpus(settings, progress=rows.append, log=logs.append, processes=n)
        sec = time.time() - t0
        m = res.info["metrics"]
        curve = [r["loss"] for r in rows if r.get("loss") is not None]
        curves[(n, packing, workers)] = curve
        steps = [r for r in rows if r.get("loss") is not None]
        k = min(a.skip, len(steps) - 2)  # steady state: after the steps that compiled
        steady = row_rate(steps[k], steps[-1]) if len(steps) > 2 else float("nan")
        # each logged step's own rate (rows are read after the step's loss reached the host), median:
        # a window's mean moves with a few slow steps (a recompile for a new padded width, a GC)
        per_step = sorted(r for r in map(row_rate, steps[k:], steps[k + 1:]) if r == r)  # r == r: not nan
        median = per_step[len(per_step) // 2] if per_step else float("nan")
        print(f"processes {n}, packing {packing}, loader workers {workers}: {sec:.1f} s in all, training {m['train_seconds']:.1f} s, "
              f"{m['tokens_seen']:,} tokens, {m['tokens_per_s'] or 0:,.0f} tokens/s over the run, "
              f"{steady:,.0f} tokens/s after step {k}, median step {median:,.0f} tokens/s", flush=True)
        for line in logs:
            if any(w in line for w in ("compiled", "Liger", "liger", "processes", "loader")):
                print(f"  log: {line}")
        print("  loss: " + " ".join(f"{x:.4f}" for x in curve), flush=True)
    first = curves[runs[0]]
    for (n, packing, workers), c in curves.items():
        d = max((abs(x - y) for x, y in zip(c, first)), default=0.0)
        rel = max((abs(x - y) / abs(y) for x, y in zip(c, first) if y), default=0.0)
        print(f"processes {n} packing {packing} loader workers {workers} vs {runs[0]}: largest |Δ loss| {d:.4f} "
              f"(relative {rel:.2%}) over {len(c)} steps")


if __name__ == "__main__":
    main()
