"""Explore tab: one forward pass, every view. Layout in `build`, callbacks below it.

Run traces the prompt once and stores the Trace server-side; moving a slider re-slices the
stored Trace (no new forward pass); changing a sampling setting only re-filters the stored
next-token logits.
"""

from __future__ import annotations

import json
from pathlib import Path

import gradio as gr

from app import figures, views
from app.context import Shared, endpoint, get_model, max_prompt_tokens, scratch_dir
from app.trace_store import STORE
from model_core.errors import LmscopeError
from model_core.sampling import SamplingSettings
from model_core.trace import trace

OVERVIEW_METRICS = ["entropy (nats; low = focused)", "first-token attention (attention sink)",
                    "previous-token score"]
LENS_COLOURS = ["probability", "entropy (nats)"]


def _md(text: str) -> gr.Markdown:
    return gr.Markdown(text, elem_classes=["explain"])


class ExploreTab:
    """Holds the components so callbacks can name their outputs."""

    def __init__(self, shared: Shared):
        self.shared = shared
        self.state = gr.State({})  # {"key", "model", "prompt", "chat", "truncate"}
        self.status = gr.Markdown(elem_id="explore-status")
        with gr.Row():
            self.truncate = gr.Checkbox(label=f"Truncate prompts over {max_prompt_tokens()} tokens (keep the end)",
                                        value=False, scale=2)
            self.export_btn = gr.Button("Export trace data (JSON + CSV)", size="sm", scale=1)
        self.export_files = gr.File(label="Exported data", file_count="multiple", visible=False)

        gr.Markdown("### Tokens")
        _md("The prompt as the model sees it: one chip per token. Colour is how surprised the model was by "
            "each token given the ones before it; ␣ marks a space, ↵ a newline, <0xNN> a raw byte.")
        self.tokens = gr.HTML(elem_id="tokens")

        gr.Markdown("### Attention")
        _md("Each head decides, for every token (row), how much to read from each earlier token (column). "
            "Look for diagonal stripes (previous-token heads), a bright first column (attention sinks), "
            "and heads that jump to a specific earlier word.")
        with gr.Row():
            # Generous bounds until the first run sets the model's own (a shared URL may name any layer).
            self.layer = gr.Slider(0, 127, value=0, step=1, label="Layer", elem_id="layer")
            self.head = gr.Slider(0, 127, value=0, step=1, label="Head", elem_id="head")
            self.query = gr.Slider(0, 8191, value=0, step=1, label="Query token (position)", elem_id="query")
        self.last = gr.State(-1)  # Run always starts at the last token
        self.head_grid = gr.Plot(label="All heads of this layer", elem_id="head-grid")
        with gr.Row():
            self.head_big = gr.Plot(label="Chosen head", elem_id="head-big", scale=3)
            self.head_bars = gr.Plot(label="Where the chosen token looks", elem_id="head-bars", scale=2)
        with gr.Accordion("Find interesting heads: every layer × head", open=False):
            _md("One number per head, averaged over the prompt. Low entropy means a head focuses on few "
                "tokens; a high first-token score means it parks attention on the first token; a high "
                "previous-token score means it mostly reads the token just before.")
            self.metric = gr.Radio(OVERVIEW_METRICS, value=OVERVIEW_METRICS[2], label="Summary")
            self.overview = gr.Plot(label="Head overview", elem_id="head-overview")

        gr.Markdown("### Residual stream and logit lens")
        _md("The residual stream is the running sum every layer reads from and writes to. The logit lens "
            "decodes it after each layer with the model's own final norm and unembedding, to show when the "
            "answer appears. Rows are layers (top = first); each cell is that layer's top guess for the "
            "token after that position.")
        self.lens_colour = gr.Radio(LENS_COLOURS, value="probability", label="Logit-lens colour")
        self.lens = gr.Plot(label="Logit lens", elem_id="lens")
        with gr.Row():
            self.target = gr.Plot(label="The next token across layers", elem_id="lens-target")
            self.contrib = gr.Plot(label="What each layer adds", elem_id="contrib")
        self.resid = gr.Plot(label="Residual norms", elem_id="resid")

        gr.Markdown("### MLP activations")
        _md("Inside each MLP, thousands of neurons fire or stay quiet for each token. These are the neurons of "
            "the chosen layer that fire hardest over the visible tokens (red positive, blue negative).")
        with gr.Row():
            self.neurons = gr.Plot(label="Top neurons", elem_id="neurons", scale=3)
            self.neuron_bars = gr.Plot(label="Top neurons at the chosen token", elem_id="neuron-bars", scale=2)

        gr.Markdown("### Next token")
        _md("The model's distribution for the token after the prompt, and what your sampling settings do to "
            "it: temperature reshapes it, top-k / top-p / min-p cut the tail (✕ = removed), the repetition "
            "penalty pushes down tokens already in the prompt. Temperature 0 means greedy.")
        with gr.Row():
            self.temperature = gr.Slider(0, 3, value=1.0, step=0.05, label="Temperature", elem_id="temperature")
            self.top_k = gr.Number(value=0, label="Top-k (0 = off)", precision=0, elem_id="top-k")
            self.top_p = gr.Slider(0.01, 1, value=1.0, step=0.01, label="Top-p", elem_id="top-p")
            self.min_p = gr.Slider(0, 1, value=0.0, step=0.01, label="Min-p", elem_id="min-p")
            self.rep = gr.Slider(0.5, 2.0, value=1.0, step=0.05, label="Repetition penalty", elem_id="rep")
        self.next_plot = gr.Plot(label="Next-token distribution", elem_id="next-token")
        # mass kept is measured on each stage's input (after the penalty, temperature and earlier
        # filters), not on the temperature-1 bars above: the headers say so (issue 18 fix 8)
        self.stages = gr.Dataframe(headers=["stage", "removed", "mass kept (of the distribution entering the stage)"],
                                   label="What each stage did (mass kept: of the distribution after the penalty, "
                                         "temperature and earlier filters, not of the grey temperature-1 bars)",
                                   interactive=False)

    # ------------------------------------------------------------------ wiring
    @property
    def sampling_inputs(self):
        return [self.temperature, self.top_k, self.top_p, self.min_p, self.rep]

    @property
    def layer_head_outputs(self):
        return [self.head_grid, self.head_big, self.head_bars, self.neurons, self.neuron_bars]

    @property
    def view_outputs(self):
        return [self.head_grid, self.head_big, self.head_bars, self.lens, self.target, self.contrib, self.resid,
                self.neurons, self.neuron_bars]

    def wire(self, run_button: gr.Button):
        s = self.shared
        run_inputs = [s.model, s.prompt, s.chat, self.truncate, self.layer, self.head, self.last,
                      self.lens_colour, *self.sampling_inputs]
        run_outputs = [self.state, self.status, self.tokens, self.layer, self.head, self.query,
                       *self.view_outputs, self.next_plot, self.stages]
        ev = run_button.click(run_trace, run_inputs, run_outputs, concurrency_id="model", api_name="trace")
        ev2 = s.prompt.submit(run_trace, run_inputs, run_outputs, concurrency_id="model")
        for e in (ev, ev2):
            e.then(overview, [self.state, self.metric, self.layer, self.head], [self.overview])
        slice_inputs = [self.state, self.layer, self.head, self.query, self.lens_colour]
        # Layer/head only change the attention and neuron views; the query position changes all.
        for comp in (self.layer, self.head):
            comp.input(update_layer_head, slice_inputs, self.layer_head_outputs, concurrency_id="views")
        self.query.input(update_views, slice_inputs, self.view_outputs, concurrency_id="views")
        self.lens_colour.input(update_views, slice_inputs, self.view_outputs, concurrency_id="views")
        self.metric.input(overview, [self.state, self.metric, self.layer, self.head], [self.overview])
        for comp in self.sampling_inputs:
            comp.input(update_next, [self.state, *self.sampling_inputs], [self.next_plot, self.stages])
        self.export_btn.click(export, [self.state], [self.export_files])
        return ev, ev2


# ---------------------------------------------------------------------- callbacks

def _settings(temperature, top_k, top_p, min_p, rep) -> SamplingSettings:
    try:
        return SamplingSettings.from_values(temperature, top_k, top_p, min_p, rep)
    except LmscopeError as e:
        raise gr.Error(str(e)) from None


def _get_trace(state: dict):
    tr = STORE.get((state or {}).get("key"))
    if tr is not None:
        return tr
    if not state or not state.get("prompt"):
        raise gr.Error("Run a prompt first.")
    # Evicted from the server's trace cache: re-run it transparently.
    lm = get_model(state["model"])
    tr = trace(lm, state["prompt"], chat=state.get("chat", False), truncate=state.get("truncate", False),
               max_tokens=max_prompt_tokens())
    state["key"] = STORE.put(tr)
    return tr


def _clamp(v, hi) -> int:
    try:
        v = int(v)
    except (TypeError, ValueError):
        v = hi
    return max(0, min(hi, v))


def render_layer_head(tr, layer: int, head: int, query: int) -> list:
    labels = views.labels(tr)
    av = views.attention_view(tr, layer, head, query)
    pos = av["positions"]
    grid = figures.head_grid(av["patterns"], labels, pos, layer, views.kv_groups(tr), head)
    big = figures.attention_heatmap(av["patterns"][head], labels, pos, layer, head, query)
    note = f" (+{av['outside_mass']:.0%} on earlier tokens not shown)" if av["outside_mass"] > 0.005 else ""
    bars = figures.attention_bars(av["row"], labels, pos, labels[query] + note, layer, head)
    nv = views.neuron_view(tr, layer, query)
    neurons = figures.neuron_heatmap(nv["acts"], nv["neurons"], labels, nv["positions"], layer)
    nbars = figures.top_neurons_bars(nv["query_values"], nv["query_neurons"], labels[query], layer)
    return [grid, big, bars, neurons, nbars]


def render_views(tr, layer: int, head: int, query: int, lens_colour: str) -> list:
    grid, big, bars, neurons, nbars = render_layer_head(tr, layer, head, query)
    labels = views.labels(tr)
    lens_colour = lens_colour if lens_colour in LENS_COLOURS else LENS_COLOURS[0]  # a hand-made request may send anything
    lv = views.lens_view(tr, query, "probability" if lens_colour == "probability" else "entropy")
    lens = figures.logit_lens_grid(lv["top"], lv["probs"], lv["colour"], lens_colour, labels, lv["positions"],
                                   lv["layers"])
    target = figures.target_across_layers(lv["target_probs"], lv["target_ranks"], lv["target"], labels[query])
    rv = views.residual_view(tr, query)
    contrib = figures.block_contributions(rv["attn"], rv["mlp"], labels[query])
    resid = figures.residual_norms(rv["norms"], labels, rv["positions"])
    return [grid, big, bars, lens, target, contrib, resid, neurons, nbars]


def next_outputs(tr, settings: SamplingSettings):
    nv = views.next_token_view(tr, settings)
    fig = figures.next_token_bars(nv["tokens"], nv["base"], nv["final"], nv["removed_by"], nv["summary"])
    rows = [[r["stage"], r["removed"], r["mass_kept"]] for r in nv["stages"]]
    return fig, rows


@endpoint(model=True)
def run_trace(model, prompt, chat, truncate, layer, head, query, lens_colour, temperature, top_k, top_p, min_p,
              rep, request: gr.Request = None):
    settings = _settings(temperature, top_k, top_p, min_p, rep)
    lm = get_model(model)
    try:
        tr = trace(lm, prompt, chat=bool(chat), truncate=bool(truncate), max_tokens=max_prompt_tokens())
    except LmscopeError as e:
        raise gr.Error(str(e)) from None
    key = STORE.put(tr)
    shape = lm.shape
    L, H, T = shape.n_layers, shape.n_heads, tr.n_tokens
    layer, head = _clamp(layer, L - 1), _clamp(head, H - 1)
    query = T - 1 if query is None or int(query) < 0 or int(query) >= T else int(query)
    state = {"key": key, "model": lm.name, "prompt": prompt, "chat": bool(chat), "truncate": bool(truncate)}
    ppl = tr.perplexity()
    lp = [None if i == 0 else float(v) for i, v in enumerate(tr.token_logprobs.tolist())]
    status = (f"**{lm.name}** · {T} tokens · {L} layers × {H} heads ({shape.n_kv_heads} key/value heads) · "
              f"traced in {tr.seconds * 1000:.0f} ms on {lm.device}")
    figs = render_views(tr, layer, head, query, lens_colour)
    nfig, rows = next_outputs(tr, settings)
    return [state, status, figures.token_strip_html(tr.tokens, lp, ppl),
            gr.update(maximum=max(L - 1, 1), value=layer), gr.update(maximum=max(H - 1, 1), value=head),
            gr.update(maximum=max(T - 1, 1), value=query), *figs, nfig, rows]


@endpoint(model=True)
def update_views(state, layer, head, query, lens_colour, request: gr.Request = None):
    tr = _get_trace(state)
    s = tr._lm.shape
    return render_views(tr, _clamp(layer, s.n_layers - 1), _clamp(head, s.n_heads - 1),
                        _clamp(query, tr.n_tokens - 1), lens_colour)


@endpoint(model=True)
def update_layer_head(state, layer, head, query, lens_colour, request: gr.Request = None):
    tr = _get_trace(state)
    s = tr._lm.shape
    return render_layer_head(tr, _clamp(layer, s.n_layers - 1), _clamp(head, s.n_heads - 1),
                             _clamp(query, tr.n_tokens - 1))


@endpoint
def update_next(state, temperature, top_k, top_p, min_p, rep):
    tr = _get_trace(state)
    return next_outputs(tr, _settings(temperature, top_k, top_p, min_p, rep))


@endpoint(model=True)
def overview(state, metric, layer, head, request: gr.Request = None):
    if not state or not state.get("key"):
        return figures.empty_figure("Run a prompt to see every head.")
    tr = _get_trace(state)
    values = views.head_overview(tr, metric)
    return figures.head_overview(values, metric, (int(layer), int(head)))


@endpoint
def export(state):
    tr = _get_trace(state)
    d = scratch_dir("export")
    table = views.token_table(tr)
    table.to_csv(d / "tokens.csv", index=False)
    from model_core.cli import trace_summary

    (d / "trace.json").write_text(json.dumps(trace_summary(tr._lm, tr), ensure_ascii=False, indent=2))
    lv = views.lens_view(tr, tr.n_tokens - 1)
    import pandas as pd

    rows = [{"layer": l, "position": p, "top_token": lv["top"][i][j], "prob": float(lv["probs"][i][j])}
            for i, l in enumerate(lv["layers"]) for j, p in enumerate(lv["positions"])]
    pd.DataFrame(rows).to_csv(d / "logit_lens.csv", index=False)
    return gr.update(value=[str(d / "trace.json"), str(d / "tokens.csv"), str(d / "logit_lens.csv")], visible=True)
