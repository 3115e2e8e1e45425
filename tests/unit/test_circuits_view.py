"""The attribution graph's view (app/tabs/explore/circuits_view.py, circuits_figures.grouped): a
supernode is drawn as one node whose edges are its members' summed (the sums checked against the
graph's own edges), pins label nodes and "pinned only" keeps them, the logit and the groups; a view
read back from the page or a link keeps only what fits its shape."""

from __future__ import annotations

import json

import pytest

from app.tabs.explore import circuits_view as CV
from app.tabs.explore.circuits_figures import graph_figure, grouped, node_markdown


def _node(nid, kind, layer, pos, influence=0.1, feature=None):
    return {"id": nid, "kind": kind, "layer": layer, "position": pos, "feature": feature, "token": f"t{pos}",
            "value": 1.0, "influence": influence}


GRAPH = {
    "nodes": [_node("T0", "embedding", None, 0), _node("T1", "embedding", None, 1),
              _node("F0.0.5", "feature", 0, 0, 0.3, 5), _node("F0.1.7", "feature", 0, 1, 0.2, 7),
              _node("F1.1.2", "feature", 1, 1, 0.4, 2), _node("E1.1", "error", 1, 1, 0.05),
              _node("logit", "logit", None, 1, 1.0)],
    "edges": [{"source": "T0", "target": "F0.0.5", "weight": 1.0}, {"source": "T1", "target": "F0.1.7", "weight": 0.5},
              {"source": "F0.0.5", "target": "F1.1.2", "weight": 0.25}, {"source": "F0.1.7", "target": "F1.1.2",
                                                                          "weight": -0.75},
              {"source": "F0.0.5", "target": "F0.1.7", "weight": 0.125}, {"source": "F1.1.2", "target": "logit",
                                                                           "weight": 2.0},
              {"source": "E1.1", "target": "logit", "weight": 0.5}, {"source": "F0.1.7", "target": "logit",
                                                                     "weight": 0.3}],
    "prompt_tokens": ["t0", "t1"], "target_token": " x", "target_prob": 0.5, "n_layers": 2,
}


def test_a_supernode_sums_its_members_edges_and_drops_the_inner_ones():
    view, said = CV.group(CV.empty(), "early", ["F0.0.5", "F0.1.7"])
    assert "2 nodes" in said
    nodes, edges = grouped(GRAPH, view)
    ids = {n["id"] for n in nodes}
    assert "group:early" in ids and "F0.0.5" not in ids and "F0.1.7" not in ids
    w = {(e["source"], e["target"]): e["weight"] for e in edges}
    assert w[("group:early", "F1.1.2")] == 0.25 - 0.75  # both members' edges into F1.1.2
    assert w[("T0", "group:early")] == 1.0 and w[("T1", "group:early")] == 0.5
    assert w[("group:early", "logit")] == 0.3
    assert ("group:early", "group:early") not in w  # F0.0.5 -> F0.1.7 is inside the group
    sup = next(n for n in nodes if n["id"] == "group:early")
    assert sup["influence"] == pytest.approx(0.5) and sup["members"] == ["F0.0.5", "F0.1.7"]
    fig = graph_figure(GRAPH, 2, [], view)
    trace = next(t for t in fig.data if t.name == "supernode")
    assert list(trace.customdata) == ["group:early"] and list(trace.text) == ["early"]
    assert trace.x[0] == pytest.approx(0.5)  # its members' mean position
    assert "1 supernode" in fig.layout.title.text
    page = node_markdown(GRAPH, "group:early", view=view)
    assert "`F1.1.2`" in page and "-0.5000" in page


def test_pins_label_nodes_and_pinned_only_keeps_pins_groups_and_the_logit():
    view, _ = CV.toggle_pins(CV.empty(), ["F1.1.2", "E1.1"])
    fig = graph_figure(GRAPH, 2, [], view)
    feats = next(t for t in fig.data if t.name == "feature")
    labels = dict(zip(feats.customdata, feats.text))
    assert "F1.1.2" in labels["F1.1.2"] and labels["F0.0.5"] == ""
    view = {**view, "pinned_only": True}
    nodes, edges = grouped(GRAPH, view)
    assert {n["id"] for n in nodes} == {"F1.1.2", "E1.1", "logit"}
    assert {(e["source"], e["target"]) for e in edges} == {("F1.1.2", "logit"), ("E1.1", "logit")}
    view, said = CV.toggle_pins(view, ["F1.1.2", "E1.1"])  # all pinned already: unpinned
    assert view["pins"] == [] and "Unpinned" in said


def test_views_from_the_page_or_a_link_keep_only_what_fits():
    assert CV.parse(None) == CV.empty() and CV.parse("not json") == CV.empty() and CV.parse("[1]") == CV.empty()
    hostile = json.dumps({"groups": {"ok": ["F0.0.5", "../../etc", "logit", 3], "<script>": ["F0.0.5"],
                                     "empty": ["nope"]},
                          "pins": ["F1.1.2", {"a": 1}, "x" * 500], "pinned_only": "yes"})
    v = CV.parse(hostile)
    assert v == {"groups": {"ok": ["F0.0.5"]}, "pins": ["F1.1.2"], "pinned_only": False}
    assert CV.parse("{" * 30_000) == CV.empty()
    with pytest.raises(CV.ViewError, match="Name the supernode"):
        CV.group(CV.empty(), "  ", ["F0.0.5", "F0.1.7"])
    with pytest.raises(CV.ViewError, match="at least two"):
        CV.group(CV.empty(), "one", ["F0.0.5"])
    with pytest.raises(CV.ViewError, match="no supernode named"):
        CV.ungroup(CV.empty(), "nope")
    # a node moves to the newest group; a link's numbers outside (0, 1] fall back to the defaults
    v, _ = CV.group(CV.empty(), "a", ["F0.0.5", "F0.1.7"])
    v, _ = CV.group(v, "b", ["F0.1.7", "F1.1.2"])
    assert v["groups"] == {"a": ["F0.0.5"], "b": ["F0.1.7", "F1.1.2"]}
    link = CV.from_query({"circuits": "set", "cnode": "7", "cedge": "nan", "cview": CV.dumps(v)})
    assert link["node_threshold"] == 0.8 and link["edge_threshold"] == 0.98 and link["view"] == v
    assert CV.from_query({"prompt": "x"}) is None


def test_a_refusal_from_gradio_reads_as_its_sentence_not_a_quoted_string():
    """gr.Error's str() wraps its message in quotes; the panels show the message itself."""
    from app.tabs.explore import circuits_panel as P

    msg = P.build({"model": "x", "trace_key": "nope"}, "set", "", 0.8, 0.98, "")[-1]
    assert msg["value"] == "⚠️ Run a prompt first.", msg
