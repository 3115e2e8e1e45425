"""The Generate tab's "Clamp a feature" accordion: one sparse-autoencoder feature of a set trained
in the app (model_core.interp.features) clamped to a value in every forward (model_core.interp.feature_steering;
0 ablates it), and the generation as the model runs next to the clamped one: same seed, same
sampling settings as the Generate tab, the next token's KL and each output's perplexity under the
unedited model.

`build(shared, gen)` is called by app/generate_tab inside the Generate tab (gen: its GenerateTab,
whose sampling controls this panel reads)."""

from __future__ import annotations

import gradio as gr
import torch

from app.shared import validation as V
from app.shared.context import Shared, endpoint, get_model
from app.tabs.explore.features_panel import open_set, sets_for
from app.tabs.generate.steering_panel import perplexity_text, whole
from model_core.core.errors import LmscopeError
from model_core.interp import feature_steering as FS
from model_core.interp.steering import base_perplexity
from model_core.serving.generate import check_seed, generation_to_json
from model_core.serving.steered import generations_at_once

MAX_NEW = 48
INTRO = """Clamp one **feature** of a sparse autoencoder trained in this app (Explore → *Sparse-autoencoder
features*, or `lmscope jobs submit features`) in every forward pass: at the set's layer, each position from
*from position* on gets **x + (value − a_f(x))·d_f**, a_f its activation, d_f its decoder row. **0 ablates** the
feature; a large value writes its direction in. Both generations use the Generate tab's sampling settings and seed."""


@endpoint
def refresh_sets(model_name, request: gr.Request = None):
    """[set menu, message]: the feature sets trained on the chosen model."""
    names = sets_for(model_name) if isinstance(model_name, str) else []
    if not names:
        return gr.update(choices=[], value=None), V.show(
            "No feature set for this model yet: `lmscope jobs submit features --model ... --layer 6 --wait`.")
    return gr.update(choices=names, value=names[-1]), V.clear()


@endpoint(model=True)
def run_clamped(model_name, prompt, chat, set_name, feature, value, from_pos, max_new, t, k, p, m, r, sd,
                request: gr.Request = None):
    """[info, plain text, clamped text, message]: the two generations, same seed."""
    try:
        if not isinstance(prompt, str) or not prompt.strip():
            raise FS.FeatureError("Type a prompt above first.")
        settings, problems = V.check_settings(t, k, p, m, r)
        if problems:
            raise FS.FeatureError(" ".join(problems.values()))
        feats, _, labels = open_set(set_name)
        lm = get_model(model_name)
        FS.check_set_fits(lm, feats)  # before the feature number is checked against the set's size
        f = whole(feature, "feature number", 0, feats.num_latents - 1)
        v = FS.check_value(value)
        from_pos = whole(from_pos, "'from position'", 0, 100_000)
        options = dict(max_new_tokens=whole(max_new, "number of new tokens", 1, MAX_NEW), settings=settings,
                       seed=check_seed(sd), chat=bool(chat))
        edits = FS.feature_edits(lm, feats, f, v, from_position=from_pos)
        plain, clamped = generations_at_once(lm, prompt, [None, edits], **options)  # side by side on the engine
        shift = FS.next_token_shift(lm, torch.tensor([plain.prompt_ids], device=lm.device), edits)
    except (LmscopeError, gr.Error) as e:
        return gr.skip(), gr.skip(), gr.skip(), V.show(e)
    a, b = generation_to_json(lm, plain), generation_to_json(lm, clamped)
    label = labels[f]["label"] if f < len(labels) else ""
    what = "ablated (0)" if v == 0 else f"clamped to {v:g}"
    lines = [f"Feature **#{f}** of `{feats.name}` ({label or 'no label'}) {what} at "
             f"`{feats.point(lm).edit_name}`{', from position ' + str(from_pos) if from_pos else ', every position'}.",
             f"KL(clamped ‖ as it runs) of the next-token distribution after the prompt: **{shift['kl']:.4f} nats**.",
             f"Perplexity of each continuation under the unedited model: "
             f"{perplexity_text(base_perplexity(lm, plain.prompt_ids, plain.token_ids))} (as it runs) and "
             f"{perplexity_text(base_perplexity(lm, clamped.prompt_ids, clamped.token_ids))} (clamped)."]
    return ("\n\n".join(lines), gr.update(value=a["text"], label=f"as it runs, {len(a['steps'])} tokens"),
            gr.update(value=b["text"], label=f"feature #{f} {what}, {len(b['steps'])} tokens"), V.clear())


def build(shared: Shared, gen) -> None:
    with gr.Accordion("Clamp a feature", open=False, elem_id="gen-clamp"):
        gr.Markdown(INTRO)
        with gr.Row():
            set_name = gr.Dropdown(choices=[], label="feature set", elem_id="gen-clamp-set", scale=3)
            refresh = gr.Button("Find feature sets", elem_id="gen-clamp-refresh", scale=1)
        with gr.Row():
            feature = gr.Number(value=0, precision=0, label="feature #", elem_id="gen-clamp-feature")
            value = gr.Number(value=0.0, label="clamp to (0 = ablate)", elem_id="gen-clamp-value")
            from_pos = gr.Number(value=1, precision=0, label="from position", elem_id="gen-clamp-from")
            max_new = gr.Slider(1, MAX_NEW, value=24, step=1, label="new tokens", elem_id="gen-clamp-max-new")
        run_btn = gr.Button("Generate clamped vs as it runs", variant="primary", elem_id="gen-clamp-btn")
        msg = V.field_message("gen-clamp-msg")
        info = gr.Markdown(elem_id="gen-clamp-info")
        with gr.Row(equal_height=True):
            plain = gr.Textbox(label="as it runs", lines=4, interactive=False, elem_id="gen-clamp-plain")
            clamped = gr.Textbox(label="clamped", lines=4, interactive=False, elem_id="gen-clamp-clamped")
        refresh.click(refresh_sets, [shared.model], [set_name, msg])
        sampling = [gen.temperature, gen.top_k, gen.top_p, gen.min_p, gen.rep, gen.seed]
        run_btn.click(run_clamped, [shared.model, shared.prompt, shared.chat, set_name, feature, value, from_pos,
                                    max_new, *sampling], [info, plain, clamped, msg], concurrency_id="model")
