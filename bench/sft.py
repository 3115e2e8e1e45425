"""SFT training throughput: tokens per second and MFU (6 N x tokens/s / peak) of a plain training step
(forward, loss on every token, backward, AdamW step) for full fine-tuning and LoRA.

  python bench/sft.py                                   # CPU, real default model (fp32), 2 x 128, short
  PYTHONPATH=. python bench/sft.py --model random-smollm2-135m --device cuda --dtype bf16 \
      --shapes 8x512 32x512 --modes full lora [--compile]

GPU runs use random weights of the default architecture (the packaged GGUF cannot travel there).
Peak: --peak-tflops, else 989 (H100/H200 dense bf16, datasheet) on CUDA; on CPU an estimate from
cores x clock x FLOPs per cycle (fp32 FMA: 32 with AVX2, 64 with AVX-512), printed as an estimate.
MFU counts 6 N FLOPs per token for both modes (the usual convention); LoRA skips the weight
gradients of the frozen matrices (~2N of the 6N), so its useful-FLOP utilisation is ~2/3 of that.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from common import device_info, sync  # noqa: E402

from model_core import sft  # noqa: E402


def cpu_peak_estimate() -> tuple[float, str]:
    flags = ""
    ghz = None
    try:
        info = Path("/proc/cpuinfo").read_text()
        flags = next((l for l in info.splitlines() if l.startswith("flags")), "")
        mhz = [float(l.split(":")[1]) for l in info.splitlines() if l.startswith("cpu MHz")]
        ghz = (max(mhz) / 1000) if mhz else None
    except OSError:
        pass
    per_cycle = 64 if "avx512f" in flags else (32 if "fma" in flags else 8)
    ghz = ghz or 2.5
    threads = torch.get_num_threads()
    peak = threads * ghz * 1e9 * per_cycle
    return peak, f"estimate: {threads} threads x {ghz:.2f} GHz x {per_cycle} fp32 FLOP/cycle"


def build(model_name: str, device: str, dtype: torch.dtype, mode: str, rank: int, compile_: bool):
    model, tok, dev = sft.load_trainable(model_name, device)
    model = model.to(dtype=dtype)
    model.config.use_cache = False
    n_params = sum(p.numel() for p in model.parameters())
    if mode == "lora":
        model = sft.apply_lora(model, rank, None)
        for p in model.parameters():  # LoRA weights in the run dtype too
            if p.requires_grad:
                p.data = p.data.to(dtype)
    params = [p for p in model.parameters() if p.requires_grad]
    fused = dev.type == "cuda"
    opt = torch.optim.AdamW(params, lr=1e-5, fused=fused) if fused else torch.optim.AdamW(params, lr=1e-5)
    fwd = torch.compile(model) if compile_ else model
    return model, fwd, opt, n_params, sum(p.numel() for p in params), dev


def run(model_name, device, dtype, mode, batch, seq, steps, warmup, rank, compile_):
    model, fwd, opt, n_params, n_train, dev = build(model_name, device, dtype, mode, rank, compile_)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (batch, seq), generator=g).to(dev)
    model.train()

    def step():
        out = fwd(input_ids=ids, labels=ids)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return out.loss

    for _ in range(warmup):
        step()
    sync(dev)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        loss = step()
        sync(dev)
        times.append(time.perf_counter() - t0)
    if not torch.isfinite(loss):
        print(f"  warning: loss {float(loss)} is not finite")
    mem = torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else None
    model = fwd = opt = None  # free them before the next configuration
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    return statistics.median(times), n_params, n_train, mem


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None, help="float32 | bfloat16 (default: bf16 on cuda, fp32 on cpu)")
    ap.add_argument("--shapes", nargs="+", default=None, help="BxT, e.g. 8x512 32x512 (cpu default 2x128)")
    ap.add_argument("--modes", nargs="+", default=["full", "lora"], choices=["full", "lora"])
    ap.add_argument("--lora-rank", type=int, default=8)
    ap.add_argument("--steps", type=int, default=None, help="timed steps (median); default 3 cpu, 10 cuda")
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--compile", action="store_true", help="also time torch.compile(model)")
    ap.add_argument("--peak-tflops", type=float, default=None)
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    cuda = a.device.startswith("cuda")
    dtype = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}[
        a.dtype or ("bf16" if cuda else "fp32")]
    shapes = [tuple(int(x) for x in s.lower().split("x")) for s in (a.shapes or (["8x512", "32x512"] if cuda
                                                                                 else ["2x128"]))]
    steps = a.steps or (10 if cuda else 3)
    warmup = a.warmup if a.warmup is not None else (3 if cuda else 1)
    if a.peak_tflops:
        peak, peak_note = a.peak_tflops * 1e12, f"given: {a.peak_tflops} TFLOP/s"
    elif cuda:
        peak, peak_note = sft.H100_BF16_PEAK, "989 TFLOP/s dense bf16 (H100/H200 datasheet)"
    else:
        peak, peak_note = cpu_peak_estimate()
    print(f"# {device_info(a.device)} · model {a.model} · {str(dtype).replace('torch.', '')} · peak {peak / 1e12:.3f} "
          f"TFLOP/s ({peak_note})")
    print(f"{'mode':5s} {'compile':7s} {'shape':>8s} {'s/step':>8s} {'tokens/s':>10s} {'MFU':>7s} {'trainable':>12s}"
          f" {'GPU GiB':>8s}")
    for compile_ in ([False, True] if a.compile else [False]):
        for mode in a.modes:
            for b, t in shapes:
                try:
                    sec, n, ntr, mem = run(a.model, a.device, dtype, mode, b, t, steps, warmup, a.lora_rank, compile_)
                except torch.cuda.OutOfMemoryError:
                    print(f"{mode:5s} {str(compile_):7s} {b}x{t:<6d} out of memory")
                    torch.cuda.empty_cache()
                    continue
                tps = b * t / sec
                m = sft.mfu(n, tps, peak)
                print(f"{mode:5s} {str(compile_):7s} {f'{b}x{t}':>8s} {sec:8.3f} {tps:10.0f} {m:7.2%} {ntr:12,d} "
                      f"{(f'{mem:.1f}' if mem is not None else '-'):>8s}", flush=True)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
