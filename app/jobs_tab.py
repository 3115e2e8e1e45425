"""Jobs tab: submit tokenizer training, watch jobs move, cancel, download, and compare tokenizers.

Owner: a per-browser uuid kept in localStorage (gr.BrowserState), so a reload keeps your jobs; the
record's `owner` field. With sign-in on (LMSCOPE_AUTH), the owner is the signed-in user name and
each user sees, cancels and downloads only their own jobs ("All sessions" is ignored). Without
sign-in, "All sessions" shows everyone's jobs, but only the browser that submitted a job cancels it.
"""

from __future__ import annotations

import functools
import shutil
import tempfile
import uuid
from pathlib import Path

import gradio as gr

from app import jobs_figures as jf
from app.context import Shared
from model_core.errors import LmscopeError

REFRESH_S = 1.5
DEFAULT_REF = "smollm2-135m-instruct"


def _jobs():
    from tasks import jobs

    return jobs


def _owner(owner: str | None, request: gr.Request | None = None) -> str:
    user = getattr(request, "username", None) if request is not None else None
    if user:
        return user
    return owner or f"browser-{uuid.uuid4().hex[:12]}"


def _strict(owner: str | None, request: gr.Request | None) -> str | None:
    """The owner every read is checked against: the signed-in user; None (no check) without sign-in."""
    return getattr(request, "username", None) if request is not None else None


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
        return _jobs().read_report(rec)
    except (OSError, ValueError):
        return None


def refresh(owner, show_all, selected, request: gr.Request = None):
    """Timer tick: job list, and the selected job's progress + log."""
    owner = _owner(owner, request)
    if _strict(owner, request):
        show_all = False
    try:
        recs = _jobs().list_jobs(owner=None if show_all else owner, limit=100)
        status = ""
    except LmscopeError as e:
        return owner, gr.skip(), f"⚠️ {e}", gr.skip(), gr.skip()
    sel = next((r for r in recs if r["id"] == selected), None)
    if sel is None and selected:
        try:
            sel = _jobs().get_job(selected, _strict(owner, request))
        except LmscopeError:
            sel = None
    log = "\n".join(sel["log"]) if sel else ""
    return owner, jf.jobs_table(recs), status, jf.progress_html(sel), log


def submit(owner, algorithm, vocab, min_freq, specials, corpus_kind, files, corpus_mb, request: gr.Request = None):
    owner = _owner(owner, request)
    params = {"algorithm": algorithm, "vocab_size": vocab, "min_frequency": min_freq,
              "special_tokens": specials or None, "corpus": "builtin",
              "corpus_max_mb": corpus_mb if corpus_mb else None}
    paths = []
    if corpus_kind == "upload":
        paths = [f if isinstance(f, str) else getattr(f, "name", f) for f in (files or [])]
        if not paths:
            raise gr.Error("Upload at least one .txt or .jsonl file, or choose the built-in corpus.")
    try:
        rec = _jobs().submit("tokenizer", params, owner=owner, files=paths)
    except LmscopeError as e:
        raise gr.Error(str(e)) from None
    return owner, rec["id"], f"Queued job **{rec['id']}**."


def select_job(evt: gr.SelectData):
    row = evt.row_value if evt is not None else None
    return row[0] if row else None


def show_selected(selected, prompt, owner=None, request: gr.Request = None):
    """Everything below the list for the selected job: progress, log, report, downloads."""
    if not selected:
        return (jf.progress_html(None), "", "", jf.histogram_figure(None), jf.merges_table(None),
                jf.compression_figure({}), None)
    try:
        rec = _jobs().get_job(selected, _strict(owner, request))
    except LmscopeError as e:
        raise gr.Error(str(e)) from None
    rep = _report(rec)
    reports = {f"job {rec['id']} ({rep['algorithm']})": rep} if rep else {}
    files = None
    if rec.get("artifacts"):
        tmp = Path(tempfile.mkdtemp(prefix=f"lmscope-{rec['id']}-"))
        files = []
        for a in rec["artifacts"]:
            if Path(a["path"]).exists():
                dst = tmp / f"{rec['id']}-{a['name']}"
                shutil.copyfile(a["path"], dst)
                files.append(str(dst))
    return (jf.progress_html(rec), "\n".join(rec["log"]), jf.summary_markdown(rec, rep), jf.histogram_figure(rep),
            jf.merges_table(rep), jf.compression_figure(reports), files or None)


def cancel(selected, owner=None, request: gr.Request = None):
    if not selected:
        raise gr.Error("Select a job to cancel.")
    try:
        rec = _jobs().cancel_job(selected, owner=_owner(owner, request))
    except LmscopeError as e:
        raise gr.Error(str(e)) from None
    return f"Job **{rec['id']}** is {rec['state']}."


def tokenizer_choices(owner, show_all, request: gr.Request = None):
    if _strict(owner, request):
        show_all = False
    try:
        recs = _jobs().list_jobs(owner=None if show_all else _owner(owner, request), limit=100)
    except LmscopeError:
        return gr.update()
    ch = [(f"{r['id']} · {jf.job_details(r)}", r["id"]) for r in recs
          if r["kind"] == "tokenizer" and r["state"] == "succeeded"]
    return gr.update(choices=ch)


def compare(prompt, ids, selected, owner=None, request: gr.Request = None):
    """The prompt tokenized by the default model's tokenizer and each chosen job's tokenizer."""
    from tasks.tokenizer_train import hf_pieces, token_pieces

    prompt = prompt or ""
    ids = list(ids or [])
    if selected and selected not in ids:
        ids.insert(0, selected)
    rows = []
    ref, why = _reference(DEFAULT_REF)
    rows.append((f"{DEFAULT_REF} (default model)", hf_pieces(ref, prompt) if ref is not None else why))
    reports = {}
    for job_id in ids:
        try:
            rec = _jobs().get_job(job_id, _strict(owner, request))
        except LmscopeError as e:
            rows.append((job_id, str(e)))
            continue
        path = _jobs().artifact_path(rec, "tokenizer.json")
        if path is None:
            rows.append((f"job {job_id}", f"no tokenizer yet (job is {rec['state']})"))
            continue
        tok = _load_tokenizer(str(path), path.stat().st_mtime)
        name = f"job {job_id} ({rec['params']['algorithm']}, vocab {tok.get_vocab_size():,})"
        rows.append((name, token_pieces(tok, prompt)))
        rep = _report(rec)
        if rep:
            reports[name] = rep
    return jf.tokens_html(rows), jf.compression_figure(reports)


def build(shared: Shared) -> None:
    from tasks.tokenizer_train import ALGORITHMS, VOCAB_MAX, VOCAB_MIN

    owner = gr.BrowserState("", storage_key="lmscope_owner")
    selected = gr.State(None)
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
            with gr.Row():
                gr.Markdown("### Jobs")
                show_all = gr.Checkbox(False, label="All sessions", elem_id="job-show-all")
            table = gr.Dataframe(jf.jobs_table([]), interactive=False, wrap=True, elem_id="job-table",
                                 label="Click a row to see its progress, log and report")
            progress = gr.HTML(jf.progress_html(None), elem_id="job-progress")
            with gr.Row():
                cancel_btn = gr.Button("Cancel job", variant="stop", elem_id="job-cancel")
            log = gr.Textbox(label="Log", lines=8, max_lines=16, interactive=False, elem_id="job-log")
            downloads = gr.File(label="Artifacts", file_count="multiple", interactive=False, elem_id="job-files-out")
    gr.Markdown("### Tokenizer report")
    summary = gr.Markdown(elem_id="job-summary")
    with gr.Row():
        hist = gr.Plot(jf.histogram_figure(None), elem_id="job-hist")
        comp = gr.Plot(jf.compression_figure({}), elem_id="job-compression")
    merges = gr.Dataframe(jf.merges_table(None), label="First and last 20 merges (BPE)", interactive=False,
                          elem_id="job-merges")
    gr.Markdown("### The current prompt, tokenized side by side")
    with gr.Row():
        others = gr.Dropdown([], multiselect=True, label="Also compare these finished tokenizer jobs", scale=4,
                             elem_id="job-compare-pick")
        compare_btn = gr.Button("Tokenize prompt", scale=1, elem_id="job-compare")
    compared = gr.HTML(elem_id="job-compare-out")

    timer = gr.Timer(REFRESH_S)
    tick_out = [owner, table, status, progress, log]
    timer.tick(refresh, [owner, show_all, selected], tick_out, show_progress="hidden", queue=False)
    show_all.change(refresh, [owner, show_all, selected], tick_out)
    corpus_kind.change(lambda k: gr.update(visible=k == "upload"), [corpus_kind], [files])
    detail_out = [progress, log, summary, hist, merges, comp, downloads]
    submit_btn.click(submit, [owner, algorithm, vocab, min_freq, specials, corpus_kind, files, corpus_mb],
                     [owner, selected, status]).then(refresh, [owner, show_all, selected], tick_out)
    table.select(select_job, None, [selected])
    selected.change(show_selected, [selected, shared.prompt, owner], detail_out).then(
        tokenizer_choices, [owner, show_all], [others])
    cancel_btn.click(cancel, [selected, owner], [status]).then(refresh, [owner, show_all, selected], tick_out)
    # when the selected job finishes, load its report once
    progress.change(_maybe_report, [selected, progress, owner], detail_out, show_progress="hidden")
    compare_btn.click(compare, [shared.prompt, others, selected, owner], [compared, comp])
    others.focus(tokenizer_choices, [owner, show_all], [others])


def _maybe_report(selected, progress_html, owner=None, request: gr.Request = None):
    h = progress_html or ""
    if selected and any(f"data-state='{s}'" in h for s in ("succeeded", "failed", "cancelled")):
        return show_selected(selected, None, owner, request)
    return [gr.skip()] * 7
