"""Explore's figures skip plotly's validators (a layer switch redraws six of them: ~70 -> ~30 ms), so
app/tabs/explore/figures.py writes every layout value the way the validators would leave it. The
reference is plotly validating the same dict: a key it would reject raises, and anything it would
rewrite (a bare title string, a named colour scale, the template) shows up as a difference. Inputs:
views of a tiny random-weight model (app.tabs.explore.views), exact (labelled cells) and pooled."""

from __future__ import annotations

import json

import numpy as np
import plotly.graph_objects as go
import pytest

from app.tabs.explore import figures, views
from app.tabs.explore import tab as explore_tab
from model_core import load_model, trace
from model_core.core.sampling import SamplingSettings

SCALES = list(views.SCALES)


@pytest.fixture(scope="module")
def traces():
    lm = load_model("random-llama-tiny", device="cpu")  # byte-level: one token per character
    short = trace(lm, "the quick brown fox jumps over")  # every view exact, token labels
    long = trace(lm, ("the quick brown fox jumps over a lazy dog " * 4)[:150])  # every view pooled
    return short, long


def _figures(tr) -> dict[str, go.Figure]:
    """Every figure of app/tabs/explore/figures.py built through _figure / _fig, for one trace, with
    the inputs the Explore tab gives them (each attention scale, both lens colours)."""
    labels = views.labels(tr)
    q = tr.n_tokens - 1
    out = {}
    for scale in SCALES:
        grid, big, bars = explore_tab.render_attention(tr, 1, 0, q, scale=scale)
        out |= {f"head_grid {scale}": grid, f"attention_heatmap {scale}": big, f"attention_bars {scale}": bars}
    out["neuron_heatmap"], out["top_neurons_bars"] = explore_tab.render_neurons(tr, 1, q)
    out["block_contributions"], out["residual_norms"] = explore_tab.render_residual(tr, q)
    for colour in explore_tab.LENS_COLOURS:
        out[f"logit_lens_grid {colour}"], out[f"target_across_layers {colour}"] = explore_tab.render_lens(tr, q, colour)
    lv = views.lens_view(tr, q, "probability", compute=False)  # columns still being computed
    out["logit_lens_grid missing"] = figures.logit_lens_grid(lv["top"], lv["probs"], lv["colour"], "probability",
                                                             labels, lv["positions"], lv["layers"], lv["step"], q,
                                                             missing=lv["missing"] or 3)
    for metric in explore_tab.OVERVIEW_METRICS:
        out[f"head_overview {metric}"] = figures.head_overview(views.head_overview(tr, metric), metric, (1, 0))
    out["head_overview unselected"] = figures.head_overview(views.head_overview(tr, explore_tab.OVERVIEW_METRICS[0]),
                                                            explore_tab.OVERVIEW_METRICS[0])
    out["next_token_bars"], _ = explore_tab.next_outputs(tr, SamplingSettings(temperature=0.8, top_k=5, top_p=0.9))
    L, H = tr.n_layers, tr.lm.shape.n_heads
    rng = np.random.default_rng(0)
    mean = rng.random((L, H)).tolist()
    mean[0][1] = None  # a head where the metric is undefined
    out["head_search_map corpus"] = figures.head_search_map(mean, rng.random((L, H)).tolist(), "induction score", 8,
                                                            tr.model_name, [[f"prompt <{l}.{h}>" for h in range(H)]
                                                                            for l in range(L)])
    out["head_search_map repeated"] = figures.head_search_map(mean, None, "induction score", 1, tr.model_name)
    out["empty_figure"] = figures.empty_figure("Run a prompt to see every head.")
    return out


def _json(fig: go.Figure) -> dict:
    return json.loads(fig.to_json())


def test_unvalidated_figures_equal_plotly_validated_builds(traces):
    for tr in traces:
        for name, fig in _figures(tr).items():
            assert fig._validate is False, f"{name} was built with plotly's validators on"
            validated = go.Figure(fig.to_dict())  # raises on a key plotly does not know
            assert _json(fig) == _json(validated), name


def test_every_figure_built_through_figure_is_compared(traces):
    """A new figure function in app/tabs/explore/figures.py joins the comparison above (_figures)."""
    import inspect

    built = {name for name, fn in inspect.getmembers(figures, inspect.isfunction)
             if fn.__module__ == figures.__name__ and not name.startswith("_")
             and ("_figure(" in inspect.getsource(fn) or "_fig(" in inspect.getsource(fn))}
    compared = {name.split(" ")[0] for name in _figures(traces[0])}
    assert built and built <= compared, built - compared
