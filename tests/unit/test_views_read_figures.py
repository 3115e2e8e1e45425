"""Issue 37 items 5, 10 and 12 without a browser: the lens figure keeps its words while a cell holds a
few characters (and sends whole words for the page to cut), its strip and a cell's top 10 are the
lens's own numbers, the "where the chosen token looks" bars stop at the query on an axis fitted to
the data, and the attribution / head-patching heatmaps say which layer and head each cell is.
Reference numbers: model_core.interp.lens.logit_lens on a tiny random-weight model; the attention
row of Trace.attention_pattern."""

from __future__ import annotations

import json

import numpy as np
import pytest

from app.tabs.explore import figures, views
from app.tabs.interventions import figures as ivfig
from app.tabs.interventions import tab as ivtab
from model_core import load_model, trace
from model_core.interp.lens import logit_lens


@pytest.fixture(scope="module")
def tr():
    lm = load_model("random-llama-tiny")  # byte-level: one token per character
    return trace(lm, "the quick brown fox jumps over a lazy dog while ott")


def test_cell_chars_and_cut_words():
    # 41 columns over 1000 px: 24.4 px a cell, (24.4 - 2) / 5.4 = 4 characters; at 300 px none fit
    assert figures.lens_cell_chars(1000, 41) == 4
    assert figures.lens_cell_chars(300, 41) == 0
    assert figures.lens_cell_chars(1000, 200) == 0
    assert figures.fit_word("␣and", 4) == "␣and"
    assert figures.fit_word("␣and", 3) == "and"  # the ␣ goes first
    assert figures.fit_word("␣river", 4) == "riv…"
    assert figures.fit_word("anything", 0) == ""


def test_lens_grid_keeps_words_past_32_positions():
    L, P = 3, 41
    words = [[f"w{l}{p}" for p in range(P)] for l in range(L)]
    probs = np.full((L, P), 0.5, np.float32)
    fig = figures.logit_lens_grid(words, probs, probs, "probability", [f"t{i}" for i in range(P)], list(range(P)),
                                  list(range(L)))
    t = fig.data[0]
    assert t.texttemplate == "%{text}"  # before: no text at all past 32 positions
    assert [list(r) for r in t.text] == [[figures.fit_word(w, 4) for w in row] for row in words]
    meta = fig.layout.meta["lmscope"]
    assert meta["words"] == words and meta["kind"] == "lens" and meta["min_chars"] == figures.LENS_MIN_CHARS
    assert "customdata[0]" in t.hovertemplate  # the hover keeps the whole word
    # sampled columns (a long prompt) show words too
    fig2 = figures.logit_lens_grid(words, probs, probs, "probability", [f"t{i}" for i in range(500)],
                                   [12 * j + 11 for j in range(P)], list(range(L)), step=12)
    assert any(c for row in fig2.data[0].text for c in row)


def test_strip_and_topk_are_the_lens_numbers(tr):
    layer = tr.captured_layers[-1]
    views.lens_view(tr, tr.n_tokens - 1)  # computes the columns, as the lens figure does
    st = views.lens_strip(tr, layer)
    ref = logit_lens(tr, positions=st["positions"], layers=[layer], k=1)
    tok = tr.lm.tokenizer
    assert st["words"] == [views._show(tok, i) for i in ref.top_ids[0, :, 0].tolist()]
    np.testing.assert_allclose(st["probs"], ref.top_probs[0, :, 0].numpy(), atol=1e-5)
    html = figures.lens_strip_html(st["words"], st["probs"], views.labels(tr), st["positions"], layer, 1, 5)
    assert html.count('class="lens-chip') == tr.n_tokens and 'data-pos="5"' in html and "lens-query" in html

    tk = views.lens_topk(tr, 1, 7)
    ref = logit_lens(tr, positions=[7], layers=[1], k=10)
    np.testing.assert_allclose(tk["probs"], ref.top_probs[0, 0].numpy(), atol=1e-6)
    assert tk["tokens"] == [views._show(tok, i) for i in ref.top_ids[0, 0].tolist()]
    out = figures.lens_topk_html(tk["tokens"], tk["probs"], 1, 7, "x", tk["entropy"])
    assert out.count("<tr>") == 11 and "Layer 1, after position 7" in out


def test_bars_stop_at_the_query_on_a_fitted_axis(tr):
    q = 20
    av = views.attention_view(tr, 1, 0, q)
    row = tr.attention_pattern(1)[0, q].float().numpy()
    assert (av["bars"]["lo"], av["bars"]["hi"]) == (0, q)
    np.testing.assert_allclose(av["row"], row[: q + 1], atol=1e-6)
    fig = figures.attention_bars(av["row"], av["bars"], "x", 1, 0, av["outside_mass"])
    assert list(fig.layout.xaxis.range) == [-0.5, q + 0.5]
    assert fig.layout.yaxis.range[0] == 0
    assert fig.layout.yaxis.range[1] == pytest.approx(min(1.0, float(row.max()) * 1.12), rel=1e-5)
    # a zoom whose key columns all lie after the query: the keys it can read, 0..query
    late = views.attention_view(tr, 1, 0, q, (15, 30, 25, 30))
    assert (late["bars"]["lo"], late["bars"]["hi"]) == (0, q)
    # pooled bars (bins of 2 keys): the axis covers the first bin to the query's
    ax = views.axis(0, 9, 5)
    fig = figures.attention_bars(np.array([0.1, 0.2, 0.3, 0.2, 0.2]), ax, "x", 0, 0)
    assert list(fig.layout.xaxis.range) == [-0.5, 9.5] and fig.layout.yaxis.range[1] == pytest.approx(0.336)


def test_head_heatmaps_say_their_layer_and_head():
    attr = ivfig.head_attribution([[0.1, 0.2, 0.3], [0.0, -1.0, 2.0]])
    assert attr.layout.meta["lmscope"] == {"kind": "heads", "layers": [0, 1], "heads": [0, 1, 2]}
    heads = ivfig.patching_heatmap([[0.1, 0.2]], [4], ["H0", "H1"], "t", kind="heads")
    assert heads.layout.meta["lmscope"] == {"kind": "heads", "layers": [4], "heads": [0, 1]}
    resid = ivfig.patching_heatmap([[0.1, 0.2]], [4], ["0:The", "1:x"], "t", kind="resid")
    assert resid.layout.meta is None  # a position is not a head: nothing to put in the ablation


def test_pick_head_fills_one_valid_head():
    model = "random-llama-tiny"
    L, H = ivtab.shape_of(model)
    assert ivtab.pick_head(model, json.dumps({"head": "L1H1", "n": 3})) == ["L1H1"]
    for bad in (json.dumps({"head": f"L{L}H0"}), json.dumps({"head": f"L0H{H}"}), "{", json.dumps({"head": 3}),
                json.dumps(["L1H1"]), "x" * 500, None):
        assert not isinstance(ivtab.pick_head(model, bad), list), bad
