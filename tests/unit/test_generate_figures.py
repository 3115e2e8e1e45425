"""app.tabs.generate.figures' two-panel figures are built in one constructor; their layout is the one
plotly's own make_subplots makes (the reference), their traces sit on the panels make_subplots'
row/col would have put them on."""

import json

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from app.tabs.generate import figures as GF


def _json(fig: go.Figure) -> dict:
    return json.loads(fig.to_json())


def test_side_by_side_is_make_subplots_layout():
    for spacing, kwargs in ((0.1, {}), (0.18, {"horizontal_spacing": 0.18})):  # 0.1: make_subplots' default
        ref = make_subplots(rows=1, cols=2, subplot_titles=("left", "right"), **kwargs)
        ours = go.Figure(layout=GF._side_by_side(("left", "right"), spacing))
        assert _json(ours)["layout"] == _json(ref)["layout"]


def test_distribution_and_kv_figures_equal_their_make_subplots_build():
    step = {"index": 3, "chosen": {"id": 1, "token": "a", "prob": 0.5, "rank": 1},
            "top_before": [{"id": 1, "token": "a", "prob": 0.5, "removed_by": None},
                           {"id": 2, "token": "b", "prob": 0.2, "removed_by": "top_k"}],
            "top_after": [{"id": 1, "token": "a", "prob": 1.0}]}
    fig = _json(GF.distribution_figure(step))
    ref = make_subplots(rows=1, cols=2, subplot_titles=[a["text"] for a in fig["layout"]["annotations"]],
                        horizontal_spacing=0.18)
    for trace in fig["data"]:  # each trace on the panel its axes name, as row/col would place it
        panel = 2 if trace.get("xaxis") == "x2" else 1
        ref.add_trace(go.Scatter(**{k: v for k, v in trace.items() if k not in ("xaxis", "yaxis", "type")})
                      if trace["type"] == "scatter" else
                      go.Bar(**{k: v for k, v in trace.items() if k not in ("xaxis", "yaxis", "type")}), row=1, col=panel)
    ref.update_layout(title=fig["layout"]["title"], margin=fig["layout"]["margin"], height=380,
                      legend=fig["layout"]["legend"])
    ref.update_xaxes(title_text="probability", rangemode="tozero")
    assert _json(ref) == fig
    assert [t.get("xaxis", "x") for t in fig["data"][:2]] == ["x", "x2"]  # before the filters left, after right

    report = {"formula_per_layer": [10, 10], "measured_per_layer": [10, 10], "measured_series": [(1, 20), (2, 40)],
              "measured_total": 40, "formula_total": 40, "tokens": 2}
    kv = _json(GF.kv_cache_figure(report, {"tokens": [1, 2], "total": [20, 40]}))
    assert [(t["type"], t.get("xaxis", "x")) for t in kv["data"]] == [("bar", "x"), ("bar", "x"), ("scatter", "x2"),
                                                                     ("scatter", "x2")]
    ref_kv = make_subplots(rows=1, cols=2, subplot_titles=("per layer at the end", "total as the sequence grows"))
    assert {k: kv["layout"][k]["domain"] for k in ("xaxis", "xaxis2")} == \
           {k: list(_json(ref_kv)["layout"][k]["domain"]) for k in ("xaxis", "xaxis2")}
    assert kv["layout"]["xaxis2"]["title"]["text"] == "tokens in the cache" and kv["layout"]["barmode"] == "group"
