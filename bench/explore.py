"""Server-side cost of the Explore view against the bare trace, measured in the same run.

  python bench/explore.py [--lengths 16 128 512 1024] [--repeats 5]
  LMSCOPE_MAX_PROMPT_TOKENS=2048 python bench/explore.py --lengths 2048   # a server that allows more

first view = the Run callback: trace + every view of the page over the whole prompt (pooled past
64 positions), serialised as Gradio sends it. Switches re-slice the stored trace (no forward pass):
layer / head = the layer and head sliders (attention grid, chosen head, bars, neurons, the head
overview's outline); zoom = a dragged box or typed range of 64 positions (attention, residual,
neurons: single cells); lens zoom = the lens that follows a zoom, on positions not computed before
(30 layers x 64 positions through the unembedding); query = a token chip (every view; lens columns
cached). overview = the layer x head summary the page computes after the first view (every layer's
pattern). page KB = everything the first view and the overview send to the browser (figures as JSON,
the token strip's HTML, tables; the server-side state excluded). Targets (issue 15, CPU, real
model): first view <= 1.5x the bare trace at 1,024 tokens, switches < 150 ms, page <= 400 KB.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import plotly.graph_objects as go  # noqa: E402
import torch  # noqa: E402

from common import device_info, interleaved  # noqa: E402
from app import explore_tab  # noqa: E402
from model_core import load_model, trace  # noqa: E402

METRIC = explore_tab.OVERVIEW_METRICS[2]


def _bytes(outputs, skip=()) -> int:
    """What Gradio sends for these outputs: figures as JSON, text as text, the rest as JSON."""
    n = 0
    for i, o in enumerate(outputs if isinstance(outputs, (list, tuple)) else [outputs]):
        if i in skip:
            continue
        if isinstance(o, go.Figure):
            n += len(o.to_json())
        elif isinstance(o, str):
            n += len(o.encode())
        else:
            n += len(json.dumps(o, default=str).encode())
    return n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", type=int, nargs="+", default=[16, 128, 512, 1024])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    lm = load_model("smollm2-135m-instruct")
    print(f"# bench/explore.py  model={lm.name}  {device_info()}")
    print(f"{'T':>5} {'bare trace s':>12} {'first view':>11} {'ratio':>6} {'layer ms':>9} {'head ms':>8} "
          f"{'zoom ms':>8} {'lens zoom ms':>13} {'query ms':>9} {'overview s':>11} {'page KB':>8}")
    words = ("the quick brown fox jumps over a lazy dog while seven curious otters watch from the river bank "
             "and a small bird sings ").split()
    state_i = explore_tab.RUN_OUTPUT_NAMES.index("state")
    view_i = explore_tab.RUN_OUTPUT_NAMES.index("view")
    for T in args.lengths:
        prompt = " ".join(words[i % len(words)] for i in range(T * 2))
        ids = lm.tokenizer(prompt)["input_ids"][:T]
        prompt = lm.tokenizer.decode(ids)
        sampling = (1.0, 0, 1.0, 0.0, 1.0)
        box = {}

        def bare():
            trace(lm, prompt, max_tokens=None)  # LMSCOPE_MAX_PROMPT_TOKENS still bounds it, as in the page

        def first_view():
            out = explore_tab.run_trace(lm.name, prompt, False, False, 0, 0, -1, "probability", *sampling)
            box["state"], box["view"] = out[state_i], out[view_i]
            _bytes(out, skip={state_i})

        t = interleaved({"bare": bare, "first": first_view}, args.repeats)
        n = len(lm.tokenizer(prompt)["input_ids"])
        last = n - 1
        state, view = box["state"], box["view"]
        ov = interleaved({"overview": lambda: _bytes(explore_tab.overview(state, METRIC, 0, 0))}, 1, warmup=0)
        step = iter(range(10**6))

        def switch_layer():
            _bytes(explore_tab.update_layer_head(state, 1 + next(step) % 28, 0, last, "probability", view, METRIC))

        def switch_head():
            _bytes(explore_tab.update_layer_head(state, 7, 1 + next(step) % 8, last, "probability", view, METRIC))

        def region():
            a = (next(step) * 97) % max(1, n - 64)
            return f"{a}-{min(n - 1, a + 63)}"

        def zoom():
            out = explore_tab.set_zoom(state, 7, 1, last, region(), view)
            box["zoomed"] = out[1]
            _bytes(out)

        def lens_zoom():  # the lens that follows the zoom just made, over positions it has not computed
            _bytes(explore_tab.update_lens(state, last, "probability", box["zoomed"]))

        def query():
            _bytes(explore_tab.update_views(state, 7, 1, next(step) % n, "probability", view, METRIC))

        s = interleaved({"layer": switch_layer, "head": switch_head, "zoom": zoom, "lens": lens_zoom,
                         "query": query}, args.repeats)
        out = explore_tab.run_trace(lm.name, prompt, False, False, 0, 0, -1, "probability", *sampling)
        kb = (_bytes(out, skip={state_i}) + _bytes(explore_tab.overview(out[state_i], METRIC, 0, 0))) / 1024
        print(f"{n:>5} {t['bare']:>12.3f} {t['first']:>10.3f}s {t['first'] / t['bare']:>5.2f}x"
              f" {s['layer'] * 1e3:>9.0f} {s['head'] * 1e3:>8.0f} {s['zoom'] * 1e3:>8.0f} {s['lens'] * 1e3:>13.0f}"
              f" {s['query'] * 1e3:>9.0f} {ov['overview']:>11.2f} {kb:>8.0f}", flush=True)


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
