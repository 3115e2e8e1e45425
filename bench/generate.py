"""Generation throughput: lmscope's recorded generation against transformers' generate.

For greedy and sampled settings, in the same run and on the same model:
  - tokens/s of model_core.serving.generate.generate (every step recorded: top candidates before/after
    the filters, chosen rank and probability, entropies, per-filter counts),
  - tokens/s of transformers' model.generate with the same settings (dynamic cache; and on
    CUDA, with --hf-static, cache_implementation="static" which compiles the forward),
  - the ratio (recording overhead; the target is at most 10% slower),
  - the KV-cache on/off ratio (greedy decoding with and without the cache).

CPU:  .venv/bin/python bench/generate.py            (the real default model)
      .venv/bin/python bench/generate.py --server   (and through a live server's /generate)
      .venv/bin/python bench/generate.py --random   (random-smollm2-135m, same architecture)
GPU:  PYTHONPATH=. python bench/generate.py --device cuda   (random-smollm2-135m in bf16;
      no gguf needed). Prints one line per measurement and a JSON summary at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _hf_generate(lm, ids, n, s, static=False):
    kw = dict(max_new_tokens=n, min_new_tokens=n, pad_token_id=lm.tokenizer.pad_token_id or 0,
              attention_mask=torch.ones_like(ids))
    if static:
        kw["cache_implementation"] = "static"
    if s.greedy:
        kw.update(do_sample=False, temperature=None, top_k=None, top_p=None)
        if s.repetition_penalty != 1:
            kw["repetition_penalty"] = s.repetition_penalty
    else:
        kw.update(do_sample=True, temperature=s.temperature, top_k=s.top_k or None, top_p=s.top_p,
                  min_p=s.min_p or None, repetition_penalty=s.repetition_penalty)
    with torch.inference_mode():
        return lm.model.generate(ids, **kw)


def _time(fn, dev, repeats):
    best = float("inf")
    for _ in range(repeats):
        _sync(dev)
        t0 = time.perf_counter()
        fn()
        _sync(dev)
        best = min(best, time.perf_counter() - t0)
    return best


def _time_pair(a, b, dev, repeats):
    """Best-of-N wall time of a and b, alternating runs so that machine noise hits both alike."""
    ta = tb = float("inf")
    for _ in range(repeats):
        ta = min(ta, _time(a, dev, 1))
        tb = min(tb, _time(b, dev, 1))
    return ta, tb


def _server_vs_script(lm, model: str, ids: list[int], prompt: str, n: int, repeats: int, client: str = "page") -> dict:
    """The greedy generation above through a live server on loopback, as a browser asks for it (one
    request, the reply once every view is built), against the same generation in this script,
    alternating one of each `repeats` times after two warm-ups (this machine's speed drifts by 20-30%
    over minutes: both sides of the ratio see the same drift); best of each. While one side is
    timed the other waits (the server on its socket, this process on the reply). The request goes
    as the page sends it (bench/load.py's `connect`: one session, its event stream read as it
    comes); client="gradio": through gradio_client, whose 50 ms polling of its own message queue
    adds up to 50 ms to every message it waits for."""
    import re

    from load import connect, gen_args, wait_for_recordings

    from model_core.core.sampling import SamplingSettings
    from model_core.serving.generate import generate
    from tests.helpers.browser import LiveServer

    greedy = SamplingSettings(temperature=0)
    server = LiveServer(extra_env={"LMSCOPE_MAX_NEW_TOKENS": str(max(n, 256)), "REDIS_URL": "redis://127.0.0.1:1/0"})
    try:
        call = connect(server.url, None, client)
        args = gen_args(model, prompt, n)  # greedy, as the script's (the one list of the event's inputs)
        best_server = best_script = float("inf")
        steps, pair_ratios = None, []
        for i in range(repeats + 2):
            if i in (0, 2):  # a CPU engine's recordings, here and in the server: made before timing
                # (at start, and those the warm-ups asked for: model_core.serving.torchscript_replay)
                print("server:", wait_for_recordings(server.url, None, model))
                from model_core.serving.engine import existing_engine

                eng = existing_engine(lm)
                if eng is not None and eng._recorded is not None:
                    eng._recorded.wait_recorded(300)
            t0 = time.perf_counter()
            g = generate(lm, token_ids=ids, max_new_tokens=n, settings=greedy, seed=0, ignore_eos=True)
            t_script = time.perf_counter() - t0
            assert len(g.steps) == n
            t0 = time.perf_counter()
            out = call("generate", args)
            t_server = time.perf_counter() - t0
            m = re.search(r"(\d+) tokens", str(out[2]))  # the status line says how many were generated
            steps = int(m.group(1)) if m else n
            if i >= 2:
                best_server, best_script = min(best_server, t_server), min(best_script, t_script)
                pair_ratios.append((steps / t_server) / (n / t_script))
    finally:
        server.stop()
    row = {"client": client, "server_tok_s": steps / best_server, "server_tokens": steps, "script_tok_s": n / best_script,
           "server_vs_script": (steps / best_server) / (n / best_script),
           "pair_ratios": [round(r, 3) for r in pair_ratios], "median_pair_ratio": statistics.median(pair_ratios)}
    print(f"server   {row['server_tok_s']:8.1f} tok/s through /generate ({client} client, {steps} tokens, reply with "
          "every view) | "
          f"script {row['script_tok_s']:8.1f} tok/s (alternating with the server) | server/script: best of each "
          f"{row['server_vs_script']:.3f}, median of the {len(pair_ratios)} back-to-back pairs "
          f"{row['median_pair_ratio']:.3f} (target: within 10%)")
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    ap.add_argument("--random", action="store_true", help="random-smollm2-135m instead of the real default model")
    ap.add_argument("--model", default=None)
    ap.add_argument("--tokens", type=int, default=None, help="new tokens per run (default 32 CPU, 256 GPU)")
    ap.add_argument("--prompt", default="The history of the printing press begins")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None,
                    help="CPU threads (default 1: on a shared 2-core machine more threads spin and slow down)")
    ap.add_argument("--hf-static", action="store_true", help="also time transformers with the static cache (CUDA)")
    ap.add_argument("--no-cache-tokens", type=int, default=16, help="new tokens for the cache on/off ratio")
    ap.add_argument("--server", action="store_true",
                    help="also time the same greedy generation through a live `lmscope serve` (the Generate "
                         "tab's /generate endpoint: streamed, every view built), against this script's")
    ap.add_argument("--client", choices=["page", "gradio"], default="page",
                    help="with --server: page (the request as the page sends it) or gradio (gradio_client)")
    args = ap.parse_args(argv)

    dev_name = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    os.environ.setdefault("LMSCOPE_DEVICE", dev_name)
    if dev_name == "cpu":
        torch.set_num_threads(args.threads or 1)
    n = args.tokens or (256 if dev_name == "cuda" else 32)
    os.environ["LMSCOPE_MAX_NEW_TOKENS"] = str(max(n, args.no_cache_tokens, 256))

    from model_core.core.registry import load_model
    from model_core.core.sampling import SamplingSettings
    from model_core.serving.generate import generate, time_cache_vs_no_cache

    name = args.model or ("random-smollm2-135m" if (args.random or dev_name == "cuda") else "smollm2-135m-instruct")
    lm = load_model(name, device=dev_name)
    dev = lm.device
    from model_core.serving.engine import can_use_engine, engine_for

    engine_state = None
    if can_use_engine(lm):  # measure the engine as it serves once started (compiled on CUDA)
        t0 = time.perf_counter()
        eng = engine_for(lm)
        eng.wait_compiled(900)
        engine_state = f"{eng.compile_state} ({time.perf_counter() - t0:.0f} s to start)"
    ids_list = lm.tokenizer(args.prompt)["input_ids"]
    ids = torch.tensor([ids_list], device=dev)
    import transformers

    info = {"model": name, "device": str(dev), "dtype": str(lm.dtype).replace("torch.", ""),
            "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else None,
            "threads": torch.get_num_threads(), "torch": torch.__version__, "transformers": transformers.__version__,
            "prompt_tokens": len(ids_list), "new_tokens": n, "repeats": args.repeats,
            "engine_compiled": engine_state}
    print("bench/generate.py", json.dumps(info))
    results = {"info": info, "settings": {}}
    for label, s in [("greedy", SamplingSettings(temperature=0)),
                     ("sampled", SamplingSettings(temperature=0.8, top_k=50, top_p=0.95, min_p=0.02,
                                                  repetition_penalty=1.1))]:
        ours = lambda: generate(lm, token_ids=ids_list, max_new_tokens=n, settings=s, seed=0, ignore_eos=True)  # noqa: E731
        hf = lambda: _hf_generate(lm, ids, n, s)  # noqa: E731
        ours(), hf()  # warm up
        if can_use_engine(lm) and engine_for(lm)._recorded is not None:  # a CPU engine's recordings, made
            engine_for(lm)._recorded.wait_recorded(300)  # before timing (model_core.serving.torchscript_replay)
        g = ours()
        assert len(g.steps) == n
        t_ours, t_hf = _time_pair(ours, hf, dev, args.repeats)
        row = {"lmscope_tok_s": n / t_ours, "hf_dynamic_tok_s": n / t_hf, "ratio_vs_hf_dynamic": t_hf / t_ours,
               "recording_overhead_pct": 100 * (t_ours / t_hf - 1)}
        if args.hf_static and dev.type == "cuda":
            hfs = lambda: _hf_generate(lm, ids, n, s, static=True)  # noqa: E731
            hfs(), hfs()
            t_s = _time(hfs, dev, args.repeats)
            row.update(hf_static_tok_s=n / t_s, ratio_vs_hf_static=t_s / t_ours)
        if s.greedy:
            ref = hf()[0, len(ids_list):].tolist()
            row["greedy_equals_hf"] = ref == g.token_ids
        results["settings"][label] = row
        print(f"{label:8s} lmscope {row['lmscope_tok_s']:8.1f} tok/s (every step recorded) | transformers generate "
              f"{row['hf_dynamic_tok_s']:8.1f} tok/s | ratio {row['ratio_vs_hf_dynamic']:.3f} "
              f"(recording overhead {row['recording_overhead_pct']:+.1f}%)"
              + (f" | hf static {row['hf_static_tok_s']:.1f} tok/s, ratio {row['ratio_vs_hf_static']:.3f}"
                 if "hf_static_tok_s" in row else "")
              + (f" | greedy == hf: {row['greedy_equals_hf']}" if "greedy_equals_hf" in row else ""))
    if args.server:
        results["server"] = _server_vs_script(lm, name, ids_list, args.prompt, n, max(args.repeats, 5), args.client)
    c = time_cache_vs_no_cache(lm, ids_list, new_tokens=args.no_cache_tokens, repeats=max(1, args.repeats - 1))
    results["cache"] = c
    print(f"cache    on {c['with_cache_tok_s']:8.1f} tok/s | off {c['without_cache_tok_s']:8.1f} tok/s | "
          f"on/off ratio {c['speedup']:.2f} ({c['new_tokens']} tokens after a {c['prompt_tokens']}-token prompt; "
          f"same tokens: {c['same_tokens']})")
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
