"""Attribution graphs: time and peak memory against prompt length, beside one plain forward pass of
the same prompt (the baseline, measured in the same run).

The transcoders are a fresh seeded set (encoder random, decoder its normalised transpose, no skip):
a graph's cost depends on the number of active features (k per position per layer), the rows
expanded (--max-feature-nodes) and the model's size, not on what the features mean. Every graph's
checks are printed with it.

CPU:  .venv/bin/python bench/attribution.py                  (the real default model, float32)
GPU:  PYTHONPATH=. python bench/attribution.py --device cuda --random-1b   (a Llama-3.2-1B-shaped
      random checkpoint, float32)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

TEXT = ("The history of the city begins with a small settlement by the river, where traders met to exchange salt, "
        "grain and cloth. Over the centuries the town grew into a centre of learning, and its university drew "
        "students from every corner of the continent, who argued late into the night about philosophy, law and the "
        "motion of the stars above the old stone bridge that still stands today.")


class PeakRSS:
    """The process's peak resident memory above its level at start, sampled every 5 ms (CPU)."""

    def __init__(self):
        import psutil

        self.proc = psutil.Process(os.getpid())
        self.base = self.peak = self.proc.memory_info().rss
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self.stop.wait(0.005):
            self.peak = max(self.peak, self.proc.memory_info().rss)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()

    @property
    def mb(self) -> float:
        return (self.peak - self.base) / 2**20


def random_1b_dir() -> str:
    """A Llama-3.2-1B-shaped checkpoint with random weights (16 layers, width 2048, 32 heads, 8 KV
    heads, MLP 8192) written to a temporary folder, with the default model's tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from model_core import load_model

    tok = load_model("random-smollm2-135m", device="cpu").tokenizer  # the tokenizer that needs no download
    cfg = LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=len(tok), max_position_embeddings=4096, tie_word_embeddings=True,
                      rope_theta=500000.0)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    d = tempfile.mkdtemp(prefix="random-1b-")
    model.save_pretrained(d)
    tok.save_pretrained(d)
    return d


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--random-1b", action="store_true")
    ap.add_argument("--lengths", type=int, nargs="+", default=[8, 16, 32, 64])
    ap.add_argument("--max-feature-nodes", type=int, default=512)
    ap.add_argument("--expansion-factor", type=int, default=4)
    ap.add_argument("--k", type=int, default=16)
    args = ap.parse_args(argv)

    from bench.common import device_info
    from model_core import load_model
    from model_core.interp import attribution_graph as AG
    from model_core.interp.attribution_graph import attribution_graph
    from model_core.interp.transcoders import Transcoders, new_transcoder

    name = random_1b_dir() if args.random_1b else "smollm2-135m-instruct"
    lm = load_model(name, device=args.device, dtype="float32")
    d = lm.shape.d_model
    torch.manual_seed(0)
    coders = {}
    for layer in range(lm.shape.n_layers):
        c = new_transcoder(d, args.expansion_factor, args.k, lm.device, skip=False)
        with torch.no_grad():
            c.W_dec.data = c.encoder.weight.data / c.encoder.weight.data.norm(dim=1, keepdim=True) * 0.5
        c.requires_grad_(False)
        coders[layer] = c
    tc = Transcoders(coders=coders, model=lm.name, name="bench-random")
    ids_all = lm.tokenizer(TEXT * 8, add_special_tokens=False)["input_ids"]
    AG.MAX_PROMPT_TOKENS = max(AG.MAX_PROMPT_TOKENS, *args.lengths)  # the bench measures past the served limit
    cuda = lm.device.type == "cuda"
    print(f"# bench/attribution.py  {lm.name} ({lm.shape.n_layers} layers, width {d}) on {device_info(lm.device)}, "
          f"float32; transcoders {args.expansion_factor}x, k={args.k}; up to {args.max_feature_nodes} feature rows",
          flush=True)
    print(f"{'tokens':>6} {'active':>7} {'rows':>5} {'graph s':>8} {'forward s':>9} {'ratio':>7} {'peak MB':>8}  checks")
    rows = []
    attribution_graph(lm, tc, ids_all[:8], max_feature_nodes=8)  # warm-up
    for n in args.lengths:
        ids = ids_all[:n]
        with torch.no_grad():
            t0 = time.perf_counter()
            lm.model(input_ids=torch.tensor([ids], device=lm.device), use_cache=False)
            if cuda:
                torch.cuda.synchronize()
            fwd = time.perf_counter() - t0
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        with (contextlib.nullcontext() if cuda else PeakRSS()) as rss:
            t0 = time.perf_counter()
            g = attribution_graph(lm, tc, ids, max_feature_nodes=args.max_feature_nodes)
            if cuda:
                torch.cuda.synchronize()
            secs = time.perf_counter() - t0
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20 if cuda else rss.mb
        ok = "all ok" if all(c["ok"] for c in g.checks.values() if c) else \
            "FAIL: " + ", ".join(k for k, c in g.checks.items() if c and not c["ok"])
        print(f"{n:>6} {g.stats['active_features']:>7} {g.stats['rows_computed']:>5} {secs:>8.2f} {fwd:>9.4f} "
              f"{secs / fwd:>7.0f} {peak:>8.0f}  {ok}", flush=True)
        rows.append({"tokens": n, "active_features": g.stats["active_features"], "rows": g.stats["rows_computed"],
                     "graph_s": round(secs, 3), "forward_s": round(fwd, 5), "peak_mb": round(peak, 1),
                     "checks_ok": ok == "all ok"})
    print(json.dumps({"device": device_info(lm.device), "model": lm.name, "results": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
