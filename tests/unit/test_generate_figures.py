"""app.tabs.generate.figures' two-panel figures are built in one constructor; their layout is the one
plotly's own make_subplots makes (the reference), their traces sit on the panels make_subplots'
row/col would have put them on. The KV plot's formula runs to the tokens the cache holds, and each
"mass kept" number says which distribution it refers to (issue 18, fixes 4 and 8)."""

import json

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from app.tabs.generate import figures as GF
from model_core import load_model
from model_core.serving.generate import generate


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


def test_kv_formula_runs_to_the_tokens_the_cache_holds():
    from app.tabs.generate.tab import _light_state

    lm = load_model("random-llama-tiny")
    gen = generate(lm, "Hello there", max_new_tokens=8, ignore_eos=True)
    st = _light_state(lm, gen, [])
    held = st["kv"]["tokens"]
    # the last token drawn is never fed back through the model: the cache holds one token fewer
    assert held == len(gen.all_ids) - 1 == gen.kv_series[-1][0]
    assert st["growth"]["tokens"][-1] == held
    assert st["growth"]["total"][-1] == st["kv"]["formula_total"] == st["kv"]["measured_total"]


def test_generate_and_explore_say_which_distribution_mass_kept_refers_to():
    from app.tabs.generate import figures as GF

    step = {"index": 0, "chosen": {"id": 1, "token": "a", "prob": 0.5, "rank": 1},
            "top_before": [{"id": 1, "token": "a", "prob": 0.5, "removed_by": None}],
            "top_after": [{"id": 1, "token": "a", "prob": 1.0}], "n_candidates": 1,
            "removed": {"top_k": {"n_removed": 9, "kept_mass": 0.8}}}
    md = GF.removed_summary(step)
    assert "of the distribution entering the filter" in md and "temperature-1" in md
    titles = [a.text for a in GF.distribution_figure(step).layout.annotations]
    assert "temperature 1" in titles[0] and "temperature" in titles[1]


def test_unvalidated_timeline_equals_plotly_validated_build():
    """timeline_figure skips plotly's validators (~9 -> ~1 ms for 256 bars, redrawn while tokens
    stream); the reference is plotly validating the same dict: any key it would reject raises here,
    and anything it would rewrite (a named colorscale it spells out) shows as a difference."""
    steps = [{"index": i, "entropy": 0.3 * i, "chosen": {"id": i, "token": f"t{i}", "display": f"t{i}", "prob": 1 / (i + 2),
                                                         "prob_filtered": 0.9, "rank": i % 3,
                                                         **({"bytes": "E6 9D"} if i == 2 else {})}}
             for i in range(12)]
    for colour in ("prob", "entropy"):
        for selected in (None, 4):
            spec = GF.timeline_spec(steps, colour, selected)
            validated = go.Figure(spec)  # raises on a key plotly does not know
            assert _json(GF.timeline_figure(steps, colour, selected)) == _json(validated)
    assert _json(GF.timeline_figure([]))["layout"]["annotations"][0]["text"].startswith("No steps yet")


def test_streamed_timeline_payload_is_the_figures_json():
    """Generate sends the timeline as a Plot payload serialized straight from its figure dict; the
    reference is Gradio's own postprocessing of the figure (plotly's to_json), parsed and compared."""
    import gradio as gr

    from app.tabs.generate.tab import _timeline

    steps = [{"index": i, "entropy": 0.3 * i, "chosen": {"id": i, "token": f"t{i}", "display": f"t{i}", "prob": 1 / (i + 2),
                                                         "prob_filtered": 0.9, "rank": i % 3, "label": "é·1/2" if i == 2 else f"t{i}"}}
             for i in range(40)]
    plot = gr.Plot()
    for colour, selected in (("prob", None), ("entropy", 7)):
        sent = plot.postprocess(_timeline(steps, colour, selected))
        assert sent.type == "plotly"
        assert json.loads(sent.plot) == json.loads(plot.postprocess(GF.timeline_figure(steps, colour, selected)).plot)
    assert json.loads(plot.postprocess(_timeline([], "prob")).plot)["layout"]["annotations"][0]["text"].startswith("No steps")
