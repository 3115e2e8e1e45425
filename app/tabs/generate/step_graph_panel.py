"""The Generate tab's "Attribution graph of this step" accordion (issue 42): the attribution graph
(model_core.interp.attribution_graph) of the step chosen in the "One step" section above it, with
the text before that step's token as the prompt and the token it chose as the target, on a
transcoder set trained in the app. Explore's circuits panel (app/tabs/explore/circuits_panel.py)
opens a prompt's graph; this one opens a generation's, one step at a time, next to the step's
sampling record.

`build(gen)` is called by app/tabs/generate/tab.py right after the step section (gen: its
GenerateTab, whose generation state and step slider this panel reads)."""

from __future__ import annotations

import gradio as gr

from app.shared import validation as V
from app.shared.context import endpoint, get_model
from app.tabs.explore.circuits_figures import checks_html, graph_figure
from app.tabs.explore.circuits_panel import graph_summary, no_set_message, number_in, open_set, sets_for
from app.tabs.generate.figures import step_label
from model_core.core.errors import LmscopeError
from model_core.interp.attribution_graph import MAX_PROMPT_TOKENS
from model_core.interp.features_sae import FeatureError

INTRO = f"""How the model got to the token it chose at the step above (the step slider, a clicked token or a
timeline bar): the **attribution graph** of the text before that token (up to {MAX_PROMPT_TOKENS} tokens) toward the
chosen token, drawn as transcoder features joined by their direct effects, with the checks that say whether it adds
up. Train a transcoder set with `lmscope jobs submit transcoders --wait`; Explore's *Attribution graph (circuits)*
accordion opens nodes and ablates them."""
NO_GENERATION = "Generate some text first; then build the graph of one of its steps."


def _whole(v) -> int | None:
    """v as a whole number, None when it is not one (a slider sends 2.0; junk sends anything)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v or v in (float("inf"), float("-inf")):
        return None
    return int(v) if v == int(v) else None


def chosen_step(state, step) -> tuple[int, dict, list[int], int]:
    """(index, the step's record, the token ids before its token, that token's id) of a generation's
    state, or one sentence: the state and index come from the browser and are checked before any work."""
    if not isinstance(state, dict) or not isinstance(state.get("model"), str):
        raise FeatureError(NO_GENERATION)
    steps, ids = state.get("steps"), state.get("ids")
    if not isinstance(steps, list) or not steps or not isinstance(ids, list):
        raise FeatureError(NO_GENERATION)
    i = _whole(step)
    if i is None or not 0 <= i < len(steps):
        raise FeatureError(f"Choose a step from 0 to {len(steps) - 1}.")
    s = steps[i]
    chosen = s.get("chosen") if isinstance(s, dict) else None
    pos = _whole(s.get("position")) if isinstance(s, dict) else None
    cid = _whole(chosen.get("id")) if isinstance(chosen, dict) else None
    if pos is None or cid is None or not 0 < pos < len(ids) or _whole(ids[pos]) != cid:
        # the record and the text disagree: a graph toward another token than the one shown
        raise FeatureError(f"Step {i}'s token is not at its place in the generated text; generate again.")
    prefix = ids[:pos]
    if any(_whole(t) is None or t < 0 for t in prefix):
        raise FeatureError(NO_GENERATION)
    return i, s, [int(t) for t in prefix], cid


def summary_line(i: int, step: dict, g, tc) -> str:
    """Which step, its prefix, the target with its probability in the graph's forward beside the
    step's record (both the model's softmax before any sampling filter), then the graph's line."""
    label = step_label(step).replace("`", "'")
    recorded = step["chosen"].get("prob")
    record = f", {recorded:.3f} in the step's record" if isinstance(recorded, float) else ""
    return (f"**Step {i}**: the graph of its {len(g.prompt_ids)}-token prefix toward the token it chose, `{label}` "
            f"(id {g.target}, `{g.target_display or g.target_token!r}`): p = {g.target_prob:.3f} in the graph's forward{record}. "
            + graph_summary(g, tc))


@endpoint
def refresh_sets(state, request: gr.Request = None):
    """[set menu, message]: the transcoder sets trained on the generation's model."""
    model = state.get("model") if isinstance(state, dict) else None
    if not isinstance(model, str) or not model:
        return gr.update(choices=[], value=None), V.show(NO_GENERATION)
    names = sets_for(model)
    if not names:
        return gr.update(choices=[], value=None), V.show(no_set_message(model))
    return gr.update(choices=names, value=names[-1]), V.clear()


@endpoint(model=True)
def build_graph(state, step, name, node_threshold, edge_threshold, request: gr.Request = None):
    """[summary, graph figure, checks, message] of the chosen step's graph."""
    from model_core.interp.attribution_graph import attribution_graph

    try:
        i, s, prefix, target = chosen_step(state, step)
        nt = number_in(node_threshold, "node threshold", 0, 1)
        et = number_in(edge_threshold, "edge threshold", 0, 1)
        lm = get_model(state["model"])
        if max(prefix + [target]) >= lm.shape.vocab_size:
            raise FeatureError(NO_GENERATION)
        tc = open_set(name, lm)
        g = attribution_graph(lm, tc, prefix, target, node_threshold=nt, edge_threshold=et)
    except (gr.Error, LmscopeError) as e:
        return gr.skip(), gr.skip(), gr.skip(), V.show(e)
    n_layers = lm.shape.n_layers
    return summary_line(i, s, g, tc), graph_figure(g.to_dict(), n_layers), checks_html(g.checks), V.clear()


def build(gen) -> None:
    with gr.Accordion("Attribution graph of this step", open=False, elem_id="gen-graph"):
        gr.Markdown(INTRO, elem_classes=["explain"])
        with gr.Row():
            set_name = gr.Dropdown(choices=[], label="transcoder set", elem_id="gen-graph-set", scale=3)
            refresh = gr.Button("Find transcoder sets", elem_id="gen-graph-refresh", scale=1)
        with gr.Row():
            node_threshold = gr.Number(value=0.8, label="node threshold", elem_id="gen-graph-node-threshold", scale=1)
            edge_threshold = gr.Number(value=0.98, label="edge threshold", elem_id="gen-graph-edge-threshold",
                                       scale=1)
            build_btn = gr.Button("Build the graph of this step", variant="primary", elem_id="gen-graph-build",
                                  scale=1)
        msg = V.field_message("gen-graph-msg")
        summary = gr.Markdown(elem_id="gen-graph-summary")
        plot = gr.Plot(label="Attribution graph", elem_id="gen-graph-plot")
        checks = gr.HTML(elem_id="gen-graph-checks")
    refresh.click(refresh_sets, [gen.state], [set_name, msg])
    build_btn.click(build_graph, [gen.state, gen.step_sel, set_name, node_threshold, edge_threshold],
                    [summary, plot, checks, msg], concurrency_id="model")
