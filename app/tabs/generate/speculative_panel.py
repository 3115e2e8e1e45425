"""The Generate tab's "Speculative decoding" accordion: greedy decoding with a draft's proposals
checked k at a time (model_core.serving.speculative), beside plain greedy decoding of the same prompt
in the same click: who wrote each token, each target forward's kept and rejected proposals, the
acceptance rate, the speed-up this click measured, and whether the tokens equal plain greedy's (the
model's own one-token-at-a-time forward).

`build(shared)` is called by app/tabs/generate/tab.py inside the Generate tab."""

from __future__ import annotations

import gradio as gr

from app.shared.context import Shared, endpoint, get_model, max_prompt_tokens
from app.tabs.generate import speculative_figures as F
from model_core.core.errors import LmscopeError
from model_core.core.prompts import encode_prompt
from model_core.core.tokenization import describe_tokens
from model_core.serving import speculative as S

DRAFTS = {"prompt lookup": "lookup", "this model's first layers": "layers"}
MAX_NEW = 128

INTRO = """A **draft** guesses the next k tokens; the model checks all k in **one forward pass** and keeps the
guesses up to the first one it would not have chosen, then adds its own token there. Every kept token is the
model's own greedy choice, so the text is exactly plain greedy decoding's; a good draft only means fewer
forward passes. **Prompt lookup** guesses the tokens that followed the text's last 3, 2 or 1 tokens earlier in
the text (no second model: it pays when the output copies the prompt, as code and summaries do). **This model's
first layers** is the model cut after a few layers (an untrained early exit: cheap, and mostly wrong). On a CPU
a forward over k tokens costs nearly k forwards, so the speed-up shows on a GPU, where one forward's cost is
reading the weights."""


def _summary(run: dict, plain: dict, equal: bool, k: int) -> str:
    rate = run["acceptance_rate"]
    speed = plain["seconds"] / run["seconds"] if run["seconds"] > 0 else float("nan")
    mark = ("<span style='color:#15803d'>✓</span> the same tokens as plain greedy decoding (one forward per token), "
            "run in this click" if equal else
            "<span style='color:#b91c1c'>✗</span> tokens differ from plain greedy decoding run in this click")
    return (f"**{run['draft']}, k = {k}**: {len(run['token_ids'])} tokens in **{run['target_forwards']} target "
            f"forwards** (plain greedy: {plain['target_forwards']}), {run['tokens_per_forward']:.2f} tokens per "
            f"forward. The draft proposed {run['proposed']} tokens and the model kept {run['accepted']}"
            + (f" (**{rate:.0%}**)" if rate is not None else "")
            + f". Time: {run['seconds'] * 1000:.0f} ms vs {plain['seconds'] * 1000:.0f} ms plain, "
              f"**{speed:.2f}×** plain greedy's speed in this click.\n\n{mark}.")


@endpoint(model=True)
def run_speculative(model_name, prompt, chat, draft_kind, k, layers, max_new, request: gr.Request = None):
    """Plain greedy and speculative greedy of the same prompt; a bad setting changes only the message."""
    try:
        k, max_new = S.check_k(_whole(k)), _whole(max_new)
        if not 1 <= max_new <= MAX_NEW:
            raise LmscopeError(f"Max new tokens must be a whole number from 1 to {MAX_NEW}.")
        lm = get_model(model_name)
        kind = DRAFTS.get(draft_kind)
        if kind is None:
            raise LmscopeError(f"Pick a draft: {', '.join(DRAFTS)}.")
        draft = S.PromptLookup() if kind == "lookup" else S.DraftModel(S.first_layers(lm, _whole(layers)))
        ids = encode_prompt(lm, prompt, chat=bool(chat), max_tokens=max_prompt_tokens())
    except LmscopeError as e:
        return str(e), gr.skip(), gr.skip()
    plain = S.plain_greedy(lm, ids, max_new)
    spec = S.speculative_greedy(lm, ids, max_new, draft, k=k)
    labels = [r["display"] for r in describe_tokens(lm.tokenizer, spec.token_ids)]  # "glyph·k/n" for byte pieces
    run = spec.to_json()
    return (_summary(run, plain.to_json(), spec.token_ids == plain.token_ids, k), F.token_marks(run, labels),
            F.steps_figure(run, labels))


def _whole(v) -> int:
    """A whole number from the page (a float from a slider or number box), else a sentence."""
    try:
        f = float(v)
    except (TypeError, ValueError):
        raise LmscopeError(f"Expected a whole number, not {v!r}.") from None
    if f != f or f in (float("inf"), float("-inf")) or f != int(f):
        raise LmscopeError(f"Expected a whole number, not {v!r}.")
    return int(f)


def build(shared: Shared) -> None:
    with gr.Accordion("Speculative decoding", open=False, elem_id="gen-spec"):
        gr.Markdown(INTRO)
        with gr.Row():
            draft = gr.Radio(list(DRAFTS), value="prompt lookup", label="draft", elem_id="gen-spec-draft")
            k = gr.Slider(1, S.MAX_DRAFT_TOKENS, value=4, step=1, label="k: tokens the draft proposes per forward",
                          elem_id="gen-spec-k")
            layers = gr.Number(value=8, precision=0, label="layers of the cut draft", elem_id="gen-spec-layers")
            max_new = gr.Slider(1, MAX_NEW, value=48, step=1, label="max new tokens", elem_id="gen-spec-max")
            go_btn = gr.Button("Decode", variant="primary", elem_id="gen-spec-btn")
        info = gr.Markdown(elem_id="gen-spec-info")
        tokens = gr.HighlightedText(label="who wrote each token", color_map=F.TOKEN_COLOURS, show_legend=True,
                                    combine_adjacent=False, elem_id="gen-spec-tokens")
        plot = gr.Plot(F.steps_figure(None), elem_id="gen-spec-steps")
        go_btn.click(run_speculative, [shared.model, shared.prompt, shared.chat, draft, k, layers, max_new],
                     [info, tokens, plot], concurrency_id="model", api_name="speculative")
