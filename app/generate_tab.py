"""Generation lab tab: token-by-token generation with live sampling settings, every step's
distribution before and after the filters, N samples side by side, and the KV cache.

`build(shared)` is called inside an open `gr.Tab`. All heavy lifting is model_core.generate;
figures come from app.generate_figures (pure functions)."""

from __future__ import annotations

import gradio as gr

from app import generate_figures as F
from app import validation as V
from app.context import Shared, endpoint, generate_concurrency, get_model, max_prompt_tokens
from model_core.errors import LmscopeError
from model_core.generate import (
    check_seed,
    generation_to_json,
    iter_generate,
    kv_cache_growth,
    max_new_tokens_cap,
    step_attention,
    step_to_json,
    time_cache_vs_no_cache,
)
from model_core.sampling import SamplingSettings
from model_core.tokenization import continuation_display, describe_raw, describe_tokens, pending_bytes, token_bytes

MAX_SAMPLES = 8
SAMPLE_TOKENS_CAP = 64  # each of the N samples is at most this long (N x tokens of CPU time)
TIMELINE_EVERY = 4  # redraw the timeline every few streamed steps (and at the end)


def parse_stop(text: str | None) -> list[str]:
    r"""One stop string per line; `\n` and `\t` are written as escapes."""
    if not text:
        return []
    return [line.replace("\\n", "\n").replace("\\t", "\t") for line in text.split("\n") if line != ""]


def _settings(temperature, top_k, top_p, min_p, repetition_penalty) -> SamplingSettings:
    try:
        return SamplingSettings.from_values(temperature, top_k, top_p, min_p, repetition_penalty)
    except LmscopeError as e:
        raise gr.Error(str(e)) from None


def _highlight(steps: list[dict]) -> list[tuple[str, str]]:
    return [(F.step_label(s), F.prob_bucket(s["chosen"]["prob"])) for s in steps]


def _problems(t, k, p, m, r, sd) -> dict[str, str]:
    """{setting: one sentence} for every bad sampling setting or seed; empty when all are fine."""
    _, problems = V.check_settings(t, k, p, m, r)
    try:
        check_seed(sd)
    except LmscopeError as e:
        problems["seed"] = str(e)
    return problems


class _Labeller:
    """Generated tokens as people should see them while they stream: a character spelled by
    several byte tokens is labelled "glyph·k/n" on each of them (model_core.tokenization), and a
    step's candidates that finish a character the text so far left open show it ("…မ")."""

    def __init__(self, tokenizer, prompt_ids):
        self.tok = tokenizer
        self.raws: list[bytes] = []
        self.ids: list[int] = []
        self.context = [token_bytes(tokenizer, i) for i in list(prompt_ids)[-4:]]

    def add(self, step: dict) -> None:
        pending = pending_bytes(self.context + self.raws)
        if pending:  # the model is in the middle of a character: say which one each candidate makes
            step["pending"] = pending.hex(" ").upper()
            for c in step["top_before"] + step["top_after"]:
                c["token"] = continuation_display(pending, token_bytes(self.tok, c["id"]))
        cid = int(step["chosen"]["id"])
        self.ids.append(cid)
        self.raws.append(token_bytes(self.tok, cid))

    def label(self, steps: list[dict]) -> None:
        for step, row in zip(steps, describe_raw(self.ids, self.raws)):
            step["chosen"]["label"] = row["display"]
            step["chosen"]["bytes"] = row["bytes"]


def _status(gen_json: dict, running: bool) -> str:
    n = gen_json["n_tokens"]
    if running:
        return f"Generating… {n} tokens"
    why = {"length": "reached max new tokens", "eos": "the model ended its text (EOS)",
           "stop_string": f"stop string {gen_json.get('stop_string')!r} appeared",
           "cancelled": "stopped", "context_full": "the model's context is full"}.get(gen_json["finish_reason"],
                                                                                   gen_json["finish_reason"])
    return (f"**{n} tokens**, finished because {why}. {gen_json['tokens_per_second']:.1f} tokens/s "
            f"(prompt: {len(gen_json['prompt_token_ids'])} tokens, {gen_json['prefill_seconds'] * 1000:.0f} ms).")


def _kv_markdown(kv: dict | None) -> str:
    if not kv:
        return ""
    ok = "equal" if kv["measured_total"] == kv["formula_total"] else "differ (sliding-window layers keep fewer tokens)"
    return (f"Formula: **{kv['expression']} = {kv['formula_total']:,} B**; measured key/value tensors: "
            f"**{kv['measured_total']:,} B** ({ok}). That is {kv['bytes_per_token']:,} B per token in "
            f"{kv['bytes_per_value'] * 8}-bit values.")


# Generate's settings and chosen step in the page URL (issue 15 item 5), beside the shared model /
# prompt / chat keys: a link with ?tab=generate&gen_max=... generates the same text (greedy, or the
# same seed) and opens the same step.
GEN_URL_KEYS = ["gen_max", "gen_t", "gen_k", "gen_p", "gen_minp", "gen_rep", "gen_seed", "gen_stop", "gen_step"]
GEN_URL_JS = """(model, prompt, chat, ...v) => {
  const keys = %s;
  const q = new URLSearchParams(location.search);
  q.set('tab', 'generate');
  if (model) q.set('model', model);
  if (prompt !== null && prompt !== undefined) q.set('prompt', prompt);
  q.set('chat', chat ? 1 : 0);
  keys.forEach((k, i) => { const x = v[i];
    if (x !== null && x !== undefined && x !== '') q.set(k, x); else q.delete(k); });
  history.replaceState(null, '', '?' + q.toString());
  return [];
}""" % (GEN_URL_KEYS,)
# (key, default, lowest, highest) of each number the link may carry; None: no bound
_GEN_NUMBERS = [("gen_t", 0.0, 0.0, 2.0), ("gen_k", 0, None, None), ("gen_p", 1.0, 0.01, 1.0),
                ("gen_minp", 0.0, 0.0, 1.0), ("gen_rep", 1.0, 0.5, 2.0), ("gen_seed", 0, None, None)]


def settings_from_url(query: dict, cap: int, opened_tab: str | None = None) -> dict | None:
    """A link's Generate settings, each clamped into its control's range (a bad top-k or seed is
    kept as written: the run then says so beside that control), or None when the link has none or
    opens another tab. `opened_tab`: the link's ?tab= as the page read it before its first tab's
    select rewrote the URL (app/ui.py HEAD_JS); the server may see the rewritten one."""
    if (opened_tab or query.get("tab")) != "generate" or "gen_max" not in query:
        return None

    def num(k, default, lo=None, hi=None, cast=float):
        try:
            v = cast(float(query[k]))
        except (KeyError, ValueError, TypeError, OverflowError):
            return default
        if v != v:
            return default
        return max(lo, min(hi, v)) if lo is not None else v
    out = {"gen_max": num("gen_max", min(32, cap), 1, cap, int)}
    for k, default, lo, hi in _GEN_NUMBERS:
        out[k] = num(k, default, lo, hi, int if k in ("gen_k", "gen_seed") else float)
    out["gen_stop"] = str(query.get("gen_stop") or "")[:400]
    out["gen_step"] = num("gen_step", 0, 0, 10**6, int)
    for k in ("model", "prompt"):
        out[k] = query.get(k)
    out["chat"] = query.get("chat") in ("1", "true")
    return out


def _light_state(lm, gen, steps_json) -> dict:
    kv = dict(gen.kv_cache or {})
    kv["measured_series"] = [list(x) for x in gen.kv_series]
    # the formula runs to the tokens the cache really holds: the last token drawn was never fed
    # back through the model, so the cache has one token fewer than the text (39 of 40)
    cached = kv.get("tokens") or (gen.kv_series[-1][0] if gen.kv_series else len(gen.all_ids))
    return {"model": lm.name, "ids": gen.all_ids, "prompt_len": len(gen.prompt_ids), "steps": steps_json,
            "kv": kv, "growth": kv_cache_growth(lm, max(1, int(cached))),
            # for the steps download (app/exports.write_generation)
            "prompt": gen.prompt, "chat": gen.chat, "settings": gen.settings.to_dict(), "seed": gen.seed,
            "text": gen.text}


def build(shared: Shared) -> None:
    cap = max_new_tokens_cap()
    state = gr.State(None)  # per user: the last generation (ids, step records, KV report)
    gr.Markdown(
        "### Generation lab\nThe model writes one token at a time. At every step it gives a probability to "
        "every token; the sampling settings reshape and cut that distribution, then one token is picked."
    )
    with gr.Row():
        with gr.Column(scale=1, min_width=260):
            max_new = gr.Slider(1, cap, value=min(32, cap), step=1, label="max new tokens", elem_id="gen-max-new")
            temperature = gr.Slider(0, 2, value=0.0, step=0.05, label="temperature (0 = greedy)",
                                    elem_id="gen-temperature")
            top_k = gr.Number(value=0, precision=0, label="top-k (0 = off)", elem_id="gen-top-k")
            topk_msg = V.field_message("gen-top-k-msg")
            top_p = gr.Slider(0.01, 1, value=1.0, step=0.01, label="top-p (1 = off)", elem_id="gen-top-p")
            min_p = gr.Slider(0, 1, value=0.0, step=0.01, label="min-p (0 = off)", elem_id="gen-min-p")
            rep = gr.Slider(0.5, 2.0, value=1.0, step=0.05, label="repetition penalty (1 = off)", elem_id="gen-rep")
            seed = gr.Number(value=0, precision=0, label="seed", elem_id="gen-seed")
            seed_msg = V.field_message("gen-seed-msg")
            stop = gr.Textbox(label="stop strings (one per line, \\n for newline)", lines=2, elem_id="gen-stop")
            with gr.Row():
                go_btn = gr.Button("Generate", variant="primary", elem_id="gen-generate")
                stop_btn = gr.Button("Stop", elem_id="gen-stop-btn")
            gen_msg = V.field_message("gen-msg")  # the prompt, stop strings and anything else
        with gr.Column(scale=3):
            gr.Markdown("Tokens appear as they are generated, coloured by how likely the model found them. "
                        "Click a token to inspect that step.")
            out_text = gr.Textbox(label="generated text", lines=4, interactive=False, elem_id="gen-output")
            tokens = gr.HighlightedText(label="tokens (click one)", color_map=F.BUCKET_COLOURS, show_legend=True,
                                        combine_adjacent=False, elem_id="gen-tokens")
            status = gr.Markdown(elem_id="gen-status")
            color_by = gr.Radio(["prob", "entropy"], value="prob", label="timeline colour", elem_id="gen-colour-by")
            gr.Markdown("The timeline: one bar per step. Low bars (probability) or high bars (entropy) are where "
                        "the model was unsure and the sampling settings matter most.")
            timeline = gr.Plot(F.timeline_figure([]), label="timeline", elem_id="gen-timeline")
            with gr.Row():
                steps_btn = gr.Button("Download the steps (CSV + JSON)", size="sm", scale=0,
                                      elem_id="gen-steps-export")
                steps_files = gr.File(label="Steps", file_count="multiple", visible=False,
                                      elem_id="gen-steps-files")

    gr.Markdown("#### One step\nLeft: the model's top candidates before any filter (coloured by the filter that "
                "removed them). Right: the distribution the token was actually drawn from.")
    with gr.Row():
        step_sel = gr.Slider(0, 1, value=0, step=1, label="step", elem_id="gen-step")
        show_att = gr.Checkbox(value=True, label="show attention for the step (one extra forward pass)",
                               elem_id="gen-show-att")
    dist = gr.Plot(F.distribution_figure(None), elem_id="gen-dist")
    removed_md = gr.Markdown(elem_id="gen-removed")
    gr.Markdown("Attention: where the token that produced this step looked, layer by layer (mean over heads).")
    att_plot = gr.Plot(F.attention_figure(None, []), elem_id="gen-attention")

    gr.Markdown("#### N samples\nThe same prompt and settings drawn with consecutive seeds, side by side. "
                f"Greedy (temperature 0) gives the same text every time; raise the temperature for variety "
                f"(each sample at most {SAMPLE_TOKENS_CAP} tokens).")
    with gr.Row():
        n_samples = gr.Slider(2, MAX_SAMPLES, value=5, step=1, label="samples", elem_id="gen-n-samples")
        samples_btn = gr.Button("Draw samples", elem_id="gen-samples-btn")
    samples_df = gr.Dataframe(headers=["seed", "text", "tokens", "mean p", "finish"], interactive=False,
                              wrap=True, elem_id="gen-samples")
    samples_plot = gr.Plot(F.samples_figure([]), elem_id="gen-samples-plot")

    gr.Markdown("#### KV cache\nEach layer keeps the keys and values of every earlier token so a step only "
                "processes the newest one. Its size: 2 × layers × kv_heads × head_dim × tokens × bytes per value.")
    kv_plot = gr.Plot(F.kv_cache_figure(None), elem_id="gen-kv")
    kv_md = gr.Markdown(elem_id="gen-kv-md")
    with gr.Row():
        timing_btn = gr.Button("Time with vs without the cache (16 tokens)", elem_id="gen-timing-btn")
    timing_md = gr.Markdown(elem_id="gen-timing")

    # --- callbacks --------------------------------------------------------------------
    @endpoint(model=True)
    def run(model_name, prompt, chat, n_new, t, k, p, m, r, sd, stop_text, colour, request: gr.Request = None):
        yield from _run(model_name, prompt, chat, n_new, t, k, p, m, r, sd, stop_text, colour)

    def _msgs(problems: dict | None = None) -> tuple:
        """Updates for (gen_msg, topk_msg, seed_msg): each problem beside the control that caused
        it (what no control of its own has goes under the Generate button); none: all cleared."""
        problems = dict(problems or {})
        k_msg, seed_msg_ = problems.pop("top_k", None), problems.pop("seed", None)
        rest = " ".join(problems.values())
        return tuple(V.show(x) if x else V.clear() for x in (rest, k_msg, seed_msg_))

    def _run(model_name, prompt, chat, n_new, t, k, p, m, r, sd, stop_text, colour):
        keep = (gr.skip(),) * 12  # one per view: a refused request leaves the last generation on screen
        problems = _problems(t, k, p, m, r, sd)
        if problems:
            yield (*keep, *_msgs(problems))
            return
        lm = get_model(model_name)
        settings = _settings(t, k, p, m, r)
        steps_json: list[dict] = []
        gen = lab = None
        try:
            it = iter_generate(lm, prompt, max_new_tokens=n_new, settings=settings, seed=sd, chat=bool(chat),
                               stop=parse_stop(stop_text), max_prompt_tokens=max_prompt_tokens())
            for step, gen in it:
                if lab is None:
                    lab = _Labeller(lm.tokenizer, gen.prompt_ids)
                sj = step_to_json(lm, step)
                lab.add(sj)
                steps_json.append(sj)
                if not gen.finished:
                    lab.label(steps_json)
                    redraw = len(steps_json) % TIMELINE_EVERY == 1
                    yield (gen.text, _highlight(steps_json), f"Generating… {len(steps_json)} tokens",
                           F.timeline_figure(steps_json, colour) if redraw else gr.skip(),
                           gr.skip(), gr.skip(), gr.skip(), gr.skip(), gr.skip(), gr.skip(), gr.skip(), gr.skip(),
                           *(_msgs() if len(steps_json) == 1 else (gr.skip(),) * 3))
        except LmscopeError as e:
            # before the first token (an empty or too long prompt, a bad stop string): nothing shown
            # is lost; later, the tokens so far stay and the status says why it stopped
            field = V.field_of(e) or "prompt"
            if not steps_json:
                yield (*keep, *_msgs({field: str(e)}))
            else:
                yield (gr.skip(), gr.skip(), f"Stopped after {len(steps_json)} tokens: {e}", *keep[3:],
                       *_msgs({field: str(e)}))
            return
        if gen is None:
            yield ("", [], "Stopped before the first token.", F.timeline_figure([]), gr.skip(), gr.skip(),
                   gr.skip(), F.attention_figure(None, []), gr.skip(), gr.skip(), None, False, *_msgs())
            return
        lab.label(steps_json)
        gj = generation_to_json(lm, gen)
        st = _light_state(lm, gen, steps_json)
        last = max(0, len(steps_json) - 1)
        yield (gen.text, _highlight(steps_json), _status(gj, False), F.timeline_figure(steps_json, colour, 0),
               gr.update(minimum=0, maximum=max(1, last), value=0), F.distribution_figure(steps_json[0] if steps_json
                                                                                         else None),
               F.removed_summary(steps_json[0] if steps_json else None),
               F.attention_figure(None, [], hint="Working out where step 0 looked…"),
               F.kv_cache_figure(st["kv"], st["growth"]), _kv_markdown(st["kv"]), st, True, *_msgs())

    messages = [gen_msg, topk_msg, seed_msg]
    opening = gr.State(False)  # a generation just finished: show its first step with attention
    gen_outputs = [out_text, tokens, status, timeline, step_sel, dist, removed_md, att_plot, kv_plot, kv_md, state,
                   opening, *messages]
    gen_inputs = [shared.model, shared.prompt, shared.chat, max_new, temperature, top_k, top_p, min_p, rep, seed,
                  stop, color_by]
    gen_event = go_btn.click(run, gen_inputs, gen_outputs, concurrency_id="generate",
                             concurrency_limit=generate_concurrency(), api_name="generate")

    @endpoint(model=True)
    def show_step(i, st, colour, with_att, request: gr.Request = None):
        if not st or not st["steps"]:
            return F.distribution_figure(None), "", F.attention_figure(None, []), gr.skip()
        i = int(max(0, min(int(i or 0), len(st["steps"]) - 1)))
        step = st["steps"][i]
        att_fig = F.attention_figure(None, [], hint="Attention is off: tick “show attention for the step” above.")
        if with_att:
            lm = get_model(st["model"])
            try:
                a = step_attention(lm, st["ids"], step["position"]).float().mean(1)  # [layers, context]
            except LmscopeError as e:
                raise gr.Error(str(e)) from None
            # labelled over the whole text, so a character cut by the step boundary keeps its glyph
            labels = [t["display"] for t in describe_tokens(lm.tokenizer, st["ids"])][: step["position"]]
            att_fig = F.attention_figure(a.tolist(), labels, i, F.step_label(step))
        return (F.distribution_figure(step), F.removed_summary(step), att_fig,
                F.timeline_figure(st["steps"], colour, i))

    step_sel.release(show_step, [step_sel, state, color_by, show_att],
                                  [dist, removed_md, att_plot, timeline])
    @endpoint  # show_step holds the model slot
    def open_first_step(fresh, st, colour, with_att, request: gr.Request = None):
        if fresh is not True:  # a refused request: nothing new to open
            return gr.skip(), gr.skip(), gr.skip(), gr.skip(), gr.skip()
        return (*show_step(0, st, colour, with_att, request), False)

    # a finished generation opens at step 0 with its attention, never empty axes
    gen_event.success(open_first_step, [opening, state, color_by, show_att],
                      [dist, removed_md, att_plot, timeline, opening])
    show_att.change(show_step, [step_sel, state, color_by, show_att], [dist, removed_md, att_plot, timeline])

    @endpoint
    def pick_token(st, colour, with_att, evt: gr.SelectData, request: gr.Request = None):
        idx = evt.index if isinstance(evt.index, int) else (evt.index[0] if evt.index else 0)
        return (gr.update(value=idx), *show_step(idx, st, colour, with_att, request))

    tokens.select(pick_token, [state, color_by, show_att], [step_sel, dist, removed_md, att_plot, timeline])

    @endpoint
    def recolour(st, colour, i):
        return F.timeline_figure(st["steps"] if st else [], colour, int(i or 0))

    color_by.change(recolour, [state, color_by, step_sel], [timeline])

    @endpoint
    def export_steps(st):
        from app.context import scratch_dir
        from app.exports import write_generation

        if not isinstance(st, dict) or not st.get("steps"):
            raise gr.Error("Generate some text first; then its steps can be downloaded.")
        return gr.update(value=[str(p) for p in write_generation(st, scratch_dir("steps"))], visible=True)

    steps_btn.click(export_steps, [state], [steps_files])

    @endpoint(model=True)
    def samples(model_name, prompt, chat, n_new, t, k, p, m, r, sd, stop_text, n, request: gr.Request = None):
        problems = _problems(t, k, p, m, r, sd)
        if problems:  # the samples already drawn stay
            yield gr.skip(), gr.skip(), *_msgs(problems)
            return
        lm = get_model(model_name)
        settings = _settings(t, k, p, m, r)
        n = int(max(2, min(int(n or 2), MAX_SAMPLES)))
        base = int(sd or 0)
        rows, gens = [], []
        try:
            for j in range(n):
                gen = None
                for _, gen in iter_generate(lm, prompt, max_new_tokens=min(int(n_new or 1), SAMPLE_TOKENS_CAP),
                                            settings=settings, seed=base + j, chat=bool(chat),
                                            stop=parse_stop(stop_text)):
                    pass
                gj = generation_to_json(lm, gen)
                mean_p = sum(s["chosen"]["prob"] for s in gj["steps"]) / max(1, len(gj["steps"]))
                rows.append([base + j, gen.text, len(gen.token_ids), round(mean_p, 3), gen.finish_reason])
                gens.append({"seed": base + j, "steps": gj["steps"]})
                yield rows, gr.skip(), *(_msgs() if j == 0 else (gr.skip(),) * 3)
        except LmscopeError as e:
            if not rows:
                yield gr.skip(), gr.skip(), *_msgs({V.field_of(e) or "prompt": str(e)})
                return
            raise gr.Error(str(e)) from None
        if settings.greedy:
            gr.Info("Temperature 0 is greedy: every seed gives the same text.")
        distinct = len({row[1] for row in rows})
        rows.append(["", f"{distinct} distinct texts out of {len(rows)}", "", "", ""])
        yield rows, F.samples_figure(gens), *_msgs()

    samples_event = samples_btn.click(samples, gen_inputs[:-1] + [n_samples], [samples_df, samples_plot, *messages],
                                      api_name="sample")

    # Stop: cancelling closes the running generator, which ends generation at once (model_core
    # checks nothing more; the iterator is simply not advanced) and frees the model.
    stop_btn.click(None, None, None, cancels=[gen_event, samples_event])

    # --- the link: settings and chosen step mirrored into the URL, and read back on load ----------
    url_inputs = [shared.model, shared.prompt, shared.chat, max_new, temperature, top_k, top_p, min_p, rep, seed,
                  stop, step_sel]
    # written when the status or the chosen step's view changes (a .then after these events may
    # still read the values from before their outputs landed); status: a generation finished
    for comp in (status, dist):
        comp.change(None, url_inputs, None, js=GEN_URL_JS)
    if shared.page is not None:
        linked = gr.State(None)
        opened_tab = gr.Textbox(visible=False, elem_id="gen-opened-tab")

        @endpoint
        def gen_from_url(tab, request: gr.Request = None):
            q = dict(request.query_params) if request is not None else {}
            got = settings_from_url(q, cap, tab if isinstance(tab, str) else None)
            if got is None:
                return (*(gr.skip(),) * 8, None)
            return (got["gen_max"], got["gen_t"], got["gen_k"], got["gen_p"], got["gen_minp"], got["gen_rep"],
                    got["gen_seed"], got["gen_stop"], got)

        @endpoint(model=True)
        def gen_autorun(link, n_new, t, k, p, m, r, sd, stop_text, colour, request: gr.Request = None):
            """A link to a generation runs it on load with the link's own model, prompt and chat (the
            shared bar is filled by another load event at the same moment)."""
            if not isinstance(link, dict):
                yield (gr.skip(),) * len(gen_outputs)
                return
            from app.ui import EXAMPLE_PROMPT, model_names

            model_name = link.get("model") if link.get("model") in model_names() else shared.model.value
            prompt = link.get("prompt") if isinstance(link.get("prompt"), str) else EXAMPLE_PROMPT
            yield from _run(model_name, prompt, bool(link.get("chat")), n_new, t, k, p, m, r, sd, stop_text, colour)

        @endpoint
        def gen_open_linked_step(link, fresh, st, colour, with_att, request: gr.Request = None):
            if not isinstance(link, dict) or fresh is not True or not st:
                return (gr.skip(),) * 6
            step = link.get("gen_step")
            step = step if isinstance(step, int) and not isinstance(step, bool) else 0
            i = int(max(0, min(step, len(st["steps"]) - 1)))
            return (gr.update(value=i), *show_step(i, st, colour, with_att, request), False)

        shared.page.load(gen_from_url, [opened_tab], [max_new, temperature, top_k, top_p, min_p, rep, seed, stop, linked],
                         js="() => [window.lmscopeOpenTab || '']").then(
            gen_autorun, [linked, max_new, temperature, top_k, top_p, min_p, rep, seed, stop, color_by], gen_outputs,
            concurrency_id="generate", concurrency_limit=generate_concurrency()).then(
            gen_open_linked_step, [linked, opening, state, color_by, show_att],
            [step_sel, dist, removed_md, att_plot, timeline, opening])

    @endpoint(model=True)
    def timing(st, request: gr.Request = None):
        if not st:
            raise gr.Error("Generate something first: the timing uses the current prompt.")
        lm = get_model(st["model"])
        try:
            t = time_cache_vs_no_cache(lm, st["ids"][: st["prompt_len"]], new_tokens=16)
        except LmscopeError as e:
            raise gr.Error(str(e)) from None
        return (f"16 new tokens after a {t['prompt_tokens']}-token prompt: **{t['with_cache_s'] * 1000:.0f} ms with "
                f"the cache** ({t['with_cache_tok_s']:.1f} tokens/s) vs **{t['without_cache_s'] * 1000:.0f} ms "
                f"without** ({t['without_cache_tok_s']:.1f} tokens/s): {t['speedup']:.1f}× faster with it. "
                f"Without the cache every step re-processes the whole sequence. Same tokens both ways: "
                f"{'yes' if t['same_tokens'] else 'no'}.")

    timing_btn.click(timing, [state], [timing_md])

    from app import decoding_panel  # beam / diverse / contrastive search: its own accordion and controls

    decoding_panel.build(shared)


def demo() -> gr.Blocks:
    """Standalone page with just this tab (development and browser tests)."""
    from app.context import default_model

    with gr.Blocks(title="lmscope · generation") as d:
        model = gr.Dropdown([default_model(), "random-llama-tiny"], value=default_model(), label="model",
                            elem_id="model")
        prompt = gr.Textbox(value="The capital of France is", label="prompt", elem_id="prompt")
        chat = gr.Checkbox(value=False, label="chat template", elem_id="chat")
        with gr.Tab("Generate"):
            build(Shared(model=model, prompt=prompt, chat=chat))
    return d


if __name__ == "__main__":
    import os

    demo().queue().launch(server_name="127.0.0.1", server_port=int(os.environ.get("PORT", "7861")), show_error=True)
