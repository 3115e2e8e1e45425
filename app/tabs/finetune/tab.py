"""SFT tab: fine-tune a model as a background job, follow its loss curves, see the loss mask of a
training example, and compare the fine-tuned model with its base on one prompt.

Jobs go through tasks.jobs (the same queue and records as the Jobs tab, kind 'sft'); whose jobs is
decided from the request as in the Jobs tab (app.shared.context.job_owner / job_viewer). Uploads are
accepted only from Gradio's upload folder (app.shared.context.uploaded_file). Figures: app/tabs/finetune/figures.py.
"""

from __future__ import annotations

import gradio as gr

from app.shared import job_views as jf
from app.shared.context import (
    Shared,
    default_model,
    endpoint,
    get_model,
    job_owner,
    job_viewer,
    scratch_dir,
    uploaded_file,
)
from app.tabs.finetune import figures as sf
from app.tabs.jobs.tab import JOB_URL_JS
from model_core.core.errors import LmscopeError
from model_core.training import sft

REFRESH_S = 2.0


def _finetuned_choices() -> list[tuple[str, str]]:
    from app.shared.context import finetuned_choices

    return finetuned_choices()


def _base_choices() -> list[tuple[str, str]]:
    from app.shared.context import model_choices

    return model_choices()


@endpoint
def submit(model, dataset_kind, upload, skip_bad, method, rank, lr, steps, batch, max_len, seed, name,
           sample_every=None, keep_checkpoints=0, request: gr.Request = None):
    """Queue a run. A bad upload's message (with its line numbers) stays in the panel, not only in a
    toast; with "skip bad lines" the good lines train and the panel says how many were kept."""
    params = {"model": model or default_model(), "method": method,
              "lora_rank": int(rank or 8) if method == "lora" else None,
              "learning_rate": lr or None, "max_steps": int(steps) if steps else None,
              "batch_size": int(batch or 8), "max_length": int(max_len or 256), "seed": int(seed or 0),
              "output_name": (name or "").strip() or None, "skip_bad_lines": bool(skip_bad),
              "sample_every": int(sample_every) if sample_every else None,  # 0/empty: the run's own 4 points
              "keep_checkpoints": int(keep_checkpoints or 0)}
    files = []
    if dataset_kind == "upload":
        if not upload:
            return gr.skip(), gr.skip(), "⚠️ Upload a .jsonl dataset, or choose the built-in one."
        files = [uploaded_file(upload)]
    try:
        rec = jf.job_store().submit("sft", params, owner=job_owner(request), files=files)
    except LmscopeError as e:
        return gr.skip(), gr.skip(), f"⚠️ {e}"
    kept = (rec.get("sft") or {}).get("dataset_lines") or {}
    note = (f" Kept {kept['kept']} lines, skipped {kept['skipped']} bad ones (lines "
            f"{', '.join(str(x.get('line')) for x in (kept.get('skipped_lines') or [])[:10])})."
            if kept.get("skipped") else "")
    return (rec["id"], gr.update(choices=_job_choices(request), value=rec["id"]),
            f"Queued job **{rec['id']}**; it will register **{rec['sft']['model_name']}**.{note}")


def _sft_records(request=None) -> list[dict]:
    return jf.user_jobs(request, ("sft",))


def _job_choices(request=None, recs: list[dict] | None = None) -> list[tuple[str, str]]:
    return jf.job_menu(_sft_records(request) if recs is None else recs, sf.run_label)


@endpoint
def job_choices(request: gr.Request = None):
    return gr.update(choices=_job_choices(request))


LATEST_RUNS = 2  # finished runs the comparison starts with when nothing is picked


def _latest_finished(recs: list[dict], picked, auto) -> list[str] | None:
    """The 'Compare runs' menu's new value, or None to leave it: the newest finished runs (recs are
    newest first), so its chart has something to show, while the menu is empty or still holds what
    this put there (`auto`); a choice the user made is left alone."""
    picked = picked if isinstance(picked, list) else []
    if picked and picked != auto:
        return None
    done = [r["id"] for r in recs if r.get("state") == "succeeded" and (r.get("sft") or {}).get("history")]
    return done[:LATEST_RUNS] if done and done[:LATEST_RUNS] != picked else None


@endpoint
def refresh(selected, known_choices, picked_runs=None, auto_runs=None, request: gr.Request = None):
    """Timer tick: the selected job's progress, curves and accuracy, and the job menus' labels (a
    second browser sees the same runs; a finished run stops saying 'running'). When the list changed,
    the comparison follows the newest finished runs unless the user picked runs there."""
    recs = _sft_records(request)
    choices = _job_choices(request, recs)
    if jf.menu_unchanged(choices, known_choices):
        menus = [gr.skip()] * 4
    else:
        latest = _latest_finished(recs, picked_runs, auto_runs)
        runs = gr.update(choices=choices) if latest is None else gr.update(choices=choices, value=latest)
        menus = [choices, gr.update(choices=choices), runs, gr.skip() if latest is None else latest]
    if not selected:
        return [sf.status_markdown(None), jf.progress_html(None), gr.skip(), gr.skip(), "", "", *menus]
    try:
        rec = jf.selected_job(selected, recs, request)
    except LmscopeError as e:
        return [f"⚠️ {e}", jf.progress_html(None), gr.skip(), gr.skip(), "", "", *menus]
    run = rec.get("sft") or {}
    hist = run.get("history")
    return [sf.status_markdown(rec), jf.progress_html(rec), sf.loss_figure(hist), sf.throughput_figure(hist),
            sf.accuracy_examples_html(rec),
            sf.samples_table_html(run.get("samples"), (run.get("sampling") or {}).get("max_new_tokens")), *menus]


def _runs_records(ids, request) -> list[dict]:
    """The chosen runs' records that this viewer may read (at most 8; unknown ids skipped)."""
    ids = [i for i in (ids or []) if isinstance(i, str)][:8]
    viewer, recs = job_viewer(request), []
    for job_id in ids:
        try:
            recs.append(jf.job_store().get_job(job_id, viewer))
        except LmscopeError:
            continue
    return recs


@endpoint
def compare_runs(ids, request: gr.Request = None):
    """Several runs' curves on one chart and their settings and results in one table."""
    recs = _runs_records(ids, request)
    return sf.runs_figure(recs), sf.runs_table(recs)


@endpoint
def export_runs(ids, request: gr.Request = None):
    """runs.csv and runs.json of the chosen runs (app.tabs.finetune.downloads.write_runs), read from their records."""
    from app.tabs.finetune.downloads import write_runs

    recs = _runs_records(ids, request)
    if not recs:
        raise gr.Error("Choose the runs to compare first.")
    return gr.update(value=[str(p) for p in write_runs(recs, scratch_dir("runs"))], visible=True)


@endpoint
def job_from_url(request: gr.Request = None):
    """?job=<id> opens that run (a link to a run, and a reload that keeps it)."""
    q = dict(request.query_params) if request is not None else {}
    job_id = q.get("job")
    if not isinstance(job_id, str) or not job_id:
        return gr.skip(), gr.skip()
    try:
        rec = jf.job_store().get_job(job_id, job_viewer(request))
    except LmscopeError:
        return gr.skip(), gr.skip()
    if rec["kind"] != "sft":
        return gr.skip(), gr.skip()
    return rec["id"], gr.update(choices=_job_choices(request), value=rec["id"])


@endpoint
def cancel(selected, request: gr.Request = None):
    return jf.cancel_job(selected, request)


@endpoint(model=True)
def show_mask(model, dataset_kind, upload, index, request: gr.Request = None):
    """One training example, each token coloured by whether it counts in the loss."""
    try:
        # the upload is read (and refused) before a model is loaded for it
        if dataset_kind == "upload" and upload:
            convs = sft.load_jsonl(uploaded_file(upload))
        else:
            convs, _ = sft.builtin_dataset(max(8, min(int(index or 0), MAX_MASK_EXAMPLE) + 1), 0, 0)
        i = max(0, min(int(index or 0), len(convs) - 1))
        return sf.mask_html(sft.mask_view(get_model(model).tokenizer, convs[i]))
    except LmscopeError as e:
        raise gr.Error(str(e)) from None


def _pair(base, tuned):
    """The fine-tuned model and the one it is compared with (its parent unless another is picked)."""
    if not tuned:
        raise gr.Error("Pick a fine-tuned model to compare.")
    t = get_model(tuned)
    base = base or t.meta.get("parent") or default_model()
    return get_model(base), t


@endpoint(model=True)
def compare(base, tuned, prompt, chat, request: gr.Request = None):
    """One prompt through base and fine-tuned models: headline numbers first, then the views."""
    b, t = _pair(base, tuned)
    r = sft.compare_models(b, t, prompt, chat=bool(chat))
    return (sf.compare_headline(r, b.name, t.name), sf.next_token_figure(r["next"], b.name, t.name),
            sf.kl_figure(r["tokens"], r["kl"]), sf.lens_kl_figure(r["tokens"], r["lens_kl"]),
            sf.lens_table_html(r["lens_top"], b.name, t.name), sf.attn_diff_figure(r["attn_diff"]))


SIDE_BY_SIDE_TOKENS = 48
MAX_MASK_EXAMPLE = 999  # the built-in set is generated up to the example asked for: never 1e308 of them


@endpoint(model=True)
def generate_both(base, tuned, prompt, chat, request: gr.Request = None):
    """The same prompt, greedy, through the base and the fine-tuned model."""
    from model_core.serving.generate import generate

    b, t = _pair(base, tuned)
    rows = []
    for lm in (b, t):
        use_chat = bool(chat) and lm.has_chat_template
        gen = generate(lm, prompt, max_new_tokens=SIDE_BY_SIDE_TOKENS, seed=0, chat=use_chat)
        rows.append((f"{lm.name}" + (" (chat)" if use_chat else ""), gen.text))
    return sf.generations_html(rows, prompt or "")


@endpoint
def shown():
    """Reveals a result's plots once they hold it (hidden until then: no empty axes on the page)."""
    return gr.update(visible=True)


@endpoint
def shown_compare():
    return [gr.update(visible=True)] * 4


@endpoint(model=True)
def weight_change(base, tuned, request: gr.Request = None):
    """Per layer and module, how far the fine-tuned weights moved from the base's (‖ΔW‖/‖W‖)."""
    from model_core.anatomy.weight_delta import weight_delta

    b, t = _pair(base, tuned)
    return sf.weight_delta_figure(weight_delta(b, t))


@endpoint
def parent_of(tuned):
    if not tuned:
        return gr.skip()
    from model_core.core.registry import list_models

    row = next((r for r in list_models(include_random=True) if r["name"] == tuned), None)
    return gr.update(value=row.get("parent")) if row and row.get("parent") else gr.skip()


def build(shared: Shared) -> None:
    selected = gr.State(None)
    gr.Markdown("Fine-tune a model on chat data in the background (loss on assistant tokens only), then compare "
                "it with its base. The built-in dataset asks to rewrite ISO dates as DD/MM/YYYY: the base "
                "SmolLM2-135M-Instruct gets it wrong, a few minutes of training fix it.")
    with gr.Row():
        with gr.Column(scale=1, min_width=300):
            gr.Markdown("### Fine-tune")
            model = gr.Dropdown(_base_choices(), value=default_model(), label="Model", elem_id="sft-model")
            dataset_kind = gr.Radio([("Built-in: dates → DD/MM/YYYY", "builtin"), ("Upload .jsonl", "upload")],
                                    value="builtin", label="Dataset", elem_id="sft-dataset")
            upload = gr.File(file_types=[".jsonl"], label='{"messages": [...]} or {"prompt", "completion"} per line',
                             visible=False, elem_id="sft-upload")
            skip_bad = gr.Checkbox(False, label="Skip malformed lines (train on the rest)", visible=False,
                                   elem_id="sft-skip-bad")
            method = gr.Radio(["full", "lora"], value="full", label="Method", elem_id="sft-method")
            rank = gr.Number(8, label="LoRA rank", precision=0, visible=False, elem_id="sft-rank")
            with gr.Row():
                lr = gr.Number(None, label="Learning rate (0 = default: 1e-4 full, 1e-3 LoRA)", elem_id="sft-lr")
                steps = gr.Number(None, label="Steps (0 = one epoch)", precision=0, elem_id="sft-steps")
            with gr.Row():
                batch = gr.Number(8, label="Batch size", precision=0, elem_id="sft-batch")
                max_len = gr.Number(256, label="Max length (tokens)", precision=0, elem_id="sft-maxlen")
                seed = gr.Number(0, label="Seed", precision=0, elem_id="sft-seed")
            name = gr.Textbox("", label="Name of the new model (empty: <model>-sft-full|lora-<job>)", elem_id="sft-name")
            with gr.Row():
                sample_every = gr.Number(0, label="Sample held-out prompts every N steps (0 = 4 times in the run)",
                                         precision=0, elem_id="sft-sample-every")
                keep_ckpt = gr.Number(0, label="Keep N intermediate checkpoints (each opens as a model)",
                                      precision=0, elem_id="sft-keep-checkpoints")
            submit_btn = gr.Button("Start fine-tuning", variant="primary", elem_id="sft-submit")
            status = gr.Markdown(elem_id="sft-status")
        with gr.Column(scale=2):
            with gr.Row():
                job = gr.Dropdown([], label="Your SFT jobs", scale=4, elem_id="sft-job")
                cancel_btn = gr.Button("Cancel job", variant="stop", scale=1, elem_id="sft-cancel")
            progress = gr.HTML(elem_id="sft-progress")
            info = gr.Markdown(sf.status_markdown(None), elem_id="sft-info")
            with gr.Row():
                loss_plot = gr.Plot(sf.loss_figure(None), elem_id="sft-loss")
                tput_plot = gr.Plot(sf.throughput_figure(None), elem_id="sft-throughput")
            examples = gr.HTML(elem_id="sft-examples")
            gr.Markdown("Greedy answers to held-out prompts while it trains (before → during → after):")
            samples = gr.HTML(elem_id="sft-samples")

    with gr.Accordion("Loss mask: which tokens of a training example count", open=False):
        with gr.Row():
            index = gr.Number(0, label="Example #", precision=0, scale=1, elem_id="sft-mask-index")
            mask_btn = gr.Button("Show", scale=1, elem_id="sft-mask-show")
        mask_out = gr.HTML(elem_id="sft-mask")

    gr.Markdown("### Compare runs")
    with gr.Row():
        # any job id is taken (an API client names runs this page never listed); compare_runs keeps only
        # the viewer's own
        runs = gr.Dropdown([], multiselect=True, label="Runs to overlay (loss curves, settings, results)", scale=4,
                           allow_custom_value=True, elem_id="sft-runs")
        runs_btn = gr.Button("Compare runs", scale=1, elem_id="sft-runs-compare")
    runs_plot = gr.Plot(sf.runs_figure([]), elem_id="sft-runs-plot")
    runs_df = gr.Dataframe(sf.runs_table([]), interactive=False, wrap=True, elem_id="sft-runs-table")
    with gr.Row():
        runs_export_btn = gr.Button("Download the runs (CSV + JSON)", size="sm", scale=0, elem_id="sft-runs-export")
        runs_files = gr.File(label="Runs", file_count="multiple", visible=False, elem_id="sft-runs-files")

    gr.Markdown("### Compare a fine-tuned model with its base (the prompt box above)")
    with gr.Row():
        tuned = gr.Dropdown(_finetuned_choices(), label="Fine-tuned model", scale=2, elem_id="sft-tuned")
        base = gr.Dropdown(_base_choices(), value=None, label="Base (default: its parent)", scale=2,
                           elem_id="sft-base", allow_custom_value=False)
        cmp_btn = gr.Button("Compare", variant="primary", scale=1, elem_id="sft-compare")
    with gr.Row():
        gen_btn = gr.Button("Generate with both (greedy)", scale=1, elem_id="sft-generate-both")
        delta_btn = gr.Button("Where the weights changed", scale=1, elem_id="sft-weight-delta")
    headline = gr.Markdown(elem_id="sft-headline")
    both = gr.HTML(elem_id="sft-both")
    # hidden until a result fills them: no blank axes under the buttons before anything is compared
    delta_plot = gr.Plot(visible=False, elem_id="sft-delta")
    next_plot = gr.Plot(visible=False, elem_id="sft-next")
    kl_plot = gr.Plot(visible=False, elem_id="sft-kl")
    with gr.Row():
        lens_plot = gr.Plot(visible=False, elem_id="sft-lens")
        attn_plot = gr.Plot(visible=False, elem_id="sft-attn")
    lens_table = gr.HTML(elem_id="sft-lens-table")

    shared.pickers.extend([(model, "all"), (tuned, "finetuned"), (base, "all")])  # kept current by app/server/page.py
    known_jobs = gr.State(None)
    dataset_kind.change(show_if_upload, [dataset_kind], [upload]).then(show_if_upload, [dataset_kind], [skip_bad])
    method.change(show_if_lora, [method], [rank])
    submit_btn.click(submit, [model, dataset_kind, upload, skip_bad, method, rank, lr, steps, batch, max_len, seed,
                              name, sample_every, keep_ckpt], [selected, job, status], api_name="jobs_submit_sft")
    job.change(pick_job, [job], [selected]).then(None, [job], None, js=JOB_URL_JS)
    timer = gr.Timer(REFRESH_S)
    auto_runs = gr.State(None)  # what the tick last put in the runs menu (app.tabs.finetune.tab._latest_finished)
    tick_in = [selected, known_jobs, runs, auto_runs]
    tick_out = [info, progress, loss_plot, tput_plot, examples, samples, known_jobs, job, runs, auto_runs]
    timer.tick(refresh, tick_in, tick_out, show_progress="hidden", queue=False)
    cancel_btn.click(cancel, [selected], [status]).then(refresh, tick_in, tick_out)
    runs_btn.click(compare_runs, [runs], [runs_plot, runs_df], api_name="compare_runs")
    runs.change(compare_runs, [runs], [runs_plot, runs_df], show_progress="hidden")  # picked, or preselected
    runs_export_btn.click(export_runs, [runs], [runs_files])
    # a menu opened fetches its list at once (a tab not shown yet may have missed the timer's update)
    job.focus(job_choices, None, [job])
    runs.focus(job_choices, None, [runs])
    mask_btn.click(show_mask, [model, dataset_kind, upload, index], [mask_out], api_name="loss_mask")
    tuned.change(parent_of, [tuned], [base])
    cmp_btn.click(compare, [base, tuned, shared.prompt, shared.chat],
                  [headline, next_plot, kl_plot, lens_plot, lens_table, attn_plot], concurrency_id="model",
                  api_name="compare_models").success(shown_compare, None, [next_plot, kl_plot, lens_plot, attn_plot],
                                                     queue=False, show_progress="hidden")
    gen_btn.click(generate_both, [base, tuned, shared.prompt, shared.chat], [both], concurrency_id="model",
                  api_name="generate_both")
    delta_btn.click(weight_change, [base, tuned], [delta_plot], concurrency_id="model",
                    api_name="weight_change").success(shown, None, [delta_plot], queue=False, show_progress="hidden")
    from app.tabs.finetune import diff_panel  # "What changed": the run's model against its base over a corpus

    diff_panel.build(shared, selected, tuned)
    if shared.page is not None:
        shared.page.load(job_from_url, None, [selected, job])
    from app.tabs.finetune import (
        pretrain_panel as pretrain_tab,  # training from scratch and the scaling sweep: a self-contained accordion
    )

    pretrain_tab.build(shared)
    from app.tabs.finetune import preference_panel  # reward models, DPO and GRPO: a self-contained accordion

    preference_panel.build(shared)


@endpoint
def show_if_upload(kind):
    return gr.update(visible=kind == "upload")


@endpoint
def show_if_lora(method):
    return gr.update(visible=method == "lora")


@endpoint
def pick_job(job):
    return jf.picked_job(job)


