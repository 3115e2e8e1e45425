"""Views of background jobs: job records / tokenizer reports -> tables, HTML, plotly (pure functions,
for the Jobs tab and every panel that shows a job's progress), and the few steps every panel that
submits and follows jobs repeats (this viewer's jobs of a kind as menu choices, the selected job's
record, cancel): the only functions here that read the job store."""

from __future__ import annotations

import html
import time
from pathlib import Path

import gradio as gr
import pandas as pd
import plotly.graph_objects as go

from app.shared.context import job_viewer
from app.shared.exports import header_only_csv, table_rows, write_csv, write_json
from app.shared.figure_style import with_message
from model_core.core.errors import LmscopeError

JOB_COLUMNS = ["id", "kind", "state", "progress", "stage", "eta", "created", "details"]
PALETTE = ["#fde68a", "#bfdbfe", "#bbf7d0", "#fecaca", "#ddd6fe", "#fed7aa", "#a5f3fc", "#f5d0fe"]
LIVE_STATES = ("queued", "running")  # a job in these may still change, and can be cancelled
DONE_STATES = ("succeeded", "failed", "cancelled")
STATE_COLOUR = {"queued": "#9ca3af", "running": "#3b82f6", "succeeded": "#16a34a", "failed": "#dc2626",
                "cancelled": "#a16207"}


def _ago(t: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t else ""


def job_details(rec: dict) -> str:
    p = rec.get("params", {})
    if rec.get("kind") == "tokenizer":
        src = p.get("corpus", "builtin")
        if src == "upload":
            src = ", ".join(p.get("corpus_files", [])) or "upload"
        return f"{p.get('algorithm')} · vocab {p.get('vocab_size')} · {src}"
    if rec.get("kind") == "sft":
        method = f"LoRA r{p.get('lora_rank') or 8}" if p.get("method") == "lora" else "full"
        # only a finished run registered a model: a cancelled or failed one points nowhere
        out = ((rec.get("sft") or {}).get("model_name") or p.get("output_name") or ""
               if rec.get("state") == "succeeded" else "")
        return f"{method} · {p.get('model')} · {p.get('dataset')}" + (f" → {out}" if out else "")
    if rec.get("kind") == "patching":
        return f"{p.get('sweep', 'residual')} patching · {p.get('model')} · target {p.get('target')!r}"
    if rec.get("kind") in ("pretrain", "scaling"):  # training from scratch (app/tabs/finetune/pretrain_figures.py)
        return pretrain_job_details(rec)
    return ""


ETA_MIN_FRACTION = 0.1  # before this much is done, or this soon after the start, a rate says nothing yet
ETA_MIN_ELAPSED_S = 5.0


def eta_text(rec: dict, now: float | None = None) -> str:
    """The time left as a person would say it, or "" while no honest estimate exists: a job at 5%
    after a second has no rate yet ("about 0 s left" was the old answer), a finished one none."""
    pr = rec.get("progress") or {}
    eta, frac = pr.get("eta_seconds"), float(pr.get("fraction") or 0)
    started = rec.get("started")
    now = time.time() if now is None else now
    if rec.get("state") != "running" or eta is None or frac < ETA_MIN_FRACTION:
        return ""
    if started and now - started < ETA_MIN_ELAPSED_S:
        return ""
    eta = max(0.0, float(eta))
    if eta < 10:
        return "a few seconds left"
    if eta < 90:
        return f"about {5 * round(eta / 5):.0f} s left"
    if eta < 5400:
        return f"about {round(eta / 60):.0f} min left"
    return f"about {eta / 3600:.1f} h left"


def cancellable(rec: dict | None) -> bool:
    return bool(rec) and rec.get("state") in LIVE_STATES


def jobs_table(records: list[dict]) -> pd.DataFrame:
    rows = []
    for r in records:
        pr = r.get("progress") or {}
        rows.append([r["id"], r["kind"], r["state"], f"{100 * (pr.get('fraction') or 0):.0f}%",
                     pr.get("stage", ""), eta_text(r).replace(" left", ""),
                     _ago(r.get("created")), job_details(r)])
    return pd.DataFrame(rows, columns=JOB_COLUMNS)


def features_line(rec: dict) -> str:
    """A features job's latest training step (loss, FVU, dead share, tokens/s) and, once evaluated,
    its held-out quality: what the run is doing, read from the record the worker pushes."""
    f = rec.get("features") or {}
    row, q = f.get("latest") or {}, f.get("quality") or {}
    parts = []
    if row:
        fvu = float(row.get("fvu", float("nan")))
        parts.append(f"step {row.get('step', '?')}: loss {float(row.get('loss', float('nan'))):.4g}, "
                     f"FVU {fvu:.3f} (explained {1 - fvu:.1%}), dead features {float(row.get('dead_share', 0)):.1%}, "
                     f"{float(row.get('tokens_per_s', 0)):,.0f} tokens/s")
    if q:
        parts.append(f"held-out: explained {float(q['explained']):.3f}, CE loss recovered {float(q['ce_recovered']):.3f}")
    return " · ".join(parts)


def progress_html(rec: dict | None) -> str:
    if not rec:
        return "<div class='lmscope-job-progress'><em>Select a job in the list.</em></div>"
    pr = rec.get("progress") or {}
    frac = max(0.0, min(1.0, float(pr.get("fraction") or 0)))
    colour = STATE_COLOUR.get(rec["state"], "#6b7280")
    bits = [f"<b>{html.escape(rec['id'])}</b> · {html.escape(rec['state'])}", html.escape(str(pr.get("stage", "")))]
    if eta_text(rec):
        bits.append(eta_text(rec))
    if rec.get("started") and rec.get("finished"):
        bits.append(f"ran {rec['finished'] - rec['started']:.1f} s")
    if rec.get("kind") == "features" and features_line(rec):
        bits.append(html.escape(features_line(rec)))
    err = f"<div style='color:#dc2626'>{html.escape(rec['error'])}</div>" if rec.get("error") else ""
    if rec.get("warning") and rec["state"] == "queued":
        err += f"<div class='lmscope-job-warning' style='color:#a16207'>{html.escape(rec['warning'])}</div>"
    return (f"<div class='lmscope-job-progress' data-state='{rec['state']}' data-fraction='{frac:.4f}'>"
            f"<div>{' · '.join(bits)}</div>"
            f"<div style='background:#e5e7eb;border-radius:6px;height:14px;overflow:hidden;margin:6px 0'>"
            f"<div style='width:{frac * 100:.1f}%;background:{colour};height:100%;transition:width .8s'></div></div>"
            f"<div style='font-size:85%'>{frac * 100:.0f}%</div>{err}</div>")


def download_url(job_id: str, name: str) -> str:
    """Relative to the page, so it works behind a proxy's path prefix; served by app.server.main's
    /download route, which checks the signed-in user owns the job."""
    from urllib.parse import quote

    return f"download/{quote(job_id, safe='')}/{quote(name, safe='')}"


def downloads_html(rec: dict | None) -> str:
    from urllib.parse import quote

    if not rec or not rec.get("artifacts"):
        return "<div class='lmscope-downloads'><em>No files yet.</em></div>"
    arts = rec["artifacts"]
    links = []
    model = (rec.get("sft") or {}).get("model_name") if rec.get("kind") == "sft" else None
    if model and rec.get("state") == "succeeded":
        # the model lives in the shared models folder, not the job's: offer it as a Hugging Face folder
        href = f"download/model/{quote(model, safe='')}.zip"
        links.append(f"<a href='{html.escape(href)}' download>{html.escape(model)}.zip (Hugging Face folder)</a>")
        arts = [a for a in arts if a["name"] not in ("lmscope.json", "model.safetensors")]
    links += [f"<a href='{html.escape(download_url(rec['id'], a['name']))}' download>{html.escape(a['name'])}</a>"
              for a in arts]
    return "<div class='lmscope-downloads'>Download: " + " · ".join(links) + "</div>"


def histogram_figure(report: dict | None) -> go.Figure:
    fig = go.Figure()
    if report:
        h = report["token_length_histogram"]
        labels = [str(n) for n in h["lengths"]]
        labels[-1] = f"{h['lengths'][-1]}+"
        fig.add_bar(x=labels, y=h["counts"], marker_color="#3b82f6", name="tokens")
    else:
        with_message(fig, "Select a finished tokenizer job to see its vocabulary.")
    fig.update_layout(title="Vocabulary: token length (characters)", xaxis_title="characters",
                      yaxis_title="tokens in vocabulary", height=300, margin=dict(l=40, r=10, t=40, b=40))
    return fig


def compression_rows(reports: dict[str, dict]) -> list[list]:
    """[[name, vocab, chars/token, tokens/word]] for each report plus its reference tokenizer."""
    rows, refs = [], {}
    for name, rep in reports.items():
        c = rep["compression"]
        rows.append([name, rep["vocab_size"], c["chars_per_token"], c["tokens_per_word"]])
        ref = rep.get("reference") or {}
        if "chars_per_token" in ref:
            refs[ref["name"]] = [ref["name"] + " (default model)", ref.get("vocab_size"), ref["chars_per_token"],
                                 ref["tokens_per_word"]]
    return rows + list(refs.values())


def compression_figure(reports: dict[str, dict]) -> go.Figure:
    rows = compression_rows(reports)
    fig = go.Figure()
    if rows:
        names = [r[0] for r in rows]
        fig.add_bar(x=names, y=[r[2] for r in rows], name="characters per token", marker_color="#16a34a")
        fig.add_bar(x=names, y=[r[3] for r in rows], name="tokens per word", marker_color="#f59e0b")
    else:
        with_message(fig, "Select a finished tokenizer job to compare its compression with the model's tokenizer.")
    # the explanation on a second, smaller line: the title reads whole on a narrow page too
    fig.update_layout(title="Compression on held-out text<br><sup>(higher chars/token, lower tokens/word = "
                            "tighter)</sup>", barmode="group", height=320, margin=dict(l=40, r=10, t=64, b=80))
    return fig


def merges_table(report: dict | None) -> pd.DataFrame:
    if not report or not report.get("first_merges"):
        return pd.DataFrame([], columns=["rank", "left", "right", "merged"])
    n = report["num_merges"]
    rows = [[i + 1, a, b, a + b] for i, (a, b) in enumerate(report["first_merges"])]
    last = report["last_merges"]
    rows += [[n - len(last) + i + 1, a, b, a + b] for i, (a, b) in enumerate(last)]
    df = pd.DataFrame(rows, columns=["rank", "left", "right", "merged"])
    for c in ("left", "right", "merged"):
        df[c] = df[c].map(lambda s: s.replace(" ", "␣").replace("\n", "↵"))
    return df


def summary_markdown(rec: dict | None, report: dict | None) -> str:
    if not rec:
        return ""
    if not report:
        return f"Job **{rec['id']}** is {rec['state']}; its report appears when it succeeds."
    c, ref, tr = report["compression"], report.get("reference") or {}, report.get("train") or {}
    lines = [f"**{report['algorithm']}** tokenizer · vocabulary **{report['vocab_size']:,}**"
             + (f" · {report['num_merges']:,} merges" if report.get("num_merges") else "")
             + (f" · trained on {tr.get('bytes', 0) / 2**20:.2f} MB in {tr.get('seconds', 0):.2f} s "
                f"({tr.get('mb_per_s', 0):.2f} MB/s)" if tr else ""),
             f"Held-out text: {report['heldout']['source']} ({report['heldout']['documents']} documents). "
             f"This tokenizer: **{c['chars_per_token']} chars/token**, {c['tokens_per_word']} tokens/word, "
             f"round trip exact on {c.get('roundtrip_exact_fraction', 0) * 100:.0f}% of documents."]
    if "chars_per_token" in ref:
        lines.append(f"{ref['name']} (vocab {ref.get('vocab_size', '?'):,}): **{ref['chars_per_token']} chars/token**, "
                     f"{ref['tokens_per_word']} tokens/word.")
    elif ref.get("unavailable"):
        lines.append(f"Reference tokenizer unavailable: {ref['unavailable']}.")
    return "\n\n".join(lines)


def _piece(text: str) -> str:
    if text == "":
        return "<span style='opacity:.5'>▁</span>"
    return html.escape(text).replace(" ", "&nbsp;").replace("\n", "↵<br>").replace("\t", "⇥")


def _shown(text: str, limit: int = 80) -> str:
    """A bit of text for a tooltip or the stats line: byte-safe (␣ ↵ <0xNN>), cut at `limit`."""
    from model_core.core.tokenization import display_bytes

    s = display_bytes(text.encode("utf-8"))
    return "“" + (s if len(s) <= limit else s[:limit] + "…") + "”"


def _chip(i: int, p: dict, text: str | None, shown: str | None = None) -> str:
    """One token: the token itself (its vocabulary string, byte-safe); the text it covered on hover.
    `shown`: what the chip says instead (the byte values of a token that is part of a character)."""
    if "display" not in p:  # a bare {id, text} piece: show the text it covered
        return (f"<span class='lmscope-tok' title='id {p['id']}' style='background:{PALETTE[i % len(PALETTE)]};"
                f"border-radius:3px;padding:1px 0;margin-right:1px;font-family:monospace'>{_piece(p['text'])}</span>")
    a, b = p.get("start", 0), p.get("end", 0)
    title = f"id {p['id']} · token {p.get('token', '')!r} · "
    if p.get("bytes"):
        title += f"bytes {p['bytes']} · "
    if (p.get("parts") or 1) > 1:
        title += f"token {p['part']} of {p['parts']} making “{p.get('glyph', '')}” · "
    if text is None:
        title += f"covers {_shown(p['text'])}"
    elif a == b:
        title += f"an inserted marker: covers no text (before character {a})"
    else:
        title += f"covers {_shown(text[a:b])} (characters {a}–{b})"
        if not p["text"]:
            title += ", shared with the token before"
    cls = "lmscope-tok"
    style = (f"background:{PALETTE[i % len(PALETTE)]};border-radius:3px;padding:1px 0;margin-right:1px;"
             "font-family:monospace")
    if p.get("unk"):
        cls += " lmscope-tok-unk"
        title += " · UNKNOWN: the tokenizer cannot represent this text, it is lost"
        style = ("background:#fee2e2;color:#b91c1c;font-weight:bold;outline:2px dashed #dc2626;border-radius:3px;"
                 "padding:1px 2px;margin:0 2px;font-family:monospace")
    elif p.get("special"):
        cls += " lmscope-tok-special"
        style += ";font-style:italic"
    mark = " data-unk='1'" if p.get("unk") else ""
    if shown is not None:
        style += (";font-size:9px;color:#444;padding:0 2px;margin:0;border-radius:0;flex:1 1 auto;text-align:center;"
                  "white-space:nowrap")
    return (f"<span class='{cls}'{mark} title='{html.escape(title, quote=True)}' style='{style}'>"
            f"{html.escape(p['display'] if shown is None else shown, quote=True)}</span>")


def _chips(pieces: list[dict], text: str | None) -> str:
    """Every token a chip; a character several byte tokens spell together (pieces with parts > 1)
    is shown once above its tokens' chips, which show their byte values."""
    out, i = [], 0
    while i < len(pieces):
        p = pieces[i]
        n = int(p.get("parts") or 1)
        if n == 1 or p.get("part") != 1 or i + n > len(pieces) or pieces[i + n - 1].get("part") != n:
            out.append(_chip(i, p, text))
            i += 1
            continue
        chips = "".join(_chip(i + k, pieces[i + k], text, pieces[i + k].get("bytes", "")) for k in range(n))
        out.append("<span class='lmscope-glyph' style='display:inline-flex;flex-direction:column;vertical-align:top;"
                   "border:1px solid #cbd5e1;border-radius:3px;margin-right:1px;line-height:1.4'>"
                   f"<span style='text-align:center;padding:0 3px;font-family:monospace;unicode-bidi:isolate'>"
                   f"{html.escape(p.get('glyph', ''))}</span><span style='display:flex;gap:1px'>{chips}</span></span>")
        i += n
    return "".join(out)


def _stats(name: str, a: dict) -> str:
    """The line above a tokenizer's chips: token count, unknown tokens and rate, round trip."""
    n, k = a["tokens"], a.get("unknown", 0)
    bits = [f"<b>{html.escape(name)}</b>", f"{n} tokens"]
    unk = f"{k} unknown"
    if n:
        unk += f" ({100 * k / n:.0f}% of tokens"
        if a.get("chars"):
            unk += f", {a.get('unknown_chars', 0)} of {a['chars']} characters"
        unk += ")"
    bits.append(f"<span class='lmscope-unk-count' style='color:{'#b91c1c' if k else 'inherit'}'>{unk}</span>")
    rt, attr = a.get("roundtrip"), ""
    if rt is True:
        bits.append("round trip: exact")
    elif rt is False:
        bits.append(f"<span style='color:#b91c1c'>round trip: differs, decodes to "
                    f"{html.escape(_shown(a.get('decoded', '')))}</span>")
    if rt is not None:
        attr = f" data-roundtrip='{'true' if rt else 'false'}'"
    return (f"<div class='lmscope-token-stats' data-tokens='{n}' data-unknown='{k}'{attr}>"
            + " · ".join(bits) + "</div>")


def tokens_html(rows: list[tuple], text: str | None = None) -> str:
    """rows: (tokenizer name, analysis) where analysis is tasks.tokenizer_train.analyse_text's dict
    ({pieces, tokens, unknown, unknown_rate, unknown_chars, roundtrip, decoded}), a bare list of
    pieces, or an error sentence. `text`: the text that was tokenized (for the hover titles).
    Each chip is the token itself (vocabulary string, byte-safe); unknown tokens are marked
    (class lmscope-tok-unk); hovering shows which characters a token covered."""
    out = ["<div class='lmscope-token-compare'>"]
    for name, a in rows:
        if isinstance(a, str):
            out.append(f"<div style='margin:8px 0'><b>{html.escape(name)}</b>: <em>{html.escape(a)}</em></div>")
            continue
        if isinstance(a, list):
            a = {"pieces": a, "tokens": len(a), "unknown": sum(1 for p in a if p.get("unk"))}
        if text is not None:
            a = {**a, "chars": len(text)}
        spans = _chips(a["pieces"], text)
        out.append(f"<div style='margin:8px 0'>{_stats(name, a)}"
                   f"<div style='line-height:1.9;color:#111'>{spans}</div></div>")
    out.append("</div>")
    return "".join(out)


# --- the jobs table as files ---

def jobs_rows(records: list[dict]) -> list[dict]:
    """The Jobs tab's table (app.shared.job_views.jobs_table) as rows, one per job."""
    return table_rows(jobs_table(records))


def write_jobs(records: list[dict], folder: Path) -> list[Path]:
    """jobs.csv (the table as shown) and jobs.json (each job's id, kind, state, progress, times,
    settings, error and warning; logs left out: each job's log is its own download)."""
    recs = [r for r in records or [] if isinstance(r, dict)]
    keep = ("id", "kind", "state", "progress", "created", "started", "finished", "params", "error", "warning",
            "artifacts")
    rows = jobs_rows(recs)
    return [write_csv(folder / "jobs.csv", rows) if rows else header_only_csv(folder / "jobs.csv", JOB_COLUMNS),
            write_json(folder / "jobs.json", {"jobs": [{k: r.get(k) for k in keep if k in r} for r in recs]})]


def pretrain_job_details(rec: dict) -> str:
    """One line for the jobs table: a 'pretrain' or 'scaling' job."""
    p = rec.get("params") or {}
    pr = rec.get("pretrain") or {}
    if rec.get("kind") == "scaling":
        fit = pr.get("fit")
        ws = ",".join(str(w) for w in (p.get("widths") or []))
        return (f"scaling d={ws} · {p.get('layers')} layers · {int(p.get('tokens') or 0):,} tokens each"
                + (f" → α = {fit['alpha']:.3f}" if fit else ""))
    steps = p.get("max_steps") or "?"
    out = pr.get("model_name") if rec.get("state") == "succeeded" else ""
    return f"from scratch d={p.get('width')} · {p.get('layers')} layers · {steps} steps" + (f" → {out}" if out else "")


# ---------------------------------------------------------------------- following a user's jobs
# What the panels that submit and follow jobs share (Fine-tune's SFT, preference and from-scratch
# panels, Explore's head search and neuron scan, Interventions' patching sweep, the Jobs tab). Owners
# come from the request (job_viewer), never from the page.

def job_store():
    """tasks.jobs, imported when first asked (building the page does not import the job framework)."""
    from tasks import jobs

    return jobs


def user_jobs(request, kinds: tuple[str, ...]) -> list[dict]:
    """This viewer's jobs of these kinds among their 100 newest, newest first; [] when the job
    store cannot be read (the menu stays empty; submitting says why)."""
    try:
        return [r for r in job_store().list_jobs(owner=job_viewer(request), limit=100) if r["kind"] in kinds]
    except LmscopeError:
        return []


def job_menu(recs: list[dict], label) -> list[tuple[str, str]]:
    """Menu choices for these jobs: "id · state · label(rec)" -> id."""
    return [(f"{r['id']} · {r['state']} · {label(r)}", r["id"]) for r in recs]


def menu_unchanged(choices: list[tuple[str, str]], known) -> bool:
    """Whether a menu last given `known` (a gr.State: it hands tuples back as lists) already shows
    these choices, so a timer tick need not resend them."""
    known = known if isinstance(known, list) else []
    return [list(c) for c in choices] == [list(c) if isinstance(c, (list, tuple)) else c for c in known]


def selected_job(selected: str, recs: list[dict], request) -> dict:
    """The selected job's record: from recs when it is among them, else read from the store
    (LmscopeError when there is no such job this viewer may see)."""
    rec = next((r for r in recs if r["id"] == selected), None)
    return rec if rec is not None else job_store().get_job(selected, job_viewer(request))


def job_bar(job_id: str, request) -> tuple[dict, str]:
    """A followed job's record and its progress bar (progress_html); LmscopeError when there is no
    such job this viewer may see."""
    rec = job_store().get_job(job_id, job_viewer(request))
    return rec, progress_html(rec)


def cancel_job(selected, request, ask: str = "Pick a job to cancel.") -> str:
    """Cancel the selected job (this viewer's own: the store refuses others) and say what it is now;
    no job selected: gr.Error(ask)."""
    if not selected or not isinstance(selected, str):
        raise gr.Error(ask)
    rec = job_store().cancel_job(selected, owner=job_viewer(request))
    return f"Job **{rec['id']}** is {rec['state']}."


def picked_job(job) -> str | None:
    """A job menu's value as a job id (None for anything else the browser sends)."""
    return job if isinstance(job, str) else None


def bar_shows(bar_html, states: tuple[str, ...]) -> bool:
    """Whether a progress bar (progress_html) shows a job in one of these states: read from the panel
    the page already has, with no request to the job store."""
    h = bar_html if isinstance(bar_html, str) else ""
    return any(f"data-state='{s}'" in h for s in states)
