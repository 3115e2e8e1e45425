"""Interventions tab: ablate heads / MLPs / neurons, patch a clean prompt into a corrupted one,
attribute the answer to layers and heads, and compare two prompts side by side.

Everything here is a thin wire between widgets, model_core.interp.interventions / attribution, and the
pure figure functions in app.tabs.interventions.figures. Interventions run inside a per-request
Recorder (a ContextVar), so nothing a user toggles here changes another user's model.
"""

from __future__ import annotations

import json
import re

import gradio as gr
import torch

from app.shared import job_views as jf
from app.shared.context import Shared, default_model, endpoint, get_model, job_owner, job_viewer
from app.shared.page_js import page_js
from app.tabs.interventions import figures as fig
from model_core.core import paths
from model_core.core.errors import LmscopeError
from model_core.core.registry import REGISTRY, converted_dir
from model_core.interp.attribution import direct_logit_attribution
from model_core.interp.interventions import (
    Ablation,
    ablate,
    compare_prompts,
    make_metric,
    patch_heads,
    patch_residual,
)
from model_core.interp.lens import logit_lens

CLEAN = "The Eiffel Tower is in the city of"
CORRUPT = "The Colosseum is in the city of"
TARGET, OTHER = " Paris", " Rome"
MAX_SWEEP_CELLS = 4000  # larger sweeps belong in a background job

INTRO = """**What if?** Switch parts of the model off, or transplant activations from one prompt into another,
and watch the prediction move. The clean/corrupted pair below differs only in the landmark; the metric is read at
the last position (logit difference `target − other`, or `log p(target)`).

- **Ablate**: zero (or replace by its mean over the prompt's positions) the chosen heads, MLP layers or neurons,
  on the *clean* prompt.
- **Patch**: run the *corrupted* prompt, but copy one activation from the clean run (one layer × position of the
  residual stream, or one head's output at every position). 0 = no better than corrupted, 1 = fully clean.
- **Attribute**: how much each head / attention layer / MLP writes directly toward the target through the final norm
  (its scale frozen as the model applied it), on the clean prompt. Adds up exactly to the logit.
- **Compare**: the two prompts side by side."""



# --- head choices without loading the model ------------------------------------------------

def _config_for(name: str) -> dict | None:
    entry = REGISTRY.get(name)
    if entry is not None and entry.random_config:
        return dict(entry.random_config)
    for d in (converted_dir(name), paths.finetuned_dir() / name):
        try:
            return json.loads((d / "config.json").read_text())
        except (OSError, ValueError):
            continue
    return None


def shape_of(name: str) -> tuple[int, int] | None:
    """(layers, heads) from a model's config file, or None when unknown before loading."""
    cfg = _config_for((name or "").strip() or default_model())
    if not cfg:
        return None
    cfg = cfg.get("text_config", cfg)
    L = cfg.get("num_hidden_layers", cfg.get("n_layer"))
    H = cfg.get("num_attention_heads", cfg.get("n_head"))
    return (int(L), int(H)) if L and H else None


def head_choices(n_layers: int, n_heads: int) -> list[str]:
    return [f"L{l}H{h}" for l in range(n_layers) for h in range(n_heads)]


@endpoint(model=True)
def _choices_update(name, request: gr.Request = None):
    from app.shared.context import model_names

    if not isinstance(name, str) or name.strip() not in model_names():
        name = default_model()  # never a path: _config_for joins the name onto server folders
    s = shape_of(name)
    if s is None:
        try:
            lm = get_model(name)
            s = (lm.shape.n_layers, lm.shape.n_heads)
        except gr.Error:
            s = (0, 0)
    return (gr.update(choices=head_choices(*s), value=[]), gr.update(choices=[str(l) for l in range(s[0])], value=[]))


_HEAD = re.compile(r"^\s*L?(\d+)\s*[.:H]\s*(\d+)\s*$", re.I)
_NEURON = re.compile(r"^\s*L?(\d+)\s*[.:N]\s*(\d+)\s*$", re.I)


def parse_pairs(items, pattern=_HEAD, what="head") -> tuple[tuple[int, int], ...]:
    """['L3H2', '5.1'] or 'L3N100, 4:7' -> ((3, 2), (5, 1))."""
    if isinstance(items, str):
        items = [p for p in re.split(r"[,\s;]+", items) if p.strip()]
    out = []
    for it in items or []:
        m = pattern.match(str(it))
        if not m:
            raise gr.Error(f"Could not read {what} '{it}': write it like "
                           f"{'L3H2' if what == 'head' else 'L3N120'} (layer, then index).")
        out.append((int(m.group(1)), int(m.group(2))))
    return tuple(out)


def _metric(lm, target, other, kind):
    other = other if kind == "logit_diff" else None
    return make_metric(lm, target, other or None, kind="logit_diff" if other else "logprob")


def _tok(lm, i: int) -> str:
    """Byte-safe, as in every other view: ␣ for a space, ↵ for a newline, <0xNN> for a raw byte."""
    from model_core.core.tokenization import token_display

    return token_display(lm.tokenizer, i) or "∅"


def _pos_labels(lm, ids) -> list[str]:
    """'position:token' axis labels; byte tokens that make a character together say which ("မ·1/3")."""
    from model_core.core.tokenization import describe_tokens

    return [f"{p}:{r['display'] or '∅'}" for p, r in enumerate(describe_tokens(lm.tokenizer, ids))]


# --- handlers ----------------------------------------------------------------------------------

@endpoint(model=True)
def run_ablation(model, clean, target, other, kind, heads, mlps, neurons, mode, request: gr.Request = None):
    lm = get_model(model)
    ab = Ablation(heads=parse_pairs(heads), mlps=tuple(int(l) for l in (mlps or [])),
                  neurons=parse_pairs(neurons, _NEURON, "neuron"), mode=mode or "zero")
    m = _metric(lm, target, other, kind)
    res = ablate(lm, clean, ab, metric=m)
    top = res.next_token_probs(10)
    bars = fig.next_token_compare([_tok(lm, i) for i in top["ids"]], top["clean"], top["ablated"],
                                  title=f"Next token: clean vs {ab.describe()}")
    follow = int(torch.argmax(res.clean.next_logits)) if m.kind == "logprob" else m.target
    T = res.clean.n_tokens
    lc = logit_lens(res.clean, positions=[T - 1], k=1, targets=[follow])
    la = logit_lens(res.ablated, positions=[T - 1], k=1, targets=[follow])
    lens = fig.lens_change(lc.layers, lc.target_probs[:, 0].tolist(), la.target_probs[:, 0].tolist(),
                           lm.tokenizer.decode([follow]),
                           [_tok(lm, i) for i in lc.top_ids[:, 0, 0].tolist()],
                           [_tok(lm, i) for i in la.top_ids[:, 0, 0].tolist()])
    summary = (f"**{ab.describe()}** on the clean prompt ({T} tokens). {m.describe(lm)}: "
               f"clean **{res.clean_metric:.3f}** → ablated **{res.ablated_metric:.3f}** "
               f"(Δ {res.ablated_metric - res.clean_metric:+.3f}).")
    data = {"ablation": ab.describe(), "metric": m.describe(lm), "clean_metric": res.clean_metric,
            "ablated_metric": res.ablated_metric, "tokens": [_tok(lm, i) for i in top["ids"]],
            "token_ids": list(top["ids"]), "clean": list(top["clean"]), "ablated": list(top["ablated"]),
            "follow": lm.tokenizer.decode([follow]), "layers": [int(l) for l in lc.layers],
            "lens_clean": lc.target_probs[:, 0].tolist(), "lens_ablated": la.target_probs[:, 0].tolist(),
            "top_clean": [_tok(lm, i) for i in lc.top_ids[:, 0, 0].tolist()],
            "top_ablated": [_tok(lm, i) for i in la.top_ids[:, 0, 0].tolist()]}
    return summary, bars, lens, data  # data: the results download (app/shared/exports.py), a State


def _patch_summary(d: dict, cols: list[str], metric_desc: str) -> str:
    """One paragraph under the heatmap, from a PatchingResult.to_dict() (interactive or job)."""
    best, where = None, None
    for r, row in enumerate(d["normalized"]):
        for c, v in enumerate(row):
            if v is not None and not (isinstance(v, float) and v != v) and (best is None or v > best):
                best, where = v, (r, c)
    n_cells = sum(len(row) for row in d["values"])
    n_c, n_k = len(d["clean_ids"]), len(d["corrupted_ids"])
    lengths = f"both prompts are {n_k} tokens" if n_c == n_k else f"prompts of {n_c} and {n_k} tokens, {d['aligned']}"
    out = (f"{metric_desc}: clean **{d['clean_value']:.3f}**, corrupted **{d['corrupted_value']:.3f}**. "
           f"{n_cells} patched runs in {d['n_forward']} forward passes (batches of {d['batch_size']}), "
           f"{d['seconds']:.1f} s; {lengths}.")
    if where is not None:
        out += (f" Strongest cell: L{d['rows'][where[0]]} · {cols[where[1]]} restores {best:.2f} of the "
                f"clean answer.")
    if d["kind"] == "resid":
        out += ("\n\n*How to read it:* each cell is one run of the corrupted prompt with the residual stream at "
                "that position, entering that layer, copied from the clean run. **1** (dark red) = the model "
                "now answers as on the clean prompt, **0** (white) = no better than the corrupted prompt, "
                "negative (blue) = pushed further away.")
    else:
        out += ("\n\n*How to read it:* each cell is one run of the corrupted prompt with that head's output "
                "(at every position) copied from the clean run. **1** = clean answer restored, **0** = no effect.")
    if abs(d["clean_value"] - d["corrupted_value"]) < 1e-6:
        out += " Clean and corrupted score the same, so the normalised effect is undefined (blank)."
    return out


def _patch_title(what: str, metric_desc: str) -> str:
    return (f"Patching clean → corrupted ({'head outputs' if what == 'heads' else 'residual stream'}): "
            f"{metric_desc}")


@endpoint(model=True)
def run_patching(model, clean, corrupt, target, other, kind, what, align, request: gr.Request = None,
                 progress=gr.Progress()):
    """Interactive sweep. Returns (summary, heatmap, job-offer visibility): a residual sweep over
    MAX_SWEEP_CELLS cells is not run here; the 'Run as a background job' box is shown instead."""
    lm = get_model(model)
    m = _metric(lm, target, other, kind)
    L = lm.shape.n_layers
    progress(0.0, desc="clean and corrupted runs")

    def report(f):
        progress(f, desc="patched runs")
    align_mode = "right" if align else "error"
    if what == "heads":
        res = patch_heads(lm, clean, corrupt, m, align=align_mode, progress=report)
        cols = [f"H{h}" for h in res.cols]
    else:
        n_tokens = len(lm.tokenizer(corrupt)["input_ids"]) if isinstance(corrupt, str) else 0
        if L * n_tokens > MAX_SWEEP_CELLS:
            return (f"That sweep is {L} layers × {n_tokens} positions = **{L * n_tokens} patched runs**, more "
                    f"than the {MAX_SWEEP_CELLS} this page runs while you wait. Run it as a background job "
                    f"below (it keeps running if you close the page), or shorten the prompts.",
                    gr.skip(), gr.update(visible=True), gr.skip())
        res = patch_residual(lm, clean, corrupt, m, align=align_mode, progress=report)
        cols = [_pos_labels(lm, res.corrupted_ids)[p] for p in res.cols]
    heat = fig.patching_heatmap(res.normalized, res.rows, cols, _patch_title(what, m.describe(lm)), kind=res.kind)
    d = {**res.to_dict(), "col_labels": cols, "metric_description": m.describe(lm)}
    return _patch_summary(d, cols, m.describe(lm)), heat, gr.update(visible=False), d


# --- the same sweep as a background job (tasks/patching_job.py) ------------------------------

JOB_POLL_S = 1.0


@endpoint(model=True)
def submit_patch_job(model, clean, corrupt, target, other, kind, what, align, request: gr.Request = None):
    """Queue the sweep on the worker. Returns (job id, progress HTML, timer, summary)."""
    lm = get_model(model)  # the server's allow-list, and a bad target fails here, not on the worker
    m = _metric(lm, target, other, kind)
    params = {"model": (model or "").strip() or default_model(), "clean": clean, "corrupted": corrupt,
              "target": target, "other": other if m.kind == "logit_diff" else None,
              "sweep": "heads" if what == "heads" else "residual", "align": "right" if align else "error"}
    rec = jf.job_store().submit("patching", params, owner=job_owner(request))
    return (rec["id"], jf.progress_html(rec), gr.Timer(active=True),
            f"Queued background job **{rec['id']}**; the heatmap appears here when it finishes. "
            f"It is also listed in the Jobs tab.")


@endpoint
def poll_patch_job(job_id, request: gr.Request = None):
    """Timer tick: progress; when the job has finished, the heatmap from its patching.json."""
    from tasks.patching_job import read_result

    if not job_id:
        return gr.skip(), gr.skip(), gr.skip(), gr.Timer(active=False), gr.skip()
    try:
        rec, bar = jf.job_bar(job_id, request)
    except LmscopeError as e:
        return f"⚠️ {e}", gr.skip(), gr.skip(), gr.Timer(active=False), gr.skip()
    if jf.cancellable(rec):
        return bar, gr.skip(), gr.skip(), gr.skip(), gr.skip()
    if rec["state"] != "succeeded":
        why = rec.get("error") or rec["state"]
        return (bar, f"Background job **{job_id}** {rec['state']}: {why}", gr.skip(), gr.Timer(active=False),
                gr.skip())
    d = read_result(rec)
    if d is None:
        return (bar, f"Job **{job_id}** finished but its result file is missing.", gr.skip(), gr.Timer(active=False),
                gr.skip())
    what = "heads" if d["kind"] == "heads" else "resid"
    heat = fig.patching_heatmap(d["normalized"], d["rows"], d["col_labels"],
                                _patch_title(what, d["metric_description"]), kind=d["kind"])
    summary = f"Background job **{job_id}**: " + _patch_summary(d, d["col_labels"], d["metric_description"])
    return bar, summary, heat, gr.Timer(active=False), d


def _space_problems(lm, target, other, kind) -> list[tuple[str, dict]]:
    from model_core.core.tokenization import spaced_alternative

    fields = [("target", target)] + ([("other", other)] if kind == "logit_diff" else [])
    return [(name, alt) for name, text in fields if (alt := spaced_alternative(lm.tokenizer, text))]


def _space_sentence(name: str, alt: dict) -> str:
    became = " + ".join(f"“{d}”" for d in alt["shown"])
    ids = ", ".join(str(i) for i in alt["ids"])
    n = len(alt["ids"])
    return (f"The {name} '{alt['text']}' became {'token' if n == 1 else f'{n} tokens'} {became} (id {ids}), "
            f"without a leading space; after a word the model writes “{alt['spaced_shown']}” "
            f"(id {alt['spaced_id']}).")


@endpoint(model=True)
def space_note(model, target, other, kind, request: gr.Request = None):
    """Under the target and other boxes: which token a text without its leading space became, and
    the button that puts the space in (hidden when both already name the token a model writes)."""
    try:
        problems = _space_problems(get_model(model), target, other, kind)
    except (gr.Error, LmscopeError):
        return gr.update(visible=False), gr.update(visible=False)
    if not problems:
        return gr.update(value="", visible=False), gr.update(visible=False)
    text = " ".join(_space_sentence(n, a) for n, a in problems)
    label = "Use " + " and ".join(f"'{a['spaced']}'" for _, a in problems)
    return gr.update(value=f"ⓘ {text}", visible=True), gr.update(value=label, visible=True)


@endpoint(model=True)
def use_spaced(model, target, other, kind, request: gr.Request = None):
    problems = dict(_space_problems(get_model(model), target, other, kind))
    return (problems["target"]["spaced"] if "target" in problems else gr.skip(),
            problems["other"]["spaced"] if "other" in problems else gr.skip(),
            gr.update(value="", visible=False), gr.update(visible=False))


@endpoint
def _job_cancel_button(bar_html):
    return gr.update(visible=jf.bar_shows(bar_html, jf.LIVE_STATES))


@endpoint
def cancel_patch_job(job_id, request: gr.Request = None):
    if not job_id:
        return gr.skip()
    return jf.progress_html(jf.job_store().cancel_job(job_id, owner=job_viewer(request)))


@endpoint(model=True)
def run_attribution(model, clean, target, other, kind, request: gr.Request = None):
    lm = get_model(model)
    m = _metric(lm, target, other, kind)
    a = direct_logit_attribution(lm, clean, m)
    what = f"logit[{lm.tokenizer.decode([m.target])!r}]" + (
        f" − logit[{lm.tokenizer.decode([m.other])!r}]" if a.other is not None else "")
    heads = fig.head_attribution(a.heads.tolist(), title=f"Direct attribution per head toward {what}")
    bars = fig.layer_bars(a.attn.tolist(), a.mlp.tolist(), a.embed, title=f"Per layer toward {what}")
    top = torch.topk(a.heads.flatten().abs(), k=min(5, a.heads.numel())).indices.tolist()
    H = a.heads.shape[1]
    tops = ", ".join(f"L{i // H}H{i % H} {float(a.heads.flatten()[i]):+.2f}" for i in top)
    summary = (f"Sum of the parts **{a.total:.3f}** = the model's logit **{a.logit:.3f}** "
               f"(embedding {a.embed:+.2f}, attention {float(a.attn.sum()):+.2f}, MLPs {float(a.mlp.sum()):+.2f}, "
               f"final bias {a.final_bias:+.2f}; final-norm scale frozen at "
               f"{a.final_scale:.3f}). Largest heads: {tops}.")
    data = {"toward": what, "logit": a.logit, "total": a.total, "embed": a.embed, "final_bias": a.final_bias,
            "final_scale": a.final_scale, "attn": a.attn.tolist(), "mlp": a.mlp.tolist(), "heads": a.heads.tolist()}
    return summary, heads, bars, data


@endpoint(model=True)
def run_compare(model, a, b, request: gr.Request = None):
    lm = get_model(model)
    c = compare_prompts(lm, a, b, k=10)
    fa = fig.distribution([_tok(lm, i) for i in c.top["a"]["ids"]], c.top["a"]["probs"], "Prompt A: next token")
    fb = fig.distribution([_tok(lm, i) for i in c.top["b"]["ids"]], c.top["b"]["probs"], "Prompt B: next token",
                          color=fig.OTHER)
    diff = fig.resid_difference(c.resid_diff_norm.tolist(), c.resid_rel_diff.tolist())
    return fa, fb, diff


@endpoint
def export_results(ablation, patching, attribution):
    """The ablation, patching and attribution results last shown, as CSV files and one JSON."""
    from app.shared.context import scratch_dir
    from app.shared.exports import write_interventions

    got = [d if isinstance(d, dict) else None for d in (ablation, patching, attribution)]
    if not any(got):
        raise gr.Error("Run an ablation, a patching sweep or an attribution first; then its results can be downloaded.")
    return gr.update(value=[str(p) for p in write_interventions(*got, scratch_dir("interventions"))], visible=True)


@endpoint(model=True)  # an unloaded model's shape is read by loading it
def pick_head(model, picked, request: gr.Request = None):
    """A click on a head's cell in the patching or attribution heatmap (static/js/interventions_bridge.js
    sends {"head": "L3H2"}): that head, alone, in "Heads to switch off", so that one more click on Run
    ablation ablates it. A head the model does not have, or anything else, changes nothing."""
    from app.shared.context import model_names

    try:
        msg = json.loads(picked) if isinstance(picked, str) and len(picked) < 200 else None
        pairs = parse_pairs([msg["head"]]) if isinstance(msg, dict) and isinstance(msg.get("head"), str) else ()
    except (ValueError, gr.Error):
        pairs = ()
    if len(pairs) != 1:
        return gr.skip()
    name = model.strip() if isinstance(model, str) and model.strip() in model_names() else default_model()
    shape = shape_of(name)
    if shape is None:
        lm = get_model(name)
        shape = (lm.shape.n_layers, lm.shape.n_heads)
    (layer, head), = pairs
    return [f"L{layer}H{head}"] if layer < shape[0] and head < shape[1] else gr.skip()


# The tab's prompts and choices in the page URL (issue 15 item 5): mirrored as they change, read
# back when a link opens this tab (as the page read ?tab= before its first tab rewrote the URL).
IV_URL_KEYS = ["iv_clean", "iv_corrupt", "iv_target", "iv_other", "iv_metric", "iv_heads", "iv_mlps", "iv_neurons",
               "iv_mode", "iv_patch", "iv_align"]
IV_URL_JS = page_js("interventions_url", KEYS=repr(IV_URL_KEYS))


def choices_from_url(query: dict, opened_tab: str | None, model: str | None = None) -> dict | None:
    """The link's Interventions values, each one a valid value of its control (heads and MLP layers
    only those the link's model has), or None when the link opens another tab or carries none."""
    if (opened_tab or query.get("tab")) != "interventions" or not any(k in query for k in IV_URL_KEYS):
        return None
    shape = shape_of(model or default_model()) or shape_of(default_model()) or (0, 0)
    heads_ok, mlps_ok = set(head_choices(*shape)), {str(l) for l in range(shape[0])}

    def text(k, cap=2000):
        v = query.get(k)
        return v[:cap] if isinstance(v, str) else gr.skip()

    def items(k, ok):
        v = query.get(k)
        return [x for x in v.split(",") if x in ok][:64] if isinstance(v, str) else gr.skip()
    return {"iv_clean": text("iv_clean"), "iv_corrupt": text("iv_corrupt"), "iv_target": text("iv_target", 200),
            "iv_other": text("iv_other", 200),
            "iv_metric": query.get("iv_metric") if query.get("iv_metric") in ("logit_diff", "logprob") else gr.skip(),
            "iv_heads": items("iv_heads", heads_ok), "iv_mlps": items("iv_mlps", mlps_ok),
            "iv_neurons": text("iv_neurons", 400),
            "iv_mode": query.get("iv_mode") if query.get("iv_mode") in ("zero", "mean") else gr.skip(),
            "iv_patch": query.get("iv_patch") if query.get("iv_patch") in ("resid", "heads") else gr.skip(),
            "iv_align": query.get("iv_align") in ("1", "true") if "iv_align" in query else gr.skip()}


def build(shared: Shared) -> None:
    s0 = shape_of(default_model()) or (0, 0)
    gr.Markdown(INTRO)
    with gr.Row():
        clean = gr.Textbox(CLEAN, label="Clean prompt", scale=3, elem_id="iv-clean")
        corrupt = gr.Textbox(CORRUPT, label="Corrupted prompt", scale=3, elem_id="iv-corrupt")
    with gr.Row():
        target = gr.Textbox(TARGET, label="Target token (mind the leading space)", elem_id="iv-target")
        other = gr.Textbox(OTHER, label="Other token (for a logit difference)", elem_id="iv-other")
        kind = gr.Radio([("logit difference", "logit_diff"), ("target log-prob", "logprob")], value="logit_diff",
                        label="Metric", elem_id="iv-metric")
    # "Paris" typed without its leading space is another token than the " Paris" a model writes
    # mid-sentence: say which token each became, and offer the spaced one
    with gr.Row():
        space_md = gr.Markdown(visible=False, elem_id="iv-space-note", elem_classes=["field-msg"])
        space_fix = gr.Button("Use the spaced tokens", size="sm", visible=False, scale=0, elem_id="iv-space-fix")

    with gr.Accordion("Ablate heads, MLPs, neurons (clean prompt)", open=True):
        with gr.Row():
            heads = gr.Dropdown(head_choices(*s0), value=[], multiselect=True, scale=3, elem_id="iv-heads",
                                label="Heads to switch off (or click a head's cell in the patching or attribution "
                                      "heatmap below)")
            mlps = gr.Dropdown([str(l) for l in range(s0[0])], value=[], multiselect=True, label="MLP layers",
                               scale=1, elem_id="iv-mlps")
            neurons = gr.Textbox("", label="Neurons (e.g. L3N120, L5N7)", scale=1, elem_id="iv-neurons")
            mode = gr.Radio([("zero", "zero"), ("mean over positions", "mean")], value="zero", label="Ablation",
                            scale=1, elem_id="iv-mode")
        ablate_btn = gr.Button("Run ablation", variant="primary", elem_id="iv-ablate")
        ablate_md = gr.Markdown(elem_id="iv-ablate-summary")
        with gr.Row():
            ablate_bars = gr.Plot(label="Next-token distribution", elem_id="iv-ablate-bars")
            ablate_lens = gr.Plot(label="Logit lens (last position)", elem_id="iv-ablate-lens")

    with gr.Accordion("Activation patching (clean → corrupted)", open=True):
        with gr.Row():
            what = gr.Radio([("residual stream: layers × positions", "resid"), ("head outputs: layers × heads", "heads")],
                            value="resid", label="Patch", scale=3, elem_id="iv-patch-kind")
            align = gr.Checkbox(False, label="Different lengths: align at the last token", scale=1,
                                elem_id="iv-align")
        patch_btn = gr.Button("Run patching sweep", variant="primary", elem_id="iv-patch")
        patch_md = gr.Markdown(elem_id="iv-patch-summary")
        with gr.Group(visible=False, elem_id="iv-job-box") as job_box:
            with gr.Row():
                job_btn = gr.Button("Run as a background job", variant="primary", elem_id="iv-job-submit")
                job_cancel = gr.Button("Cancel job", variant="stop", size="sm", visible=False, elem_id="iv-job-cancel")
            job_bar = gr.HTML(elem_id="iv-job-progress")
        patch_plot = gr.Plot(label="Patching effect", elem_id="iv-patch-plot")
        job_id = gr.State(None)
        job_timer = gr.Timer(JOB_POLL_S, active=False)

    with gr.Accordion("Direct logit attribution (clean prompt)", open=True):
        attr_btn = gr.Button("Attribute", variant="primary", elem_id="iv-attr")
        attr_md = gr.Markdown(elem_id="iv-attr-summary")
        with gr.Row():
            attr_heads = gr.Plot(label="Per head", elem_id="iv-attr-heads")
            attr_layers = gr.Plot(label="Per layer", elem_id="iv-attr-layers")

    with gr.Accordion("Compare the two prompts", open=False):
        cmp_btn = gr.Button("Compare clean and corrupted", elem_id="iv-compare")
        with gr.Row():
            cmp_a = gr.Plot(label="Clean", elem_id="iv-cmp-a")
            cmp_b = gr.Plot(label="Corrupted", elem_id="iv-cmp-b")
        cmp_diff = gr.Plot(label="Residual difference", elem_id="iv-cmp-diff")

    # the results on screen as files: ablation.csv, patching.csv, attribution.csv, results.json
    ablate_data, patch_data, attr_data = gr.State(None), gr.State(None), gr.State(None)
    with gr.Row():
        results_btn = gr.Button("Download the results (CSV + JSON)", size="sm", scale=0, elem_id="iv-export")
        results_files = gr.File(label="Results", file_count="multiple", visible=False, elem_id="iv-export-files")

    m = shared.model
    ablate_btn.click(run_ablation, [m, clean, target, other, kind, heads, mlps, neurons, mode],
                     [ablate_md, ablate_bars, ablate_lens, ablate_data], concurrency_id="model", api_name="ablate")
    patch_btn.click(run_patching, [m, clean, corrupt, target, other, kind, what, align],
                    [patch_md, patch_plot, job_box, patch_data], concurrency_id="model", api_name="patch")
    job_btn.click(submit_patch_job, [m, clean, corrupt, target, other, kind, what, align],
                  [job_id, job_bar, job_timer, patch_md], api_name="jobs_submit_patching")
    job_timer.tick(poll_patch_job, [job_id], [job_bar, patch_md, patch_plot, job_timer, patch_data],
                   show_progress="hidden")
    # a finished job has nothing to cancel: the button goes with it
    job_bar.change(_job_cancel_button, [job_bar], [job_cancel], show_progress="hidden", queue=False)
    for ev in (target.blur, other.blur, target.submit, other.submit, kind.change, m.change, ablate_btn.click,
               patch_btn.click, attr_btn.click):
        ev(space_note, [m, target, other, kind], [space_md, space_fix], show_progress="hidden")
    space_fix.click(use_spaced, [m, target, other, kind], [target, other, space_md, space_fix])
    job_cancel.click(cancel_patch_job, [job_id], [job_bar])
    attr_btn.click(run_attribution, [m, clean, target, other, kind], [attr_md, attr_heads, attr_layers, attr_data],
                   concurrency_id="model", api_name="attribute")
    results_btn.click(export_results, [ablate_data, patch_data, attr_data], [results_files])
    cmp_btn.click(run_compare, [m, clean, corrupt], [cmp_a, cmp_b, cmp_diff], concurrency_id="model",
                  api_name="compare_prompts")
    m.change(_choices_update, [m], [heads, mlps])
    # a head's cell clicked in the patching (heads) or attribution heatmap -> that head in the ablation
    head_pick = gr.Textbox(visible="hidden", elem_id="iv-head-pick", label="picked head")
    head_pick.input(pick_head, [m, head_pick], [heads], show_progress="hidden", trigger_mode="always_last")
    if shared.page is not None:
        shared.page.load(None, None, None, js=page_js("interventions_bridge"))

    # --- the link ------------------------------------------------------------------------------
    url_inputs = [clean, corrupt, target, other, kind, heads, mlps, neurons, mode, what, align]
    for comp in url_inputs:
        comp.change(None, url_inputs, None, js=IV_URL_JS)
    if shared.page is not None:
        opened_tab = gr.Textbox(visible=False, elem_id="iv-opened-tab")

        @endpoint
        def iv_from_url(tab, request: gr.Request = None):
            from app.shared.context import model_names

            q = dict(request.query_params) if request is not None else {}
            model = q.get("model") if q.get("model") in model_names() else None
            got = choices_from_url(q, tab if isinstance(tab, str) else None, model)
            if got is None:
                return (gr.skip(),) * len(url_inputs)
            return tuple(got[k] for k in IV_URL_KEYS)

        shared.page.load(iv_from_url, [opened_tab], url_inputs, js=page_js("opened_tab"))
