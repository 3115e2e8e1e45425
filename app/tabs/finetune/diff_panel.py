"""Fine-tune tab, "What changed": a fine-tuning run's model against its base over the built-in
corpus (a 'diff' job, tasks/diff_job.py), its contexts ranked by KL(base ‖ tuned), and a context
clicked into the per-prompt view (model_core.interp.model_diff.diff_prompt). The run is the SFT job
picked above when it has finished, else the fine-tuned model picked in the comparison menu.

A diff this viewer already ran for that model is shown at once; otherwise one is queued and followed
here until it ends."""

from __future__ import annotations

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


def _model_of_run(selected, tuned, request) -> str:
    """The fine-tuned model this press is about: the picked SFT job's, once it has finished."""
    if isinstance(selected, str) and selected:
        try:
            rec = jf.job_store().get_job(selected, job_viewer(request))
        except LmscopeError:
            rec = None
        name = ((rec or {}).get("sft") or {}).get("model_name")
        if rec is not None and rec.get("state") == "succeeded" and name:
            return name
    if isinstance(tuned, str) and tuned:
        return tuned
    raise gr.Error("Pick a finished fine-tuning run above, or a fine-tuned model below, to see what changed.")


def _latest_diff(model: str, request) -> dict | None:
    """This viewer's newest diff job of `model` that is running or has succeeded."""
    for rec in jf.user_jobs(request, ("diff",)):
        if (rec.get("params") or {}).get("tuned") == model and rec.get("state") in ("queued", "running", "succeeded"):
            return rec
    return None


def _shown(rec: dict, report: dict):
    return (D.summary_markdown(report, rec["id"]), gr.update(value=D.contexts_table(report), visible=True),
            gr.update(value=D.next_tokens_table(report), visible=True),
            gr.update(value=D.layers_figure(report["resid_diff"]), visible=True),
            gr.update(value=D.heads_figure(report["head_js"]), visible=True),
            {"contexts": [c["ids"] for c in report["contexts"]], "base": report["base"], "tuned": report["tuned"]})


@endpoint
def what_changed(selected, tuned, request: gr.Request = None):
    """The run's diff: shown if done, else queued (or joined) and followed until it ends."""
    model = _model_of_run(selected, tuned, request)
    rec = _latest_diff(model, request)
    if rec is None:
        rec = jf.job_store().submit("diff", {"tuned": model, "max_tokens": DIFF_TOKENS, "window": DIFF_WINDOW},
                                    owner=job_owner(request))
    skip = [gr.skip()] * 5
    deadline = time.monotonic() + FOLLOW_S
    while rec.get("state") in ("queued", "running"):
        stage = (rec.get("progress") or {}).get("stage") or rec["state"]
        yield [f"Comparing **{model}** with its base over the built-in corpus ({DIFF_TOKENS:,} tokens; job "
               f"{rec['id']}): {stage}…", *skip]
        if time.monotonic() > deadline:
            return
        time.sleep(0.5)
        rec = jf.job_store().get_job(rec["id"], job_viewer(request))
    if rec.get("state") != "succeeded":
        yield [f"⚠️ The comparison job {rec['id']} {rec.get('state')}: {rec.get('error') or 'see the Jobs tab'}.", *skip]
        return
    report = jf.job_store().read_json_artifact(rec, ARTIFACT)
    if not report:
        yield [f"⚠️ Job {rec['id']} finished without its report.", *skip]
        return
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


def build(shared: Shared, selected, tuned) -> None:
    """selected: the SFT job picked above (a State); tuned: the comparison's fine-tuned model menu."""
    gr.Markdown("### What changed: the run's model against its base over a corpus")
    with gr.Row():
        btn = gr.Button("What changed", variant="primary", scale=0, elem_id="sft-what-changed")
        status = gr.Markdown(elem_id="diff-status")
    found = gr.State(None)
    with gr.Row():
        contexts = gr.Dataframe(interactive=False, wrap=True, visible=False, scale=3, elem_id="diff-contexts",
                                label="Contexts where the two models disagree most (click one)")
        next_tokens = gr.Dataframe(interactive=False, visible=False, scale=1, elem_id="diff-next-tokens",
                                   label="KL summed by the token that follows")
    with gr.Row():
        layers = gr.Plot(visible=False, elem_id="diff-layers")
        heads = gr.Plot(visible=False, elem_id="diff-heads")
    changes = gr.HTML(elem_id="diff-prompt-changes")
    prompt_kl = gr.Plot(visible=False, elem_id="diff-prompt-kl")
    prompt_resid = gr.Plot(visible=False, elem_id="diff-prompt-resid")

    btn.click(what_changed, [selected, tuned], [status, contexts, next_tokens, layers, heads, found])
    contexts.select(open_context, [found], [prompt_kl, prompt_resid, changes], concurrency_id="model")
