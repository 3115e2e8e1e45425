"""Explore's "Experts" accordion: for a mixture-of-experts model, the experts the router chose for
each token of the current prompt at the chosen layer (model_core.interp.experts, read from the
model's own router) and the load on every expert; a dense model says it has no router."""

from __future__ import annotations

import gradio as gr

from app.shared import validation as V
from app.shared.context import endpoint, get_model
from app.tabs.explore.experts_figures import load_figure, routing_figure
from app.tabs.explore.state import trace_for_state
from model_core.interp.experts import moe_layers, routing


@endpoint(model=True)
def show_experts(state, layer, request: gr.Request = None):
    """-> (message, routing figure, load figure) for the trace in `state` at `layer`."""
    tr = trace_for_state(state)
    lm = get_model(tr.model_name)
    routed = moe_layers(lm)
    if not routed:
        note = (f"{tr.model_name}'s MLPs are dense (one MLP per layer): there is no router to show. Mixture-of-"
                f"experts models (Mixtral, Qwen-MoE, OLMoE, DeepSeek, GPT-OSS, Granite-MoE) have one.")
        return V.show(note), routing_figure([], [], [], 0), load_figure([], 0)
    try:
        layer = int(layer)
    except (TypeError, ValueError):
        layer = routed[0]
    note = ""
    if layer not in routed:
        nearest = min(routed, key=lambda l: abs(l - layer))
        note = f"Layer {layer} has a dense MLP; showing layer {nearest}, the nearest routed one."
        layer = nearest
    r = routing(lm, tr.token_ids, [layer])[layer]
    tokens = [t["display"] for t in tr.tokens]
    return (V.show(note) if note else V.clear(), routing_figure(tokens, r.probs.tolist(), r.experts.tolist(), layer, r.weights.tolist()),
            load_figure(r.load().tolist(), layer))


class ExpertsPanel:
    def __init__(self, tab):
        with gr.Accordion("Experts (mixture-of-experts models)", open=False, elem_id="experts"):
            gr.Markdown("In a mixture-of-experts model each layer's MLP is several MLPs (experts); a router "
                        "sends every token to a few of them. This shows, at the chosen layer, the router's "
                        "probabilities for each token, the experts it chose (●), and how the prompt's tokens "
                        "spread over the experts.", elem_classes=["explain"])
            show = gr.Button("Show the experts at the chosen layer", elem_id="experts-show")
            msg = V.field_message("experts-msg")
            with gr.Row():
                routes = gr.Plot(label="Router choices", elem_id="experts-routing", scale=3)
                load = gr.Plot(label="Expert load", elem_id="experts-load", scale=2)
        show.click(show_experts, [tab.state, tab.layer], [msg, routes, load], concurrency_id="views")
