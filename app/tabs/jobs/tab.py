"""Jobs tab: submit tokenizer training, watch jobs move, cancel, download, and compare tokenizers.

Whose jobs: with sign-in on (LMSCOPE_AUTH), each user sees, cancels and downloads only their own
jobs; with sign-in off there is no identity, so everyone on the server sees (and may cancel) every
job. Either way the owner comes from the request (app.shared.context.job_owner / job_viewer), never from
the browser. Downloads are links to app.server.main's /download route, which checks the same owner.
"""

from __future__ import annotations

import functools

import gradio as gr

from app.shared import job_views as jf
from app.shared.context import Shared, endpoint, job_owner, job_viewer, scratch_dir, uploaded_file
from app.shared.page_js import page_js
from model_core.core.errors import LmscopeError

REFRESH_S = 1.5
DEFAULT_REF = "smollm2-135m-instruct"


@functools.lru_cache(maxsize=16)
def _load_tokenizer(path: str, mtime: float):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(path)


@functools.lru_cache(maxsize=2)
def _reference(name: str):
    from tasks.tokenizer_train import reference_tokenizer

    return reference_tokenizer(name)


def _report(rec: dict | None) -> dict | None:
    if not rec or rec.get("state") != "succeeded":
        return None
    try:
        return jf.job_store().read_report(rec)
    except (OSError, ValueError):
        return None


@endpoint
def export_jobs(request: gr.Request = None):
    """jobs.csv and jobs.json of the jobs this viewer sees (app.shared.job_views.write_jobs)."""
    recs = jf.job_store().list_jobs(owner=job_viewer(request), limit=100)
    return gr.update(value=[str(p) for p in jf.write_jobs(recs, scratch_dir("jobs"))], visible=True)


@endpoint
def refresh(selected=None, request: gr.Request = None):
    """Timer tick: job list, and the selected job's progress + log. `selected` may be left out
    (/jobs_list with no arguments: the list alone)."""
    viewer = job_viewer(request)
    try:
        recs = jf.job_store().list_jobs(owner=viewer, limit=100)
    except LmscopeError as e:
        return gr.skip(), f"⚠️ {e}", gr.skip(), gr.skip()
    sel = next((r for r in recs if r["id"] == selected), None)
    if sel is None and selected:
        try:
            sel = jf.job_store().get_job(selected, viewer)
        except LmscopeError:
            sel = None
    log = "\n".join(sel["log"]) if sel else ""
    return jf.jobs_table(recs), "", jf.progress_html(sel), log


@endpoint
def submit(algorithm, vocab, min_freq, specials, corpus_kind, files, corpus_mb, request: gr.Request = None):
    params = {"algorithm": algorithm, "vocab_size": vocab, "min_frequency": min_freq,
              "special_tokens": specials or None, "corpus": "builtin",
              "corpus_max_mb": corpus_mb if corpus_mb else None}
    paths = []
    if corpus_kind == "upload":
        paths = [uploaded_file(f) for f in (files or [])]
        if not paths:
            raise gr.Error("Upload at least one .txt or .jsonl file, or choose the built-in corpus.")
    rec = jf.job_store().submit("tokenizer", params, owner=job_owner(request), files=paths)
    return rec["id"], f"Queued job **{rec['id']}**."


@endpoint
def select_job(evt: gr.SelectData):
    row = evt.row_value if evt is not None else None
    return str(row[0]) if isinstance(row, list) and row else None


@endpoint
def show_selected(selected, request: gr.Request = None):
    """Everything below the list for the selected job: progress, log, report, download links."""
    if not selected:
        return (jf.progress_html(None), "", "", jf.histogram_figure(None), jf.merges_table(None),
                jf.compression_figure({}), jf.downloads_html(None))
    rec = jf.job_store().get_job(selected, job_viewer(request))
    rep = _report(rec)
    reports = {f"job {rec['id']} ({rep['algorithm']})": rep} if rep else {}
    return (jf.progress_html(rec), "\n".join(rec["log"]), jf.summary_markdown(rec, rep), jf.histogram_figure(rep),
            jf.merges_table(rep), jf.compression_figure(reports), jf.downloads_html(rec))


@endpoint
def cancel(selected, request: gr.Request = None):
    return jf.cancel_job(selected, request, ask="Select a job to cancel.")


@endpoint
def tokenizer_choices(request: gr.Request = None):
    try:
        recs = jf.job_store().list_jobs(owner=job_viewer(request), limit=100)
    except LmscopeError:
        return gr.update()
    ch = [(f"{r['id']} · {jf.job_details(r)}", r["id"]) for r in recs
          if r["kind"] == "tokenizer" and r["state"] == "succeeded"]
    return gr.update(choices=ch)


@endpoint(model=True)
def compare(prompt, ids, selected=None, request: gr.Request = None):
    """The prompt tokenized by the default model's tokenizer and each chosen job's tokenizer: per
    tokenizer its tokens (unknown ones marked), token count, unknown tokens and rate, and whether
    decode(encode(prompt)) gives the prompt back. `selected` (the job open on the page) may be left
    out: /tokenize takes the prompt and the jobs."""
    from tasks.tokenizer_train import analyse_text

    prompt = prompt or ""
    ids = [i for i in (ids or []) if isinstance(i, str)]
    if selected and selected not in ids:
        ids.insert(0, selected)
    viewer = job_viewer(request)
    rows = []
    ref, why = _reference(DEFAULT_REF)
    rows.append((f"{DEFAULT_REF} (default model)", analyse_text(ref, prompt) if ref is not None else why))
    reports = {}
    for job_id in ids[:8]:
        try:
            rec = jf.job_store().get_job(job_id, viewer)
        except LmscopeError as e:
            rows.append((job_id[:40], str(e)))
            continue
        path = jf.job_store().artifact_path(rec, "tokenizer.json")
        if path is None:
            rows.append((f"job {job_id}", f"no tokenizer yet (job is {rec['state']})"))
            continue
        tok = _load_tokenizer(str(path), path.stat().st_mtime)
        name = f"job {job_id} ({rec['params']['algorithm']}, vocab {tok.get_vocab_size():,})"
        rows.append((name, analyse_text(tok, prompt)))
        rep = _report(rec)
        if rep:
            reports[name] = rep
    return jf.tokens_html(rows, prompt), jf.compression_figure(reports)


def build(shared: Shared) -> None:
    from tasks.tokenizer_train import ALGORITHMS, VOCAB_MAX, VOCAB_MIN

    # The selected job id lives in the page (hidden) so it can go into the URL (?job=<id>): a reload or
    # a link opens the same job. It is only an id: every read checks the viewer may see that job.
    selected = gr.Textbox(visible=False, elem_id="job-selected")
    gr.Markdown("Background jobs run on a Celery worker; they keep running if you close the page. "
                "Train a tokenizer on the built-in corpus (Python's standard-library docstrings) or your "
                "own text, then compare it with the default model's tokenizer.")
    with gr.Row():
        with gr.Column(scale=1, min_width=280):
            gr.Markdown("### Train a tokenizer")
            algorithm = gr.Dropdown(list(ALGORITHMS), value="byte-level-bpe", label="Algorithm",
                                    elem_id="job-algorithm")
            vocab = gr.Number(4000, label=f"Vocabulary size ({VOCAB_MIN}–{VOCAB_MAX:,})", precision=0,
                              elem_id="job-vocab")
            min_freq = gr.Number(2, label="Minimum pair frequency (not used by unigram)", precision=0,
                                 elem_id="job-minfreq")
            specials = gr.Textbox("", label="Special tokens (comma-separated; empty = the algorithm's usual ones)",
                                  elem_id="job-specials")
            corpus_kind = gr.Radio([("Built-in (stdlib docstrings, ~1.5 MB)", "builtin"),
                                    ("Upload .txt / .jsonl", "upload")], value="builtin", label="Corpus",
                                   elem_id="job-corpus")
            files = gr.File(file_count="multiple", file_types=[".txt", ".jsonl"], label="Corpus files",
                            visible=False, elem_id="job-files")
            corpus_mb = gr.Number(None, label="Train on the first N MB only (optional)", elem_id="job-mb")
            submit_btn = gr.Button("Submit job", variant="primary", elem_id="job-submit")
            status = gr.Markdown(elem_id="job-status")
        with gr.Column(scale=2):
            gr.Markdown("### Jobs" + (" (yours)" if _signed_in_server() else " (everyone's on this server)"))
            table = gr.Dataframe(jf.jobs_table([]), interactive=False, wrap=True, elem_id="job-table",
                                 label="Click a row to see its progress, log and report")
            progress = gr.HTML(jf.progress_html(None), elem_id="job-progress")
            with gr.Row():
                # only while the selected job can still be stopped (a finished one has nothing to cancel)
                cancel_btn = gr.Button("Cancel job", variant="stop", size="sm", visible=False, elem_id="job-cancel")
            log = gr.Textbox(label="Log", lines=8, max_lines=16, interactive=False, elem_id="job-log")
            downloads = gr.HTML(jf.downloads_html(None), elem_id="job-files-out")
            with gr.Row():
                jobs_export_btn = gr.Button("Download the job list (CSV + JSON)", size="sm", scale=0,
                                            elem_id="job-list-export")
                jobs_files = gr.File(label="Job list", file_count="multiple", visible=False, elem_id="job-list-files")
    gr.Markdown("### Tokenizer report")
    summary = gr.Markdown(elem_id="job-summary")
    with gr.Row():
        hist = gr.Plot(jf.histogram_figure(None), elem_id="job-hist")
        comp = gr.Plot(jf.compression_figure({}), elem_id="job-compression")
    merges = gr.Dataframe(jf.merges_table(None), label="First and last 20 merges (BPE)", interactive=False,
                          elem_id="job-merges")
    gr.Markdown("### The current prompt, tokenized side by side")
    with gr.Row():
        # any job id is taken (an API client names jobs this page never listed); compare checks each
        # against the viewer's own
        others = gr.Dropdown([], multiselect=True, label="Also compare these finished tokenizer jobs", scale=4,
                             allow_custom_value=True, elem_id="job-compare-pick")
        compare_btn = gr.Button("Tokenize prompt", scale=1, elem_id="job-compare")
    compared = gr.HTML(elem_id="job-compare-out")

    timer = gr.Timer(REFRESH_S)
    tick_out = [table, status, progress, log]
    timer.tick(refresh, [selected], tick_out, show_progress="hidden", queue=False, api_name="jobs_list")
    corpus_kind.change(show_if_upload, [corpus_kind], [files])
    detail_out = [progress, log, summary, hist, merges, comp, downloads]
    submit_btn.click(submit, [algorithm, vocab, min_freq, specials, corpus_kind, files, corpus_mb],
                     [selected, status], api_name="jobs_submit_tokenizer").then(refresh, [selected], tick_out)
    table.select(select_job, None, [selected])
    jobs_export_btn.click(export_jobs, None, [jobs_files])
    selected.change(show_selected, [selected], detail_out).then(tokenizer_choices, None, [others]).then(
        None, [selected], None, js=JOB_URL_JS)
    if shared.page is not None:
        shared.page.load(job_from_url, None, [selected])
    cancel_btn.click(cancel, [selected], [status]).then(refresh, [selected], tick_out)
    # when the selected job finishes, load its report once
    progress.change(_maybe_report, [selected, progress], detail_out, show_progress="hidden")
    progress.change(_cancel_button, [progress], [cancel_btn], show_progress="hidden", queue=False)
    compare_btn.click(compare, [shared.prompt, others, selected], [compared, comp], api_name="tokenize")
    others.focus(tokenizer_choices, None, [others])


JOB_URL_JS = page_js("job_url")


@endpoint
def job_from_url(request: gr.Request = None):
    """?job=<id> selects that job when the viewer may see it."""
    q = dict(request.query_params) if request is not None else {}
    job_id = q.get("job")
    if not isinstance(job_id, str) or not job_id:
        return gr.skip()
    try:
        return jf.job_store().get_job(job_id, job_viewer(request))["id"]
    except LmscopeError:
        return gr.skip()


def _signed_in_server() -> bool:
    from app.shared.context import auth_on

    return auth_on()


@endpoint
def show_if_upload(kind):
    return gr.update(visible=kind == "upload")


@endpoint
def _cancel_button(progress_html):
    """The cancel button shows only while the selected job is queued or running (read from the
    progress panel the page already has: no extra request to the job store)."""
    return gr.update(visible=jf.bar_shows(progress_html, jf.LIVE_STATES))


@endpoint
def _maybe_report(selected, progress_html, request: gr.Request = None):
    if selected and jf.bar_shows(progress_html, jf.DONE_STATES):
        return show_selected(selected, request)
    return [gr.skip()] * 7
