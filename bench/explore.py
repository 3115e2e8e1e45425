"""Server-side cost of the Explore view against the bare trace, measured in the same run.

  python bench/explore.py [--lengths 16 128 512] [--repeats 5]

first view = the Run callback: trace + every figure of the page, serialised to JSON as Gradio
sends it. switch = moving the layer or head slider: re-slicing the stored trace (no forward pass).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import plotly.graph_objects as go  # noqa: E402
import torch  # noqa: E402

from common import device_info, interleaved  # noqa: E402
from app import explore_tab  # noqa: E402
from model_core import load_model, trace  # noqa: E402


def _serialise(outputs) -> int:
    n = 0
    for o in outputs:
        if isinstance(o, go.Figure):
            n += len(o.to_json())
    return n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", type=int, nargs="+", default=[16, 128, 512])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    lm = load_model("smollm2-135m-instruct")
    print(f"# bench/explore.py  model={lm.name}  {device_info()}")
    print(f"{'T':>5} {'bare trace s':>12} {'first view':>11} {'ratio':>7} {'switch layer ms':>16} {'switch head ms':>15} {'page KB':>8}")
    words = ("the quick brown fox jumps over a lazy dog while seven curious otters watch from the river bank "
             "and a small bird sings ").split()
    for T in args.lengths:
        prompt = " ".join(words[i % len(words)] for i in range(T * 2))
        ids = lm.tokenizer(prompt)["input_ids"][:T]
        prompt = lm.tokenizer.decode(ids)
        sampling = (1.0, 0, 1.0, 0.0, 1.0)
        state = {}

        def bare():
            trace(lm, prompt)

        def first_view():
            out = explore_tab.run_trace(lm.name, prompt, False, False, 0, 0, -1, "probability", *sampling)
            state.update(out[0])
            _serialise(out)

        t = interleaved({"bare": bare, "first": first_view}, args.repeats)
        last = len(lm.tokenizer(prompt)["input_ids"]) - 1
        layer_i = iter(range(10**6))
        head_i = iter(range(10**6))

        def switch_layer():
            _serialise(explore_tab.update_layer_head(state, 1 + next(layer_i) % 28, 0, last, "probability"))

        def switch_head():
            _serialise(explore_tab.update_layer_head(state, 7, 1 + next(head_i) % 8, last, "probability"))

        s = interleaved({"layer": switch_layer, "head": switch_head}, args.repeats)
        out = explore_tab.run_trace(lm.name, prompt, False, False, 0, 0, -1, "probability", *sampling)
        kb = _serialise(out) / 1024
        print(f"{T:>5} {t['bare']:>12.3f} {t['first']:>10.3f}s {t['first'] / t['bare']:>6.2f}x"
              f" {s['layer'] * 1e3:>16.0f} {s['head'] * 1e3:>15.0f} {kb:>8.0f}")


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
