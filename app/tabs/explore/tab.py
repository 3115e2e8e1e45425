"""Explore tab: one forward pass, every view. Layout in `build`, callbacks below it.

Run traces the prompt once and stores the Trace server-side; moving a slider re-slices the
stored Trace (no new forward pass); changing a sampling setting only re-filters the stored
next-token logits.
"""

from __future__ import annotations

import json
import re

import gradio as gr

from app.shared import steering_settings
from app.shared import validation as V
from app.shared.context import (
    Shared,
    endpoint,
    get_model,
    max_prompt_tokens,
    max_text_chars,
    scratch_dir,
    text_too_long,
)
from app.shared.page_js import page_js
from app.shared.trace_store import STORE
from app.tabs.explore import figures, views
from app.tabs.explore.lens_filler import FILLER
from app.tabs.explore.state import clamp, trace_for_state, where
from model_core.core.errors import LmscopeError
from model_core.core.sampling import SamplingSettings
from model_core.interp import steering as St
from model_core.interp.trace import trace

OVERVIEW_METRICS = ["entropy (nats; low = focused)", "first-token attention (attention sink)",
                    "previous-token score"]
LENS_COLOURS = ["probability", "entropy (nats)"]
SCALE_CHOICES = [("linear", "linear"), ("log", "log"), ("per-row renormalised", "row")]  # values: views.SCALES

# The page's side of linked views (installed once by a js-only load event): clicks on token chips and
# on plot cells, and boxes dragged on the chosen head or the lens, go to the hidden #explore-action
# box as JSON, whose input event runs on_action (Gradio 6's Textbox sends "input" from its keypress
# handler, so the bridge sets the value, then presses a key). gr.Plot has no click event of its own; Gradio draws
# figures with Plotly.react on the same element, which keeps the listeners bound here. The figures
# say in layout.meta.lmscope which axes carry token labels (category: values are "pos:token", ranges
# are indices from lo) and which carry positions (numeric). The chip of the query is outlined.
BRIDGE_JS = page_js("explore_bridge")


# Epsilon and eta in the page URL, beside the keys app/server/page.py mirrors (its URL_JS keeps keys it does
# not own): written when either changes (left out at 0, off), read back when a link opens the page.
CUTOFF_KEYS = ("epsilon", "eta")
CUTOFF_URL_JS = page_js("explore_cutoffs_url")


def _md(text: str) -> gr.Markdown:
    return gr.Markdown(text, elem_classes=["explain"])


class ExploreTab:
    """Holds the components so callbacks can name their outputs."""

    def __init__(self, shared: Shared):
        self.shared = shared
        self.state = gr.State({})  # {"key", "model", "prompt", "chat", "truncate"}
        # a prompt that cannot run (empty, too long) says so here, under the prompt; the views stay
        self.prompt_msg = V.field_message("explore-msg")
        self.status = gr.Markdown(elem_id="explore-status")
        with gr.Row():
            self.truncate = gr.Checkbox(label=f"Truncate prompts over {max_prompt_tokens()} tokens (keep the end)",
                                        value=False, scale=2)
            self.export_btn = gr.Button("Export trace data (JSON + CSV)", size="sm", scale=1)
            self.export_tensors_btn = gr.Button("Export tensors (safetensors)", size="sm", scale=1,
                                                elem_id="export-tensors")
        self.export_files = gr.File(label="Exported data", file_count="multiple", visible=False)
        self.export_tensors_file = gr.File(label="Trace tensors: load with model_core.load_trace(path)",
                                           visible=False, elem_id="export-tensors-file")
        with gr.Accordion("Steering vector: run this prompt with α·v added", open=False, elem_id="explore-steer"):
            _md("The mean difference of the residual stream between positive and negative prompts at one layer, "
                "added to that layer's input (the Generate tab's *Steering vector* panel explains it and sweeps α). "
                "Every view below then shows the steered model: compare the logit lens and the next-token "
                "distribution with a plain Run.")
            with gr.Row():
                self.steer_choice = gr.Radio([*St.BUILTIN_PAIRS, steering_settings.MY_PAIRS], value="love-hate",
                                             label="pairs", elem_id="explore-steer-pairs")
                self.steer_layer = gr.Number(value=6, precision=0, label="layer (its input gets α·v)",
                                             elem_id="explore-steer-layer")
                self.steer_alpha = gr.Number(value=4.0, label="α", elem_id="explore-steer-alpha")
                self.steer_from = gr.Number(value=0, precision=0, label="from position", elem_id="explore-steer-from")
            self.steer_pairs = gr.Textbox(label="my pairs: one {\"positive\": ..., \"negative\": ...} per line",
                                          lines=2, elem_id="explore-steer-pairs-text")
            self.steer_btn = gr.Button("Run with the vector", variant="primary", elem_id="explore-steer-btn")
            self.steer_msg = V.field_message("explore-steer-msg")

        gr.Markdown("### Tokens")
        _md("The prompt as the model sees it: one chip per token. Colour is how surprised the model was by "
            "each token given the ones before it; ␣ marks a space, ↵ a newline, <0xNN> a raw byte. A character "
            "that several byte tokens spell together (a Burmese letter, an emoji) stands above their chips.")
        self.tokens = gr.HTML(elem_id="tokens")

        gr.Markdown("### Attention")
        _md("Each head decides, for every token (row), how much to read from each earlier token (column). "
            "Look for diagonal stripes (previous-token heads), a bright first column (attention sinks), "
            "and heads that jump to a specific earlier word. Every position is shown, however long the prompt: "
            "beyond 64 positions a cell is the largest weight of a block; drag a box on the chosen head or type "
            "a range to zoom to single cells. Click a token chip to look from that token, a head to open it.")
        with gr.Row():
            # Generous bounds until the first run sets the model's own (a shared URL may name any layer).
            self.layer = gr.Slider(0, 127, value=0, step=1, label="Layer", elem_id="layer")
            self.head = gr.Slider(0, 127, value=0, step=1, label="Head", elem_id="head")
            self.query = gr.Slider(0, 8191, value=0, step=1, label="Query token (position)", elem_id="query")
        with gr.Row():
            self.scale = gr.Radio(SCALE_CHOICES, value="linear", label="Attention colour scale", elem_id="attn-scale",
                                  scale=2)
            self.zoom = gr.Textbox(label="Zoom to positions (Enter)", elem_id="zoom", scale=2, max_lines=1,
                                   placeholder="whole prompt · 100-160 · or 100-160, 0-160 (query rows, key columns)")
            self.zoom_reset = gr.Button("Whole prompt", size="sm", scale=1, elem_id="zoom-reset")
        self.attn_note = gr.Markdown(elem_id="attn-note")
        # Applied view settings. Run reads them in its query slot (Run always starts at the last token),
        # so the public /trace API and the raw event's inputs stay as they were.
        self.view = gr.State({"scale": "linear", "zoom": ""})
        # clicks and dragged boxes in the views arrive here as JSON from the page's bridge (BRIDGE_JS)
        self.action = gr.Textbox(visible="hidden", elem_id="explore-action", label="view action")
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
        with gr.Row():  # the chosen layer's guesses as words; a click on a cell or a word: its top 10
            with gr.Column(scale=3, min_width=300):
                self.lens_strip = gr.HTML(elem_id="lens-strip")
            with gr.Column(scale=1, min_width=240):
                self.lens_topk = gr.HTML(elem_id="lens-topk")
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
        from app.tabs.explore.unit_page import (
            UnitPage,  # a neuron or head on its own page (click a neuron above)
        )

        self.unit_page = UnitPage(self)
        from app.tabs.explore.head_search_panel import (
            HeadSearchPanel,  # every head scored over the corpus (a job)
        )

        self.head_search = HeadSearchPanel(self)
        from app.tabs.explore.features_panel import (
            FeaturesPanel,  # sparse-autoencoder features trained in the app
        )

        self.features = FeaturesPanel(self)
        from app.tabs.explore.circuits_panel import CircuitsPanel  # attribution graphs on transcoders

        self.circuits = CircuitsPanel(self)
        from app.tabs.explore.experts_panel import ExpertsPanel  # a mixture-of-experts model's routing

        self.experts = ExpertsPanel(self)

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
        # truncation cutoffs of the explainer only (the generation engine does not apply them): after
        # min-p, in transformers' order; eta's cutoff is min(eta, sqrt(eta)·e^-H) of what enters it
        with gr.Row():
            self.epsilon = gr.Number(value=0, step=0.0001, elem_id="epsilon",
                                     label="Epsilon cutoff: drop p < ε (0 = off; this view only)")
            self.eta = gr.Number(value=0, step=0.0001, elem_id="eta",
                                 label="Eta cutoff: drop p < min(η, √η·e^−H) (0 = off; this view only)")
        self.sampling_msg = V.field_message("explore-sampling-msg")
        # a link's refused epsilon / eta: said under the settings once the link's own run has drawn
        self.url_note = gr.State("")
        self.next_plot = gr.Plot(label="Next-token distribution", elem_id="next-token")
        # mass kept is measured on each stage's input (after the penalty, temperature and earlier
        # filters), not on the temperature-1 bars above: the headers say so (issue 18 fix 8)
        self.stages = gr.Dataframe(headers=["stage", "removed", "mass kept (of the distribution entering the stage)"],
                                   label="What each stage did (mass kept: of the distribution after the penalty, "
                                         "temperature and earlier filters, not of the grey temperature-1 bars)",
                                   interactive=False, elem_id="explore-stages")
        self.stages_btn = gr.Button("Download the stage table (CSV + JSON)", size="sm", elem_id="export-stages")
        self.stages_files = gr.File(label="Stage table", file_count="multiple", visible=False,
                                    elem_id="export-stages-files")

    # ------------------------------------------------------------------ wiring
    @property
    def sampling_inputs(self):
        return [self.temperature, self.top_k, self.top_p, self.min_p, self.rep]

    @property
    def layer_head_outputs(self):
        return [self.head_grid, self.head_big, self.head_bars, self.neurons, self.neuron_bars, self.overview]

    @property
    def view_outputs(self):
        return [self.head_grid, self.head_big, self.head_bars, self.lens, self.target, self.contrib, self.resid,
                self.neurons, self.neuron_bars]

    @property
    def run_outputs(self):
        """What run_trace returns, in order (app/server/page.py's link autorun sends the same)."""
        return [self.state, self.status, self.tokens, self.layer, self.head, self.query,
                *self.view_outputs, self.next_plot, self.stages, self.zoom, self.view, self.attn_note,
                self.prompt_msg, self.sampling_msg]

    @property
    def zoom_outputs(self):
        return [self.zoom, self.view, self.attn_note, self.head_grid, self.head_big, self.head_bars, self.contrib,
                self.resid, self.neurons, self.neuron_bars, self.lens, self.target, self.tokens]

    def wire(self, run_button: gr.Button):
        s = self.shared
        run_inputs = [s.model, s.prompt, s.chat, self.truncate, self.layer, self.head, self.view,
                      self.lens_colour, *self.sampling_inputs]
        run_outputs = self.run_outputs
        ev = run_button.click(run_trace, run_inputs, run_outputs, concurrency_id="model", api_name="trace")
        ev2 = s.prompt.submit(run_trace, run_inputs, run_outputs, concurrency_id="model")
        for e in (ev, ev2):
            e.then(overview, [self.state, self.metric, self.layer, self.head], [self.overview])
        slice_inputs = [self.state, self.layer, self.head, self.query, self.lens_colour, self.view, self.metric]
        # Layer/head change the attention and neuron views (and the overview's outline); the query
        # position changes all; the zoom every view over positions, then the lens (costly when new).
        for comp in (self.layer, self.head):
            comp.input(update_layer_head, slice_inputs, self.layer_head_outputs, concurrency_id="views")
        self.query.input(update_views, slice_inputs, self.view_outputs, concurrency_id="views")
        self.lens_colour.input(update_views, slice_inputs, self.view_outputs, concurrency_id="views")
        sc = self.scale.input(set_scale, [self.state, self.layer, self.head, self.query, self.scale, self.view],
                              [self.view, self.head_grid, self.head_big, self.attn_note], concurrency_id="views")
        lens_inputs = [self.state, self.query, self.lens_colour, self.view]
        zoom_inputs = [self.state, self.layer, self.head, self.query, self.zoom, self.view, self.lens_colour]
        z1 = self.zoom.submit(set_zoom, zoom_inputs, self.zoom_outputs, concurrency_id="views")
        z2 = self.zoom_reset.click(reset_zoom, [self.state, self.layer, self.head, self.query, self.view,
                                                self.lens_colour], self.zoom_outputs, concurrency_id="views")
        # always_last: a double-click is a click (a query message) then a zoom message a few ms
        # later; Gradio's default for an input event ("once") dropped the zoom whenever the click's
        # event was still running, so the double-click did nothing
        a = self.action.input(on_action, [self.state, self.action, *slice_inputs[1:]],
                              [self.layer, self.head, self.query, *self.zoom_outputs, self.overview],
                              concurrency_id="views", show_progress="minimal", trigger_mode="always_last")
        # a zoom draws the lens from the columns already computed (the background filler computes every
        # position while the server is idle); columns it lacks are blank, said in the title, and this
        # fills them in (and sends nothing when none was missing)
        for e in (z1, z2, a):
            e.then(update_lens, lens_inputs, [self.lens, self.target], concurrency_id="views",
                   show_progress="minimal")
        # app/server/page.py mirrors the settings into the URL after these
        self.url_events = [z1, z2, a, sc]
        if s.page is not None:
            s.page.load(None, None, None, js=BRIDGE_JS)
        self.metric.input(overview, [self.state, self.metric, self.layer, self.head], [self.overview])
        next_io = dict(inputs=[self.state, *self.sampling_inputs, self.epsilon, self.eta],
                       outputs=[self.next_plot, self.stages, self.sampling_msg])
        for comp in [*self.sampling_inputs, self.epsilon, self.eta]:
            e = comp.input(update_next, **next_io)
            if comp in (self.epsilon, self.eta):
                e.then(None, [self.epsilon, self.eta], None, js=CUTOFF_URL_JS)
        # a new trace keeps the cutoffs set here (run_trace's own view has none), whoever ran it: Run,
        # Enter in the prompt, or a link's own run (app/server/page.py)
        after_io = dict(inputs=[*next_io["inputs"], self.url_note], outputs=[*next_io["outputs"], self.url_note])
        self.state.change(cutoffs_after_run, **after_io)
        if s.page is not None:
            s.page.load(cutoffs_from_url, None, [self.epsilon, self.eta, self.sampling_msg, self.url_note]).then(
                None, [self.epsilon, self.eta], None, js=CUTOFF_URL_JS).then(cutoffs_after_run, **after_io)
        # the lens's word strip and the chosen cell's top 10 follow every redraw of the lens and the layer
        gr.on([self.lens.change, self.layer.change], lens_side, [self.state, self.layer, self.query, self.view],
              [self.lens_strip, self.lens_topk], concurrency_id="views", show_progress="hidden",
              trigger_mode="always_last")
        self.head_search.wire(run_trace, run_inputs, run_outputs)
        self.features.wire()
        self.circuits.wire()
        steer_inputs = [self.steer_choice, self.steer_pairs, self.steer_layer, self.steer_alpha, self.steer_from]
        self.steer_btn.click(run_steered_trace, run_inputs + steer_inputs, run_outputs + [self.steer_msg],
                             concurrency_id="model").then(
            overview, [self.state, self.metric, self.layer, self.head], [self.overview])
        self.export_btn.click(export, [self.state], [self.export_files])
        self.stages_btn.click(export_stages, next_io["inputs"], [self.stages_files, self.sampling_msg])
        self.export_tensors_btn.click(export_tensors, [self.state, self.layer, self.head, self.query, self.view,
                                                       self.lens_colour, *self.sampling_inputs],
                                      [self.export_tensors_file], concurrency_id="model")
        return ev, ev2


def build(shared: Shared) -> ExploreTab:
    """The tab's layout inside the current gr.Tab, as every tab module's build(shared). Its events
    need the shared Run button, which sits above the tabs: app/server/page.py calls .wire(run) on the result."""
    return ExploreTab(shared)


# ---------------------------------------------------------------------- callbacks

def _settings(temperature, top_k, top_p, min_p, rep) -> SamplingSettings:
    try:
        return SamplingSettings.from_values(temperature, top_k, top_p, min_p, rep)
    except LmscopeError as e:
        raise gr.Error(str(e)) from None






def _view(view) -> tuple[str, str]:
    """(scale, zoom) of the applied view settings (a hand-made request may send anything)."""
    v = view if isinstance(view, dict) else {}
    scale = v.get("scale") if isinstance(v.get("scale"), str) and v["scale"] in views.SCALES else "linear"
    zoom = v.get("zoom") if isinstance(v.get("zoom"), str) else ""
    return scale, zoom[:200]


def _region(tr, zoom):
    return views.parse_region(zoom, tr.n_tokens)


def region_note(tr, region, notice: str = "", scale: str = "linear") -> str:
    """One line under the zoom box: what the views show, how, and any clamp."""
    T = tr.n_tokens
    q0, q1, k0, k1 = region
    what = ("the whole prompt" if region == views.whole(T) else
            f"query rows {q0}-{q1} × key columns {k0}-{k1}" if (q0, q1) != (k0, k1) else f"positions {q0}-{q1}")
    wide = max(q1 - q0, k1 - k0) + 1
    how = ("every cell" if wide <= views.EXACT else
           f"pooled (drag a box on the chosen head, or type a range of at most {views.EXACT} positions, "
           "to see single cells)")
    thin = (" Over many tokens attention is spread thin: the log or per-row scale shows more."
            if scale == "linear" and T > views.EXACT else "")
    return (f"⚠️ {notice} " if notice else "") + f"Showing {what} of {T:,} tokens, {how}.{thin}"


def render_attention(tr, layer: int, head: int, query: int, region=None, scale: str = "linear") -> list:
    labels = views.labels(tr)
    av = views.attention_view(tr, layer, head, query, region, scale)
    grid = figures.head_grid(av["grid"], av["grid_rows"], av["grid_cols"], layer, views.kv_groups(tr), head,
                             av["scale"], av["log_floor"])
    big = figures.attention_heatmap(av["big"], av["rows"], av["cols"], layer, head, query, av["scale"],
                                    av["log_floor"])
    bars = figures.attention_bars(av["row"], av["bars"], labels[query], layer, head, av["outside_mass"])
    return [grid, big, bars]


def render_neurons(tr, layer: int, query: int, region=None) -> list:
    labels = views.labels(tr)
    region = region or views.whole(tr.n_tokens)
    nv = views.neuron_view(tr, layer, query, region[:2])
    neurons = figures.neuron_heatmap(nv["acts"], nv["neurons"], nv["axis"], layer)
    nbars = figures.top_neurons_bars(nv["query_values"], nv["query_neurons"], labels[query], layer)
    return [neurons, nbars]


def render_residual(tr, query: int, region=None) -> list:
    labels = views.labels(tr)
    region = region or views.whole(tr.n_tokens)
    rv = views.residual_view(tr, query, region[:2])
    return [figures.block_contributions(rv["attn"], rv["mlp"], labels[query]), figures.residual_norms(rv["norms"], rv["axis"])]


def render_lens(tr, query: int, lens_colour: str, region=None, compute: bool = True, with_missing: bool = False):
    """[lens, target]; compute=False draws only the columns already computed (with_missing: also
    returns how many it lacked)."""
    labels = views.labels(tr)
    region = region or views.whole(tr.n_tokens)
    lens_colour = lens_colour if lens_colour in LENS_COLOURS else LENS_COLOURS[0]  # a hand-made request may send anything
    lv = views.lens_view(tr, query, "probability" if lens_colour == "probability" else "entropy", region[:2],
                         compute=compute)
    lens = figures.logit_lens_grid(lv["top"], lv["probs"], lv["colour"], lens_colour, labels, lv["positions"],
                                   lv["layers"], lv["step"], query, missing=lv["missing"])
    target = figures.target_across_layers(lv["target_probs"], lv["target_ranks"], lv["target"], labels[query])
    return [lens, target, lv["missing"]] if with_missing else [lens, target]


def render_layer_head(tr, layer: int, head: int, query: int, region=None, scale: str = "linear") -> list:
    return [*render_attention(tr, layer, head, query, region, scale), *render_neurons(tr, layer, query, region)]


def render_views(tr, layer: int, head: int, query: int, lens_colour: str, region=None, scale: str = "linear") -> list:
    """Every view over positions, in ExploreTab.view_outputs order. The query only marks a row /
    column and picks what the bars show: it never crops a view."""
    grid, big, bars = render_attention(tr, layer, head, query, region, scale)
    lens, target = render_lens(tr, query, lens_colour, region)
    contrib, resid = render_residual(tr, query, region)
    neurons, nbars = render_neurons(tr, layer, query, region)
    return [grid, big, bars, lens, target, contrib, resid, neurons, nbars]


def next_outputs(tr, settings: SamplingSettings, epsilon: float = 0.0, eta: float = 0.0):
    nv = views.next_token_view(tr, settings, epsilon=epsilon, eta=eta)
    fig = figures.next_token_bars(nv["tokens"], nv["base"], nv["final"], nv["removed_by"], nv["summary"])
    rows = [[r["stage"], r["removed"], r["mass_kept"]] for r in nv["stages"]]
    return fig, rows


@endpoint(model=True, long_text=("prompt",))  # _run caps the prompt: a sentence under it, or truncation
def run_trace(model, prompt, chat, truncate, layer, head, query, lens_colour, temperature, top_k, top_p, min_p,
              rep, request: gr.Request = None):
    """query: a position (out of range or -1: the last token), or the page's view settings
    {"scale", "zoom", "query"?} (the attention colour scale and the zoom, which is clamped to the
    prompt with a notice; from a link, the query too)."""
    return _run(model, prompt, chat, truncate, layer, head, query, lens_colour, temperature, top_k, top_p, min_p, rep)


@endpoint(model=True, long_text=("prompt",))
def run_steered_trace(model, prompt, chat, truncate, layer, head, query, lens_colour, temperature, top_k, top_p,
                      min_p, rep, choice, pairs_text, steer_layer, alpha, from_pos, request: gr.Request = None):
    """run_trace with a steering vector added (app.tabs.generate.steering_panel: alpha * v at steer_layer's input):
    every view, the lens and the next-token distribution included, shows the steered model. Its
    outputs: run_trace's, then the steering message (a bad value: that sentence, nothing else changes)."""
    steer = steering_settings.steer_settings(choice, pairs_text, steer_layer, alpha, from_pos)
    try:
        edits, line = steering_settings.edits_for(get_model(model), steer)
    except LmscopeError as e:
        return [gr.skip()] * len(RUN_OUTPUT_NAMES) + [V.show(e)]
    return [*_run(model, prompt, chat, truncate, layer, head, query, lens_colour, temperature, top_k, top_p, min_p,
                  rep, steer=(steer, edits, line)), V.clear()]


def _run(model, prompt, chat, truncate, layer, head, query, lens_colour, temperature, top_k, top_p, min_p, rep,
         steer=None):
    """run_trace's work; steer: (settings kept in the state, edits, the status line's words) or None."""
    view = query if isinstance(query, dict) else None
    query = view.get("query", -1) if view is not None else query
    # a bad sampling setting loses nothing: the views run, the distribution leaves that setting at
    # its default, and the sentence stands under the settings (issue 15 item 4)
    settings, problems = V.check_settings(temperature, top_k, top_p, min_p, rep)
    too_long = text_too_long(prompt)
    if too_long and not truncate:  # the sentence under the prompt; every view keeps the last good one
        return [gr.skip()] * (len(RUN_OUTPUT_NAMES) - 2) + [V.show(too_long), gr.skip()]
    if too_long:  # truncation keeps the end: first the characters the server reads, then the tokens
        prompt = prompt[-max_text_chars():]
    lm = get_model(model)
    try:
        tr = trace(lm, prompt, chat=bool(chat), truncate=bool(truncate), max_tokens=max_prompt_tokens(),
                   edits=steer[1] if steer else None)
    except LmscopeError as e:  # an empty or too long prompt: every view keeps the last good one
        return [gr.skip()] * (len(RUN_OUTPUT_NAMES) - 2) + [V.show(e), gr.skip()]
    key = STORE.put(tr)
    FILLER.schedule(tr)  # the lens of every position, while the server is idle (zooms find it ready)
    shape = lm.shape
    L, H, T = shape.n_layers, shape.n_heads, tr.n_tokens
    asked = {"layer": _asked(layer), "head": _asked(head), "query": _asked(query)}
    layer, head = clamp(layer, L - 1), clamp(head, H - 1)
    query = T - 1 if _int(query) is None or not 0 <= _int(query) < T else _int(query)
    # out-of-range values (a shared link's ?layer=999, another model's layer) are clamped, and said
    clamped = [str(view.get("notice"))[:300]] if view is not None and view.get("notice") else []
    for what, got, n in (("Layer", layer, L), ("Head", head, H)):
        if asked[what.lower()] is not None and asked[what.lower()] != got:
            clamped.append(f"{what} {asked[what.lower()]} is outside {lm.name}'s {n} {what.lower()}s "
                           f"(0–{n - 1}): showing {what.lower()} {got}.")
    if view is not None and asked["query"] not in (None, -1) and asked["query"] != query:
        clamped.append(f"Query position {asked['query']} is outside the prompt's {T} tokens: showing the last.")
    state = {"key": key, "model": lm.name, "prompt": prompt, "chat": bool(chat), "truncate": bool(truncate)}
    if steer:
        state["steer"] = steer[0]
    ppl = tr.perplexity()
    lp = [None if i == 0 else float(v) for i, v in enumerate(tr.token_logprobs.tolist())]
    status = (f"**{lm.name}** · {T} tokens · {L} layers × {H} heads ({shape.n_kv_heads} key/value heads) · "
              f"traced in {tr.seconds * 1000:.0f} ms on {lm.device}" + (f" · **{steer[2]}**" if steer else ""))
    scale, zoom = _view(view)
    region, notice = _region(tr, zoom)
    notice = " ".join([*clamped, notice] if notice else clamped)
    figs = render_views(tr, layer, head, query, lens_colour, region, scale)
    nfig, rows = next_outputs(tr, settings)
    zoom = views.region_text(region, T)
    sampling = (V.show(" ".join(problems.values()) + " The distribution below leaves it at its default.")
                if problems else V.clear())
    return [state, status, strip_html(tr, region, lp, ppl),
            gr.update(maximum=max(L - 1, 1), value=layer), gr.update(maximum=max(H - 1, 1), value=head),
            gr.update(maximum=max(T - 1, 1), value=query), *figs, nfig, rows,
            zoom, {"scale": scale, "zoom": zoom}, region_note(tr, region, notice, scale), V.clear(), sampling]


RUN_OUTPUT_NAMES = ["state", "status", "tokens", "layer", "head", "query", "head_grid", "head_big", "head_bars",
                    "lens", "target", "contrib", "resid", "neurons", "neuron_bars", "next_plot", "stages", "zoom",
                    "view", "attn_note", "prompt_msg", "sampling_msg"]  # ExploreTab.run_outputs, in order


def _asked(v):
    """The integer a request asked for (to say what was clamped), or None."""
    try:
        return int(v)
    except (TypeError, ValueError, OverflowError):
        return None




def _overview_fig(tr, metric, layer: int, head: int):
    metric = metric if metric in OVERVIEW_METRICS else OVERVIEW_METRICS[2]
    return figures.head_overview(views.head_overview(tr, metric), metric, (layer, head))


@endpoint(model=True)
def lens_side(state, layer, query, view=None, request: gr.Request = None):
    """The lens's word strip at the chosen layer, and the top 10 at the chosen cell (layer, query: a
    click on a lens cell sets both)."""
    if not isinstance(state, dict) or not state.get("key"):
        return gr.skip(), gr.skip()
    tr, layer, _, query = where(state, layer, 0, query)
    names = views.labels(tr)
    st = views.lens_strip(tr, layer, _region(tr, _view(view)[1])[0][:2])
    tk = views.lens_topk(tr, layer, query)
    return (figures.lens_strip_html(st["words"], st["probs"], names, st["positions"], st["layer"], st["step"], query),
            figures.lens_topk_html(tk["tokens"], tk["probs"], tk["layer"], tk["pos"], names[tk["pos"]], tk["entropy"]))


@endpoint(model=True)
def update_views(state, layer, head, query, lens_colour, view=None, metric=None, request: gr.Request = None):
    tr, layer, head, query = where(state, layer, head, query)
    scale, zoom = _view(view)
    return render_views(tr, layer, head, query, lens_colour, _region(tr, zoom)[0], scale)


@endpoint(model=True)
def update_layer_head(state, layer, head, query, lens_colour, view=None, metric=None, request: gr.Request = None):
    tr, layer, head, query = where(state, layer, head, query)
    scale, zoom = _view(view)
    figs = render_layer_head(tr, layer, head, query, _region(tr, zoom)[0], scale)
    return [*figs, _overview_fig(tr, metric, layer, head)]


@endpoint(model=True)
def update_lens(state, query, lens_colour, view=None, request: gr.Request = None):
    """The lens after a zoom or a click: computes the columns the zoom drew blank, drawing as it
    goes (views.missing_batches: a few columns spread over the region first, then the rest in two
    growing batches; a 64-column cold zoom is ~2 s of unembedding on the 2-core CPU). The zoom's
    view state says how many it lacked ("lens_missing"); none: nothing to send."""
    if isinstance(view, dict) and view.get("lens_missing") == 0:
        yield gr.skip(), gr.skip()
        return
    tr = trace_for_state(state)
    query = clamp(query, tr.n_tokens - 1)
    region = _region(tr, _view(view)[1])[0]
    positions, _ = views.lens_positions(*region[:2])
    batches = views.missing_batches(tr, positions)
    for batch in batches:
        views.lens_columns(tr, batch)
        yield render_lens(tr, query, lens_colour, region, compute=False)
    if not batches:  # the filler got there between the zoom and this event
        yield render_lens(tr, query, lens_colour, region, compute=False)


@endpoint(model=True)
def set_scale(state, layer, head, query, scale, view=None, request: gr.Request = None):
    tr, layer, head, query = where(state, layer, head, query)
    scale = scale if isinstance(scale, str) and scale in views.SCALES else "linear"
    zoom = _view(view)[1]
    region, notice = _region(tr, zoom)
    grid, big, _ = render_attention(tr, layer, head, query, region, scale)
    return [{"scale": scale, "zoom": zoom}, grid, big, region_note(tr, region, notice, scale)]


def _zoomed(tr, layer, head, query, scale, region, notice="", strip: bool = True, lens_colour=None,
            lens: bool = True):
    """Outputs of ExploreTab.zoom_outputs for a region. The lens is drawn from the columns already
    computed (blank where not, said in its title; update_lens follows and fills them in; the view
    state's "lens_missing" tells it how many). lens=False: the lens is left as it is. The token
    strip is sent again only when the prompt is longer than one strip holds and the zoom moved."""
    zoom = views.region_text(region, tr.n_tokens)
    FILLER.focus(tr, *region[:2])  # the background lens fills the rows on screen first
    grid, big, bars = render_attention(tr, layer, head, query, region, scale)
    contrib, resid = render_residual(tr, query, region)
    neurons, nbars = render_neurons(tr, layer, query, region)
    if lens:
        lfig, target, missing = render_lens(tr, query, lens_colour, region, compute=False, with_missing=True)
    else:
        lfig, target, missing = gr.skip(), gr.skip(), 0
    tokens = strip_html(tr, region) if strip and tr.n_tokens > STRIP_MAX else gr.skip()
    return [zoom, {"scale": scale, "zoom": zoom, "lens_missing": missing}, region_note(tr, region, notice, scale),
            grid, big, bars, contrib, resid, neurons, nbars, lfig, target, tokens]


STRIP_MAX = 1024  # token chips sent at most: past that the strip shows a window of the prompt


def strip_html(tr, region=None, lp=None, ppl=None) -> str:
    """The token strip; for a prompt longer than STRIP_MAX tokens, the STRIP_MAX tokens around the
    zoomed rows (the end of the prompt when not zoomed), so the page stays bounded at any length."""
    T = tr.n_tokens
    if lp is None:
        lp = [None if i == 0 else float(v) for i, v in enumerate(tr.token_logprobs.tolist())]
    ppl = tr.perplexity() if ppl is None else ppl
    if T <= STRIP_MAX:
        return figures.token_strip_html(tr.tokens, lp, ppl)
    q0, q1 = (region or views.whole(T))[:2]
    n = q1 - q0 + 1
    a = q0 - (STRIP_MAX - n) // 2 if n <= STRIP_MAX else q1 + 1 - STRIP_MAX
    a = max(0, min(T - STRIP_MAX, a))
    body = figures.token_strip_html(tr.tokens[a: a + STRIP_MAX], lp[a: a + STRIP_MAX], ppl)
    body = re.sub(r'data-pos="(\d+)"', lambda m: f'data-pos="{int(m.group(1)) + a}"', body)  # positions in the prompt
    return (f'<div class="token-legend">Tokens {a}–{a + STRIP_MAX - 1} of {T:,} (one strip holds {STRIP_MAX:,}; '
            f'zoom elsewhere to see others). Perplexity is over the whole prompt.</div>' + body)


@endpoint(model=True)
def set_zoom(state, layer, head, query, zoom, view=None, lens_colour=None, request: gr.Request = None):
    tr, layer, head, query = where(state, layer, head, query)
    region, notice = _region(tr, zoom)
    return _zoomed(tr, layer, head, query, _view(view)[0], region, notice, lens_colour=lens_colour)


@endpoint(model=True)
def reset_zoom(state, layer, head, query, view=None, lens_colour=None, request: gr.Request = None):
    tr, layer, head, query = where(state, layer, head, query)
    return _zoomed(tr, layer, head, query, _view(view)[0], views.whole(tr.n_tokens), lens_colour=lens_colour)


def _int(v):
    """An integer from a bridge message, or None (hostile values are simply ignored)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v or abs(v) > 1e9:
        return None
    return int(round(v))


def _range(v):
    if isinstance(v, list) and len(v) == 2:
        a, b = _int(v[0]), _int(v[1])
        if a is not None and b is not None:
            return min(a, b), max(a, b)
    return None


@endpoint(model=True)
def on_action(state, action, layer, head, query, lens_colour, view=None, metric=None, request: gr.Request = None):
    """A click or a dragged box in the page (BRIDGE_JS), as JSON: {"kind": "query", "pos"} (a token
    chip, a row of the chosen head), {"kind": "head", "layer"?, "head"} (the overview, the grid),
    {"kind": "lens", "layer", "pos"}, {"kind": "zoom", "rows": [a, b], "cols"?: [c, d]} or
    {"kind": "zoom"} for the whole prompt. Returns the sliders, the zoom outputs (the lens from the
    columns already computed; update_lens fills in the rest) and the overview. Anything else changes
    nothing."""
    n_out = 3 + 13 + 1
    try:
        msg = json.loads(action) if isinstance(action, str) and len(action) < 2000 else None
    except ValueError:
        msg = None
    if not isinstance(msg, dict) or not state or not isinstance(state, dict) or not state.get("key"):
        return [gr.skip()] * n_out
    tr, layer, head, query = where(state, layer, head, query)
    s, T = tr.lm.shape, tr.n_tokens
    scale, zoom = _view(view)
    region, notice = _region(tr, zoom)
    kind = msg.get("kind")
    if kind in ("query", "lens") and _int(msg.get("pos")) is not None:
        query = clamp(_int(msg["pos"]), T - 1)
    if kind in ("head", "lens") and _int(msg.get("layer")) is not None:
        layer = clamp(_int(msg["layer"]), s.n_layers - 1)
    if kind == "head" and _int(msg.get("head")) is not None:
        head = clamp(_int(msg["head"]), s.n_heads - 1)
    if kind == "zoom":
        rows, cols = _range(msg.get("rows")), _range(msg.get("cols"))
        if rows is None:
            region, notice = views.whole(T), ""
        else:
            cols = cols or rows
            text = f"{rows[0]}-{rows[1]}, {cols[0]}-{cols[1]}"
            region, notice = views.parse_region(text, T) if min(rows + cols) >= 0 else (views.whole(T), "")
    elif kind not in ("query", "lens", "head"):
        return [gr.skip()] * n_out
    # a head click changes no position: the lens stays as it is
    out = _zoomed(tr, layer, head, query, scale, region, notice, strip=kind == "zoom", lens_colour=lens_colour,
                  lens=kind != "head")
    return [layer, head, query, *out, _overview_fig(tr, metric, layer, head)]


@endpoint
def update_next(state, temperature, top_k, top_p, min_p, rep, epsilon=0.0, eta=0.0):
    settings, problems = V.check_settings(temperature, top_k, top_p, min_p, rep)
    from model_core.core.sampling import check_cutoff

    for name, v in (("epsilon", epsilon), ("eta", eta)):
        try:
            check_cutoff(name, v)
        except LmscopeError as e:
            problems[name] = str(e)
    if problems:  # the distribution shown stays; the sentence stands under the settings
        return gr.skip(), gr.skip(), V.show(" ".join(problems.values()))
    tr = trace_for_state(state)
    return (*next_outputs(tr, settings, float(epsilon or 0), float(eta or 0)), V.clear())


@endpoint
def cutoffs_after_run(state, temperature, top_k, top_p, min_p, rep, epsilon=0.0, eta=0.0, note=""):
    """After a new trace (and once a link's cutoffs are in their boxes): redraw the distribution with
    the epsilon / eta cutoffs when one is on, and say a link's refused value (`note`, then cleared)."""
    if not isinstance(state, dict) or not state.get("key"):  # no trace yet: the run will call again
        return gr.skip(), gr.skip(), gr.skip(), gr.skip()
    on = any(isinstance(v, (int, float)) and not isinstance(v, bool) and v for v in (epsilon, eta))
    fig, rows, msg = update_next(state, temperature, top_k, top_p, min_p, rep, epsilon, eta) if on else (
        gr.skip(), gr.skip(), gr.skip())
    if isinstance(note, str) and note:
        said = msg.get("value", "") if isinstance(msg, dict) and msg.get("visible") else ""
        msg = V.show(" ".join(x for x in (note[:600], said.removeprefix("⚠️ ")) if x))
    return fig, rows, msg, ""


def cutoffs_from_query(q: dict) -> tuple[dict, str]:
    """A link's ?epsilon= / ?eta= -> ({name: value to put in its box}, notice). A value the explainer
    cannot use (not a number, negative, 1 or more) is refused: that cutoff stays off (0), and the
    notice says so in one sentence (like ?layer=999, which is clamped with a notice)."""
    from model_core.core.sampling import check_cutoff

    values, notes = {}, []
    for k in CUTOFF_KEYS:
        raw = q.get(k)
        if raw is None or raw == "":
            continue
        raw = str(raw)[:40]
        try:
            values[k] = check_cutoff(k, raw)
        except LmscopeError as e:
            values[k] = 0
            notes.append(f"The link's {k}={raw} was not used ({str(e).rstrip('.')}): {k} is off.")
    return values, " ".join(notes)


@endpoint
def cutoffs_from_url(request: gr.Request = None):
    """The page's load: a link's epsilon / eta into their boxes (cutoffs_from_query), a refused one
    said under the settings and kept in the url_note state until the link's own run has drawn."""
    values, note = cutoffs_from_query(dict(request.query_params) if request is not None else {})
    return [values.get(k, gr.skip()) for k in CUTOFF_KEYS] + [V.show(note) if note else gr.skip(), note]


@endpoint(model=True)
def overview(state, metric, layer, head, request: gr.Request = None):
    if not state or not state.get("key"):
        return figures.empty_figure("Run a prompt to see every head.")
    tr, layer, head, _ = where(state, layer, head, 0)
    return _overview_fig(tr, metric, layer, head)


@endpoint
def export_stages(state, temperature, top_k, top_p, min_p, rep, epsilon=0.0, eta=0.0):
    """stages.csv and stages.json (app/exports.write_stages): what each sampling stage did to the
    trace's next-token distribution with these settings. A bad setting: its sentence under the
    settings, nothing written."""
    from app.shared.exports import write_stages
    from model_core.core.sampling import check_cutoff

    settings, problems = V.check_settings(temperature, top_k, top_p, min_p, rep)
    for name, v in (("epsilon", epsilon), ("eta", eta)):
        try:
            check_cutoff(name, v)
        except LmscopeError as e:
            problems[name] = str(e)
    if problems:
        return gr.skip(), V.show(" ".join(problems.values()) + " Nothing was downloaded.")
    tr = trace_for_state(state)
    eps, et = float(epsilon or 0), float(eta or 0)
    nv = views.next_token_view(tr, settings, epsilon=eps, eta=et)
    st = state if isinstance(state, dict) else {}
    meta = {"model": tr.model_name, "prompt": st.get("prompt"), "chat": bool(st.get("chat")),
            "n_tokens": tr.n_tokens, "settings": {**settings.to_dict(), "epsilon": eps, "eta": et}}
    files = write_stages(nv, scratch_dir("stages"), meta)
    return gr.update(value=[str(f) for f in files], visible=True), V.clear()


@endpoint
def export(state):
    tr = trace_for_state(state)
    d = scratch_dir("export")
    table = views.token_table(tr)
    table.to_csv(d / "tokens.csv", index=False)
    from model_core.interp.trace_summary import trace_summary

    (d / "trace.json").write_text(json.dumps(trace_summary(tr.lm, tr), ensure_ascii=False, indent=2))
    lv = views.lens_view(tr, tr.n_tokens - 1)
    import pandas as pd

    rows = [{"layer": l, "position": p, "top_token": lv["top"][i][j], "prob": float(lv["probs"][i][j])}
            for i, l in enumerate(lv["layers"]) for j, p in enumerate(lv["positions"])]
    pd.DataFrame(rows).to_csv(d / "logit_lens.csv", index=False)
    return gr.update(value=[str(d / "trace.json"), str(d / "tokens.csv"), str(d / "logit_lens.csv")], visible=True)


@endpoint(model=True)
def export_tensors(state, layer, head, query, view, lens_colour, temperature, top_k, top_p, min_p, rep,
                   request: gr.Request = None):
    """The trace itself as safetensors (app/exports.trace_file; over model_core.interp.trace_io's size cap:
    one sentence), with the view settings and the model id in its metadata."""
    from app.shared.exports import trace_file

    tr, layer, head, query = where(state, layer, head, query)
    scale, zoom = _view(view)

    def num(v):
        return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None
    st = state if isinstance(state, dict) else {}
    settings = {"model": tr.model_name, "prompt": st.get("prompt"), "chat": bool(st.get("chat")),
                "truncate": bool(st.get("truncate")), "layer": layer, "head": head, "query": query, "scale": scale,
                "zoom": zoom, "lens_colour": lens_colour if lens_colour in LENS_COLOURS else "probability",
                "temperature": num(temperature), "top_k": num(top_k), "top_p": num(top_p), "min_p": num(min_p),
                "repetition_penalty": num(rep)}
    return gr.update(value=str(trace_file(tr, scratch_dir("tensors"), settings)), visible=True)
