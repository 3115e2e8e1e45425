"""Trace cost against a plain transformers forward, measured in the same run.

  python bench/trace.py                 # CPU, real default model (fp32)
  python bench/trace.py --random        # default architecture with random weights
  PYTHONPATH=. python bench/trace.py --random --device cuda --lengths 16 128 512 2048 --parity
  PYTHONPATH=. python bench/trace.py --shape llama-8b --device cuda --lengths 512 2048 --profile

Prints, per prompt length: median seconds of a plain forward (SDPA), of lmscope's trace, of the
trace plus its first view (one layer's attention pattern, moved to the host), of the trace with
every layer's pattern materialised, and of transformers' output_attentions + output_hidden_states
(eager; plus copying everything to the host on GPU) — each as a ratio to the plain forward.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from common import device_info, interleaved  # noqa: E402

from model_core import (
    load_model,  # noqa: E402
    trace,
)


def load_times(name: str) -> tuple[tuple | None, tuple]:
    """Cold (GGUF -> safetensors conversion into an empty cache) and warm load, each in a fresh process."""
    # prints "total load_model" seconds: a fresh process, imports included, and load_model() alone
    code = ("import time,sys; t=time.perf_counter(); from model_core import load_model; "
            "t1=time.perf_counter(); lm=load_model(sys.argv[1]); t2=time.perf_counter(); print(t2-t, t2-t1)")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    cold = None
    if not name.startswith("random-"):
        with tempfile.TemporaryDirectory() as d:
            out = subprocess.run([sys.executable, "-c", code, name], env={**env, "LMSCOPE_CACHE_DIR": d},
                                 capture_output=True, text=True, check=True)
            cold = tuple(map(float, out.stdout.strip().splitlines()[-1].split()))
    out = subprocess.run([sys.executable, "-c", code, name], env=env, capture_output=True, text=True, check=True)
    return cold, tuple(map(float, out.stdout.strip().splitlines()[-1].split()))


# Random-weight checkpoints of a published shape, built on the device and opened by path (as a
# user's own checkpoint is): the trace's overhead at a size where the GPU, not Python, is the cost.
SHAPES = {
    "llama-8b": dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                     num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0,
                     max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=False),
}


def build_shape(shape: str, device: str, dtype: str | None) -> str:
    """Save a random checkpoint of `shape` (SHAPES) with the default model's tokenizer; its folder."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from model_core.core.tokenization import byte_tokenizer

    fields = dict(SHAPES[shape])
    cfg = AutoConfig.for_model(fields.pop("model_type"), **fields)
    folder = Path(tempfile.gettempdir()) / f"lmscope-bench-{shape}"
    if not (folder / "config.json").exists():
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, dtype or "bfloat16"))
        model.save_pretrained(folder)
        byte_tokenizer().save_pretrained(folder)
        del model
        if torch.device(device).type == "cuda":
            torch.cuda.empty_cache()
    return str(folder)


def profile_ratio(lm, ids) -> None:
    """Where the trace's extra time goes: CUDA kernel time by name, trace minus plain forward."""
    from torch.profiler import ProfilerActivity, profile

    def kernels(fn) -> dict[str, float]:
        fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            fn()
            torch.cuda.synchronize()
        return {e.key: e.device_time_total / 1e3 for e in prof.key_averages() if e.device_time_total > 0}

    def plain():
        with torch.inference_mode():
            lm.model(input_ids=ids, use_cache=False)

    a, b = kernels(plain), kernels(lambda: trace(lm, token_ids=ids[0]))
    diff = sorted(((b.get(k, 0.0) - a.get(k, 0.0), k) for k in set(a) | set(b)), reverse=True)
    print(f"  profile (device ms): plain {sum(v for k, v in a.items() if not k.startswith('aten::')):.1f}, "
          f"trace {sum(v for k, v in b.items() if not k.startswith('aten::')):.1f}; largest extra:")
    for d, k in diff[:12]:
        if d > 0.05:
            print(f"    +{d:7.2f} ms  {k[:100]}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--random", action="store_true", help="random weights of the default architecture")
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--lengths", type=int, nargs="+", default=[16, 128, 512])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--parity", action="store_true", help="check CPU-vs-device parity on random weights")
    ap.add_argument("--no-load", action="store_true")
    ap.add_argument("--shape", choices=sorted(SHAPES), help="random weights of this shape, saved and opened by path")
    ap.add_argument("--profile", action="store_true", help="CUDA kernel time the trace adds, by kernel")
    ap.add_argument("--no-hf", action="store_true", help="skip transformers' output_attentions (memory at 8B)")
    args = ap.parse_args()

    name = "random-smollm2-135m" if args.random else "smollm2-135m-instruct"
    if args.shape:
        name, args.no_load = build_shape(args.shape, args.device or "cuda", args.dtype), True
    lm = load_model(name, device=args.device, dtype=args.dtype)
    eager = None if args.shape else load_model(name, device=args.device, dtype=args.dtype,
                                               attn_implementation="eager")
    dev = lm.device
    print(f"# bench/trace.py  model={name}  {device_info(lm.device)}  dtype={lm.dtype}")
    if not args.no_load:
        cold, warm = load_times(name) if dev.type == "cpu" else (None, (lm.load_seconds, lm.load_seconds))
        c = "n/a" if cold is None else f"{cold[0]:.2f} s ({cold[1]:.2f} s in load_model)"
        print(f"load, fresh process with imports: cold (GGUF convert) {c}; warm (cache) {warm[0]:.2f} s"
              f" ({warm[1]:.2f} s in load_model, the rest importing torch + transformers)")
    g = torch.Generator().manual_seed(0)
    print(f"{'T':>5} {'plain s':>9} {'trace':>7} {'+1st view':>9} {'+all pat':>9} {'hf attn+hid':>11}"
          f" {'captured MB':>11} {'patterns MB':>11} {'peak GPU MB':>11}")
    for T in args.lengths:
        top = 256 if args.shape else 40000 if not args.random else 49000  # a shape has the byte tokenizer
        ids = torch.randint(min(300, top // 2), top, (1, T), generator=g).to(dev)
        mid = lm.shape.n_layers // 2

        def plain():
            with torch.inference_mode():
                lm.model(input_ids=ids, use_cache=False)

        def tr_only():
            trace(lm, token_ids=ids[0])

        def first_view():
            tr = trace(lm, token_ids=ids[0])
            tr.attention_pattern(mid)[0].float().cpu()  # one head's heatmap, what the page shows

        def all_patterns():
            tr = trace(lm, token_ids=ids[0])
            tr.cache_size = 10**6
            for l in range(lm.shape.n_layers):
                tr.attention_pattern(l)

        def hf_full():
            with torch.inference_mode():
                out = eager.model(input_ids=ids, output_attentions=True, output_hidden_states=True, use_cache=False)
                if dev.type == "cuda":
                    [a.cpu() for a in out.attentions]
                    [h.cpu() for h in out.hidden_states]

        reps = args.repeats if T <= 512 else max(3, args.repeats // 2)
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        fns = {"plain": plain, "trace": tr_only, "first": first_view, "all": all_patterns, "hf": hf_full}
        if args.no_hf or args.shape:  # every pattern of 32 layers at 2,048 tokens is 8 GB per copy
            fns.pop("hf")
            fns.pop("all")
        t = interleaved(fns, reps, dev)
        t.setdefault("hf", float("nan"))
        t.setdefault("all", float("nan"))
        peak = torch.cuda.max_memory_allocated() / 2**20 if dev.type == "cuda" else float("nan")
        tr = trace(lm, token_ids=ids[0])
        cap = tr.captured_bytes() / 2**20
        pat = lm.shape.n_layers * lm.shape.n_heads * T * T * torch.finfo(lm.dtype).bits / 8 / 2**20
        p = t["plain"]
        print(f"{T:>5} {p:>9.4f} {t['trace'] / p:>6.3f}x {t['first'] / p:>8.3f}x {t['all'] / p:>8.3f}x"
              f" {t['hf'] / p:>10.3f}x {cap:>11.1f} {pat:>11.1f} {peak:>11.0f}")
        print(f"      absolute: trace {t['trace'] * 1e3:.1f} ms, trace + first view {t['first'] * 1e3:.1f} ms,"
              f" hf attn+hidden{' + host copy' if dev.type == 'cuda' else ''} {t['hf'] * 1e3:.1f} ms")
        del tr
        if args.profile and dev.type == "cuda":
            profile_ratio(lm, ids)
    if args.parity and dev.type != "cpu":
        cpu = load_model("random-smollm2-135m", device="cpu", dtype="float32")
        gpu32 = load_model("random-smollm2-135m", device=str(dev), dtype="float32")
        ids = torch.randint(300, 49000, (256,), generator=g)
        a, b = trace(cpu, token_ids=ids), trace(gpu32, token_ids=ids)
        dl = (a.next_logits - b.next_logits.cpu()).abs().max().item()
        dp = max((a.attention_pattern(l) - b.attention_pattern(l).cpu()).abs().max().item() for l in range(30))
        c = trace(lm, token_ids=ids)
        top_match = (a.logits().argmax(-1) == c.logits().float().cpu().argmax(-1)).float().mean().item()
        print(f"parity CPU fp32 vs {dev} fp32: max |dlogits| {dl:.2e}, max |dpattern| {dp:.2e};"
              f" CPU fp32 vs {dev} {lm.dtype}: top-1 agreement {top_match:.3f}")


if __name__ == "__main__":
    main()
