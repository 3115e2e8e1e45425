"""What the engine's compiled decode step costs at 32 rows, per way of compiling it, against
transformers' static-cache `generate` at batch 32 in the same run.

Each variant compiles the engine's own step (`Engine._step`, fast: the forward with grouped decode
attention, the greedy sampling and every record) on scratch buffers, captures it as a CUDA graph
and replays it; "positions" is the attention length the step's bucket covers (a 24-token prompt
plus 256 new tokens attends over 280, which the engine rounds up to its length bucket).

  engine           what the engine compiles today
  fused            + inductor freezing and the pre-grad `batch_linear_lhs` pass: linears that read
                   the same input (q/k/v, gate/up) become one matmul over weights concatenated
                   once, at compile time (freezing folds the concatenation)

GPU:  PYTHONPATH=. python bench/decode_forward.py [--rows 32] [--lengths 512 384 288]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from common import capture, captured_ms  # noqa: E402

from model_core import load_model  # noqa: E402
from model_core.serving import decode_attention
from model_core.serving.batch_sampling import sample_rows  # noqa: E402
from model_core.serving.engine import GREEDY_ONLY, Engine, StepBuffers, max_len_from_env  # noqa: E402

VARIANTS = {  # inductor options, and whether rows and positions are dynamic sizes (the engine's way)
    "engine": ({}, True),
    "static": ({}, False),
    "fused": ({"freezing": True, "pre_grad_fusion_options": {"batch_linear_lhs": {}}}, True),
}


def _kernels(fn, n: int = 20) -> str:
    """The kernels of one replay of fn captured as a CUDA graph: how many, and the costliest."""
    from torch.profiler import ProfilerActivity, profile

    g = capture(fn)
    g.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            g.replay()
        torch.cuda.synchronize()
    evs = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    count = sum(e.count for e in evs) / n
    total = sum(e.device_time_total for e in evs) / n / 1000
    top = sorted(evs, key=lambda e: -e.device_time_total)[:12]
    rows = "\n".join(f"    {e.device_time_total / n / 1000:7.3f} ms {e.count / n:5.0f}x  {e.key[:90]}" for e in top)
    return f"  {count:.0f} kernels, {total:.3f} ms of kernel time per step\n{rows}"


def _forward_only(eng: Engine, lm, b: StepBuffers, rows: int, L: int):
    from model_core.core.cache_api import cache_kwarg

    mask = b.cache.window(rows, L, b.pos[:rows])
    return lambda: eng._fast_forward(input_ids=b.tok_in[:rows, None], position_ids=b.pos[:rows, None], attention_mask=mask,
                                     use_cache=True, logits_to_keep=1, **{cache_kwarg(lm.model): b.cache},
                                     **{decode_attention.SLOT_DECODE: True})


def _compiled_step(eng: Engine, lm, variant: tuple, rows: int, lengths: list[int], profile: bool):
    import model_core.serving.engine_step as engine_step

    options, dynamic = variant
    torch._dynamo.reset()
    mark = engine_step._mark_dynamic
    if not dynamic:
        engine_step._mark_dynamic = lambda *dims: None
    eng._fast_forward = torch.compile(lm.model, dynamic=False)
    eng._fast_sample = {GREEDY_ONLY: torch.compile(sample_rows, dynamic=False, options={"split_reductions": False})}
    t0 = time.perf_counter()
    with torch.inference_mode(), torch._inductor.config.patch(**options):
        b = StepBuffers.allocate(eng._shapes, eng.slots, eng.max_len, eng.vocab, eng.dtype, eng.device)
        # a fixed state to compare the variants' outputs on
        g = torch.Generator(device="cuda").manual_seed(0)
        for t in b.cache.keys + b.cache.values:
            t.copy_(torch.randn(t.shape, generator=g, device="cuda", dtype=t.dtype))
        b.tok_in.copy_(torch.randint(0, eng.vocab, b.tok_in.shape, generator=g, device="cuda"))
        b.pos.fill_(min(lengths) - 1)
        for L in lengths:  # compile every shape first (1 and 2 rows as the engine does, then these)
            eng._step(1, L, b, GREEDY_ONLY, fast=True)
            eng._step(2, L, b, GREEDY_ONLY, fast=True)
            eng._step(rows, L, b, GREEDY_ONLY, fast=True)
        torch.cuda.synchronize()
        compile_s = time.perf_counter() - t0
        b.pos.fill_(min(lengths) - 1)
        eng._step(rows, min(lengths), b, GREEDY_ONLY, fast=True)
        logits = b.out_logits[0, :rows].clone()
        ms = {}
        for L in lengths:
            b.pos.fill_(min(lengths) - 1)
            ms[L] = captured_ms(lambda L=L: eng._step(rows, L, b, GREEDY_ONLY, fast=True))
        L = max(lengths)
        fwd = _forward_only(eng, lm, b, rows, L)
        ms["forward"] = captured_ms(fwd)
        detail = ""
        if profile:
            detail = ("whole step:\n" + _kernels(lambda: eng._step(rows, L, b, GREEDY_ONLY, fast=True))
                      + "\nforward alone:\n" + _kernels(fwd))
    engine_step._mark_dynamic = mark
    from torch._dynamo.utils import counters

    fused = dict(counters["inductor"]).get("batch_linear_lhs", 0)
    return ms, logits, compile_s, detail, fused


def _hf_static_ms(lm, rows: int, new: int = 256, prompt: int = 24) -> float:
    x = torch.randint(0, lm.shape.vocab_size, (rows, prompt), device="cuda")
    kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, attention_mask=torch.ones_like(x),
              pad_token_id=0, temperature=None, top_k=None, top_p=None, cache_implementation="static")
    with torch.inference_mode():
        for _ in range(2):
            lm.model.generate(x, **kw)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        lm.model.generate(x, **kw)
        torch.cuda.synchronize()
    return 1000 * (time.perf_counter() - t0) / new


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 384, 288])
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS))
    ap.add_argument("--profile", action="store_true", help="the kernels of one step, per variant")
    args = ap.parse_args()
    lm = load_model("random-smollm2-135m", device="cuda")
    print(f"# {torch.cuda.get_device_name(0)}, torch {torch.__version__}, {lm.name} {lm.dtype}, {args.rows} rows", flush=True)
    eng = Engine(lm, args.rows, max_len_from_env(lm), use_graphs=False, compile=False)
    eng.ready.wait()
    decode_attention.install()
    hf = _hf_static_ms(lm, args.rows)
    print(f"hf static generate, batch {args.rows}: {hf:.3f} ms per step (280 positions at the end)", flush=True)
    ref = None
    print(f"{'variant':>8} {'compile s':>9} " + " ".join(f"{L:>5} pos ms" for L in args.lengths)
          + " " + " ".join(f"{'x hf @' + str(L):>9}" for L in args.lengths)
          + "  forward ms  max |logit diff| vs engine  linears fused")
    for name in args.variants:
        ms, logits, cs, detail, fused = _compiled_step(eng, lm, VARIANTS[name], args.rows, args.lengths, args.profile)
        diff = 0.0 if ref is None else (logits - ref).abs().max().item()
        ref = logits if ref is None else ref
        print(f"{name:>8} {cs:>9.0f} " + " ".join(f"{ms[L]:>10.3f}" for L in args.lengths) + " "
              + " ".join(f"{hf / ms[L]:>9.2f}" for L in args.lengths)
              + f"  {ms['forward']:>10.3f}  {diff:>26.4f}  {fused:>13}", flush=True)
        if detail:
            print(detail, flush=True)
    eng.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
