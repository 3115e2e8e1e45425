"""Explore views over long prompts (issue 15 items 1 and 3), on a tiny random-weight model: pooled
overviews equal a block-by-block reference, zoomed regions are exact, the lens is the model's own
final norm and unembedding, the query never crops a view, what is sent stays bounded at any
length, and clicks arriving from the page move the right settings."""

from __future__ import annotations

import json
import math
import os

import numpy as np
import plotly.graph_objects as go
import pytest
import torch

from app.tabs.explore import lens_filler, views
from app.tabs.explore import tab as explore_tab
from model_core import load_model, trace
from model_core.core.cpu_threads import REQUEST_NICE

MODEL = "random-llama-tiny"  # byte-level tokens: one token per character


@pytest.fixture(scope="module")
def lm():
    return load_model(MODEL)


def _prompt(n: int) -> str:
    words = "the quick brown fox jumps over a lazy dog while otters watch from the bank".split()
    text = " ".join(words[i % len(words)] for i in range(n))
    return text[:n]  # one token per character


@pytest.fixture(scope="module")
def long_tr(lm):
    tr = trace(lm, _prompt(700))
    assert tr.n_tokens == 700
    return tr


def _block_max(a: np.ndarray, br: int, bc: int) -> np.ndarray:
    """Reference max pooling, one block at a time (ragged last blocks included)."""
    R, C = a.shape
    out = np.zeros((math.ceil(R / br), math.ceil(C / bc)), np.float32)
    for i in range(out.shape[0]):
        for j in range(out.shape[1]):
            out[i, j] = a[i * br:(i + 1) * br, j * bc:(j + 1) * bc].max()
    return out


def test_whole_prompt_overview_is_block_max_of_the_real_pattern(long_tr):
    tr = long_tr
    pat = tr.attention_pattern(1).float().numpy()
    av = views.attention_view(tr, 1, 2, query=3)  # an early query crops nothing
    T = tr.n_tokens
    assert (av["rows"]["lo"], av["rows"]["hi"], av["cols"]["lo"], av["cols"]["hi"]) == (0, T - 1, 0, T - 1)
    b = av["rows"]["bin"]
    assert b == math.ceil(T / views.BIG_BINS) and av["rows"]["labels"] is None
    np.testing.assert_allclose(av["big"], _block_max(pat[2], b, av["cols"]["bin"]), rtol=0, atol=1e-7)
    gb = av["grid_rows"]["bin"]
    for h in range(pat.shape[0]):
        np.testing.assert_allclose(av["grid"][h], _block_max(pat[h], gb, gb), rtol=0, atol=1e-7)
    # the query's bars stop at the query itself (keys after it are masked: nothing to show)
    assert (av["bars"]["lo"], av["bars"]["hi"]) == (0, 3)
    # a late query's bars are sums over key blocks: with what lies outside the region, the whole row
    late = views.attention_view(tr, 1, 2, query=T - 1)
    assert late["bars"]["bin"] > 1 and len(late["row"]) <= views.BAR_BINS
    assert abs(late["row"].sum() + late["outside_mass"] - 1) < 1e-4
    np.testing.assert_allclose(late["row"][0], pat[2, T - 1, :late["bars"]["bin"]].sum(), atol=1e-6)


def test_zoomed_region_is_exact_with_labels_and_scales(long_tr):
    tr = long_tr
    pat = tr.attention_pattern(0).float().numpy()
    region, note = views.parse_region("600-640, 580-640", tr.n_tokens)
    assert region == (600, 640, 580, 640) and note == ""
    av = views.attention_view(tr, 0, 1, 620, region)
    assert av["rows"]["bin"] == av["cols"]["bin"] == 1
    np.testing.assert_array_equal(av["big"], pat[1, 600:641, 580:641])
    names = views.labels(tr)
    assert av["rows"]["labels"][0] == f"600:{names[600]}" and len(av["cols"]["labels"]) == 61
    assert av["outside_mass"] == pytest.approx(pat[1, 620, :580].sum(), abs=1e-5)
    # a query outside the zoomed rows: its bars span the prompt up to the query (not an empty chart)
    away = views.attention_view(tr, 0, 1, 100, region)
    assert (away["bars"]["lo"], away["bars"]["hi"]) == (0, 100) and away["outside_mass"] < 1e-5
    assert away["row"].sum() == pytest.approx(1, abs=1e-4)
    # log: log10 of the weight, floored two decades below a uniform row
    lg = views.attention_view(tr, 0, 1, 620, region, "log")
    floor = views.log_floor(tr.n_tokens)
    np.testing.assert_allclose(lg["big"], np.log10(np.maximum(pat[1, 600:641, 580:641], 10.0 ** floor)), atol=1e-5)
    # per row: every row's largest shown weight is 1
    rw = views.attention_view(tr, 0, 1, 620, region, "row")
    np.testing.assert_allclose(rw["big"].max(-1), 1.0, atol=1e-6)
    np.testing.assert_allclose(rw["big"], pat[1, 600:641, 580:641] / pat[1, 600:641, 580:641].max(-1, keepdims=True),
                               atol=1e-6)


@pytest.mark.parametrize("text,T,region,clamped", [
    ("", 100, (0, 99, 0, 99), False), ("all", 100, (0, 99, 0, 99), False),
    ("10-20", 100, (10, 20, 10, 20), False), ("30-20, 0-5", 100, (20, 30, 0, 5), False),
    ("10 to 20 / 3..9", 100, (10, 20, 3, 9), False), ("50-999", 100, (50, 99, 50, 99), True),
    ("500-999", 100, (0, 99, 0, 99), True), ("nonsense", 100, (0, 99, 0, 99), True),
    ("1-2, 3-4, 5-6", 100, (0, 99, 0, 99), True), ("-5", 100, (0, 99, 0, 99), True),
    (None, 1, (0, 0, 0, 0), False), (["1-2"], 10, (1, 2, 1, 2), False),
])
def test_zoom_text_is_parsed_and_clamped_with_a_notice(text, T, region, clamped):
    got, note = views.parse_region(text, T)
    assert got == region
    assert bool(note) == clamped
    if region == views.whole(T):
        assert views.region_text(got, T) == ""
    elif not clamped:
        assert views.parse_region(views.region_text(got, T), T) == (got, "")


def test_lens_over_all_positions_matches_the_models_own_unembedding(lm, long_tr):
    tr = long_tr
    T = tr.n_tokens
    lv = views.lens_view(tr, query=3)  # the query does not crop the lens
    pos = lv["positions"]
    assert pos[-1] == T - 1 and len(pos) <= views.LENS_COLS and lv["step"] == math.ceil(T / views.LENS_COLS)
    # reference: transformers' own final norm and lm_head on the residual stream after each layer
    norm, head = lm.model.model.norm, lm.model.lm_head
    with torch.inference_mode():
        for i, layer in enumerate(lv["layers"]):
            x = tr.resid_post(layer)[pos]
            probs = torch.softmax(head(norm(x)).float(), -1)
            top = probs.max(-1)
            np.testing.assert_allclose(lv["probs"][i], top.values.numpy(), rtol=1e-4, atol=1e-6)
            ids = top.indices.tolist()
            assert lv["top"][i] == [views._show(lm.tokenizer, t) for t in ids]
        # the target plot is at the query: the probability of the next prompt token
        x = tr.resid_post(lv["layers"][-1])[3:4]
        p = torch.softmax(head(norm(x)).float(), -1)[0, tr.token_ids[4]]
    assert lv["target_probs"][-1] == pytest.approx(float(p), rel=1e-4)
    # zoomed to a few positions: every one of them
    zoomed = views.lens_view(tr, query=650, rows=(640, 660))
    assert zoomed["positions"] == list(range(640, 661)) and zoomed["step"] == 1


def test_lens_columns_are_computed_once(lm, monkeypatch):
    tr = trace(lm, _prompt(200))
    calls = []
    real = views.logit_lens
    monkeypatch.setattr(views, "logit_lens",
                        lambda *a, **k: calls.append((k["positions"], k["targets"] is not None)) or real(*a, **k))
    views.lens_columns(tr, [100, 101, 102])
    views.lens_columns(tr, [101, 102, 103])
    views.lens_columns(tr, [100, 103])
    # the next token's probability and rank (twice the cost) only where asked: the query's column
    views.lens_columns(tr, [102], targets=True)
    got = views.lens_columns(tr, [102, 100], targets=True)
    assert calls == [([100, 101, 102], False), ([103], False), ([102], True), ([100], True)]
    assert got["tp"].shape == (len(tr.captured_layers), 2) and (got["tp"] > 0).all()
    lv = views.lens_view(tr, query=150)  # sampled columns without targets, the query's with them
    assert calls[-1] == ([150], True) and not any(t for _, t in calls[4:-1])
    assert len(lv["target_probs"]) == len(tr.captured_layers)


def _cells(fig: go.Figure) -> int:
    n = 0
    for tr in fig.data:
        z = getattr(tr, "z", None)
        if z is not None:
            n += int(np.asarray(z).size)
    return n


@pytest.mark.parametrize("n", [40, 300, 1000])
def test_what_is_sent_is_bounded_whatever_the_length(lm, n):
    tr = trace(lm, _prompt(n))
    figs = explore_tab.render_views(tr, 2, 1, 5, "probability")
    grid, big, bars, lens, target, contrib, resid, neurons, nbars = figs
    H = lm.shape.n_heads
    T = tr.n_tokens
    assert _cells(grid) <= H * views.GRID_EXACT ** 2 and _cells(big) <= views.EXACT ** 2 + views.BIG_BINS ** 2
    assert len(bars.data[0].y) <= views.BAR_BINS and np.asarray(lens.data[0].z).shape[1] <= max(views.LENS_COLS, views.EXACT)
    assert np.asarray(resid.data[0].z).shape[1] <= views.SEQ_BINS
    assert np.asarray(neurons.data[0].z).shape[1] <= views.SEQ_BINS
    # the views reach the end of the prompt whatever the query (5)
    for fig in (big, lens, resid, neurons):
        assert fig.layout.meta["lmscope"]["x" if fig is not big else "y"]["hi"] == T - 1
        assert fig.layout.meta["lmscope"]["x" if fig is not big else "y"]["lo"] == 0  # and its start
    size = sum(len(f.to_json()) for f in figs)
    if n == 1000:
        assert size < 200_000, size
    # pooled views say so in their caption; exact ones have token labels
    if T > views.EXACT:
        assert "max pooling" in big.layout.title.text and "one column per" in lens.layout.title.text
    else:
        assert "every cell shown" in big.layout.title.text and isinstance(big.data[0].x[0], str)


def test_clicks_from_the_page_move_the_settings(lm, monkeypatch):
    monkeypatch.setattr(lens_filler.FILLER, "enabled", False)  # the lens below comes from the clicks alone
    out = explore_tab.run_trace(MODEL, _prompt(300), False, False, 0, 0, -1, "probability", 1.0, 0, 1.0, 0.0, 1.0)
    state, view = out[0], out[explore_tab.RUN_OUTPUT_NAMES.index("view")]
    assert out[5]["value"] == 299 and view == {"scale": "linear", "zoom": ""}
    act = explore_tab.on_action

    def send(msg, layer=0, head=0, query=299):
        return act(state, json.dumps(msg), layer, head, query, "probability", view, None)
    # a token chip: the query moves, layer and head stay
    o = send({"kind": "query", "pos": 17})
    assert o[:3] == [0, 0, 17]
    # an overview cell: layer and head; the overview outlines it
    o = send({"kind": "head", "layer": 2, "head": 3})
    assert o[:2] == [2, 3] and o[-1].layout.shapes[0].x0 == 2.5 and o[-1].layout.shapes[0].y0 == 1.5
    assert "Layer 2, head 3" in o[7].layout.title.text  # the chosen head's figure
    # a lens cell: layer and position
    o = send({"kind": "lens", "layer": 1, "pos": 250}, layer=2, head=3)
    assert o[:3] == [1, 3, 250]
    # a dragged box: the zoom box, the view state and the figures follow; clamped to the prompt
    o = send({"kind": "zoom", "rows": [280, 400], "cols": [200, 290]})
    assert o[3] == "280-299, 200-290" and {k: o[4][k] for k in ("scale", "zoom")} == {
        "scale": "linear", "zoom": "280-299, 200-290"}
    assert "clamped" in o[5]
    meta = o[7].layout.meta["lmscope"]
    assert (meta["y"]["lo"], meta["y"]["hi"], meta["x"]["lo"], meta["x"]["hi"]) == (280, 299, 200, 290)
    # the zoom draws the lens at once from the columns already computed: of rows 280-299 the first
    # view's sampled columns 289 and 299 (one per 10 positions); the 18 others are blank, said so
    lens = o[3 + 10]
    z = np.asarray(lens.data[0].z, dtype=float)
    known = [list(lens.data[0].x).index(f"{p}:{views.labels(explore_tab.trace_for_state(state))[p]}") for p in (289, 299)]
    assert o[4]["lens_missing"] == 18 and "computing 18 of 20 columns" in lens.layout.title.text
    assert np.isnan(z).sum(1).tolist() == [18] * z.shape[0] and not np.isnan(z[:, known]).any()
    # ... and the event chained after it fills them in, drawing as it goes: 4 columns spread over
    # the region first, then 3x what it has, then the rest (views.missing_batches)
    drawn = list(explore_tab.update_lens(state, 290, "probability", o[4]))
    blank = [int(np.isnan(np.asarray(f.data[0].z, dtype=float)).sum(1).max()) for f, _ in drawn]
    assert blank == [14, 2, 0], blank
    assert "computing 14 of 20 columns" in drawn[0][0].layout.title.text
    lens, target = drawn[-1]
    assert lens.layout.meta["lmscope"]["x"]["lo"] == 280 and list(lens.data[0].x)[-1].startswith("299:")
    assert not np.isnan(np.asarray(lens.data[0].z, dtype=float)).any() and "computing" not in lens.layout.title.text
    np.testing.assert_allclose(np.asarray(lens.data[0].z, dtype=float)[:, known], z[:, known])
    # the same zoom again: every column is known, the lens comes with the zoom and nothing follows
    o = send({"kind": "zoom", "rows": [280, 299], "cols": [200, 290]})
    assert o[4]["lens_missing"] == 0 and "computing" not in o[13].layout.title.text
    (again,) = explore_tab.update_lens(state, 290, "probability", o[4])
    assert all(isinstance(v, type(explore_tab.gr.skip())) for v in again)
    # a head click leaves the lens as it is
    o = send({"kind": "head", "layer": 1, "head": 1})
    assert isinstance(o[13], type(explore_tab.gr.skip())) and o[4]["lens_missing"] == 0
    # double-click: the whole prompt
    o = send({"kind": "zoom"})
    assert o[3] == "" and o[4]["zoom"] == ""
    # out of range and hostile messages are clamped or change nothing
    o = send({"kind": "head", "layer": 999, "head": -4})
    assert o[:2] == [lm.shape.n_layers - 1, 0]
    import gradio as gr
    for bad in ["", "{", "[]", "null", json.dumps({"kind": "rm -rf"}), json.dumps({"kind": "query", "pos": "x"}),
                json.dumps({"kind": "query", "pos": 1e308}), "x" * 5000]:
        o = act(state, bad, 0, 0, 5, "probability", view, None)
        assert all(isinstance(v, type(gr.skip())) for v in o) or o[:3] == [0, 0, 5], bad


def test_a_prompt_longer_than_one_strip_shows_a_window_of_it(lm, monkeypatch):
    """Past STRIP_MAX tokens the strip is a window (the end of the prompt, or around the zoom), with
    chips that keep their positions in the prompt, so the page stays bounded at any length."""
    import re as _re

    monkeypatch.setattr(explore_tab, "STRIP_MAX", 100)
    out = explore_tab.run_trace(MODEL, _prompt(300), False, False, 0, 0, -1, "probability", 1.0, 0, 1.0, 0.0, 1.0)
    strip = out[explore_tab.RUN_OUTPUT_NAMES.index("tokens")]
    pos = [int(p) for p in _re.findall(r'data-pos="(\d+)"', strip)]
    assert pos == list(range(200, 300)) and "Tokens 200–299 of 300" in strip
    state, view = out[0], out[explore_tab.RUN_OUTPUT_NAMES.index("view")]
    z = explore_tab.set_zoom(state, 0, 0, 299, "40-60", view)
    pos = [int(p) for p in _re.findall(r'data-pos="(\d+)"', z[-1])]
    assert pos == list(range(1, 101))  # rows 40-60 in the middle
    z = explore_tab.set_zoom(state, 0, 0, 299, "150-170", view)
    assert [int(p) for p in _re.findall(r'data-pos="(\d+)"', z[-1])] == list(range(111, 211))
    z = explore_tab.set_zoom(state, 0, 0, 299, "280-299", view)  # near the end: the last 100
    assert [int(p) for p in _re.findall(r'data-pos="(\d+)"', z[-1])] == list(range(200, 300))
    # a click that does not zoom leaves the strip as it is
    o = explore_tab.on_action(state, json.dumps({"kind": "query", "pos": 160}), 0, 0, 299, "probability", z[1], None)
    assert isinstance(o[-2], type(explore_tab.gr.skip()))
    monkeypatch.setattr(explore_tab, "STRIP_MAX", 1024)  # short prompts: the whole strip, never resent on zoom
    z = explore_tab.set_zoom(state, 0, 0, 299, "10-20", view)
    assert isinstance(z[-1], type(explore_tab.gr.skip()))


def test_the_lens_of_every_position_is_filled_in_while_the_server_is_idle(lm):
    """After a run the background filler computes the lens of every position (so a zoom finds its
    columns ready), never while a request holds a model slot; what it computes is the model's own
    final norm and unembedding over the whole vocabulary."""
    import time

    from app.shared import context

    tr = trace(lm, _prompt(150))
    T = tr.n_tokens
    threads = torch.get_num_threads()
    with context.user_slot(None):  # a request is running: the filler waits
        held_since = time.monotonic()
        lens_filler.FILLER.schedule(tr)
        deadline = held_since + 60
        while lens_filler.FILLER._last_busy < held_since:  # until the filler has looked and found the slot held
            assert time.monotonic() < deadline, "the lens filler never looked at the server's slots"
            time.sleep(0.02)
        assert views.lens_filled(tr) == 0
    assert lens_filler.FILLER.wait_idle(300)
    assert views.lens_filled(tr) == T
    # it ran torch on one core of its own; every other thread keeps its thread count
    assert lens_filler.FILLER.one_thread is True and torch.get_num_threads() == threads
    # and below the engine's priority, whichever thread started it (model_core.core.cpu_threads)
    assert lens_filler.FILLER.yields is True
    assert os.getpriority(os.PRIO_PROCESS, lens_filler.FILLER._thread.native_id) >= REQUEST_NICE
    cols = views.lens_columns(tr, list(range(T)), compute=False)
    assert cols["missing"] == 0
    norm, head = lm.model.model.norm, lm.model.lm_head
    with torch.inference_mode():
        for i, layer in enumerate(tr.captured_layers):
            probs = torch.softmax(head(norm(tr.resid_post(layer))).float(), -1)
            top = probs.max(-1)
            np.testing.assert_allclose(cols["p"][i], top.values.numpy(), rtol=1e-4, atol=1e-6)
            assert cols["top"][i].tolist() == top.indices.tolist(), f"layer {layer}"
    # coarse to fine: every 32nd position first, so a region gets evenly spread columns early
    order = views.fill_order(100)
    assert sorted(order) == list(range(100)) and order[:3] == [31, 63, 95] and order[3:6] == [15, 47, 79]


def test_the_filler_fills_the_rows_on_screen_first(lm, monkeypatch):
    """A zoom says which rows are on screen: the background lens computes those first (a zoom into
    them is the likely next step), coarse to fine within them, then the rest."""
    import threading

    from app.shared import context

    tr = trace(lm, _prompt(160))
    calls = []
    real = views.logit_lens

    def watched(*a, **k):
        if threading.current_thread().name == "lmscope-lens-filler":
            calls.append(list(k["positions"]))
        return real(*a, **k)
    monkeypatch.setattr(views, "logit_lens", watched)
    with context.user_slot(None):
        lens_filler.FILLER.schedule(tr)
        lens_filler.FILLER.focus(tr, 100, 119)
    assert lens_filler.FILLER.wait_idle(300) and views.lens_filled(tr) == tr.n_tokens
    done = [p for c in calls for p in c]
    assert sorted(done) == list(range(tr.n_tokens))
    assert sorted(done[:20]) == list(range(100, 120))
    assert calls[:2] == [[111], [103]]  # coarse to fine: the region's position on the 16-grid, then the 8-grid


def test_a_cold_zoom_is_drawn_in_growing_batches_spread_over_the_region(lm, monkeypatch):
    """missing_batches: only columns not computed yet, coarse to fine over the region (the first
    batch spread across it, not its left edge), each batch 3x everything before it."""
    monkeypatch.setattr(lens_filler.FILLER, "enabled", False)
    tr = trace(lm, _prompt(120))
    positions = list(range(40, 104))  # a 64-column zoom
    views.lens_columns(tr, [71, 72])  # two columns someone already computed
    batches = views.missing_batches(tr, positions)
    flat = [p for b in batches for p in b]
    assert sorted(flat) == [p for p in positions if p not in (71, 72)]
    assert [len(b) for b in batches] == [4, 12, 46]
    assert batches[0] == [103, 55, 87, 47]  # index 63 of the 32-grid (31 is done), the 16-grid (15, 47), the 8-grid
    assert max(batches[0]) - min(batches[0]) >= 40
    views.lens_columns(tr, flat)
    assert views.missing_batches(tr, positions) == []
