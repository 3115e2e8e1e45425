"""Fine-tune tab, "What changed": a fine-tuning run's model against its base over the built-in
corpus (model_core.interp.model_diff), its contexts ranked by KL(base ‖ tuned), a context clicked
into the per-prompt view, KL at each checkpoint the run kept (when did it change), and the features
of a set trained on the base that appeared, vanished or shifted (a row clicked opens the feature).
The run is the job picked above (SFT, or DPO / GRPO / PPO on the preference panel) when it has
finished, else the fine-tuned model picked in the comparison menu.

A training job computes its own short diff when it finishes (tasks/diff_job.precompute), shown at
once; else a diff this viewer already ran for that model; otherwise a 'diff' job is queued and
followed here until it ends. `build` makes one such section per panel (ids prefixed)."""

from __future__ import annotations

import html
import time

import gradio as gr

from app.shared import job_views as jf
from app.shared.context import Shared, endpoint, get_model, job_owner, job_viewer
from app.tabs.finetune import diff_figures as D
from model_core.core.errors import LmscopeError

DIFF_TOKENS = 2048  # the short pass "What changed" runs: 32 contexts of 64 tokens
DIFF_WINDOW = 64
FOLLOW_S = 600  # how long one press follows its job before saying it still runs
ARTIFACT = "diff.json"
MAX_CONTEXT_IDS = 512  # the diff job's largest window


def _model_of_run(selected, tuned, request) -> tuple[str, dict | None]:
    """(the fine-tuned model this press is about, its training job when that job has finished)."""
    if isinstance(selected, str) and selected:
        try:
            rec = jf.job_store().get_job(selected, job_viewer(request))
        except LmscopeError:
            rec = None
        name = (((rec or {}).get("sft") or (rec or {}).get("preference") or {}).get("model_name"))
        if rec is not None and rec.get("kind") != "reward" and rec.get("state") == "succeeded" and name:
            return name, rec
        if rec is not None and rec.get("kind") == "reward" and not (isinstance(tuned, str) and tuned):
            raise gr.Error("A reward model scores answers and has no next-token distribution to compare; pick a "
                           "DPO, GRPO or PPO run.")
    if isinstance(tuned, str) and tuned:
        return tuned, None
    raise gr.Error("Pick a finished fine-tuning run above, or a fine-tuned model below, to see what changed.")


def _latest(kind: str, params: dict, request) -> dict | None:
    """This viewer's newest job of `kind` with these params that is running or has succeeded."""
    for rec in jf.user_jobs(request, (kind,)):
        p = rec.get("params") or {}
        if all(p.get(k) == v for k, v in params.items()) and rec.get("state") in ("queued", "running", "succeeded"):
            return rec
    return None


def _followed(rec: dict, request, waiting: str, artifact: str, outputs: int):
    """Follow a queued or running job: yield [status line, skips...] while it runs (for at most
    FOLLOW_S), then its JSON report, or None after yielding the sentence that says why there is none.
    waiting: the status line's text before '(job ID): stage…'. Use as `report = yield from ...`."""
    skip = [gr.skip()] * (outputs - 1)
    deadline = time.monotonic() + FOLLOW_S
    while rec.get("state") in ("queued", "running"):
        stage = (rec.get("progress") or {}).get("stage") or rec["state"]
        yield [f"{waiting} (job {rec['id']}): {stage}…", *skip]
        if time.monotonic() > deadline:
            return None
        time.sleep(0.5)
        rec = jf.job_store().get_job(rec["id"], job_viewer(request))
    if rec.get("state") != "succeeded":
        yield [f"⚠️ Job {rec['id']} {rec.get('state')}: {rec.get('error') or 'see the Jobs tab'}.", *skip]
        return None
    report = jf.job_store().read_json_artifact(rec, artifact)
    if not report:
        yield [f"⚠️ Job {rec['id']} finished without its report.", *skip]
    return report


def _shown(rec: dict, report: dict):
    return (D.summary_markdown(report, rec["id"]), gr.update(value=D.contexts_table(report), visible=True),
            gr.update(value=D.next_tokens_table(report), visible=True),
            gr.update(value=D.layers_figure(report["resid_diff"]), visible=True),
            gr.update(value=D.heads_figure(report["head_js"]), visible=True),
            gr.update(value=D.run_figure(report.get("across_run")), visible=True),
            {"contexts": [c["ids"] for c in report["contexts"]], "base": report["base"], "tuned": report["tuned"]})


@endpoint
def what_changed(selected, tuned, request: gr.Request = None):
    """The run's diff: its training job's own when it computed one, else a diff job's (shown if done,
    else queued or joined and followed until it ends)."""
    model, run = _model_of_run(selected, tuned, request)
    report = jf.job_store().read_json_artifact(run, ARTIFACT) if run is not None else None
    if report:
        yield list(_shown(run, report))
        return
    rec = _latest("diff", {"tuned": model}, request)
    if rec is None:
        rec = jf.job_store().submit("diff", {"tuned": model, "max_tokens": DIFF_TOKENS, "window": DIFF_WINDOW},
                                    owner=job_owner(request))
    report = yield from _followed(rec, request, f"Comparing **{model}** with its base over the built-in corpus "
                                                f"({DIFF_TOKENS:,} tokens)", ARTIFACT, 7)
    if report:
        yield list(_shown(rec, report))


@endpoint(model=True)
def open_context(found, evt: gr.SelectData, request: gr.Request = None):
    """A ranked context clicked: that text through both models, token by token."""
    from model_core.interp.model_diff import diff_prompt

    contexts = found.get("contexts") if isinstance(found, dict) else None
    row = evt.index[0] if evt is not None and isinstance(evt.index, (list, tuple)) and evt.index else None
    if not isinstance(contexts, list) or not isinstance(row, int) or not 0 <= row < len(contexts):
        raise gr.Error("Click a context in the table of a finished comparison.")
    base, tuned = get_model(found.get("base")), get_model(found.get("tuned"))
    ids = contexts[row]
    if not (isinstance(ids, list) and 0 < len(ids) <= MAX_CONTEXT_IDS
            and all(isinstance(i, int) and 0 <= i < base.shape.vocab_size for i in ids)):
        raise gr.Error("Click a context in the table of a finished comparison.")
    # the window up to the ranked position, exactly as the job ran it: its last KL is the table's
    d = diff_prompt(base, tuned, token_ids=ids).to_dict()
    last = len(d["tokens"]) - 1
    return (gr.update(value=D.prompt_kl_figure(d["tokens"], d["kl"]), visible=True),
            gr.update(value=D.prompt_resid_figure(d["tokens"], d["resid_diff"]), visible=True),
            D.changes_html(d, last))


@endpoint(model=True)
def features_changed(found, set_name, request: gr.Request = None):
    """[summary, table, rows state]: a feature set trained on the base read on the same
    built-in windows under both models (model_core.interp.model_diff_features)."""
    from app.tabs.explore.features_panel import open_set
    from model_core.interp.features_sae import FeatureError
    from model_core.interp.model_diff_features import features_shift
    from model_core.interp.neurons import corpus_windows
    from tasks import corpus

    if not isinstance(found, dict) or not all(isinstance(found.get(k), str) and found[k] for k in ("base", "tuned")):
        raise gr.Error("Open a finished comparison first (What changed), then pick a feature set of its base.")
    feats, _, _ = open_set(set_name)  # one sentence for a name that is not a saved set
    base, tuned = get_model(found.get("base")), get_model(found.get("tuned"))
    windows = corpus_windows(base.tokenizer, corpus.builtin_docs("heldout"), DIFF_TOKENS, DIFF_WINDOW)
    try:
        shift = features_shift(base, tuned, feats, windows).to_dict()
    except FeatureError as e:
        raise gr.Error(str(e)) from None
    rows = [r["feature"] for kind in ("appeared", "vanished", "shifted") for r in shift.get(kind) or []]
    return (D.feature_shift_summary(shift), gr.update(value=D.feature_shift_table(shift), visible=True),
            {"set": set_name, "features": rows, "base": found["base"]})


@endpoint(model=True)
def open_changed_feature(shown, evt: gr.SelectData, request: gr.Request = None):
    """A row of the changed features clicked: that feature's page (label, how often it fires over the
    corpus scan, its top contexts and the tokens its decoder direction promotes)."""
    from app.tabs.explore import unit_figures as UF
    from app.tabs.explore.features_panel import contexts_html, open_set
    from model_core.interp import features as FT

    rows = shown.get("features") if isinstance(shown, dict) else None
    row = evt.index[0] if evt is not None and isinstance(evt.index, (list, tuple)) and evt.index else None
    if not isinstance(rows, list) or not isinstance(row, int) or not 0 <= row < len(rows):
        raise gr.Error("Click a feature in the table of changed features.")
    feats, index, labels = open_set(shown.get("set"))
    f = rows[row]
    if isinstance(f, bool) or not isinstance(f, int) or not 0 <= f < feats.num_latents \
            or not isinstance(shown.get("base"), str):
        raise gr.Error("Click a feature in the table of changed features.")
    lm = get_model(shown.get("base"))
    ctx = FT.top_contexts(index, lm.tokenizer, f) if index is not None else []
    label = labels[f]["label"] if 0 <= f < len(labels) else ""
    d = FT.density(index, f) if index is not None else {}
    fires = f" · fires on {d['density']:.3%} of the {d['scanned']:,} tokens scanned" if d else ""
    title = f"#### Feature #{f} of {shown.get('set')}\n**Label (automatic):** {html.escape(label) or '—'}{fires}"
    top = FT.promoted_tokens(lm, feats, f, 10)
    return (title, contexts_html(ctx), gr.update(
        value=UF.weights_figure(top, f"Feature #{f}: tokens its decoder direction promotes / suppresses"),
        visible=True))


CROSSCODER_TOKENS, CROSSCODER_EVAL = 32_768, 2048  # the button's job (4,096 tokens of the default model: 4 s on 2 cores)


@endpoint
def crosscoder(found, layer, request: gr.Request = None):
    """[summary, histogram, top latents]: a crosscoder of the compared pair at a layer: this viewer's
    finished one shown, else queued (or joined) and followed until it ends."""
    if not isinstance(found, dict) or not all(isinstance(found.get(k), str) and found[k] for k in ("base", "tuned")):
        raise gr.Error("Open a finished comparison first (What changed), then train a crosscoder on it.")
    if isinstance(layer, bool) or not isinstance(layer, (int, float)) or layer != int(layer) or layer < 0:
        raise gr.Error("The layer is a whole number from 0.")
    tuned, base, layer = found["tuned"], found["base"], int(layer)
    rec = _latest("crosscoder", {"tuned": tuned, "base": base, "layer": layer}, request)
    if rec is None:
        rec = jf.job_store().submit("crosscoder", {"tuned": tuned, "base": base, "layer": layer,
                                                   "max_tokens": CROSSCODER_TOKENS, "eval_tokens": CROSSCODER_EVAL},
                                    owner=job_owner(request))
    report = yield from _followed(rec, request, f"Training a crosscoder of **{tuned}** and **{base}** at layer "
                                                f"{layer} ({CROSSCODER_TOKENS:,} tokens)", "crosscoder.json", 3)
    if report:
        yield [D.crosscoder_summary(report, rec["id"]), gr.update(value=D.crosscoder_figure(report), visible=True),
               gr.update(value=D.crosscoder_table(report), visible=True)]


@endpoint
def refresh_sets(found, request: gr.Request = None):
    from app.tabs.explore.features_panel import sets_for

    base = found.get("base") if isinstance(found, dict) else None
    return gr.update(choices=sets_for(base) if isinstance(base, str) else [])


def build(shared: Shared, selected, tuned, prefix: str = "diff", button_id: str = "sft-what-changed") -> None:
    """selected: the training job picked above (a State); tuned: the fine-tuned model menu. prefix:
    the elem_id prefix of this section's components (one section per panel)."""
    gr.Markdown("### What changed: the run's model against its base over a corpus")
    with gr.Row():
        btn = gr.Button("What changed", variant="primary", scale=0, elem_id=button_id)
        status = gr.Markdown(elem_id=f"{prefix}-status")
    found = gr.State(None)
    with gr.Row():
        contexts = gr.Dataframe(interactive=False, wrap=True, visible=False, scale=3, elem_id=f"{prefix}-contexts",
                                label="Contexts where the two models disagree most (click one)")
        next_tokens = gr.Dataframe(interactive=False, visible=False, scale=1, elem_id=f"{prefix}-next-tokens",
                                   label="KL summed by the token that follows")
    with gr.Row():
        layers = gr.Plot(visible=False, elem_id=f"{prefix}-layers")
        heads = gr.Plot(visible=False, elem_id=f"{prefix}-heads")
    run_plot = gr.Plot(visible=False, elem_id=f"{prefix}-run")
    changes = gr.HTML(elem_id=f"{prefix}-prompt-changes")
    prompt_kl = gr.Plot(visible=False, elem_id=f"{prefix}-prompt-kl")
    prompt_resid = gr.Plot(visible=False, elem_id=f"{prefix}-prompt-resid")
    gr.Markdown("#### Features that changed (a feature set trained on the base, read under both models)")
    with gr.Row():
        set_menu = gr.Dropdown([], label="feature set of the base", scale=3, elem_id=f"{prefix}-feature-set")
        feat_btn = gr.Button("Features that changed", scale=1, elem_id=f"{prefix}-features-go")
    feat_summary = gr.Markdown(elem_id=f"{prefix}-features-summary")
    feat_table = gr.Dataframe(interactive=False, wrap=True, visible=False, elem_id=f"{prefix}-features",
                              label="Features that appeared, vanished or shifted most (click one for its page)")
    feat_shown = gr.State(None)
    feat_title = gr.Markdown(elem_id=f"{prefix}-feature-title")
    feat_contexts = gr.HTML(elem_id=f"{prefix}-feature-contexts")
    feat_weights = gr.Plot(visible=False, elem_id=f"{prefix}-feature-weights")
    gr.Markdown("#### Crosscoder: one dictionary over both models' activations at a layer (shared, base-only "
                "and tuned-only latents by decoder norm)")
    with gr.Row():
        cc_layer = gr.Number(6, precision=0, minimum=0, label="layer", scale=1, elem_id=f"{prefix}-cc-layer")
        cc_btn = gr.Button("Crosscoder", scale=1, elem_id=f"{prefix}-cc-go")
    cc_status = gr.Markdown(elem_id=f"{prefix}-cc-status")
    with gr.Row():
        cc_plot = gr.Plot(visible=False, elem_id=f"{prefix}-cc-hist")
        cc_table = gr.Dataframe(interactive=False, wrap=True, visible=False, elem_id=f"{prefix}-cc-latents",
                                label="Most used latents of each class, with their top context")

    btn.click(what_changed, [selected, tuned], [status, contexts, next_tokens, layers, heads, run_plot, found]
              ).then(refresh_sets, [found], [set_menu], queue=False)
    contexts.select(open_context, [found], [prompt_kl, prompt_resid, changes], concurrency_id="model")
    set_menu.focus(refresh_sets, [found], [set_menu], queue=False)
    feat_btn.click(features_changed, [found, set_menu], [feat_summary, feat_table, feat_shown], concurrency_id="model")
    cc_btn.click(crosscoder, [found, cc_layer], [cc_status, cc_plot, cc_table])
    feat_table.select(open_changed_feature, [feat_shown], [feat_title, feat_contexts, feat_weights],
                      concurrency_id="model")
