"""The Generate tab's "Steering vector" accordion: a direction built from contrastive prompt pairs
(model_core.interp.steering), added as alpha * v to one layer's input; the steered and the unsteered
generation side by side (same seed, same sampling settings as the Generate tab), and an alpha sweep
(KL from the unsteered next-token distribution, the output's perplexity under the unsteered model,
the on-target score) as a plot and a table.

`build(shared, gen)` is called by app/generate_tab.build inside the Generate tab (gen: its
GenerateTab, whose sampling controls this panel reads)."""

from __future__ import annotations

import gradio as gr
import pandas as pd

from app.shared import validation as V
from app.shared.context import Shared, endpoint, get_model
from app.shared.steering_settings import MY_PAIRS, pairs_from, vector_for, whole
from app.tabs.generate import figures as F
from model_core.core.errors import LmscopeError
from model_core.interp import steering as St
from model_core.serving import steered as Steered
from model_core.serving.generate import check_seed, generation_to_json

MAX_NEW = 48  # tokens per continuation here (a sweep generates one per alpha)
SWEEP_COLUMNS = ["α", "KL from unsteered", "perplexity (unsteered model)", "on-target log p", "next token (top 3)",
                 "continuation"]
INTRO = """A **steering vector** is a direction in the residual stream: the mean difference, at one layer, between
the last-token residual of positive and negative prompts (e.g. *I love you* / *I hate you*). Adding **α·v** to that
layer's input in every forward pushes the model along the direction; α = 0 is the unsteered model, bit for bit, and
layers before the chosen one never see the vector. The two generations below use the Generate tab's sampling settings
and seed. **On-target score**: the mean log-probability of the target words you name, at the prompt's next token."""

def _setup(model_name, prompt, chat, choice, pairs_text, layer, from_pos, targets_text, max_new, t, k, p, m, r, sd):
    """Everything both buttons need, checked: (lm, vector, options, targets, from_position, notes)."""
    if not isinstance(prompt, str) or not prompt.strip():
        raise St.SteeringError("Type a prompt above first.")
    settings, problems = V.check_settings(t, k, p, m, r)
    if problems:
        raise St.SteeringError(" ".join(problems.values()))
    seed = check_seed(sd)
    lm = get_model(model_name)
    layer = whole(layer, "steering layer", 0, lm.shape.n_layers - 1)
    from_pos = whole(from_pos, "'from position'", 0, 100_000)
    max_new = whole(max_new, "number of new tokens", 1, MAX_NEW)
    vec = vector_for(lm, pairs_from(choice, pairs_text), layer, bool(chat))
    targets = St.target_ids(lm, targets_text)
    options = dict(max_new_tokens=max_new, settings=settings, seed=seed, chat=bool(chat))
    tnote = (" Targets: " + ", ".join(f"`{w!r}`" for w, _ in targets) + " (each word's first token, after a space)."
             if targets else "")
    note = (f"Vector: layer {layer} input, {vec.n_pairs} pairs, norm {vec.norm:.2f}"
            f"{', from position ' + str(from_pos) if from_pos else ', every position'}.{tnote}")
    return lm, vec, options, targets, from_pos, note


def perplexity_text(x) -> str:
    return "n/a" if x is None else f"{x:.2f}"


@endpoint(model=True)
def run_pair(model_name, prompt, chat, choice, pairs_text, layer, alpha, from_pos, targets_text, max_new,
             t, k, p, m, r, sd, request: gr.Request = None):
    """[info, unsteered text, steered text, message]: the two generations, same seed."""
    try:
        lm, vec, options, targets, from_pos, note = _setup(model_name, prompt, chat, choice, pairs_text, layer,
                                                           from_pos, targets_text, max_new, t, k, p, m, r, sd)
        alpha = St.check_alpha(alpha)
        base, steered = Steered.steered_pair(lm, prompt, vec, alpha, from_position=from_pos, **options)
        sweep = Steered.alpha_sweep(lm, prompt, vec, [0.0, alpha], targets=[i for _, i in targets] or None,
                               chat=options["chat"], from_position=from_pos)
    except LmscopeError as e:
        return gr.skip(), gr.skip(), gr.skip(), V.show(e)
    b, s = generation_to_json(lm, base.generation), generation_to_json(lm, steered.generation)
    lines = [note, f"**α = {alpha:g}**: KL of the next-token distribution from the unsteered one "
                   f"{sweep[-1].kl_from_unsteered:.3f} nats."]
    if targets:
        shift = sweep[-1].target_logprob - sweep[0].target_logprob
        lines.append(f"On-target score {sweep[0].target_logprob:.2f} → {sweep[-1].target_logprob:.2f} "
                     f"({shift:+.2f} nats).")
    lines.append(f"Perplexity of each continuation under the unsteered model: {perplexity_text(base.base_perplexity)} "
                 f"(unsteered) and {perplexity_text(steered.base_perplexity)} (steered).")
    return ("\n\n".join(lines), gr.update(value=b["text"], label=f"unsteered (α = 0), {len(b['steps'])} tokens"),
            gr.update(value=s["text"], label=f"steered (α = {alpha:g}), {len(s['steps'])} tokens"), V.clear())


@endpoint(model=True)
def run_sweep(model_name, prompt, chat, choice, pairs_text, layer, alphas_text, from_pos, targets_text, max_new,
              t, k, p, m, r, sd, request: gr.Request = None):
    """[info, sweep plot, sweep table, message]."""
    try:
        lm, vec, options, targets, from_pos, note = _setup(model_name, prompt, chat, choice, pairs_text, layer,
                                                           from_pos, targets_text, max_new, t, k, p, m, r, sd)
        alphas = St.parse_alphas(alphas_text)
        chat = options.pop("chat")
        rows = Steered.alpha_sweep(lm, prompt, vec, alphas, targets=[i for _, i in targets] or None, chat=chat,
                              from_position=from_pos, generate_options=options)
    except LmscopeError as e:
        return gr.skip(), gr.skip(), gr.skip(), V.show(e)
    data = [{"alpha": r.alpha, "kl_from_unsteered": r.kl_from_unsteered, "base_perplexity": r.base_perplexity,
             "target_logprob": r.target_logprob} for r in rows]
    table = pd.DataFrame([[r.alpha, round(r.kl_from_unsteered, 4), None if r.base_perplexity is None else
                           round(r.base_perplexity, 2), None if r.target_logprob is None else round(r.target_logprob, 3),
                           ", ".join(f"{w!r} {q:.2f}" for w, q in r.top_tokens[:3]), r.text] for r in rows],
                         columns=SWEEP_COLUMNS)
    return note, F.steering_sweep_figure(data, vec.layer), table, V.clear()


def build(shared: Shared, gen) -> None:
    with gr.Accordion("Steering vector", open=False, elem_id="gen-steer"):
        gr.Markdown(INTRO)
        with gr.Row():
            choice = gr.Radio([*St.BUILTIN_PAIRS, MY_PAIRS], value="love-hate", label="pairs",
                              elem_id="gen-steer-pairs")
            layer = gr.Number(value=6, precision=0, label="layer (its input gets α·v)", elem_id="gen-steer-layer")
            alpha = gr.Number(value=4.0, label="α (strength; 0 = unsteered)", elem_id="gen-steer-alpha")
            from_pos = gr.Number(value=0, precision=0, label="from position", elem_id="gen-steer-from")
        pairs_text = gr.Textbox(label="my pairs: one {\"positive\": ..., \"negative\": ...} per line", lines=3,
                                placeholder='{"positive": "I love it", "negative": "I hate it"}',
                                elem_id="gen-steer-pairs-text")
        with gr.Row():
            targets = gr.Textbox(value="wonderful, great, lovely", label="target words (on-target score)",
                                 elem_id="gen-steer-targets")
            max_new = gr.Slider(1, MAX_NEW, value=24, step=1, label="new tokens", elem_id="gen-steer-max-new")
            pair_btn = gr.Button("Generate steered vs unsteered", variant="primary", elem_id="gen-steer-btn")
        msg = V.field_message("gen-steer-msg")
        info = gr.Markdown(elem_id="gen-steer-info")
        with gr.Row(equal_height=True):
            plain = gr.Textbox(label="unsteered (α = 0)", lines=4, interactive=False, elem_id="gen-steer-plain")
            steered = gr.Textbox(label="steered", lines=4, interactive=False, elem_id="gen-steer-steered")
        with gr.Row():
            alphas = gr.Textbox(value="-8, -4, 0, 4, 8", label="α sweep (comma-separated)",
                                elem_id="gen-steer-alphas")
            sweep_btn = gr.Button("Sweep α", elem_id="gen-steer-sweep-btn")
        plot = gr.Plot(F.steering_sweep_figure([]), elem_id="gen-steer-sweep")
        table = gr.Dataframe(headers=SWEEP_COLUMNS, interactive=False, wrap=True, elem_id="gen-steer-table",
                             label="One row per α (each continuation with the same seed)")
        sampling = [gen.temperature, gen.top_k, gen.top_p, gen.min_p, gen.rep, gen.seed]
        common = [shared.model, shared.prompt, shared.chat, choice, pairs_text, layer]
        pair_btn.click(run_pair, [*common, alpha, from_pos, targets, max_new, *sampling],
                       [info, plain, steered, msg], concurrency_id="model", api_name="steer")
        sweep_btn.click(run_sweep, [*common, alphas, from_pos, targets, max_new, *sampling],
                        [info, plot, table, msg], concurrency_id="model")
