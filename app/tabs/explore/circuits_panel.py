"""Explore's "Attribution graph (circuits)" accordion: the prompt's attribution graph on a transcoder
set trained in the app (a `transcoders` job; model_core.interp.attribution_graph), with its checks,
a page per node (its inputs and outputs in the graph; for a feature, the tokens its decoder row
promotes and its activation along the prompt), QK attribution of a head's pattern entry, and an
intervention from the graph: the chosen features ablated (or scaled) in the real model, next token
and a greedy continuation before and after. The graph downloads in Neuronpedia's layout.

Built inside ExploreTab.__init__; `wire()` after the tab's components exist."""

from __future__ import annotations

import json
import time
from functools import lru_cache

import gradio as gr
import torch

from app.shared import validation as V
from app.shared.context import endpoint, scratch_dir
from app.shared.page_js import page_js
from app.tabs.explore import circuits_view as CV
from app.tabs.explore import unit_figures as UF
from app.tabs.explore.circuits_figures import (
    checks_html,
    graph_figure,
    node_markdown,
    shown_target,
    shown_tokens,
)
from app.tabs.explore.state import trace_for_state
from model_core.interp import transcoders as TC
from model_core.interp.features_sae import FeatureError

CLICK_JS = page_js("circuits_click")  # a node's click -> #circuits-click
URL_JS = page_js("circuits_url", KEYS=repr(CV.URL_KEYS))  # set, target, thresholds and view -> the URL


@lru_cache(maxsize=2)
def _open(name: str, mtime: float):
    return TC.load_transcoders(name)


def no_set_message(model: str) -> str:
    """The sentence for a model with no transcoder set: the command that trains one, for this model."""
    return (f"No transcoder set for {model} yet: `lmscope jobs submit transcoders --model {model} --wait` "
            "trains one.")


def open_set(name, lm):
    if not isinstance(name, str) or name not in TC.list_transcoders():
        if not sets_for(lm.name):
            raise FeatureError(no_set_message(lm.name))
        raise FeatureError("Choose a transcoder set.")
    tc = _open(name, (TC.transcoders_dir() / name / "transcoders.json").stat().st_mtime)
    tc.check_model(lm)
    return tc


def sets_for(model: str) -> list[str]:
    out = []
    for name in TC.list_transcoders():
        try:
            rec = json.loads((TC.transcoders_dir() / name / "transcoders.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if rec.get("model") == model:
            out.append(name)
    return out


def number_in(v, name: str, lo: float, hi: float) -> float:
    try:
        x = float(v)
    except (TypeError, ValueError):
        raise FeatureError(f"'{name}' must be a number from {lo:g} to {hi:g}.") from None
    if not lo < x <= hi:
        raise FeatureError(f"'{name}' must be a number above {lo:g} and at most {hi:g}.")
    return x


def graph_summary(g, tc) -> str:
    """A built graph in one line: its size, how much of the active features it kept and how long it
    took, whether every check passed, and the transcoder set's quality."""
    feats = sum(n.kind == "feature" for n in g.nodes)
    ok = all(c["ok"] for c in g.checks.values() if c)
    quality = TC.quality_line(tc.record["quality"]) if tc.record.get("quality") else "not evaluated"
    return (f"**{feats} feature{'s' * (feats != 1)}** and {len(g.nodes) - feats} other nodes, {len(g.edges)} edges, kept of "
            f"{g.stats['active_features']:,} active features ({g.stats['rows_computed']} rows computed in "
            f"{g.stats['seconds']:.1f} s) · checks: {'**all ok**' if ok else '**a check FAILED**'} · transcoders "
            f"`{tc.name}`: {quality}")


def _graph(graph) -> dict:
    if not isinstance(graph, dict) or "nodes" not in graph:
        raise FeatureError("Build a graph first.")
    return graph


@endpoint
def refresh_sets(state, request: gr.Request = None):
    if not isinstance(state, dict) or not state.get("model"):
        return gr.update(choices=[], value=None), V.show("Run a prompt first.")
    model = trace_for_state(state).model_name
    names = sets_for(model)
    if not names:
        return gr.update(choices=[], value=None), V.show(no_set_message(model))
    return gr.update(choices=names, value=names[-1]), V.clear()


@endpoint(model=True)
def build(state, name, target, node_threshold, edge_threshold, view="", request: gr.Request = None):
    """[graph figure, checks, summary, node menu, graph (state), message]; the figure drawn with the
    page's view (its supernodes and pins, where their nodes are in the new graph)."""
    from model_core.interp.attribution_graph import attribution_graph

    try:
        tr = trace_for_state(state)
        tc = open_set(name, tr.lm)
        t = str(target or "")[:100]
        g = attribution_graph(tr.lm, tc, tr.token_ids, t if t.strip() else None,
                              node_threshold=number_in(node_threshold, "node threshold", 0, 1),
                              edge_threshold=number_in(edge_threshold, "edge threshold", 0, 1))
    except (gr.Error, FeatureError) as e:
        return gr.skip(), gr.skip(), gr.skip(), gr.skip(), gr.skip(), V.show(e)
    d = g.to_dict()
    d["n_layers"] = tr.lm.shape.n_layers
    feats = sorted((n for n in g.nodes if n.kind == "feature"), key=lambda n: -n.influence)
    choices = [(f"{n.id} ({n.token!r}, influence {n.influence:.3f})", n.id) for n in feats]
    choices += [(f"{n.id} ({n.kind}, {n.token!r})", n.id) for n in g.nodes if n.kind != "feature"]
    return (graph_figure(d, d["n_layers"], view=CV.parse(view)), checks_html(g.checks), graph_summary(g, tc),
            gr.update(choices=choices, value=[]), d, V.clear())


@endpoint
def clicked(graph, box, chosen, view="", request: gr.Request = None):
    """A node clicked in the figure ("node id:n" from CLICK_JS): added to the chosen nodes (or removed
    when it was chosen), its page shown. A supernode's click chooses (or unchooses) its members."""
    try:
        g = _graph(graph)
    except FeatureError as e:
        return gr.skip(), gr.skip(), gr.skip(), V.show(e)
    v = CV.parse(view)
    nid = str(box or "").rsplit(":", 1)[0]
    ids = {n["id"] for n in g["nodes"]}
    chosen = CV.chosen_ids(chosen, g)
    if nid.startswith("group:") and nid[6:] in v["groups"]:
        members = [m for m in v["groups"][nid[6:]] if m in ids]
        if not members:  # a group of nodes this graph does not have: nothing drawn to click
            return gr.skip(), gr.skip(), gr.skip(), gr.skip()
        chosen = ([c for c in chosen if c not in members] if set(members) <= set(chosen)
                  else list(dict.fromkeys(chosen + members)))
    elif nid in ids:
        chosen = [c for c in chosen if c != nid] if nid in chosen else chosen + [nid]
    else:
        return gr.skip(), gr.skip(), gr.skip(), gr.skip()
    return (gr.update(value=chosen), node_markdown(g, nid, view=v), graph_figure(g, g["n_layers"], chosen, v),
            V.clear())


def _view_change(change, graph, chosen, view, *args):
    """[view box, figure, "only pinned" box, message] after `change(view, chosen ids, *args)` ->
    (view, sentence)."""
    try:
        g = _graph(graph)
        v, said = change(CV.parse(view), CV.chosen_ids(chosen, g), *args)
    except (FeatureError, CV.ViewError) as e:
        return gr.skip(), gr.skip(), gr.skip(), V.show(e)
    return (CV.dumps(v), graph_figure(g, g["n_layers"], CV.chosen_ids(chosen, g), v), v["pinned_only"],
            V.show(said))


@endpoint
def group_nodes(graph, chosen, view, name, request: gr.Request = None):
    return _view_change(lambda v, ids, n: CV.group(v, n, ids), graph, chosen, view, name)


@endpoint
def ungroup_nodes(graph, chosen, view, name, request: gr.Request = None):
    return _view_change(lambda v, ids, n: CV.ungroup(v, n), graph, chosen, view, name)


@endpoint
def pin_nodes(graph, chosen, view, request: gr.Request = None):
    return _view_change(lambda v, ids: CV.toggle_pins(v, ids), graph, chosen, view)


@endpoint
def pinned_only(graph, chosen, view, flag, request: gr.Request = None):
    def change(v, ids, on):
        on = on is True
        if on and not v["pins"] and not v["groups"]:
            raise CV.ViewError("Pin nodes or group them first: with none, only the logit would be left.")
        return {**v, "pinned_only": on}, ("Showing the pinned nodes, the supernodes and the logit." if on
                                          else "Showing the whole graph.")
    return _view_change(change, graph, chosen, view, flag)


@endpoint
def clear_view(graph, chosen, request: gr.Request = None):
    return _view_change(lambda v, ids: (CV.empty(), "Supernodes and pins cleared."), graph, chosen, "")


@endpoint
def from_link(request: gr.Request = None):
    """A link's ?circuits=... -> [accordion, set, target, thresholds, view box, pending link, message]:
    the graph is built once the link's own trace is there (built_from_link)."""
    q = dict(request.query_params) if request is not None else {}
    link = CV.from_query(q)
    if link is None:
        return (gr.skip(),) * 9
    if link["set"] not in TC.list_transcoders():
        return (gr.update(open=True), *(gr.skip(),) * 6, None,
                V.show(f"The link's transcoder set '{link['set']}' is not on this server, so no graph was built."))
    return (gr.update(open=True), gr.update(choices=[link["set"]], value=link["set"]), link["target"],
            link["node_threshold"], link["edge_threshold"], CV.dumps(link["view"]), link["view"]["pinned_only"],
            {"pending": True}, V.clear())


@endpoint(model=True)
def built_from_link(state, link, name, target, node_threshold, edge_threshold, view, request: gr.Request = None):
    """The graph a link names, once its trace is there; [figure, checks, summary, node menu, graph,
    message, pending link]."""
    if not isinstance(link, dict) or not link.get("pending") or not isinstance(state, dict) or not state.get("model"):
        return (gr.skip(),) * 7
    # build's own body: this endpoint already holds the user's model slot
    return (*build.__wrapped__(state, name, target, node_threshold, edge_threshold, view, request=request), None)


@endpoint(model=True)
def open_node(state, name, graph, chosen, request: gr.Request = None):
    """[node page, its top activations, the feature's promoted tokens, its activation along the
    prompt, message] for the last chosen node."""
    try:
        g = _graph(graph)
        chosen = [c for c in (chosen or []) if isinstance(c, str)]
        by_id = {n["id"]: n for n in g["nodes"]}
        if not chosen or chosen[-1] not in by_id:
            raise FeatureError("Choose a node (click one in the graph, or pick it in the menu).")
        n = by_id[chosen[-1]]
        page = node_markdown(g, n["id"])
        if n["kind"] != "feature":
            return page, "", UF.empty("Only feature nodes have decoder rows."), UF.empty(
                "Only feature nodes have activations."), V.clear()
        tr = trace_for_state(state)
        tc = open_set(name, tr.lm)
        top = _promoted(tr.lm, tc, n["layer"], n["feature"])
        along = _activation_along(tr.lm, tc, tr.token_ids, n["layer"], n["feature"])
        ctx = contexts_block(tr.lm, tc, n["layer"], n["feature"])
    except (gr.Error, FeatureError) as e:
        return gr.skip(), gr.skip(), gr.skip(), gr.skip(), V.show(e)
    from app.tabs.explore.features_panel import activation_figure

    return (page, ctx, UF.weights_figure(top, f"{n['id']}: tokens its decoder row promotes / suppresses (W_dec·W_U)"),
            activation_figure(along, shown_tokens(g), n["feature"]), V.clear())


def contexts_block(lm, tc, layer: int, f: int, shown: int = 8) -> str:
    """A feature's top activations over the set's held-out text (saved by the transcoders job), as the
    feature sets' page shows them."""
    from app.tabs.explore.features_panel import contexts_html
    from model_core.interp.features_reading import top_contexts

    index = tc.feature_contexts(layer)
    if index is None:
        return ("<p>Top activations: this set was saved without them (imported from another library, or measured "
                "on fewer held-out tokens than one window).</p>")
    rows = top_contexts(index, lm.tokenizer, f)[:shown]
    if not rows:
        return f"<p>Top activations: it never fired on the {index.scanned:,} held-out tokens the set was measured on.</p>"
    return f"<p><b>Top activations</b> over {index.scanned:,} held-out tokens:</p>" + contexts_html(rows)


def _promoted(lm, tc, layer: int, f: int, k: int = 10) -> dict:
    """The tokens a transcoder feature's decoder row pushes up and down through the final norm's gain
    and the unembedding."""
    from model_core.core.tokenization import describe_tokens
    from model_core.interp.neurons import unembed_direction

    with torch.no_grad():  # through the final norm's gain (LayerNorm's weight, not its bias)
        logits = unembed_direction(lm, tc.coders[layer].W_dec[f].float().to(lm.device))
    out = {}
    for key, idx in (("promoted", logits.topk(k).indices), ("suppressed", (-logits).topk(k).indices)):
        rows = describe_tokens(lm.tokenizer, idx.tolist())
        out[key] = [{"token": r["display"], "id": int(i), "value": float(logits[i])} for r, i in zip(rows, idx.tolist())]
    return out


def _activation_along(lm, tc, ids, layer: int, f: int) -> list[float]:
    pairs = TC.mlp_pairs(lm, torch.tensor([ids]), [layer])
    acts, idx = TC.encode(tc.coders[layer], pairs[layer][0][0])  # [T, k] each
    return [float(a[i == f].sum()) for a, i in zip(acts, idx)]


@endpoint(model=True)
def intervene(state, name, graph, chosen, scale, request: gr.Request = None):
    """[figure, summary, message]: the chosen feature nodes scaled (0 = ablated) in the real model."""
    from model_core.core.tokenization import describe_tokens
    from model_core.interp.graph_interventions import intervene as run
    from model_core.interp.graph_interventions import parse_feature_nodes

    try:
        g = _graph(graph)
        nodes = parse_feature_nodes(list(chosen or []), {n["id"]: n for n in g["nodes"]})
        s = number_in(scale, "scale", -10.000001, 10)
        tr = trace_for_state(state)
        tc = open_set(name, tr.lm)
        if tr.token_ids != g["prompt_ids"]:
            raise FeatureError("The prompt changed since the graph was built; build it again.")
        r = run(tr.lm, tc, tr.token_ids, nodes, scale=s, target=g["target"])
    except (gr.Error, FeatureError) as e:
        return gr.skip(), gr.skip(), V.show(e)
    base, after = r["base"], r["after"]
    union = list(dict.fromkeys(base.topk(8).indices.tolist() + after.topk(8).indices.tolist()))
    union.sort(key=lambda i: -float(base[i]))
    names = [d["display"] for d in describe_tokens(tr.lm.tokenizer, union)]
    rows = [{"token": n, "before": float(base[i].exp()), "after": float(after[i].exp())} for n, i in zip(names, union)]
    what = "ablated" if s == 0 else f"scaled by {s:g}"
    c = r["continuation"]
    note = (f"{len(nodes)} feature node(s) {what} in the real model (each at its own position; attention and the other "
            f"features run freely). Target {shown_target(g)!r}: logit change **{r['target_logit_change']:+.4f}**; "
            f"KL of the next token **{r['kl']:.4f} nats**.\n\n"
            f"Greedy continuation before: `{c['before']!r}`\n\nafter: `{c['after']!r}`")
    return (UF.clamp_figure(rows, f"The next token with {len(nodes)} node(s) {what}", f"with the node(s) {what}"),
            note, V.clear())


@endpoint(model=True)
def qk(state, name, graph, layer, head, key_pos, request: gr.Request = None):
    """[markdown, message]: QK attribution of one head's pattern entry from the graph's last position."""
    from model_core.interp.attribution_graph import FrozenModel
    from model_core.interp.qk_attribution import qk_attribution

    try:
        g = _graph(graph)
        tr = trace_for_state(state)
        tc = open_set(name, tr.lm)
        vals = []
        for v, what in ((layer, "layer"), (head, "head"), (key_pos, "key position")):
            if not isinstance(v, (int, float)) or isinstance(v, bool) or v != int(v):
                raise FeatureError(f"The {what} must be a whole number.")
            vals.append(int(v))
        r = qk_attribution(FrozenModel(tr.lm, tc, g["prompt_ids"], g["target"]), vals[0], vals[1],
                           len(g["prompt_ids"]) - 1, vals[2])
    except (gr.Error, FeatureError) as e:
        return gr.skip(), V.show(e)
    ok = "ok" if r.check["ok"] else "FAILED"
    lines = [f"**Layer {r.layer}, head {r.head}**: from the last position to position {r.key_pos} "
             f"({shown_tokens(g)[r.key_pos]!r}): score **{r.score:.4f}**, attention weight **{r.pattern:.4f}**. "
             f"The terms sum to {r.check['terms_sum']:.4f} (check {ok}, tolerance {r.check['tolerance']:.2g}).",
             "| query side | contribution | key side | contribution |", "|---|---|---|---|"]
    for (qa, qc), (ka, kc) in zip(r.query_terms[:10], r.key_terms[:10]):
        lines.append(f"| `{qa}` | {qc:+.4f} | `{ka}` | {kc:+.4f} |")
    return "\n".join(lines), V.clear()


@endpoint
def download(graph, view="", request: gr.Request = None):
    """The graph in Neuronpedia's layout, as a file, with the view's pins and supernodes."""
    from model_core.interp.attribution_export import neuronpedia_json
    from model_core.interp.attribution_graph import Graph, Node

    try:
        g = _graph(graph)
    except FeatureError as e:
        return gr.skip(), V.show(e)
    graph_obj = Graph(prompt_tokens=g["prompt_tokens"], target=g["target"], target_token=g["target_token"],
                      prompt_display=g.get("prompt_display") or [], target_display=g.get("target_display") or "",
                      prompt_text=g.get("prompt_text") or "",
                      prompt_ids=g["prompt_ids"], target_prob=g["target_prob"], model=g["model"],
                      nodes=[Node(**n) for n in g["nodes"]],
                      edges=[(e["source"], e["target"], e["weight"]) for e in g["edges"]], checks=g["checks"],
                      settings=g["settings"], stats=g["stats"])
    d = scratch_dir("graph")
    path = d / f"attribution-graph-{int(time.time())}.json"
    v = CV.parse(view)
    known = {n["id"] for n in g["nodes"]}
    supernodes = [[name, *[m for m in ms if m in known]] for name, ms in v["groups"].items()]
    path.write_text(json.dumps(neuronpedia_json(graph_obj, g["n_layers"], pinned=[p for p in v["pins"] if p in known],
                                                supernodes=[s for s in supernodes if len(s) > 1])), encoding="utf-8")
    return gr.update(value=[str(path)], visible=True), V.clear()


class CircuitsPanel:
    def __init__(self, tab):
        self.tab = tab
        with gr.Accordion("Attribution graph (circuits)", open=False, elem_id="circuits") as self.accordion:
            gr.Markdown("How the model gets from this prompt to its next token, drawn as transcoder features joined "
                        "by their direct effects (the method of Anthropic's circuit-tracer). Train a transcoder set "
                        "with `lmscope jobs submit transcoders --wait`, pick it here and build the graph; the checks "
                        "below it say whether the graph adds up. Click nodes to open and choose them, then ablate "
                        "them in the real model.", elem_classes=["explain"])
            with gr.Row():
                self.set = gr.Dropdown(choices=[], label="transcoder set", elem_id="circuits-set", scale=3)
                self.refresh = gr.Button("Find transcoder sets", elem_id="circuits-refresh", scale=1)
            with gr.Row():
                self.target = gr.Textbox(label="target token (empty: the top next token)", max_lines=1,
                                         elem_id="circuits-target", scale=2)
                self.node_threshold = gr.Number(value=0.8, label="node threshold", elem_id="circuits-node-threshold",
                                                scale=1)
                self.edge_threshold = gr.Number(value=0.98, label="edge threshold", elem_id="circuits-edge-threshold",
                                                scale=1)
                self.build = gr.Button("Build the graph", variant="primary", elem_id="circuits-build", scale=1)
            self.msg = V.field_message("circuits-msg")
            self.summary = gr.Markdown(elem_id="circuits-summary")
            self.plot = gr.Plot(label="Attribution graph", elem_id="circuits-graph")
            self.checks = gr.HTML(elem_id="circuits-checks")
            self.graph = gr.State(None)
            self.link = gr.State(None)  # a link's graph waiting for the link's own trace
            self.click = gr.Textbox(visible="hidden", elem_id="circuits-click", label="graph click")
            self.view = gr.Textbox(CV.dumps(CV.empty()), visible="hidden", elem_id="circuits-view", label="view")
            with gr.Row():
                self.chosen = gr.Dropdown(choices=[], multiselect=True, label="chosen nodes", elem_id="circuits-nodes",
                                          scale=3)
                self.open_btn = gr.Button("Open the last chosen node", elem_id="circuits-open", scale=1)
            with gr.Row(elem_id="circuits-view-row"):
                self.group_name = gr.Textbox(label="supernode name", max_lines=1, elem_id="circuits-group-name",
                                             scale=2)
                self.group_btn = gr.Button("Group the chosen nodes", elem_id="circuits-group", scale=1)
                self.ungroup_btn = gr.Button("Ungroup it", elem_id="circuits-ungroup", scale=1)
                self.pin_btn = gr.Button("Pin / unpin the chosen nodes", elem_id="circuits-pin", scale=1)
                self.pinned_only = gr.Checkbox(False, label="only pinned nodes and supernodes",
                                               elem_id="circuits-pinned-only", scale=1)
                self.clear_btn = gr.Button("Clear the view", elem_id="circuits-clear-view", scale=1)
            self.page = gr.Markdown(elem_id="circuits-page")
            self.contexts = gr.HTML(elem_id="circuits-contexts")
            with gr.Row():
                self.weights = gr.Plot(label="Through the unembedding", elem_id="circuits-weights")
                self.along = gr.Plot(label="Along the prompt", elem_id="circuits-along")
            with gr.Row():
                self.scale = gr.Number(value=0, label="scale the chosen features by (0 = ablate)",
                                       elem_id="circuits-scale", scale=1)
                self.ablate = gr.Button("Run it on the real model", elem_id="circuits-ablate", scale=1)
            self.ablate_note = gr.Markdown(elem_id="circuits-ablate-note")
            self.ablate_plot = gr.Plot(label="The real model", elem_id="circuits-ablate-plot")
            with gr.Row():
                self.qk_layer = gr.Number(value=None, precision=0, label="QK: layer", elem_id="circuits-qk-layer")
                self.qk_head = gr.Number(value=None, precision=0, label="head", elem_id="circuits-qk-head")
                self.qk_key = gr.Number(value=None, precision=0, label="key position", elem_id="circuits-qk-key")
                self.qk_btn = gr.Button("Why does it attend there?", elem_id="circuits-qk")
            self.qk_out = gr.Markdown(elem_id="circuits-qk-out")
            with gr.Row():
                self.download_btn = gr.Button("Download for Neuronpedia's graph viewer", elem_id="circuits-download")
                self.files = gr.File(visible=False, elem_id="circuits-files", label="graph JSON")

    def wire(self) -> None:
        tab = self.tab
        settings = [self.set, self.target, self.node_threshold, self.edge_threshold, self.view]
        graph_out = [self.plot, self.checks, self.summary, self.chosen, self.graph, self.msg]
        self.refresh.click(refresh_sets, [tab.state], [self.set, self.msg])
        self.build.click(build, [tab.state, *settings], graph_out, concurrency_id="model").then(
            None, settings, None, js=URL_JS)
        self.click.input(clicked, [self.graph, self.click, self.chosen, self.view],
                         [self.chosen, self.page, self.plot, self.msg])
        view_out = [self.view, self.plot, self.pinned_only, self.msg]
        for ev in (self.group_btn.click(group_nodes, [self.graph, self.chosen, self.view, self.group_name], view_out),
                   self.ungroup_btn.click(ungroup_nodes, [self.graph, self.chosen, self.view, self.group_name],
                                          view_out),
                   self.pin_btn.click(pin_nodes, [self.graph, self.chosen, self.view], view_out),
                   self.pinned_only.input(pinned_only, [self.graph, self.chosen, self.view, self.pinned_only],
                                          view_out),
                   self.clear_btn.click(clear_view, [self.graph, self.chosen], view_out)):
            ev.then(None, settings, None, js=URL_JS)
        if tab.shared.page is not None:  # a link with ?circuits=...: its graph once its trace is there
            tab.shared.page.load(from_link, None, [self.accordion, *settings, self.pinned_only, self.link, self.msg])
            tab.state.change(built_from_link, [tab.state, self.link, *settings], [*graph_out, self.link],
                             concurrency_id="model")
        self.open_btn.click(open_node, [tab.state, self.set, self.graph, self.chosen],
                            [self.page, self.contexts, self.weights, self.along, self.msg], concurrency_id="views")
        self.ablate.click(intervene, [tab.state, self.set, self.graph, self.chosen, self.scale],
                          [self.ablate_plot, self.ablate_note, self.msg], concurrency_id="model")
        self.qk_btn.click(qk, [tab.state, self.set, self.graph, self.qk_layer, self.qk_head, self.qk_key],
                          [self.qk_out, self.msg], concurrency_id="model")
        self.download_btn.click(download, [self.graph, self.view], [self.files, self.msg])
        if tab.shared.page is not None:
            tab.shared.page.load(None, None, None, js=CLICK_JS)
