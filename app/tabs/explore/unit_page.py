"""The neuron / head page inside Explore (issue 15 item 9): an accordion under the MLP neurons.

A unit is named like the Interventions tab names them: L12N767 (neuron 767 of layer 12's MLP) or
L5H4 (head 4 of layer 5); "n767" alone takes the Explore layer. A click on a neuron in the neuron
heatmap or bars opens its page (UNIT_JS, a js-only load event: it writes the name and presses
Open), and "Open the chosen head" opens the Explore head.

The page shows, from model_core.interp.neurons: the tokens the unit promotes and suppresses through the
unembedding (a head: its OV circuit on the prompt's tokens), its activation on the current prompt,
and its top-activating contexts over the built-in corpus, which a background job (kind 'neurons',
tasks/neuron_job.py) computes once per model and stores for every page; until it has, the page
offers to start it (or follows the one running) and shows its progress.
"""

from __future__ import annotations

import re

import gradio as gr

from app.shared import job_views as jf
from app.shared.context import endpoint, job_owner, job_viewer
from app.shared.page_js import page_js
from app.tabs.explore import unit_figures as UF
from app.tabs.explore.state import trace_for_state, where

_UNIT = re.compile(r"^\s*(?:L\s*(\d+)\s*)?([NH])\s*(\d+)\s*$", re.I)
JOB_POLL_S = 1.0

UNIT_JS = page_js("unit_page")


def parse_unit(text, layer_default: int | None = None) -> tuple[str, int, int]:
    """'L12N767' -> ('neuron', 12, 767); 'L5H4' -> ('head', 5, 4); 'n767' takes layer_default."""
    m = _UNIT.match(str(text or "")[:40])
    if not m or (m.group(1) is None and layer_default is None):
        raise gr.Error("Name a neuron or a head like L12N767 or L5H4 (layer, then N or H and its number).")
    layer = int(m.group(1)) if m.group(1) is not None else int(layer_default)
    return ("neuron" if m.group(2).upper() == "N" else "head"), layer, int(m.group(3))


_INDEX: dict = {}  # path -> (mtime, ContextIndex): the stored scans, read once per change


def stored_index(model: str):
    """The built-in corpus scan of `model` (tasks/neuron_job.py), or None while there is none."""
    from model_core.interp.neurons import ContextIndex
    from tasks.neuron_job import shared_index_path

    path = shared_index_path(model)
    try:
        mtime = path.stat().st_mtime
    except OSError:
        return None
    got = _INDEX.get(str(path))
    if got is None or got[0] != mtime:
        got = (mtime, ContextIndex.load(path))
        _INDEX.clear()  # one model's index at a time (a few MB each)
        _INDEX[str(path)] = got
    return got[1]


def _label(kind: str, layer: int, unit: int) -> str:
    return f"L{layer}{'N' if kind == 'neuron' else 'H'}{unit}"


def contexts_for(lm, kind: str, layer: int, unit: int) -> tuple[str, dict]:
    """(contexts html, the compute button's update) from the stored scan of lm's model."""
    index = stored_index(lm.name)
    if index is not None and index.neuron_vals.shape[0] == lm.shape.n_layers:
        ctx = index.contexts(lm.tokenizer, kind, layer, unit)
        m = index.meta
        return (UF.contexts_html(ctx, f"{m.get('tokens', index.tokens.numel()):,} tokens of the built-in corpus "
                                      f"(standard-library docstrings), windows of {index.window}"),
                gr.update(visible=False))
    return ("<p class='unit-none'>Top contexts over the built-in corpus are not computed for this model yet: press "
            "the button to run it once as a background job (every page then reuses it).</p>", gr.update(visible=True))


def render(state: dict, text, layer_default) -> tuple:
    """(title, weights figure, activation figure, OV html, contexts html, compute button, unit text)."""
    from model_core.interp import neurons as N

    tr = trace_for_state(state)
    lm = tr.lm
    kind, layer, unit = parse_unit(text, layer_default)
    name = _label(kind, layer, unit)
    labels = [f"{i}:{t['display']}" for i, t in enumerate(tr.tokens)]
    if kind == "neuron":
        logits = N.neuron_logits(lm, layer, unit)
        act = N.neuron_activation(tr, layer, unit).tolist()
        ov = ""
        peak = max(range(len(act)), key=lambda i: abs(act[i]))
        what = f"**Neuron {name}** · layer {layer}'s MLP, neuron {unit} of {lm.shape.d_mlp}"
        on_prompt = f"strongest at {labels[peak]} ({act[peak]:+.3f})"
        act_fig = UF.activation_figure(labels, act, f"{name} on the current prompt (mlp.hook_post)", "activation")
    else:
        distinct = list(dict.fromkeys(tr.token_ids))[:16]
        ov_logits = N.head_ov_logits(lm, layer, unit, distinct)
        logits = ov_logits.mean(0)
        from model_core.core.tokenization import describe_tokens

        shown = describe_tokens(lm.tokenizer, distinct)
        rows = []
        for r, (tid, d) in enumerate(zip(distinct, shown)):
            top = N.top_tokens(lm, ov_logits[r], 3)["promoted"]
            rank = int((ov_logits[r] > ov_logits[r, tid]).sum()) + 1
            rows.append({"source": d["display"], "promoted": top, "self_rank": rank})
        ov = UF.ov_html(rows)
        a = N.head_activity(tr, layer, unit)
        act = a["norm"].tolist()
        src = a["source"].tolist()
        hover = [f"{labels[i]}<br>looks most at {labels[s]} ({w:.2f})" for i, (s, w) in
                 enumerate(zip(src, a["weight"].tolist()))]
        peak = max(range(len(act)), key=lambda i: act[i])
        what = f"**Head {name}** · layer {layer}, head {unit} of {lm.shape.n_heads}"
        on_prompt = f"writes most at {labels[peak]} (‖z·W_O‖ {act[peak]:.2f}, looking at {labels[src[peak]]})"
        act_fig = UF.activation_figure(labels, act, f"{name} on the current prompt: output norm ‖z_h·W_O^h‖",
                                       "output norm", hover)
    top = N.top_tokens(lm, logits, 10)
    w_title = (f"{name}: tokens it promotes / suppresses (W_out[n]·W_U)" if kind == "neuron" else
               f"{name}: OV circuit, mean over the prompt's tokens (W_E·W_V·W_O·W_U)")
    contexts, compute = contexts_for(lm, kind, layer, unit)
    title = f"{what} · on this prompt: {on_prompt}."
    return title, UF.weights_figure(top, w_title), act_fig, ov, contexts, compute, name


class UnitPage:
    def __init__(self, tab):
        """Built inside ExploreTab.__init__ (its components exist): the accordion and its events."""
        self.tab = tab
        with gr.Accordion("Neuron or head page", open=False, elem_id="unit-page"):
            gr.Markdown("A neuron or a head on its own: the tokens it pushes up and down through the unembedding, "
                        "what it does on this prompt, and the contexts of the built-in corpus where it fires "
                        "hardest. Click a neuron above, or type one.", elem_classes=["explain"])
            with gr.Row():
                self.unit = gr.Textbox(label="Neuron or head (L12N767, L5H4)", elem_id="unit-id", max_lines=1,
                                       scale=3)
                self.open_btn = gr.Button("Open", elem_id="unit-open", scale=1)
                self.head_btn = gr.Button("Open the chosen head", elem_id="unit-head", scale=1)
            self.title = gr.Markdown(elem_id="unit-title")
            with gr.Row():
                self.weights = gr.Plot(label="Through the unembedding", elem_id="unit-weights")
                self.activation = gr.Plot(label="On the current prompt", elem_id="unit-activation")
            self.ov = gr.HTML(elem_id="unit-ov")
            self.contexts = gr.HTML(elem_id="unit-contexts")
            self.compute = gr.Button("Find top contexts for this model (background job)", visible=False,
                                     elem_id="unit-compute", size="sm")
            self.job_bar = gr.HTML(elem_id="unit-job")
        self.job_id = gr.State(None)
        self.timer = gr.Timer(JOB_POLL_S, active=False)
        outs = [self.title, self.weights, self.activation, self.ov, self.contexts, self.compute, self.unit]
        for ev in (self.open_btn.click, self.unit.submit):
            ev(open_unit, [tab.state, self.unit, tab.layer], outs, concurrency_id="views")
        self.head_btn.click(open_head, [tab.state, tab.layer, tab.head], outs, concurrency_id="views")
        self.compute.click(start_scan, [tab.state], [self.job_id, self.job_bar, self.timer])
        self.timer.tick(poll_scan, [self.job_id, tab.state, self.unit, tab.layer],
                        [self.job_bar, self.contexts, self.compute, self.timer], show_progress="hidden")
        if tab.shared.page is not None:
            tab.shared.page.load(None, None, None, js=UNIT_JS)


@endpoint(model=True)
def open_unit(state, text, layer, request: gr.Request = None):
    try:
        layer_default = int(layer)
    except (TypeError, ValueError, OverflowError):
        layer_default = None
    return render(state, text, layer_default)


@endpoint(model=True)
def open_head(state, layer, head, request: gr.Request = None):

    _, layer, head, _ = where(state, layer, head, 0)
    return render(state, f"L{layer}H{head}", layer)


def _model_of(state) -> str:
    if not isinstance(state, dict) or not isinstance(state.get("model"), str):
        raise gr.Error("Run a prompt first.")

    return trace_for_state(state).model_name  # a model this server loaded for the page, never a path


@endpoint
def start_scan(state, request: gr.Request = None):
    """Follow a scan of this model already queued or running, else queue one."""
    from tasks.neuron_job import active_job

    model = _model_of(state)
    rec = active_job(model, job_viewer(request)) or jf.job_store().submit("neurons", {"model": model},
                                                                           owner=job_owner(request))
    return rec["id"], jf.progress_html(rec), gr.Timer(active=True)


@endpoint(model=True)
def poll_scan(job_id, state, text, layer, request: gr.Request = None):
    if not job_id:
        return gr.skip(), gr.skip(), gr.skip(), gr.Timer(active=False)
    rec, bar = jf.job_bar(job_id, request)
    if jf.cancellable(rec):
        return bar, gr.skip(), gr.skip(), gr.skip()
    if rec["state"] != "succeeded":
        return bar, f"<p class='unit-none'>The scan {rec['state']}: {rec.get('error') or ''}</p>", gr.skip(), \
            gr.Timer(active=False)

    try:
        kind, lay, unit = parse_unit(text, int(layer or 0))
    except (gr.Error, TypeError, ValueError):  # no unit open yet: the contexts appear when one is
        return bar, gr.skip(), gr.update(visible=False), gr.Timer(active=False)
    contexts, compute = contexts_for(trace_for_state(state).lm, kind, lay, unit)
    return bar, contexts, compute, gr.Timer(active=False)
