"""Explore's "Sparse-autoencoder features" accordion: a feature set trained in the app (a `features`
job, model_core.interp.features) read on the current prompt, and a page per feature.

- the set: which hook it reads, its size and its measured quality (variance explained, CE loss
  recovered with its reconstruction spliced into the forward pass, on held-out text);
- on this prompt: per token, the features that fire (the chosen token's in a menu to open);
- a feature's page: its automatic label, how often it fires over the corpus scan (density and a
  histogram of its activations), top-activating corpus contexts with the activating token marked,
  its activation on every position of the prompt, and the tokens its decoder direction promotes and
  suppresses through the unembedding;
- feature steering: the next token with the feature clamped (0 ablates it), against the plain run;
- search: features whose label or top contexts mention a text.

Built inside ExploreTab.__init__; `wire()` after the tab's components exist."""

from __future__ import annotations

import html
import json
from functools import lru_cache

import gradio as gr
import plotly.graph_objects as go
import torch

from app.shared import validation as V
from app.shared.context import endpoint
from app.shared.page_js import page_js
from app.tabs.explore import figures
from app.tabs.explore import unit_figures as UF
from app.tabs.explore.state import clamp, trace_for_state
from model_core.interp import features as FT

MAX_SEARCH = 20


@lru_cache(maxsize=4)
def _open(name: str, mtime: float):
    """(Features, FeatureContexts or None, labels list) of a saved set; re-read when its folder changes."""
    feats = FT.load_features(name)
    path = feats.path
    index = FT.FeatureContexts.load(path / "contexts.safetensors") if (path / "contexts.safetensors").exists() else None
    labels = json.loads((path / "labels.json").read_text(encoding="utf-8")) if (path / "labels.json").exists() else []
    return feats, index, labels


def open_set(name):
    if not isinstance(name, str) or name not in FT.list_features():
        raise gr.Error("Choose a feature set (train one with the button above, or `lmscope jobs submit features`).")
    return _open(name, (FT.features_dir() / name / "features.json").stat().st_mtime)


def sets_for(model: str) -> list[str]:
    """Saved feature sets trained on `model`."""
    out = []
    for name in FT.list_features():
        try:
            rec = json.loads((FT.features_dir() / name / "features.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if rec.get("model") == model:
            out.append(name)
    return out


def quality_line(rec: dict) -> str:
    q = rec.get("quality") or {}
    parts = [f"**{rec.get('name', '?')}**: {rec.get('num_latents')} features (top-{rec.get('k')}) on "
             f"`{rec.get('hook_name')}` of {rec.get('model')}, {rec.get('tokens', 0):,} training tokens"]
    if q:
        parts.append(f"held-out: variance explained **{q['explained']:.1%}**, CE loss recovered **{q['ce_recovered']:.1%}** "
                     f"(clean {q['ce_clean']:.3f}, with the reconstruction {q['ce_sae']:.3f}, zero-ablated "
                     f"{q['ce_zero']:.3f} nats), {q['l0']:.1f} features active per token, "
                     f"{q['alive_share']:.0%} of features fired")
    return " · ".join(parts) + "."


def _short(labels: list, f: int) -> str:
    return labels[f]["label"][:60] if 0 <= f < len(labels) else ""


def prompt_html(acts: dict, labels: list, query: int) -> str:
    """Per token its firing features, the chosen token outlined."""
    cells = []
    for p in acts["positions"]:
        fs = "".join(f"<div class='ft-f' title='{html.escape(_short(labels, f['feature']))}'>#{f['feature']} "
                     f"<b>{f['activation']:.2f}</b></div>" for f in p["features"][:3]) or "<div class='ft-f'>·</div>"
        style = "border:2px solid #e4572e;" if p["position"] == query else "border:1px solid #ddd;"
        cells.append(f"<div style='display:inline-block;vertical-align:top;margin:2px;padding:2px 4px;{style}"
                     f"border-radius:4px;font-size:12px'><div style='font-family:monospace'>"
                     f"{html.escape(p['token'])}</div>{fs}</div>")
    return f"<div class='ft-prompt'>{''.join(cells)}</div>"


def contexts_html(ctx: list[dict], tokenizer=None) -> str:
    if not ctx:
        return "<p>No corpus context makes this feature fire (it may be dead).</p>"
    rows = []
    for c in ctx:
        toks = "".join(f"<b style='background:#fde68a'>{html.escape(t)}</b>" if i == c["at"] else html.escape(t)
                       for i, t in enumerate(c["tokens"]))
        rows.append(f"<tr><td style='text-align:right;padding-right:8px'>{c['value']:.2f}</td>"
                    f"<td style='font-family:monospace;white-space:pre-wrap;overflow-wrap:anywhere'>{toks}</td></tr>")
    return ("<table class='ft-contexts'><tr><th>activation</th><th>context (the activating token marked)</th></tr>"
            + "".join(rows) + "</table>")


def activation_figure(values: list[float], tokens: list[str], feature: int) -> go.Figure:
    fig = go.Figure(go.Bar(x=[f"{i}:{t}" for i, t in enumerate(tokens)], y=values, marker_color="#e4572e",
                           hovertemplate="%{x}<br>activation %{y:.3f}<extra></extra>"))
    fig.update_layout(title=f"Feature #{feature} on this prompt, position by position", height=300,
                      margin=dict(l=40, r=20, t=50, b=80), xaxis=dict(tickangle=-60))
    return fig


def _feature_number(text) -> int:
    try:
        f = int(str(text).strip().lstrip("#"))
    except (TypeError, ValueError):
        raise gr.Error("Type a feature number, e.g. 123.") from None
    return f


@endpoint
def refresh_sets(state, request: gr.Request = None):
    if not isinstance(state, dict) or not state.get("model"):
        return gr.update(choices=[], value=None), V.show("Run a prompt first.")
    names = sets_for(trace_for_state(state).model_name)
    if not names:
        return gr.update(choices=[], value=None), V.show(
            "No feature set for this model yet: `lmscope jobs submit features --model ... --layer 6 --wait`.")
    return gr.update(choices=names, value=names[-1]), V.clear()


@endpoint(model=True)
def on_prompt(state, name, query, request: gr.Request = None):
    """[quality line, per-token features HTML, the chosen token's features menu, message]; with no
    set chosen (a query moved before any was picked) nothing changes."""
    if not name:
        return gr.skip(), gr.skip(), gr.skip(), gr.skip()
    try:
        feats, _, labels = open_set(name)
        tr = trace_for_state(state)
        acts = FT.feature_activations(tr.lm, feats, tr.token_ids, top=5)
    except (gr.Error, FT.FeatureError) as e:
        return gr.skip(), gr.skip(), gr.skip(), V.show(e)
    q = clamp(query, len(acts["positions"]) - 1)
    here = acts["positions"][q]["features"]
    choices = [(f"#{f['feature']} ({f['activation']:.2f}) {_short(labels, f['feature'])}", f["feature"]) for f in here]
    return (quality_line(feats.record), prompt_html(acts, labels, q),
            gr.update(choices=choices, value=choices[0][1] if choices else None,
                      label=f"features at token {q} ({acts['positions'][q]['token']})"), V.clear())


@endpoint(model=True)
def open_feature(state, name, feature, request: gr.Request = None):
    """[title, contexts HTML, activation on the prompt, promoted/suppressed tokens, histogram over
    the corpus scan, message]."""
    try:
        feats, index, labels = open_set(name)
        f = _feature_number(feature)
        if not 0 <= f < feats.num_latents:
            raise FT.FeatureError(f"Feature {f} is outside this set (0-{feats.num_latents - 1}).")
        tr = trace_for_state(state)
        lm = tr.lm
        top = FT.promoted_tokens(lm, feats, f, 10)
        x = FT.capture(lm, feats.point(lm), torch.tensor([tr.token_ids]))[0]  # [T, d]
        dense = _dense(feats, x, f)
        ctx = FT.top_contexts(index, lm.tokenizer, f) if index is not None else []
    except (gr.Error, FT.FeatureError) as e:
        return gr.skip(), gr.skip(), gr.skip(), gr.skip(), gr.skip(), V.show(e)
    lab = labels[f] if f < len(labels) else {"label": "", "contexts": len(ctx)}
    d = FT.density(index, f) if index is not None else {}
    fires = (f"fires on **{d['density']:.3%}** of the {d['scanned']:,} tokens scanned ({d['fired']:,})"
             if d else "density not recorded (this set was saved before lmscope kept it)")
    title = (f"### Feature #{f} of {name}\n**Label (automatic):** {html.escape(lab['label'])} · {fires} · "
             f"{lab.get('contexts', len(ctx))} top contexts kept from the corpus scan")
    hist = (UF.density_figure(d, f"#{f} over the corpus: {d['fired']:,} of {d['scanned']:,} tokens")
            if d and d["fired"] else figures.empty_figure("This feature never fired in the corpus scan."))
    return (title, contexts_html(ctx), activation_figure(dense, [t["display"] for t in tr.tokens], f),
            UF.weights_figure(top, f"Feature #{f}: tokens its decoder direction promotes / suppresses (W_dec·W_U)"),
            hist, V.clear())


def _dense(feats, x, f: int) -> list[float]:
    """The feature's activation at every position of x [T, d] (0 where it is not among the top-k;
    the same encoder feature_activations uses)."""
    acts, idx = FT._encode(feats.sae, x)  # [T, k] each
    return [float(a[i == f].sum()) for a, i in zip(acts, idx)]


@endpoint(model=True)
def clamp_feature(state, name, feature, value, request: gr.Request = None):
    """[figure, summary, message]: the next token after the prompt with the feature clamped to
    `value` at every position from 1 (0 ablates it), against the model as it runs."""
    from model_core.interp.feature_steering import feature_edits, next_token_shift

    try:
        feats, _, _ = open_set(name)
        f = _feature_number(feature)
        tr = trace_for_state(state)
        lm = tr.lm
        edits = feature_edits(lm, feats, f, value)  # one sentence for a set of another model
    except (gr.Error, FT.FeatureError) as e:
        return gr.skip(), gr.skip(), V.show(e)
    shift = next_token_shift(lm, torch.tensor([tr.token_ids], device=lm.device), edits)
    base, after, kl = shift["base"], shift["after"], shift["kl"]
    union = list(dict.fromkeys(base.topk(8).indices.tolist() + after.topk(8).indices.tolist()))
    union.sort(key=lambda i: -float(base[i]))
    from model_core.core.tokenization import describe_tokens

    names = [r["display"] for r in describe_tokens(lm.tokenizer, union)]
    rows = [{"token": n, "before": float(base[i].exp()), "after": float(after[i].exp())} for n, i in zip(names, union)]
    v = float(value)
    what = "ablated (0)" if v == 0 else f"clamped to {v:g}"
    title = f"Feature #{f} {what} from position 1: the next token"
    return (UF.clamp_figure(rows, title),
            f"KL(clamped ‖ as it runs) of the next-token distribution: **{kl:.4f} nats**. The edit adds "
            f"(value − the feature's activation) × its decoder row at `{feats.point(lm).edit_name}`; the "
            f"autoencoder's reconstruction error is kept, so only this feature's direction moves.", V.clear())


@endpoint
def search(name, text, request: gr.Request = None):
    """Features whose automatic label or top-context n-grams contain the text (case-insensitive)."""
    try:
        _, _, labels = open_set(name)
    except gr.Error as e:
        return gr.skip(), V.show(e)
    needle = str(text or "").strip().lower()[:200]
    if not needle:
        return gr.skip(), V.show("Type a token or a word to search the labels.")
    hits = [(f"#{lab['feature']} {lab['label'][:70]}", lab["feature"]) for lab in labels
            if needle in lab["label"].lower() or any(needle in r["text"].lower() for r in lab.get("reads", []))]
    if not hits:
        return gr.update(choices=[], value=None), V.show(f"No feature label mentions {text!r}.")
    return gr.update(choices=hits[:MAX_SEARCH], value=hits[0][1], label=f"{len(hits)} features match"), V.clear()


class FeaturesPanel:
    def __init__(self, tab):
        self.tab = tab
        with gr.Accordion("Sparse-autoencoder features", open=False, elem_id="features"):
            gr.Markdown("A sparse autoencoder trained in this app on one layer's activations splits them into "
                        "features, each a direction that fires on few tokens. Train one with "
                        "`lmscope jobs submit features --layer 6 --wait`, pick it here, and see which features fire "
                        "on each token of the prompt; open one for its page.", elem_classes=["explain"])
            with gr.Row():
                self.set = gr.Dropdown(choices=[], label="feature set", elem_id="features-set", scale=3)
                self.refresh = gr.Button("Find feature sets", elem_id="features-refresh", scale=1)
                self.show = gr.Button("Features on this prompt", variant="primary", elem_id="features-show", scale=1)
            self.msg = V.field_message("features-msg")
            self.quality = gr.Markdown(elem_id="features-quality")
            self.prompt = gr.HTML(elem_id="features-prompt")
            with gr.Row():
                self.here = gr.Dropdown(choices=[], label="features at the chosen token", elem_id="features-here",
                                        scale=3)
                self.search_text = gr.Textbox(label="search labels", max_lines=1, elem_id="features-search", scale=2)
                self.number = gr.Number(value=None, precision=0, label="feature #", elem_id="features-number", scale=1)
                self.open_btn = gr.Button("Open feature", elem_id="features-open", scale=1)
            self.title = gr.Markdown(elem_id="features-title")
            self.contexts = gr.HTML(elem_id="features-contexts")
            with gr.Row():
                self.acts = gr.Plot(label="On this prompt", elem_id="features-acts")
                self.hist = gr.Plot(label="Over the corpus", elem_id="features-hist")
                self.weights = gr.Plot(label="Through the unembedding", elem_id="features-weights")
            with gr.Row():
                self.clamp_value = gr.Number(value=0, label="clamp the feature to (0 = ablate)",
                                             elem_id="features-clamp-value", scale=1)
                self.clamp_btn = gr.Button("Clamp it: the next token", elem_id="features-clamp", scale=1)
            self.clamp_note = gr.Markdown(elem_id="features-clamp-note")
            self.clamp_plot = gr.Plot(label="Feature steering", elem_id="features-clamp-plot")

    def wire(self) -> None:
        tab = self.tab
        self.refresh.click(refresh_sets, [tab.state], [self.set, self.msg])
        show_outs = [self.quality, self.prompt, self.here, self.msg]
        self.show.click(on_prompt, [tab.state, self.set, tab.query], show_outs, concurrency_id="views")
        # a token chip or the query slider moves the query: the menu follows (nothing runs without a set)
        tab.query.change(on_prompt, [tab.state, self.set, tab.query], show_outs, concurrency_id="views",
                         show_progress="hidden")
        self.here.input(None, [self.here], [self.number], js=page_js("pass_value"))
        self.search_text.submit(search, [self.set, self.search_text], [self.here, self.msg])
        page = [self.title, self.contexts, self.acts, self.weights, self.hist, self.msg]
        self.open_btn.click(open_feature, [tab.state, self.set, self.number], page, concurrency_id="views")
        self.clamp_btn.click(clamp_feature, [tab.state, self.set, self.number, self.clamp_value],
                             [self.clamp_plot, self.clamp_note, self.msg], concurrency_id="model")
