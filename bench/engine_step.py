"""What one engine decode step costs on a GPU, by part: the whole captured step, the model's forward
alone, and the sampling + records alone, each as a CUDA graph replayed 200 times, per batch size.

GPU:  PYTHONPATH=. python bench/engine_step.py   (random-smollm2-135m in bf16)
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from model_core import load_model  # noqa: E402
from model_core.engine import RECORDED, engine_for  # noqa: E402
from model_core.row_sampling import sample_rows  # noqa: E402


def replay_ms(fn, n=200) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        g.replay()
    torch.cuda.synchronize()
    return 1000 * (time.perf_counter() - t0) / n


def main() -> int:
    lm = load_model("random-smollm2-135m", device="cuda")
    eng = engine_for(lm)
    print(f"# {torch.cuda.get_device_name(0)}, {lm.name} {lm.dtype}")
    print(f"{'rows':>4} {'L':>5} {'whole step ms':>14} {'sampling+records ms':>20} {'step tok/s':>11}")
    with torch.inference_mode():
        for B in (1, 8, 32):
            for L in (512,):
                g = eng._graphs[(B, L)]
                g.replay()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(200):
                    g.replay()
                torch.cuda.synchronize()
                whole = 1000 * (time.perf_counter() - t0) / 200
                logits = torch.randn(B, lm.shape.vocab_size, device="cuda")
                st = eng.row_settings.rows(slice(0, B))
                seen = eng.seen[:B]
                samp = replay_ms(lambda: sample_rows(logits, st, seen, RECORDED))
                print(f"{B:>4} {L:>5} {whole:>14.3f} {samp:>20.3f} {B / whole * 1000:>11.0f}", flush=True)
    if "--host" in sys.argv:  # where a served step's wall time goes: host work per step vs the whole
        from model_core.engine import EngineRequest
        from model_core.sampling import SamplingSettings

        for B in (1, 32):
            spent = {"_launch": 0.0, "_hand_out": 0.0, "_drop_cancelled": 0.0}
            originals = {name: getattr(eng, name) for name in spent}

            def timed(name):
                def call(*a):
                    t = time.perf_counter()
                    try:
                        return originals[name](*a)
                    finally:
                        spent[name] += time.perf_counter() - t
                return call
            for name in spent:
                setattr(eng, name, timed(name))
            steps0 = eng.stats.steps
            reqs = [EngineRequest(ids=list(range(10, 34)), n_steps=256, settings=SamplingSettings(temperature=0),
                                  seed=0, eos=set()) for _ in range(B)]
            t0 = time.perf_counter()
            with eng.hold():
                for r in reqs:
                    eng.submit(r)
            for r in reqs:
                while r.out.get() is not None:
                    pass
            wall = time.perf_counter() - t0
            n = eng.stats.steps - steps0
            for name in spent:
                setattr(eng, name, originals[name])
            print(f"served {B:>3} rows: {1000 * wall / n:.3f} ms/step wall, host " +
                  ", ".join(f"{k} {1000 * v / n:.3f}" for k, v in spent.items()) + " ms/step", flush=True)
    if "--compile" in sys.argv:  # the model's forward compiled by inductor, then captured with the rest
        import traceback

        from model_core.cache_api import cache_kwarg
        from model_core.slot_cache import step_mask

        fwd = torch.compile(lm.model, dynamic=False)
        for B in (1, 32):
            t0 = time.perf_counter()
            tok, pos = eng.tok_in[:B], eng.pos[:B]

            def forward(B=B, tok=tok, pos=pos):
                eng._cache.window(B, 512, pos)
                return fwd(input_ids=tok[:, None], position_ids=pos[:, None], attention_mask=step_mask(pos, 512, lm.dtype),
                           use_cache=True, logits_to_keep=1, **{cache_kwarg(lm.model): eng._cache}).logits
            try:
                with torch.inference_mode():
                    ms = replay_ms(forward)
                print(f"compiled forward {B:>4} rows: {ms:.3f} ms/step, {B / ms * 1000:.0f} tok/s "
                      f"(compile + capture {time.perf_counter() - t0:.0f} s)", flush=True)
            except Exception:  # noqa: BLE001
                print("compile failed:", traceback.format_exc()[-3000:], flush=True)
                break
    with torch.inference_mode(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        logits = torch.randn(1, lm.shape.vocab_size, device="cuda")
        st = eng.row_settings.rows(slice(0, 1))
        for _ in range(5):
            sample_rows(logits, st, eng.seen[:1], RECORDED)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
