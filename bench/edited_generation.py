"""Edited generations on the shared engine against plain ones, in the same run.

Per scenario, the aggregate tokens/s of users generating at once (greedy, --tokens each, EOS
ignored), the edited ones over the plain ones as a ratio:
  - 1 and 8 users: plain; steered (a vector at layer 12, alpha 4); a sparse-autoencoder feature
    clamped (a fresh 8x autoencoder at layer 6's output); ablated (two heads of layer 3, layer 9's MLP
    and two neurons, zeroed);
  - 16 users of which half steer, against 16 plain users;
  - one steered user on the request's own forwards (the path before edits ran on the engine: a hook
    edit without a per-row form), for the before/after.
Scenarios run round-robin, --repeats times each, median reported (the machines are noisy).

CPU:  .venv/bin/python bench/edited_generation.py            (the real default model, recorded steps)
GPU:  PYTHONPATH=. python bench/edited_generation.py --device cuda --random   (random-smollm2-135m, bf16;
      the engine's CUDA graphs uncompiled unless --compile)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

WHERE = ("prefill_s", "launch_s", "wait_s", "hand_out_s", "busy_s", "steps")  # engine time by part, per run
PROMPTS = ["The history of the city begins with a small settlement by the river, where",
           "In a quiet laboratory, the researchers finally noticed that the signal",
           "def merge_sorted(a, b):\n    out = []\n    i = j = 0\n    while",
           "The recipe calls for two cups of flour, a pinch of salt and"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--random", action="store_true", help="random-smollm2-135m instead of the real default model")
    ap.add_argument("--tokens", type=int, default=None, help="new tokens per generation (default 128 CUDA, 32 CPU)")
    ap.add_argument("--users", type=int, nargs="+", default=None, help="default 1 8 16 on CUDA, 1 4 on a CPU")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--compile", action="store_true", help="the engine's compiled step for plain rows (CUDA)")
    ap.add_argument("--no-old-path", action="store_true", help="leave out the steered run on its own forwards")
    args = ap.parse_args(argv)
    cuda = args.device.startswith("cuda")
    os.environ.setdefault("LMSCOPE_COMPILE", "1" if args.compile else "0")
    tokens = args.tokens or (128 if cuda else 32)
    users = args.users or ([1, 8, 16] if cuda else [1, 4])
    os.environ.setdefault("LMSCOPE_MAX_NEW_TOKENS", str(max(256, tokens)))
    os.environ.setdefault("LMSCOPE_MAX_BATCH", str(max(32, max(users))))

    from bench.common import device_info
    from model_core import load_model
    from model_core.core.row_edits import engine_runnable
    from model_core.interp import features as F
    from model_core.interp.feature_steering import feature_edits
    from model_core.interp.interventions import Ablation, ablation_edits
    from model_core.interp.steering import SteeringVector, steering_edits
    from model_core.serving.engine import engine_for
    from model_core.serving.generate import generate

    lm = load_model("random-smollm2-135m" if args.random else "smollm2-135m-instruct", device=args.device)
    d = lm.shape.d_model
    g = torch.Generator().manual_seed(0)
    v = torch.randn(d, generator=g)
    vec = SteeringVector(model_name=lm.name, layer=12, vector=v / v.norm() * 8, n_pairs=1, position="last")
    sae = F.new_sae(d, num_latents=8 * d, k=32, seed=0, device=lm.device)
    feats = F.Features(sae=sae, model=lm.name, layer=6, hook="resid_post", name="bench")
    steer = steering_edits(lm, vec, 4.0)
    edits = {"plain": None, "steered": steer, "clamped": feature_edits(lm, feats, 7, 20.0),
             "ablated": ablation_edits(lm, Ablation(heads=[(3, 1), (3, 5)], mlps=[9], neurons=[(5, 17), (5, 400)]))}
    # the path before: the same edit as a plain function has no per-row form, so the request runs alone
    [(sname, sfn)] = steer.items()
    edits["steered, own forwards"] = {sname: lambda n, x: sfn(n, x)}

    eng = engine_for(lm)
    t_start = time.perf_counter()
    if args.compile:
        eng.wait_compiled(900)  # measured once the compiled step serves plain rows ...
        print(f"# plain step compiled after {time.perf_counter() - t_start:.0f} s", flush=True)
        deadline = time.monotonic() + 900
        while not eng.step_graphs.edited_compiled and time.monotonic() < deadline:
            time.sleep(1)  # ... and edited ones (compiled after)
        print(f"# edited step compiled after {time.perf_counter() - t_start:.0f} s "
              f"(edited_compile_s {eng.stats.edited_compile_s:.0f})", flush=True)
    print(f"# bench/edited_generation.py  {lm.name} on {device_info(lm.device)}, {lm.dtype}; {tokens} greedy tokens "
          f"per user; engine compile {eng.compile_state}, {eng.slots} slots", flush=True)

    def prompt(i):  # users 2j and 2j+1 share a prompt: a mixed batch has each prompt plain and edited
        return PROMPTS[(i // 2) % len(PROMPTS)]

    def run(kinds: list, outputs: list | None = None) -> float:
        """Users with these edit kinds generate at once; aggregate tokens/s."""
        out = [None] * len(kinds) if outputs is None else outputs

        def one(i):
            out[i] = generate(lm, prompt(i), max_new_tokens=tokens, ignore_eos=True, edits=edits[kinds[i]])

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(kinds))]
        with eng.hold():
            for t in threads:
                t.start()
            deadline = time.monotonic() + 60
            on_engine = sum(engine_runnable(edits[k], lm.device) for k in kinds)
            while eng.waiting() < on_engine and time.monotonic() < deadline:
                time.sleep(0.001)
            t0 = time.perf_counter()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        assert all(len(o.token_ids) == tokens for o in out)
        return len(kinds) * tokens / wall

    scenarios: dict[str, list] = {}
    for n in users:
        if n == 16:
            scenarios["16 users, plain"] = ["plain"] * 16
            scenarios["16 users, half steered"] = ["plain", "steered"] * 8
            continue
        for k in ("plain", "steered", "clamped", "ablated"):
            scenarios[f"{n} user{'s' if n > 1 else ''}, {k}"] = [k] * n
    if not args.no_old_path:
        scenarios["1 user, steered, own forwards"] = ["steered, own forwards"]
    for name, kinds in scenarios.items():  # warm-up: every edited bucket captured (CUDA) or recorded (CPU)
        t0 = time.perf_counter()
        run(kinds)
        first = time.perf_counter() - t0
        before = {k: getattr(eng.stats, k) for k in WHERE}
        rate = run(kinds)
        spent = "  ".join(f"{k} {getattr(eng.stats, k) - before[k]:.3f}" for k in WHERE)
        print(f"# warm-up {name}: {first:.1f} s, then {rate:.0f} tok/s; engine: {spent}", flush=True)
    if eng._recorded is not None:
        eng._recorded.wait_recorded(900)
        for kinds in scenarios.values():
            run(kinds)
    rates: dict[str, list[float]] = {k: [] for k in scenarios}
    for _ in range(args.repeats):
        for name, kinds in scenarios.items():
            rates[name].append(run(kinds))
    med = {k: statistics.median(v) for k, v in rates.items() if v}  # --repeats 0: the checks alone
    print(f"{'scenario':<34} {'tok/s':>9} {'vs plain':>8} {'ms/token/user':>13}  each run")
    summary = {}
    for name, r in med.items():
        n = len(scenarios[name])
        base = name.split(",")[0] + ", plain"
        ratio = r / med[base] if base in med else None
        summary[name] = {"tok_s": round(r, 1), "vs_plain": round(ratio, 3) if ratio else None}
        print(f"{name:<34} {r:>9.1f} {ratio if ratio else float('nan'):>8.2f} {1000 * n / r:>13.2f}  "
              + " ".join(f"{x:.0f}" for x in rates[name]), flush=True)

    def own_forwards(k: str, text: str):
        """The generation with edit k on the request's own forwards (its edits as plain hook functions)."""
        own = {name: (lambda f: lambda n, x: f(n, x))(fn) for name, fn in edits[k].items()}
        return generate(lm, text, max_new_tokens=tokens, ignore_eos=True, edits=own)

    def first_difference(a, b) -> str:
        """Where two generations' tokens part, with both sides' top-2 probabilities at that step (a near
        tie there is rounding: bf16 kernels of another shape or fusion; random weights spread the
        distribution thin (top probabilities under 1e-3), so near ties are common)."""
        i = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), None)
        if i is None:
            return f"equal over {len(a.token_ids)}"
        pa, pb = a.steps[i].top_probs[:2], b.steps[i].top_probs[:2]
        return f"differ from step {i} (top-2 p {pa[0]:.2e}/{pa[1]:.2e} vs {pb[0]:.2e}/{pb[1]:.2e})"

    # each edit on the engine against the same edit on the request's own forwards
    for k in ("steered", "clamped", "ablated"):
        a = generate(lm, PROMPTS[0], max_new_tokens=tokens, ignore_eos=True, edits=edits[k])
        print(f"# {k}: engine and own forwards {first_difference(a, own_forwards(k, PROMPTS[0]))}", flush=True)
    # in the mixed batch, each steered row against its plain batch mate (same prompt) and against the
    # same steered generation on its own forwards (bf16: a batch's kernels may round differently)
    mixed = scenarios.get("16 users, half steered")
    if mixed:
        outs: list = [None] * len(mixed)
        run(mixed, outs)
        refs = {text: own_forwards("steered", text) for text in dict.fromkeys(prompt(j) for j in range(len(mixed)))}
        for j in range(1, len(mixed), 2):
            print(f"# mixed batch, steered row {j}: against its own forwards {first_difference(outs[j], refs[prompt(j)])}; "
                  f"against its plain batch mate {first_difference(outs[j], outs[j - 1])}", flush=True)
    st = eng.stats_dict()
    print("engine:", {k: st[k] for k in ("edited_graphs", "edited_compiled_graphs", "compiled_graphs", "compile_s", "edited_compile_s", "edited_eager_steps", "cuda_graphs", "compiled",
                                         "recorded_steps") if k in st})
    from torch._dynamo.utils import counters
    print("dynamo:", dict(counters["stats"]), "graph breaks", sum(counters["graph_break"].values()))
    print(json.dumps({"device": device_info(lm.device), "tokens": tokens, "results": summary}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
