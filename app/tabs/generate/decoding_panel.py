"""The Generate tab's "Beam search and contrastive search" accordion: its own controls, one search
(model_core.serving.search_decoding) per click, the beams as a tree with their scores, a table, contrastive search's
candidates, and check lines against the model's own forward and transformers' own scores.

`build(shared)` is called by app/generate_tab.build inside the Generate tab."""

from __future__ import annotations

import gradio as gr
import pandas as pd

from app.shared.context import Shared, endpoint, get_model, max_prompt_tokens
from app.tabs.generate import figures as F
from model_core.core.errors import LmscopeError
from model_core.serving.search_decoding import (
    MAX_BEAMS,
    MAX_CONTRASTIVE_K,
    MAX_NEW_TOKENS,
    REPEAT_N,
    DecodingSettings,
    decode,
    decoding_to_json,
)

METHODS = {"beam search": "beam", "diverse beam search": "diverse", "contrastive search": "contrastive"}
COLUMNS = ["rank", "group", "text", "tokens", "log p (model)", "search score sum", "score = sum / length^lp",
           f"repeated {REPEAT_N}-grams", "ends"]

INTRO = f"""Sampling picks one token at a time. A **search** looks further: **beam search** keeps the N best partial
texts (beams) by total log-probability at every step and returns them ranked by
$\\text{{score}} = \\frac{{\\sum_t \\log p(x_t \\mid x_{{<t}})}}{{\\text{{length}}^{{\\,lp}}}}$ (length penalty $lp$: 1 = mean
log-prob per token, 0 = the plain sum, which favours short texts). Beam texts are likely but bland and tend to
**repeat themselves** (the table counts repeated {REPEAT_N}-grams, next to greedy's). **Diverse beam search** splits the
beams into groups that take turns; a group loses `diversity penalty` per earlier group that chose the same token at
this step. **Contrastive search** runs the top-k tokens through the model and picks the best
$(1-\\alpha)\\,p - \\alpha \\max_j \\cos(h_{{cand}}, h_j)$: likely, but unlike every earlier position (fights repetition).
Beam search is transformers' own `generate`; diverse beams and contrastive search are lmscope's, equal token for
token to transformers 4.55 (the last release that had them built in)."""

LATEX = [{"left": "$$", "right": "$$", "display": True}, {"left": "$", "right": "$", "display": False}]


def _check(label: str, diff: float, tol: float) -> str:
    ok = diff <= tol
    mark = "✓" if ok else "✗"
    colour = "#15803d" if ok else "#b91c1c"
    return f"<span style='color:{colour}'>{mark}</span> {label}: max |difference| {diff:.2e}"


def summary(j: dict) -> str:
    """The status line and the checks for one decoding_to_json result."""
    s = j["settings"]
    best, greedy = j["beams"][0], j.get("greedy")
    lines = [f"**{j['method']}** ({j['reference']}): {len(j['beams'])} text(s) of up to {s['max_new_tokens']} tokens in "
             f"{j['seconds']:.2f} s. Best: score {best['score']:.4f}, log p {best['logprob']:.3f} over "
             f"{best['length']} tokens."]
    rep = f"Repeated {REPEAT_N}-grams: best {best['repetition']:.0%}"
    if len(j["beams"]) > 1:
        rep += f", all beams {sum(b['repetition'] for b in j['beams']) / len(j['beams']):.0%} on average"
    if greedy:
        rep += f"; greedy, same length: {greedy['repetition']:.0%}"
    lines.append(rep + ".")
    tf = [abs(b["teacher_forced_logprob"] - b["logprob"]) for b in j["beams"] if b.get("teacher_forced_logprob") is not None]
    if tf:
        lines.append(_check("each text's log p from the search vs one plain forward pass over the finished text", max(tf),
                            2e-3))
    if j.get("transformers_sequences_scores"):
        d = max(abs(b["score"] - t) for b, t in zip(j["beams"], j["transformers_sequences_scores"]))
        lines.append(_check(f"score = log p / length^{s['length_penalty']:g} vs transformers' own sequences_scores", d,
                            1e-4))
    return "\n\n".join(lines)


def beams_table(j: dict) -> pd.DataFrame:
    rows = []
    for b in j["beams"]:
        rows.append([b["rank"], b["group"] if j["method"] == "diverse" else "", b["text"], b["length"],
                     round(b["logprob"], 4), round(b["search_logprob"], 4), round(b["score"], 4),
                     f"{b['repetition']:.0%}", "EOS" if b["eos"] else "length"])
    if j.get("greedy"):
        g = j["greedy"]
        rows.append(["greedy", "", g["text"], g["length"], round(g["logprob"], 4), "", "", f"{g['repetition']:.0%}",
                     "EOS" if g["eos"] else "length"])
    return pd.DataFrame(rows, columns=COLUMNS)


def tree_beams(j: dict) -> list[dict]:
    out = []
    for b in j["beams"]:
        d = {k: b[k] for k in ("rank", "tokens", "token_ids", "step_logprobs", "score", "logprob", "eos")}
        if j["method"] == "diverse":
            d["group"] = b["group"]
        out.append(d)
    return out


@endpoint(model=True)
def run_search(model_name, prompt, chat, method, num_beams, groups, diversity, length_penalty, alpha, top_k, max_new,
               request: gr.Request = None):
    try:
        s = DecodingSettings.from_values(METHODS.get(method, method), num_beams=num_beams, num_beam_groups=groups,
                                         diversity_penalty=diversity, length_penalty=length_penalty,
                                         penalty_alpha=alpha, top_k=top_k, max_new_tokens=max_new)
    except LmscopeError as e:
        raise gr.Error(str(e)) from None
    lm = get_model(model_name)
    try:
        j = decoding_to_json(lm, decode(lm, prompt, s, chat=bool(chat), max_prompt_tokens=max_prompt_tokens()))
    except LmscopeError as e:
        raise gr.Error(str(e)) from None
    tail = "prompt"
    cand = F.contrastive_figure(j["candidates"], s.penalty_alpha) if j["candidates"] else F.contrastive_figure([], 0)
    return summary(j), F.beam_tree_figure(tree_beams(j), tail), beams_table(j), cand


def build(shared: Shared) -> None:
    with gr.Accordion("Beam search and contrastive search", open=False, elem_id="gen-beams"):
        gr.Markdown(INTRO, latex_delimiters=LATEX)
        with gr.Row():
            method = gr.Radio(list(METHODS), value="beam search", label="search", elem_id="gen-search-method")
            max_new = gr.Slider(1, MAX_NEW_TOKENS, value=40, step=1, label="max new tokens", elem_id="gen-search-max")
        with gr.Row():
            beams = gr.Slider(2, MAX_BEAMS, value=4, step=1, label="beams", elem_id="gen-search-beams")
            groups = gr.Slider(1, MAX_BEAMS, value=2, step=1, label="groups (diverse)", elem_id="gen-search-groups")
            diversity = gr.Number(value=1.0, minimum=0, maximum=10, label="diversity penalty (diverse)",
                                  elem_id="gen-search-diversity")
            lp = gr.Number(value=1.0, minimum=-5, maximum=5, label="length penalty lp", elem_id="gen-search-lp")
        with gr.Row():
            alpha = gr.Slider(0, 1, value=0.6, step=0.05, label="α (contrastive)", elem_id="gen-search-alpha")
            top_k = gr.Slider(1, MAX_CONTRASTIVE_K, value=4, step=1, label="top-k candidates (contrastive)",
                              elem_id="gen-search-topk")
            go_btn = gr.Button("Search", variant="primary", elem_id="gen-search-btn")
        info = gr.Markdown(elem_id="gen-search-info", latex_delimiters=LATEX)
        tree = gr.Plot(F.beam_tree_figure([]), elem_id="gen-search-tree")
        table = gr.Dataframe(headers=COLUMNS, interactive=False, wrap=True, elem_id="gen-search-table",
                             label="Every returned text (greedy last, for comparison)")
        cands = gr.Plot(F.contrastive_figure([], 0), elem_id="gen-search-cands")
        go_btn.click(run_search, [shared.model, shared.prompt, shared.chat, method, beams, groups, diversity, lp,
                                  alpha, top_k, max_new], [info, tree, table, cands], concurrency_id="model")
