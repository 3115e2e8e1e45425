"""Explore's "Head search over a corpus" accordion: every head of the model scored over many corpus
prompts by a background job (kind 'heads', tasks/head_search_job.py), drawn as a layer x head map of
one metric with its spread across prompts; a head opens on the prompt where it scored highest.

Built inside ExploreTab.__init__ (after its components exist); `wire(run_inputs, run_outputs)` once
the tab's run event inputs are known (opening a head re-runs Explore on the chosen prompt)."""

from __future__ import annotations

import json
import re

import gradio as gr

from app.shared import job_views as jf
from app.shared import validation as V
from app.shared.context import endpoint, job_owner, job_viewer
from app.tabs.explore import figures
from app.tabs.explore.state import trace_for_state

JOB_POLL_S = 1.0
METRICS = {  # label -> key of heads.json's "metrics" (None: the repeated-random induction test)
    "induction (repeated random tokens)": None,
    "previous-token": "previous_token",
    "duplicate-token": "duplicate_token",
    "induction (on the corpus)": "induction",
    "first token (attention sink)": "first_token",
    "entropy (nats)": "entropy",
}
INTRO = """Every head of the model scored over corpus prompts (the held-out split of the built-in corpus) by a
background job: **previous-token** (attention to the token before), **duplicate-token** (to earlier copies of the
same token), **induction** (to the token after an earlier copy of the current one; also the standard test on
random tokens repeated twice, where a previous-token head scores 0), **first token** (the attention sink) and
**entropy**. Hover a cell for the spread across prompts; type a head to open it on the prompts where it scored
highest."""
HEAD_RE = re.compile(r"^\s*L(\d{1,3})\s*H(\d{1,3})\s*$", re.I)


def _model_of(state) -> str:
    if not isinstance(state, dict) or not isinstance(state.get("model"), str):
        raise gr.Error("Run a prompt first: the search scores the model of the current trace.")
    return trace_for_state(state).model_name


def _load(rec: dict) -> dict:
    from tasks.lifecycle import artifact_path

    path = artifact_path(rec, "heads.json")
    if path is None:
        raise gr.Error("That head search has no result file.")
    return {"job": rec["id"], "data": json.loads(path.read_text(encoding="utf-8"))}


def figure(result, label) -> object:
    """The map of one metric of a loaded search (a hint when there is none)."""
    if not isinstance(result, dict) or "data" not in result:
        return figures.head_search_map(None, None, "", 0, "")
    d = result["data"]
    key = METRICS.get(label if label in METRICS else next(iter(METRICS)))
    label = label if label in METRICS else next(iter(METRICS))
    n, model = d["settings"]["n_prompts"], d["settings"]["model"]
    if key is None:
        return figures.head_search_map(d["induction_repeated"], None, label, n, model)
    m = d["metrics"][key]
    snippets = [[d["prompts"][top[0]]["text"][:60] if top else "" for top in row] for row in m["top"]]
    return figures.head_search_map(m["mean"], m["std"], label, n, model, snippets)


def top_prompts(result, label, head_text) -> tuple[int, int, list[tuple[str, int]]]:
    """(layer, head, [(choice label, prompt index)]) for a typed head, best prompt first."""
    if not isinstance(result, dict) or "data" not in result:
        raise gr.Error("Load or run a head search first.")
    m = HEAD_RE.match(head_text or "")
    if not m:
        raise gr.Error("Type a head as L<layer>H<head>, e.g. L5H3.")
    d = result["data"]
    layer, head = int(m.group(1)), int(m.group(2))
    key = METRICS.get(label) or "induction"  # the random-token test has no prompts: its corpus twin
    tops = d["metrics"][key]["top"]
    if not (0 <= layer < len(tops) and 0 <= head < len(tops[0])):
        raise gr.Error(f"The model has layers 0-{len(tops) - 1} and heads 0-{len(tops[0]) - 1}.")
    choices = []
    for rank, i in enumerate(tops[layer][head]):
        text = d["prompts"][i]["text"]
        choices.append((f"#{rank + 1}: {text[:80]}", int(i)))
    return layer, head, choices


@endpoint
def start(state, n_prompts, tokens, request: gr.Request = None):
    try:
        rec = jf.job_store().submit("heads", {"model": _model_of(state), "prompts": n_prompts, "max_tokens": tokens},
                                    owner=job_owner(request))
    except gr.Error:
        raise
    except Exception as e:  # noqa: BLE001 - a bad setting or no broker: one sentence beside the buttons
        return gr.skip(), gr.skip(), gr.skip(), V.show(e)
    return rec["id"], jf.progress_html(rec), gr.Timer(active=True), V.clear()


@endpoint
def poll(job_id, label, request: gr.Request = None):
    """Timer tick: the job's bar; when it has finished, its map."""
    if not job_id:
        return gr.skip(), gr.skip(), gr.skip(), gr.Timer(active=False)
    rec, bar = jf.job_bar(job_id, request)
    if jf.cancellable(rec):
        return bar, gr.skip(), gr.skip(), gr.skip()
    if rec["state"] != "succeeded":
        return bar, gr.skip(), gr.skip(), gr.Timer(active=False)
    result = _load(rec)
    return bar, result, figure(result, label), gr.Timer(active=False)


@endpoint
def latest(state, label, request: gr.Request = None):
    """The newest finished head search of the current model that this user may see."""
    model = _model_of(state)
    for rec in jf.job_store().list_jobs(job_viewer(request), 200):
        if rec.get("kind") == "heads" and rec.get("state") == "succeeded" and \
                (rec.get("params") or {}).get("model") == model:
            result = _load(rec)
            return result, figure(result, label), V.clear()
    return gr.skip(), gr.skip(), V.show(f"No finished head search of {model} yet: run one.")


@endpoint
def redraw(result, label, request: gr.Request = None):
    return figure(result, label)


@endpoint
def pick_head(result, label, head_text, request: gr.Request = None):
    try:
        _, _, choices = top_prompts(result, label, head_text)
    except gr.Error as e:
        return gr.skip(), V.show(e)
    return gr.update(choices=choices, value=choices[0][1] if choices else None), V.clear()


@endpoint
def open_head(result, label, head_text, choice, request: gr.Request = None):
    """[prompt, layer, head, message, go]: the prompt where the head scored highest (or the chosen
    one) and that head; go tells the chained run (run_if) whether to run."""
    try:
        layer, head, choices = top_prompts(result, label, head_text)
    except gr.Error as e:
        return gr.skip(), gr.skip(), gr.skip(), V.show(e), False
    index = choice if choice in [i for _, i in choices] else choices[0][1]
    return result["data"]["prompts"][index]["text"], layer, head, V.clear(), True


def run_if(run_fn, n_outputs: int):
    """The tab's run, only after open_head said go (a bad head runs nothing and changes nothing)."""
    @endpoint
    def run_opened(go, *args, request: gr.Request = None):
        if go is not True:
            return [gr.skip()] * n_outputs
        return run_fn(*args, request=request)

    return run_opened


class HeadSearchPanel:
    def __init__(self, tab):
        self.tab = tab
        with gr.Accordion("Head search over a corpus", open=False, elem_id="head-search"):
            gr.Markdown(INTRO, elem_classes=["explain"])
            with gr.Row():
                self.n_prompts = gr.Slider(4, 256, value=32, step=1, label="corpus prompts", elem_id="heads-prompts")
                self.tokens = gr.Slider(16, 256, value=96, step=8, label="tokens per prompt", elem_id="heads-tokens")
                self.run_btn = gr.Button("Score every head (background job)", elem_id="heads-run")
                self.latest_btn = gr.Button("Show the latest search", elem_id="heads-latest")
            self.bar = gr.HTML(elem_id="heads-job")
            self.metric = gr.Radio(list(METRICS), value=next(iter(METRICS)), label="score", elem_id="heads-metric")
            self.plot = gr.Plot(figure(None, None), elem_id="heads-map")
            with gr.Row():
                self.head = gr.Textbox(label="head (L5H3)", max_lines=1, elem_id="heads-head", scale=1)
                self.prompt_choice = gr.Dropdown(choices=[], label="its top prompts", elem_id="heads-prompt",
                                                 scale=3)
                self.open_btn = gr.Button("Open it on that prompt", elem_id="heads-open", scale=1)
            self.msg = V.field_message("heads-msg")
        self.result = gr.State(None)
        self.job_id = gr.State(None)
        self.timer = gr.Timer(JOB_POLL_S, active=False)

    def wire(self, run_fn, run_inputs, run_outputs) -> None:
        tab = self.tab
        self.run_btn.click(start, [tab.state, self.n_prompts, self.tokens], [self.job_id, self.bar, self.timer, self.msg])
        self.timer.tick(poll, [self.job_id, self.metric], [self.bar, self.result, self.plot, self.timer],
                        show_progress="hidden")
        self.latest_btn.click(latest, [tab.state, self.metric], [self.result, self.plot, self.msg])
        self.metric.input(redraw, [self.result, self.metric], [self.plot])
        self.head.submit(pick_head, [self.result, self.metric, self.head], [self.prompt_choice, self.msg])
        go = gr.State(False)
        self.open_btn.click(open_head, [self.result, self.metric, self.head, self.prompt_choice],
                            [tab.shared.prompt, tab.layer, tab.head, self.msg, go]).then(
            run_if(run_fn, len(run_outputs)), [go, *run_inputs], run_outputs, concurrency_id="model")
