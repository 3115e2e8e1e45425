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
The column "MFU+attn" adds the attention matmuls, 12 L d T per token (PaLM's appendix B and
nanoGPT's estimate_mfu count them; 6 N alone leaves them out).

Loss / kernels (--losses): "labels" is transformers' own `labels=` loss (full [tokens, vocab] logits);
"liger" is Liger's fused linear + cross-entropy on the body's last hidden state (no logits tensor);
"liger-all" adds Liger's RMSNorm, SwiGLU and RoPE kernels. --compile-scope: "model" compiles the
whole model (with a Liger loss it compiles the body only: Liger's own kernels stay outside the graph),
"layers" compiles each decoder layer on its own (regional compilation).
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

from model_core.training import sft  # noqa: E402


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


def build(model_name: str, device: str, dtype: torch.dtype, mode: str, rank: int, compile_: bool,
          loss: str = "labels", scope: str = "model"):
    model, tok, dev = sft.load_trainable(model_name, device)
    model = model.to(dtype=dtype)
    model.config.use_cache = False
    if loss == "liger-all":
        from liger_kernel.transformers import apply_liger_kernel_to_llama
        apply_liger_kernel_to_llama(rope=True, rms_norm=True, swiglu=True, fused_linear_cross_entropy=False,
                                    cross_entropy=False, model=model)
    n_params = sum(p.numel() for p in model.parameters())
    if mode == "lora":
        model = sft.apply_lora(model, rank, None)
        for p in model.parameters():  # LoRA weights in the run dtype too
            if p.requires_grad:
                p.data = p.data.to(dtype)
    params = [p for p in model.parameters() if p.requires_grad]
    fused = dev.type == "cuda"
    opt = torch.optim.AdamW(params, lr=1e-5, fused=fused) if fused else torch.optim.AdamW(params, lr=1e-5)
    if loss == "labels":
        if compile_ and scope == "layers":
            for layer in model.get_decoder().layers:
                layer.compile()
            fwd = model
        else:
            fwd = torch.compile(model) if compile_ else model
        return model, fwd, opt, n_params, sum(p.numel() for p in params), dev
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    body, head, flce = model.get_decoder(), model.get_output_embeddings(), LigerFusedLinearCrossEntropyLoss()
    if compile_ and scope == "layers":
        for layer in body.layers:
            layer.compile()
    elif compile_:
        body = torch.compile(body)

    def fwd(input_ids, labels):
        h = body(input_ids=input_ids).last_hidden_state  # [B, T, d]
        h = h[:, :-1].reshape(-1, h.shape[-1])  # [B*(T-1), d]: position t predicts token t+1
        return flce(head.weight, h, labels[:, 1:].reshape(-1))
    return model, fwd, opt, n_params, sum(p.numel() for p in params), dev


PROFILE = False


def attention_flops_per_token(config, seq: int) -> float:
    """Forward + backward FLOPs of the two attention matmuls (QK^T and AV) per token: 12 L d T."""
    d = config.num_attention_heads * getattr(config, "head_dim", config.hidden_size // config.num_attention_heads)
    return 12.0 * config.num_hidden_layers * d * seq


def run(model_name, device, dtype, mode, batch, seq, steps, warmup, rank, compile_, loss="labels", scope="model"):
    model, fwd, opt, n_params, n_train, dev = build(model_name, device, dtype, mode, rank, compile_, loss, scope)
    vocab = model.config.vocab_size
    attn = attention_flops_per_token(model.config, seq)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (batch, seq), generator=g).to(dev)
    model.train()

    def step():
        out = fwd(input_ids=ids, labels=ids)
        out = out if torch.is_tensor(out) else out.loss
        out.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return out

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
    if PROFILE and dev.type == "cuda":  # where a step's GPU time goes: the top kernels of two steps
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(2):
                step()
            sync(dev)
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60))
    mem = torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else None
    model = fwd = opt = None  # free them before the next configuration
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    return statistics.median(times), n_params, n_train, mem, attn


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
    ap.add_argument("--losses", nargs="+", default=["labels"], choices=["labels", "liger", "liger-all"])
    ap.add_argument("--compile-scope", default="model", choices=["model", "layers"])
    ap.add_argument("--no-eager", action="store_true", help="with --compile: time the compiled rows only")
    ap.add_argument("--peak-tflops", type=float, default=None)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--profile", action="store_true", help="print each row's top CUDA kernels over two steps")
    a = ap.parse_args()
    global PROFILE
    PROFILE = a.profile
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
    print(f"{'mode':5s} {'loss':9s} {'compile':7s} {'shape':>8s} {'s/step':>8s} {'tokens/s':>10s} {'MFU':>7s} "
          f"{'MFU+attn':>8s} {'trainable':>12s} {'GPU GiB':>8s}")
    compiles = [True] if (a.compile and a.no_eager) else ([False, True] if a.compile else [False])
    for compile_ in compiles:
        for loss in a.losses:
            for mode in a.modes:
                for b, t in shapes:
                    label = f"{mode:5s} {loss:9s} {(a.compile_scope if compile_ else 'no'):7s} {f'{b}x{t}':>8s}"
                    try:
                        sec, n, ntr, mem, attn = run(a.model, a.device, dtype, mode, b, t, steps, warmup,
                                                     a.lora_rank, compile_, loss, a.compile_scope)
                    except torch.cuda.OutOfMemoryError:
                        print(f"{label} out of memory", flush=True)
                        torch.cuda.empty_cache()
                        continue
                    except Exception as e:  # a kernel or compiler failure ends this row, not the run
                        print(f"{label} failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
                        continue
                    tps = b * t / sec
                    m = sft.mfu(n, tps, peak)
                    m_attn = (6.0 * n + attn) * tps / peak
                    print(f"{label} {sec:8.3f} {tps:10.0f} {m:7.2%} {m_attn:8.2%} {ntr:12,d} "
                          f"{(f'{mem:.1f}' if mem is not None else '-'):>8s}", flush=True)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
