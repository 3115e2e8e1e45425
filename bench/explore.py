"""Server-side cost of the Explore view against the bare trace, measured in the same run.

  python bench/explore.py [--lengths 16 128 512 1024] [--repeats 5]
  LMSCOPE_MAX_PROMPT_TOKENS=2048 python bench/explore.py --lengths 2048   # a server that allows more

first view = the Run callback: trace + every view of the page over the whole prompt (pooled past
64 positions), serialised as Gradio sends it. Switches re-slice the stored trace (no forward pass):
layer / head = the layer and head sliders (attention grid, chosen head, bars, neurons, the head
overview's outline); zoom = a dragged box or typed range of 64 positions (attention, residual,
neurons: single cells; the lens drawn from the columns already computed); query = a token chip
(every view). overview = the layer x head summary the page computes after the first view (every
layer's pattern). page KB = everything the first view and the overview send to the browser
(figures as JSON, the token strip's HTML, tables; the server-side state excluded).

The lens after a zoom, as the user sees it complete (the zoom's event + the chained update_lens):
  zoom+lens cold = onto 64 positions whose lens no one computed yet: before the background filler
                   existed this was every zoom (30 layers x 64 positions through the unembedding)
  cold 1st picture = the same zooms until the chained event's first drawing (4 columns spread over
                   the region; it then draws twice more, views.missing_batches)
  fill s         = the background filler computing the lens of every position of the prompt, from
                   the end of the first view, on an otherwise idle server (wall clock)
  zoom+lens warm = the same zooms once the filler is done (what a zoom costs from then on)
  layer (filling) = the layer switch while the filler is working (a request waits for its chunk)
Everything but "fill s" and "layer (filling)" runs with the filler off, so that it cannot take CPU
time from what is measured (in the server it runs only while no request holds a model slot).
Targets (issue 15, CPU, real model): first view <= 1.5x the bare trace at 1,024 tokens, switches
< 150 ms, page <= 400 KB.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import plotly.graph_objects as go  # noqa: E402
import torch  # noqa: E402
from common import device_info, interleaved  # noqa: E402

from app.tabs.explore import lens_filler, views  # noqa: E402
from app.tabs.explore import tab as explore_tab  # noqa: E402
from app.tabs.explore.state import trace_for_state  # noqa: E402
from model_core import (
    load_model,  # noqa: E402
    trace,
)

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
    print(f"# bench/explore.py  model={lm.name}  {device_info(lm.device)}")
    print(f"{'T':>5} {'bare trace s':>12} {'first view':>11} {'ratio':>6} {'layer ms':>9} {'head ms':>8} "
          f"{'zoom ms':>8} {'query ms':>9} {'overview s':>11} {'page KB':>8} | {'zoom+lens cold ms':>17} "
          f"{'cold 1st picture ms':>19} {'fill s':>7} {'zoom+lens warm ms':>17} {'layer (filling) ms':>18}")
    words = ("the quick brown fox jumps over a lazy dog while seven curious otters watch from the river bank "
             "and a small bird sings ").split()
    state_i = explore_tab.RUN_OUTPUT_NAMES.index("state")
    view_i = explore_tab.RUN_OUTPUT_NAMES.index("view")
    filler = lens_filler.FILLER
    for T in args.lengths:
        filler.enabled = False
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
        tr = trace_for_state(state)
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
            _bytes(explore_tab.set_zoom(state, 7, 1, last, region(), view))

        def query():
            _bytes(explore_tab.update_views(state, 7, 1, next(step) % n, "probability", view, METRIC))

        s = interleaved({"layer": switch_layer, "head": switch_head, "zoom": zoom, "query": query}, args.repeats)

        def fresh_lens():
            """Forget every lens column, then compute what the first view had (its sampled columns
            and the query's), outside the timing."""
            views._vcache(tr).pop("lens", None)
            explore_tab.render_lens(tr, last, "probability")

        def zoom_and_lens(first=None):
            """A zoom and its chained lens event, as the page runs them: seconds until the lens is
            complete (first: a list that gets the seconds until the chained event's first picture)."""
            t0 = time.perf_counter()
            out = explore_tab.set_zoom(state, 7, 1, last, region(), view, "probability")
            _bytes(out)
            for i, drawn in enumerate(explore_tab.update_lens(state, last, "probability", out[1])):
                _bytes(drawn)
                if i == 0 and first is not None:
                    first.append(time.perf_counter() - t0)
            return time.perf_counter() - t0

        cold, cold_first = [], []
        for _ in range(args.repeats):
            fresh_lens()
            cold.append(zoom_and_lens(cold_first))
        # the filler from the end of a first view, on an idle server
        fresh_lens()
        filler.clear()
        filler.enabled = True
        t0 = time.perf_counter()
        filler.schedule(tr)
        filler.wait_idle()
        fill = time.perf_counter() - t0
        assert views.lens_filled(tr) == n
        filler.enabled = False
        warm = [zoom_and_lens() for _ in range(args.repeats)]
        # a layer switch while the filler works: each arrives at a random point of its chunk
        fresh_lens()
        filler.enabled = True
        filler.schedule(tr)
        busy = []
        for _ in range(args.repeats):
            time.sleep(filler.IDLE_S + 0.1 + random.random() * 0.1)  # the filler is computing a chunk
            if views.lens_filled(tr) >= n:
                break
            t0 = time.perf_counter()
            switch_layer()
            busy.append(time.perf_counter() - t0)
        filler.enabled = False
        filler.wait_idle()
        filler.clear()
        out = explore_tab.run_trace(lm.name, prompt, False, False, 0, 0, -1, "probability", *sampling)
        kb = (_bytes(out, skip={state_i}) + _bytes(explore_tab.overview(out[state_i], METRIC, 0, 0))) / 1024

        def ms(v):
            return f"{statistics.median(v) * 1e3:.0f}" if v else "-"
        print(f"{n:>5} {t['bare']:>12.3f} {t['first']:>10.3f}s {t['first'] / t['bare']:>5.2f}x"
              f" {s['layer'] * 1e3:>9.0f} {s['head'] * 1e3:>8.0f} {s['zoom'] * 1e3:>8.0f}"
              f" {s['query'] * 1e3:>9.0f} {ov['overview']:>11.2f} {kb:>8.0f} | {ms(cold):>17} {ms(cold_first):>19} {fill:>7.2f}"
              f" {ms(warm):>17} {ms(busy):>18}", flush=True)


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
