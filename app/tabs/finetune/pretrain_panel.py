"""Training from scratch: a self-contained accordion (in the Fine-tune tab) with a form for a 'pretrain'
job (one tiny decoder on the built-in corpus) and one for a 'scaling' sweep (several widths, same
tokens, the fitted L(N); or several depths at equal non-embedding parameters), the selected job's live
loss / perplexity curves and the sweep's plot (L(N), or loss against depth).

Jobs go through tasks.jobs like every other kind; owners come from the request (job_owner /
job_viewer), never from the page. Figures: app/tabs/finetune/pretrain_figures.py. Registered models appear in
every model menu through app/server/page.py's refresher.
"""

from __future__ import annotations

import gradio as gr

from app.shared import job_views as jf
from app.shared.context import Shared, endpoint, job_owner
from app.tabs.finetune import pretrain_figures as pf
from model_core.core.errors import LmscopeError

REFRESH_S = 2.0
KINDS = ("pretrain", "scaling")


def _records(request=None) -> list[dict]:
    return jf.user_jobs(request, KINDS)


def _choices(recs: list[dict]) -> list[tuple[str, str]]:
    return jf.job_menu(recs, jf.pretrain_job_details)


def _num(v):
    """An empty or zero box means the default; anything else goes to the settings check as it is
    (model_core.training.pretrain.validate_settings answers a bad value with one sentence)."""
    return None if v is None or (isinstance(v, (str, int, float)) and not isinstance(v, bool) and v in ("", 0)) else v


def _text(v):
    return v.strip() or None if isinstance(v, str) else v


@endpoint
def submit_pretrain(width, layers, steps, lr, keep, name, request: gr.Request = None):
    params = {"width": _num(width), "layers": _num(layers), "max_steps": _num(steps), "learning_rate": _num(lr),
              "keep_checkpoints": _num(keep), "output_name": _text(name)}
    try:
        rec = jf.job_store().submit("pretrain", params, owner=job_owner(request))
    except LmscopeError as e:
        return gr.skip(), gr.skip(), f"⚠️ {e}"
    return (rec["id"], gr.update(choices=_choices(_records(request)), value=rec["id"]),
            f"Queued job **{rec['id']}**; it will register **{rec['pretrain']['model_name']}**.")


@endpoint
def submit_scaling(widths, layers, tokens, lr, axis="widths", depths=None, n_params=None,
                   request: gr.Request = None):
    params = {"widths": _text(widths), "layers": _num(layers), "tokens": _num(tokens),
              "learning_rate": _num(lr)}
    if axis == "depths":
        # N defaults to that of width 128 at the layers given (tasks.pretrain_job's rule)
        params = {**params, "widths": None, "depths": _text(depths), "params": _num(n_params)}
    try:
        rec = jf.job_store().submit("scaling", params, owner=job_owner(request))
    except LmscopeError as e:
        return gr.skip(), gr.skip(), f"⚠️ {e}"
    names = [n for n in rec["pretrain"]["models"] if "-step" not in n]
    return (rec["id"], gr.update(choices=_choices(_records(request)), value=rec["id"]),
            f"Queued sweep **{rec['id']}**; it will register {', '.join(f'**{n}**' for n in names)}.")


@endpoint
def refresh(selected, known, request: gr.Request = None):
    """Timer tick: the selected job's progress, curves and L(N) plot; the job menu when its list changed."""
    recs = _records(request)
    choices = _choices(recs)
    selected = selected if isinstance(selected, str) else None
    menu = [gr.skip(), gr.skip()] if jf.menu_unchanged(choices, known) else [choices, gr.update(choices=choices)]
    if not selected:
        return [pf.status_markdown(None), jf.progress_html(None), gr.skip(), gr.skip(), gr.skip(), *menu,
                gr.update(visible=False)]
    try:
        rec = jf.selected_job(selected, recs, request)
    except LmscopeError as e:
        return [f"⚠️ {e}", jf.progress_html(None), gr.skip(), gr.skip(), gr.skip(), *menu, gr.update(visible=False)]
    pr = rec.get("pretrain") or {}
    return [pf.status_markdown(rec), jf.progress_html(rec), pf.curve_figure(pr.get("history")),
            pf.sweep_figure(rec) if rec["kind"] == "scaling"
            else pf.empty_figure("The L(N) plot belongs to a scaling sweep.", 460),
            pf.points_table(pr.get("points")), *menu,
            gr.update(visible=jf.cancellable(rec))]  # cancel: only while it can stop


@endpoint
def cancel(selected, request: gr.Request = None):
    return jf.cancel_job(selected, request)


@endpoint
def job_choices(request: gr.Request = None):
    return gr.update(choices=_choices(_records(request)))


@endpoint
def pick_job(job):
    return jf.picked_job(job)


@endpoint
def pick_axis(axis):
    """Show the widths box or the depth sweep's boxes."""
    depth = axis == "depths"
    return gr.update(visible=not depth), gr.update(visible=depth), gr.update(visible=depth)


def build(shared: Shared) -> None:
    selected = gr.State(None)
    known = gr.State(None)
    with gr.Accordion("Train from scratch: a tiny decoder, and a scaling sweep L(N)", open=False,
                      elem_id="pt-accordion"):
        gr.Markdown(
            "Train a Llama-style decoder of a few hundred thousand to a few million parameters from random "
            "weights on the built-in corpus (Python's standard-library docstrings), one byte per token (258-token "
            "vocabulary: the body, not the embedding, holds the parameters and the compute). The held-out loss is "
            "measured on held-out files; the model registers like a fine-tuned one (checkpoints too, step 0 = the "
            "random initialisation), so you can open it in Explore and watch heads form. A **scaling sweep** trains "
            "several widths for the same tokens and fits L = a·N^-α over the non-embedding parameter count N; "
            "over **depths** it trains several layer counts, each at the width with (about) the same N, and draws "
            "loss against depth.")
        with gr.Row():
            with gr.Column(scale=1, min_width=280):
                gr.Markdown("#### One model")
                with gr.Row():
                    width = gr.Number(128, label="Width d_model (multiple of 16)", precision=0, elem_id="pt-width")
                    layers = gr.Number(2, label="Layers", precision=0, elem_id="pt-layers")
                with gr.Row():
                    steps = gr.Number(200, label="Steps (16 × 128 tokens each)", precision=0, elem_id="pt-steps")
                    lr = gr.Number(2e-3, label="Peak learning rate", elem_id="pt-lr")
                with gr.Row():
                    keep = gr.Number(4, label="Checkpoints to keep (step 0 first)", precision=0, elem_id="pt-keep")
                    name = gr.Textbox("", label="Model name (empty: scratch-d<W>-l<L>-<job>)", elem_id="pt-name")
                pt_btn = gr.Button("Train from scratch", variant="primary", elem_id="pt-submit")
                gr.Markdown("#### Scaling sweep")
                axis = gr.Radio(["widths", "depths"], value="widths", label="Sweep over",
                                elem_id="pretrain-sweep-axis")
                widths = gr.Textbox("64,128,256", label="Widths", elem_id="sc-widths")
                with gr.Row():
                    depths = gr.Textbox("1,2,4,8", label="Depths (layers)", visible=False, elem_id="pretrain-depths")
                    n_params = gr.Number(0, label="Non-embedding parameters per shape (0: width 128 at the layers "
                                         "below)", precision=0, visible=False, elem_id="pretrain-params")
                with gr.Row():
                    sc_layers = gr.Number(2, label="Layers", precision=0, elem_id="sc-layers")
                    tokens = gr.Number(400_000, label="Tokens per width", precision=0, elem_id="sc-tokens")
                    sc_lr = gr.Number(2e-3, label="Peak learning rate", elem_id="sc-lr")
                sc_btn = gr.Button("Run the sweep", variant="primary", elem_id="sc-submit")
                status = gr.Markdown(elem_id="pt-status")
            with gr.Column(scale=2):
                with gr.Row():
                    job = gr.Dropdown([], label="From-scratch jobs", scale=4, elem_id="pt-job")
                    cancel_btn = gr.Button("Cancel job", variant="stop", scale=1, visible=False, elem_id="pt-cancel")
                progress = gr.HTML(elem_id="pt-progress")
                info = gr.Markdown(pf.status_markdown(None), elem_id="pt-info")
                curve = gr.Plot(pf.curve_figure(None), elem_id="pt-curve")
        scaling = gr.Plot(pf.scaling_figure(None), elem_id="pt-scaling")
        table = gr.Dataframe(pf.points_table(None), interactive=False, wrap=True, elem_id="pt-points")

    outs = [info, progress, curve, scaling, table, known, job, cancel_btn]
    pt_btn.click(submit_pretrain, [width, layers, steps, lr, keep, name], [selected, job, status])
    sc_btn.click(submit_scaling, [widths, sc_layers, tokens, sc_lr, axis, depths, n_params], [selected, job, status])
    axis.change(pick_axis, [axis], [widths, depths, n_params])
    job.change(pick_job, [job], [selected])
    job.focus(job_choices, None, [job])
    gr.Timer(REFRESH_S).tick(refresh, [selected, known], outs, show_progress="hidden", queue=False)
    cancel_btn.click(cancel, [selected], [status]).then(refresh, [selected, known], outs)
