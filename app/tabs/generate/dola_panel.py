"""The Generate tab's "DoLa" accordion: greedy decoding by contrasting layers
(model_core.interp.dola) beside plain greedy decoding of the same prompt: both texts, and for each
token the earlier layer it was contrasted with and every candidate's divergence.

`build(shared)` is called by app/tabs/generate/tab.py inside the Generate tab."""

from __future__ import annotations

import html

import gradio as gr

from app.shared.context import Shared, endpoint, get_model, max_prompt_tokens
from app.tabs.generate import dola_figures as F
from model_core.core.errors import LmscopeError
from model_core.core.prompts import encode_prompt
from model_core.core.tokenization import describe_tokens
from model_core.interp import dola as D
from model_core.serving.speculative import plain_greedy

MAX_NEW = 64

INTRO = """**DoLa** (decoding by contrasting layers, Chuang et al. 2023): at each step the final layer's next-token
log-probabilities minus those of an earlier ("premature") layer, the candidate whose distribution differs most
from the final one; tokens the final layer gives under a tenth of its top probability are ruled out first. The
idea: facts the model settles in its late layers stand out against what an early layer already guessed.
Candidates are every other layer of the lower ('low') or upper ('high') half, read as the transformers 4.x code
and the published code read them (the unembedding applied to the raw residual stream, without the final norm,
unlike the logit lens in Explore). Checked token for token against transformers 4.55.4's own DoLa."""


@endpoint(model=True)
def run_dola(model_name, prompt, chat, layers, max_new, request: gr.Request = None):
    try:
        which = D.check_layers(layers)
        n = int(float(max_new))
        if not 1 <= n <= MAX_NEW:
            raise LmscopeError(f"Max new tokens must be a whole number from 1 to {MAX_NEW}.")
        lm = get_model(model_name)
        ids = encode_prompt(lm, prompt, chat=bool(chat), max_tokens=max_prompt_tokens())
    except (LmscopeError, TypeError, ValueError, OverflowError) as e:
        msg = str(e) if isinstance(e, LmscopeError) else f"Max new tokens must be a whole number from 1 to {MAX_NEW}."
        return msg, gr.skip()
    run = D.dola_greedy(lm, ids, n, which).to_json(lm.tokenizer)
    plain = plain_greedy(lm, ids, n)
    plain_text = lm.tokenizer.decode(plain.token_ids, skip_special_tokens=True)
    labels = [r["display"] for r in describe_tokens(lm.tokenizer, [s["token_id"] for s in run["dola"]["steps"]])]
    same = next((i for i, (a, b) in enumerate(zip(run["token_ids"], plain.token_ids)) if a != b), None)
    parted = ("the same tokens as plain greedy decoding" if same is None and run["token_ids"] == plain.token_ids
              else f"parts from plain greedy decoding at token {same if same is not None else min(len(run['token_ids']), len(plain.token_ids))}")
    chosen = [s["premature_layer"] for s in run["dola"]["steps"]]
    most = max(set(chosen), key=chosen.count) if chosen else None
    info = (f"**DoLa ({which} layers {', '.join(map(str, run['dola']['candidates']))})**: {len(run['token_ids'])} tokens, "
            f"{parted}; contrasted most often with layer {most} ({chosen.count(most)} of {len(chosen)} tokens)."
            f"\n\n| DoLa | plain greedy |\n|---|---|\n| {_cell(run['text'])} | {_cell(plain_text)} |")
    return info, F.divergence_figure(run, labels)


def _cell(text: str) -> str:
    return html.escape(text).replace("|", "&#124;").replace("\n", "↵ ") or "(nothing)"


def build(shared: Shared) -> None:
    with gr.Accordion("DoLa: decoding by contrasting layers", open=False, elem_id="gen-dola"):
        gr.Markdown(INTRO)
        with gr.Row():
            layers = gr.Radio(list(D.LAYER_CHOICES), value="high", label="candidate layers", elem_id="gen-dola-layers")
            max_new = gr.Slider(1, MAX_NEW, value=24, step=1, label="max new tokens", elem_id="gen-dola-max")
            go_btn = gr.Button("Decode", variant="primary", elem_id="gen-dola-btn")
        info = gr.Markdown(elem_id="gen-dola-info")
        plot = gr.Plot(F.divergence_figure(None), elem_id="gen-dola-plot")
        go_btn.click(run_dola, [shared.model, shared.prompt, shared.chat, layers, max_new], [info, plot],
                     concurrency_id="model")
