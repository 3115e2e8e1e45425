"""What one engine decode step costs on a GPU: the captured step uncompiled and compiled (each a CUDA
graph replayed 200 times) per rows and stage set, the sampling + records alone, and with --host
where a served step's wall time goes.

GPU:  PYTHONPATH=. python bench/engine_step.py   (random-smollm2-135m in bf16)
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from common import captured_ms, graph_ms  # noqa: E402

from model_core import load_model  # noqa: E402
from model_core.serving.batch_sampling import sample_rows  # noqa: E402
from model_core.serving.engine import RECORDED, engine_for  # noqa: E402


def main() -> int:
    from model_core.serving.engine import ALL_STAGES, GREEDY_ONLY, Engine, max_len_from_env

    lm = load_model("random-smollm2-135m", device="cuda")
    print(f"# {torch.cuda.get_device_name(0)}, {lm.name} {lm.dtype}")
    # the uncompiled graphs first, on an engine of their own (nothing compiling beside them)
    plain = Engine(lm, 32, max_len_from_env(lm), compile=False)
    plain.ready.wait()
    times = {}
    for B in (1, 8, 32):
        for st in (GREEDY_ONLY, ALL_STAGES):
            times[("graphs", B, st)] = graph_ms(plain._graphs[(B, 512, st)])
    plain.close()
    del plain
    t0 = time.perf_counter()
    eng = engine_for(lm)
    ok = eng.wait_compiled(900)
    print(f"compiled: {eng.compile_state} after {time.perf_counter() - t0:.0f} s", flush=True)
    if ok:
        for B in (1, 8, 32):
            for st in (GREEDY_ONLY, ALL_STAGES):
                times[("compiled", B, st)] = graph_ms(eng._graphs[(B, 512, st)])
    print(f"{'step':>9} {'rows':>4} {'stages':>7} {'ms/step at 512 positions':>25} {'tok/s':>8}")
    for (kind, B, st), ms in times.items():
        print(f"{kind:>9} {B:>4} {'all' if st else 'greedy':>7} {ms:>25.3f} {B / ms * 1000:>8.0f}", flush=True)
    with torch.inference_mode():
        for B in (1, 8, 32):
            logits = torch.randn(B, lm.shape.vocab_size, device="cuda")
            st = eng.live.row_settings.rows(slice(0, B))
            seen = eng.live.seen[:B]
            samp = captured_ms(lambda: sample_rows(logits, st, seen, RECORDED))
            print(f"uncompiled sampling + records alone, {B:>2} rows, all stages: {samp:.3f} ms", flush=True)
    if "--host" in sys.argv:  # where a served step's wall time goes: host work per step vs the whole
        from model_core.core.sampling import SamplingSettings
        from model_core.serving.engine import EngineRequest

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
            samples: dict = {}
            sampling = threading.Event()
            sampling.set()

            def sample_engine_stack():  # a poor man's py-spy: where the engine thread is, every 0.2 ms
                while sampling.is_set():
                    f = sys._current_frames().get(eng._thread.ident)
                    here = []
                    while f is not None and len(here) < 4:
                        here.append(f"{f.f_code.co_name}:{f.f_lineno}")
                        f = f.f_back
                    samples[" < ".join(here)] = samples.get(" < ".join(here), 0) + 1
                    time.sleep(0.0002)
            sampler = threading.Thread(target=sample_engine_stack, daemon=True)
            sampler.start()
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
            sampling.clear()
            sampler.join()
            total = sum(samples.values())
            for where, c in sorted(samples.items(), key=lambda kv: -kv[1])[:12]:
                print(f"  {100 * c / total:5.1f}%  {where}")
            n = eng.stats.steps - steps0
            for name in spent:
                setattr(eng, name, originals[name])
            print(f"served {B:>3} rows: {1000 * wall / n:.3f} ms/step wall, host " +
                  ", ".join(f"{k} {1000 * v / n:.3f}" for k, v in spent.items()) + " ms/step", flush=True)
        print("engine:", eng.stats_dict(), flush=True)
    with torch.inference_mode(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        logits = torch.randn(1, lm.shape.vocab_size, device="cuda")
        st = eng.live.row_settings.rows(slice(0, 1))
        for _ in range(5):
            sample_rows(logits, st, eng.live.seen[:1], RECORDED)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
