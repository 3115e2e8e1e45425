"""Generation lab tab: token-by-token generation with live sampling settings, every step's
distribution before and after the filters, N samples side by side, and the KV cache.

`build(shared)` is called inside an open `gr.Tab`. All heavy lifting is model_core.serving.generate;
figures come from app.tabs.generate.figures (pure functions)."""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Iterator

import gradio as gr
import orjson
from gradio.components.plot import PlotData

from app.shared import validation as V
from app.shared.context import (
    Shared,
    endpoint,
    generate_concurrency,
    generation_steps,
    get_model,
    max_prompt_tokens,
)
from app.shared.page_js import page_js
from app.tabs.generate import figures as F
from model_core.core.errors import LmscopeError
from model_core.core.sampling import SamplingSettings
from model_core.core.tokenization import (
    continuation_display,
    describe_raw,
    describe_tokens,
    pending_bytes,
    token_bytes,
)
from model_core.serving.generate import (
    check_seed,
    generate,
    generation_to_json,
    kv_cache_growth,
    max_new_tokens_cap,
    step_attention,
    step_to_json,
    time_cache_vs_no_cache,
)
from model_core.serving.generation_request import GenerateRequest

MAX_SAMPLES = 8
SAMPLE_TOKENS_CAP = 64  # each of the N samples is at most this long (N x tokens of CPU time)
TIMELINE_EVERY = 4  # redraw the timeline every few streamed updates (and at the end)
STREAM_EVERY_S = 0.1  # streamed updates at most this often (text, chips; the timeline every TIMELINE_EVERY)
# All generations together send at most this many streamed updates per second: each costs the web
# process's one interpreter ~3 ms (an H200 serving 32 users over HTTP: 1.0 core busy, 2.2 ms of it
# per generated token, the model process idle at 0.13 core), so with many streaming at once each
# one's updates come less often instead of every user's generation waiting on the interpreter.
STREAM_UPDATES_PER_S = 40


class _StreamPace:
    """How many generations are streaming now, and how long each waits between its updates."""

    def __init__(self):
        self.streaming = 0
        self._lock = threading.Lock()

    def __enter__(self):
        with self._lock:
            self.streaming += 1
        return self

    def __exit__(self, *exc):
        with self._lock:
            self.streaming -= 1

    def interval(self) -> float:
        return max(STREAM_EVERY_S, self.streaming / STREAM_UPDATES_PER_S)


_PACE = _StreamPace()


def parse_stop(text: str | None) -> list[str]:
    r"""One stop string per line; `\n` and `\t` are written as escapes."""
    if not text:
        return []
    return [line.replace("\\n", "\n").replace("\\t", "\t") for line in text.split("\n") if line != ""]


def _timeline(steps: list[dict], colour, selected: int | None = None):
    """The timeline as the Plot's payload, its figure dict serialized by orjson: a plotly Figure and
    its to_json cost ~4 ms of the web process's interpreter per redraw of 256 bars on the CPU, this
    ~0.8 ms (tests/unit/test_generate_figures.py: the same JSON as the figure's)."""
    if not steps:
        return F.timeline_figure([])
    return _sent(F.timeline_spec(steps, colour, selected))


def _sent(spec: dict) -> PlotData:
    """A figure dict as the Plot's payload, serialized by orjson (no plotly Figure, no to_json)."""
    return PlotData(type="plotly", plot=orjson.dumps(spec).decode())


def _distribution(step: dict | None):
    """A step's distribution chart as the Plot's payload, serialized as the timeline is."""
    return _sent(F.distribution_spec(step)) if step else F.distribution_figure(None)


def _kv_cache(report: dict | None, growth: dict | None):
    """The KV-cache chart as the Plot's payload, likewise."""
    return _sent(F.kv_cache_spec(report, growth)) if report else F.kv_cache_figure(None)


@functools.cache
def _finding_step_zero() -> PlotData:
    """The attention plot's hint while step 0's forward runs, serialized once: it is the same at the
    end of every generation (~1 ms of the web process to build and serialize again each time)."""
    return PlotData(type="plotly", plot=F.attention_figure(None, [], hint="Working out where step 0 looked…").to_json())


def _highlight(steps: list[dict]) -> list[tuple[str, str]]:
    return [(F.step_label(s), F.prob_bucket(s["chosen"]["prob"])) for s in steps]


def _problems(t, k, p, m, r, sd, pp=0.0, fp=0.0) -> dict[str, str]:
    """{setting: one sentence} for every bad sampling setting or seed; empty when all are fine."""
    _, problems = V.check_settings(t, k, p, m, r)
    for name, value in (("presence_penalty", pp), ("frequency_penalty", fp)):
        try:
            SamplingSettings.from_values(**{name: value})
        except LmscopeError as e:
            problems[name] = str(e)
    try:
        check_seed(sd)
    except LmscopeError as e:
        problems["seed"] = str(e)
    return problems


class _Labeller:
    """Generated tokens as people should see them while they stream: a character spelled by
    several byte tokens is labelled "glyph·k/n" on each of them (model_core.core.tokenization), and a
    step's candidates that finish a character the text so far left open show it ("…မ")."""

    def __init__(self, tokenizer, prompt_ids):
        self.tok = tokenizer
        self.raws: list[bytes] = []
        self.ids: list[int] = []
        self.context = [token_bytes(tokenizer, i) for i in list(prompt_ids)[-4:]]
        self.settled = 0  # steps before this one keep their labels (see label)

    def add(self, step: dict) -> None:
        pending = pending_bytes(self.context + self.raws[-4:])  # the tail only: a step is O(1), not O(steps)
        if pending:  # the model is in the middle of a character: say which one each candidate makes
            step["pending"] = pending.hex(" ").upper()
            for c in step["top_before"] + step["top_after"]:
                c["token"] = continuation_display(pending, token_bytes(self.tok, c["id"]))
        cid = int(step["chosen"]["id"])
        self.ids.append(cid)
        self.raws.append(token_bytes(self.tok, cid))

    def label(self, steps: list[dict]) -> None:
        """Labels the steps from the last settled one on. Appended text can only extend the last
        character (grapheme clusters grow at the end), and the bytes of a character still open at the
        end may yet make one with it (a combining mark) or with each other; every span before those is
        final and is not described again at each streamed update (that made labelling quadratic)."""
        start = self.settled
        raws = self.raws[start:]
        rows = describe_raw(self.ids[start:], raws)
        for step, row in zip(steps[start:], rows):
            step["chosen"]["label"] = row["display"]
            step["chosen"]["bytes"] = row["bytes"]
        first_open, still_open = len(raws), len(pending_bytes(self.context + self.raws[-4:]))
        while still_open > 0 and first_open > 0:  # the tokens holding the open character's bytes
            first_open -= 1
            still_open -= len(raws[first_open])
        if first_open > 0:  # from the span of the last finished character on, all may still change
            self.settled = start + rows[first_open - 1]["span"][0]


def _status(gen) -> str:
    """One line about a finished generation: how many tokens, why it ended, its speed."""
    why = {"length": "reached max new tokens", "eos": "the model ended its text (EOS)",
           "stop_string": f"stop string {gen.stop_string!r} appeared",
           "cancelled": "stopped", "context_full": "the model's context is full"}.get(gen.finish_reason,
                                                                                   gen.finish_reason)
    return (f"**{len(gen.token_ids)} tokens**, finished because {why}. {gen.tokens_per_second:.1f} tokens/s "
            f"(prompt: {len(gen.prompt_ids)} tokens, {gen.prefill_seconds * 1000:.0f} ms).")


def _kv_markdown(kv: dict | None) -> str:
    if not kv:
        return ""
    if kv["measured_total"] == kv["formula_total"]:
        ok = "equal"
    elif kv["measured_total"] > kv["formula_total"]:  # the engine's slots on a sliding-window model
        ok = ("differ: the formula keeps only the last window-1 tokens on sliding-window layers, as transformers' "
              "own cache does; this server's engine keeps every position there and masks the far past")
    else:
        ok = "differ (sliding-window layers keep fewer tokens)"
    return (f"Formula: **{kv['expression']} = {kv['formula_total']:,} B**; measured key/value tensors: "
            f"**{kv['measured_total']:,} B** ({ok}). That is {kv['bytes_per_token']:,} B per token in "
            f"{kv['bytes_per_value'] * 8}-bit values.")


# Generate's settings and chosen step in the page URL (issue 15 item 5), beside the shared model /
# prompt / chat keys: a link with ?tab=generate&gen_max=... generates the same text (greedy, or the
# same seed) and opens the same step.
GEN_URL_KEYS = ["gen_max", "gen_t", "gen_k", "gen_p", "gen_minp", "gen_rep", "gen_seed", "gen_stop", "gen_step",
                "gen_pres", "gen_freq"]
GEN_URL_JS = page_js("generate_url", KEYS=repr(GEN_URL_KEYS))
TIMELINE_CLICK_JS = page_js("generate_timeline_click")  # a timeline bar's click -> #gen-step-click
# (key, default, lowest, highest) of each number the link may carry; None: no bound
_GEN_NUMBERS = [("gen_t", 0.0, 0.0, 2.0), ("gen_k", 0, None, None), ("gen_p", 1.0, 0.01, 1.0),
                ("gen_minp", 0.0, 0.0, 1.0), ("gen_rep", 1.0, 0.5, 2.0), ("gen_seed", 0, None, None),
                ("gen_pres", 0.0, -2.0, 2.0), ("gen_freq", 0.0, -2.0, 2.0)]


def settings_from_url(query: dict, cap: int, opened_tab: str | None = None) -> dict | None:
    """A link's Generate settings, each clamped into its control's range (a bad top-k or seed is
    kept as written: the run then says so beside that control), or None when the link has none or
    opens another tab. `opened_tab`: the link's ?tab= as the page read it before its first tab's
    select rewrote the URL (app/server/page.py HEAD_JS); the server may see the rewritten one."""
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


class GenerateTab:
    """The tab's components, and its callbacks as named methods that answer {component: value}
    dicts: a component a callback leaves out keeps what it shows (a refused request leaves the last
    generation on screen)."""

    def __init__(self, shared: Shared):
        self.shared = shared
        self.cap = max_new_tokens_cap()
        self.state = gr.State(None)  # per user: the last generation (ids, step records, KV report)
        self.opening = gr.State(False)  # a generation just finished: show its first step with attention
        gr.Markdown(
            "### Generation lab\nThe model writes one token at a time. At every step it gives a probability to "
            "every token; the sampling settings reshape and cut that distribution, then one token is picked."
        )
        with gr.Row():
            self._settings_column()
            self._output_column()
        self._step_section()
        from app.tabs.generate import step_graph_panel  # the step's attribution graph, under its record

        step_graph_panel.build(self)
        self._samples_section()
        self._kv_section()
        self.messages = [self.gen_msg, self.topk_msg, self.seed_msg]
        # every view a generation fills, then the messages: the public /generate endpoint's outputs
        self.gen_outputs = [self.out_text, self.tokens, self.status, self.timeline, self.step_sel, self.dist,
                            self.removed_md, self.att_plot, self.kv_plot, self.kv_md, self.state, self.opening,
                            *self.messages]
        self.step_outputs = [self.dist, self.removed_md, self.att_plot, self.timeline]
        self.gen_inputs = [shared.model, shared.prompt, shared.chat, self.max_new, self.temperature, self.top_k,
                           self.top_p, self.min_p, self.rep, self.seed, self.stop, self.color_by,
                           self.presence, self.frequency]  # the penalties last: older API calls still fit
        self._wire()

    # --- layout ------------------------------------------------------------------------------
    def _settings_column(self) -> None:
        with gr.Column(scale=1, min_width=260):
            self.max_new = gr.Slider(1, self.cap, value=min(32, self.cap), step=1, label="max new tokens",
                                     elem_id="gen-max-new")
            self.temperature = gr.Slider(0, 2, value=0.0, step=0.05, label="temperature (0 = greedy)",
                                         elem_id="gen-temperature")
            self.top_k = gr.Number(value=0, precision=0, label="top-k (0 = off)", elem_id="gen-top-k")
            self.topk_msg = V.field_message("gen-top-k-msg")
            self.top_p = gr.Slider(0.01, 1, value=1.0, step=0.01, label="top-p (1 = off)", elem_id="gen-top-p")
            self.min_p = gr.Slider(0, 1, value=0.0, step=0.01, label="min-p (0 = off)", elem_id="gen-min-p")
            self.rep = gr.Slider(0.5, 2.0, value=1.0, step=0.05, label="repetition penalty (1 = off)", elem_id="gen-rep")
            # OpenAI's, over the generated tokens only: logit - presence * [count > 0] - frequency * count
            self.presence = gr.Slider(-2.0, 2.0, value=0.0, step=0.05, label="presence penalty (0 = off)",
                                      elem_id="gen-presence")
            self.frequency = gr.Slider(-2.0, 2.0, value=0.0, step=0.05, label="frequency penalty (0 = off)",
                                       elem_id="gen-frequency")
            self.seed = gr.Number(value=0, precision=0, label="seed", elem_id="gen-seed")
            self.seed_msg = V.field_message("gen-seed-msg")
            self.stop = gr.Textbox(label="stop strings (one per line, \\n for newline)", lines=2, elem_id="gen-stop")
            with gr.Row():
                self.go_btn = gr.Button("Generate", variant="primary", elem_id="gen-generate")
                self.stop_btn = gr.Button("Stop", elem_id="gen-stop-btn")
            self.gen_msg = V.field_message("gen-msg")  # the prompt, stop strings and anything else

    def _output_column(self) -> None:
        with gr.Column(scale=3):
            gr.Markdown("Tokens appear as they are generated, coloured by how likely the model found them. "
                        "Click a token to inspect that step.")
            self.out_text = gr.Textbox(label="generated text", lines=4, interactive=False, elem_id="gen-output")
            self.tokens = gr.HighlightedText(label="tokens (click one)", color_map=F.BUCKET_COLOURS,
                                             show_legend=True, combine_adjacent=False, elem_id="gen-tokens")
            self.status = gr.Markdown(elem_id="gen-status")
            self.color_by = gr.Radio(["prob", "entropy"], value="prob", label="timeline colour",
                                     elem_id="gen-colour-by")
            gr.Markdown("The timeline: one bar per step. Low bars (probability) or high bars (entropy) are where "
                        "the model was unsure and the sampling settings matter most.")
            self.timeline = gr.Plot(F.timeline_figure([]), label="timeline", elem_id="gen-timeline")
            # "step:n" from TIMELINE_CLICK_JS when a bar is clicked (n makes each click a change)
            self.step_click = gr.Textbox(visible="hidden", elem_id="gen-step-click", label="timeline click")
            with gr.Row():
                self.steps_btn = gr.Button("Download the steps (CSV + JSON)", size="sm", scale=0,
                                           elem_id="gen-steps-export")
                self.steps_files = gr.File(label="Steps", file_count="multiple", visible=False,
                                           elem_id="gen-steps-files")

    def _step_section(self) -> None:
        gr.Markdown("#### One step\nLeft: the model's top candidates before any filter (coloured by the filter "
                    "that removed them). Right: the distribution the token was actually drawn from.")
        with gr.Row():
            self.step_sel = gr.Slider(0, 1, value=0, step=1, label="step", elem_id="gen-step")
            self.show_att = gr.Checkbox(value=True, label="show attention for the step (one extra forward pass)",
                                        elem_id="gen-show-att")
        self.dist = gr.Plot(F.distribution_figure(None), elem_id="gen-dist")
        self.removed_md = gr.Markdown(elem_id="gen-removed")
        gr.Markdown("Attention: where the token that produced this step looked, layer by layer (mean over heads).")
        self.att_plot = gr.Plot(F.attention_figure(None, []), elem_id="gen-attention")

    def _samples_section(self) -> None:
        gr.Markdown("#### N samples\nThe same prompt and settings drawn with consecutive seeds, side by side. "
                    f"Greedy (temperature 0) gives the same text every time; raise the temperature for variety "
                    f"(each sample at most {SAMPLE_TOKENS_CAP} tokens).")
        with gr.Row():
            self.n_samples = gr.Slider(2, MAX_SAMPLES, value=5, step=1, label="samples", elem_id="gen-n-samples")
            self.samples_btn = gr.Button("Draw samples", elem_id="gen-samples-btn")
        self.samples_df = gr.Dataframe(headers=["seed", "text", "tokens", "mean p", "finish"], interactive=False,
                                       wrap=True, elem_id="gen-samples")
        self.samples_plot = gr.Plot(F.samples_figure([]), elem_id="gen-samples-plot")
        with gr.Row():
            self.samples_export_btn = gr.Button("Download the samples (CSV + JSON)", size="sm", scale=0,
                                                elem_id="gen-samples-export")
            self.samples_files = gr.File(label="Samples", file_count="multiple", visible=False,
                                         elem_id="gen-samples-files")

    def _kv_section(self) -> None:
        gr.Markdown("#### KV cache\nEach layer keeps the keys and values of every earlier token so a step only "
                    "processes the newest one. Its size: 2 × layers × kv_heads × head_dim × tokens × bytes per "
                    "value.")
        self.kv_plot = gr.Plot(F.kv_cache_figure(None), elem_id="gen-kv")
        self.kv_md = gr.Markdown(elem_id="gen-kv-md")
        with gr.Row():
            self.timing_btn = gr.Button("Time with vs without the cache (16 tokens)", elem_id="gen-timing-btn")
        self.timing_md = gr.Markdown(elem_id="gen-timing")

    # --- events --------------------------------------------------------------------------------
    def _wire(self) -> None:
        step_inputs = [self.state, self.color_by, self.show_att]
        gen_event = self.go_btn.click(self.run, self.gen_inputs, self.gen_outputs, concurrency_id="generate",
                                      concurrency_limit=generate_concurrency(), api_name="generate")
        # a finished generation opens at step 0 with its attention, never empty axes
        gen_event.success(self.open_first_step, [self.opening, *step_inputs], [*self.step_outputs, self.opening])
        self.step_sel.release(self.show_step, [self.step_sel, *step_inputs], self.step_outputs)
        self.show_att.change(self.show_step, [self.step_sel, *step_inputs], self.step_outputs)
        self.tokens.select(self.pick_token, step_inputs, [self.step_sel, *self.step_outputs])
        self.step_click.input(self.click_step, [self.step_click, *step_inputs], [self.step_sel, *self.step_outputs])
        self.color_by.change(self.recolour, [self.state, self.color_by, self.step_sel], [self.timeline])
        self.steps_btn.click(self.export_steps, [self.state], [self.steps_files])
        samples_event = self.samples_btn.click(self.samples, [*self.gen_inputs[:11], self.n_samples,
                                                              self.presence, self.frequency],
                                               [self.samples_df, self.samples_plot, *self.messages],
                                               api_name="sample")
        # Stop: cancelling closes the running generator, which ends generation at once (model_core
        # checks nothing more; the iterator is simply not advanced) and frees the model.
        self.stop_btn.click(None, None, None, cancels=[gen_event, samples_event])
        self.samples_export_btn.click(self.export_samples, [self.samples_df, self.shared.model, self.shared.prompt],
                                      [self.samples_files])
        self._wire_link()
        self.timing_btn.click(self.timing, [self.state], [self.timing_md])

        from app.tabs.generate import (
            decoding_panel,  # beam / diverse / contrastive search: its own accordion and controls
        )

        decoding_panel.build(self.shared)

        from app.tabs.generate import (
            steering_panel,  # a steering vector: steered vs unsteered, and an alpha sweep
        )

        steering_panel.build(self.shared, self)

        from app.tabs.generate import (
            feature_clamp_panel,  # one autoencoder feature clamped: clamped vs as it runs
        )

        feature_clamp_panel.build(self.shared, self)

        from app.tabs.generate import (
            speculative_panel,  # a draft's proposals checked k at a time, beside plain greedy
        )

        speculative_panel.build(self.shared)

        from app.tabs.generate import dola_panel  # the final layer contrasted with an earlier one

        dola_panel.build(self.shared)

    def _wire_link(self) -> None:
        """The link: settings and chosen step mirrored into the URL, and read back on load."""
        shared = self.shared
        url_inputs = [shared.model, shared.prompt, shared.chat, self.max_new, self.temperature, self.top_k,
                      self.top_p, self.min_p, self.rep, self.seed, self.stop, self.step_sel, self.presence,
                      self.frequency]
        # written when the status or the chosen step's view changes (a .then after these events may
        # still read the values from before their outputs landed); status: a generation finished
        for comp in (self.status, self.dist):
            comp.change(None, url_inputs, None, js=GEN_URL_JS)
        if shared.page is None:
            return
        shared.page.load(None, None, None, js=TIMELINE_CLICK_JS)
        self.linked = gr.State(None)
        opened_tab = gr.Textbox(visible=False, elem_id="gen-opened-tab")
        controls = [self.max_new, self.temperature, self.top_k, self.top_p, self.min_p, self.rep, self.seed,
                    self.stop, self.presence, self.frequency]
        shared.page.load(self.gen_from_url, [opened_tab], [*controls, self.linked],
                         js=page_js("opened_tab")).then(
            self.gen_autorun, [self.linked, *controls[:-2], self.color_by, *controls[-2:]], self.gen_outputs,
            concurrency_id="generate", concurrency_limit=generate_concurrency()).then(
            self.gen_open_linked_step, [self.linked, self.opening, self.state, self.color_by, self.show_att],
            [self.step_sel, *self.step_outputs, self.opening])

    # --- callbacks -----------------------------------------------------------------------------
    def _messages(self, problems: dict | None = None) -> dict:
        """Each problem beside the control that caused it (what no control of its own has goes under
        the Generate button); none: every message cleared."""
        problems = dict(problems or {})
        shown = {self.topk_msg: problems.pop("top_k", None), self.seed_msg: problems.pop("seed", None)}
        shown[self.gen_msg] = " ".join(problems.values())
        return {c: V.show(x) if x else V.clear() for c, x in shown.items()}

    @endpoint(model=True)
    def run(self, model_name, prompt, chat, n_new, t, k, p, m, r, sd, stop_text, colour, pp=0.0, fp=0.0,
            request: gr.Request = None):
        yield from self._generation(model_name, prompt, chat, n_new, t, k, p, m, r, sd, stop_text, colour, pp, fp)

    def _generation(self, model_name, prompt, chat, n_new, t, k, p, m, r, sd, stop_text, colour,
                    pp=0.0, fp=0.0) -> Iterator[dict]:
        """Generate, streaming the text and tokens (the timeline every few steps), then every view of
        the finished generation. A refused request (a bad setting, an empty or too long prompt, a bad
        stop string) changes only the messages; one that fails later keeps its tokens and says why."""
        problems = _problems(t, k, p, m, r, sd, pp, fp)
        if problems:
            yield self._messages(problems)
            return
        lm = get_model(model_name)
        settings = SamplingSettings.from_values(t, k, p, m, r, presence_penalty=pp, frequency_penalty=fp)
        steps_json: list[dict] = []
        pending: list = []  # steps not turned into JSON yet
        gen = lab = None
        last_yield, updates = 0.0, 0

        def flush():
            nonlocal lab
            for step in pending:
                lab = lab or _Labeller(lm.tokenizer, gen.prompt_ids)
                sj = step_to_json(lm, step)
                lab.add(sj)
                steps_json.append(sj)
            pending.clear()

        try:
            request = GenerateRequest(prompt=prompt, max_new_tokens=n_new, settings=settings, seed=sd,
                                      chat=bool(chat), stop=parse_stop(stop_text), max_prompt_tokens=max_prompt_tokens())
            with _PACE:
                for step, gen in generation_steps(lm, request):
                    pending.append(step)
                    # this thread's Python (step JSON, text, chips) holds the GIL that the engine thread's
                    # decode step needs: do it in batches, at most every _PACE.interval() (docs/PERFORMANCE.md)
                    if not gen.finished and time.monotonic() - last_yield >= _PACE.interval():
                        flush()
                        last_yield = time.monotonic()
                        yield self._streaming(steps_json, gen, lab, colour, timeline=updates % TIMELINE_EVERY == 0,
                                              first=updates == 0)
                        updates += 1
        except LmscopeError as e:
            flush()
            out = self._messages({V.field_of(e) or "prompt": str(e)})
            if steps_json:
                out[self.status] = f"Stopped after {len(steps_json)} tokens: {e}"
            yield out
            return
        flush()
        yield self._finished(lm, gen, steps_json, lab, colour)

    def _streaming(self, steps_json: list[dict], gen, lab: _Labeller, colour, timeline: bool = True,
                   first: bool = False) -> dict:
        lab.label(steps_json)
        out = {self.out_text: gen.text, self.tokens: _highlight(steps_json),
               self.status: f"Generating… {len(steps_json)} tokens"}
        if timeline:
            out[self.timeline] = _timeline(steps_json, colour)
        if first:  # clears what an earlier run left; only once: each is a real update, which Gradio
            out.update(self._messages())  # rebuilds for the session (~1 ms of the event loop each)
        return out

    def _finished(self, lm, gen, steps_json: list[dict], lab: _Labeller | None, colour) -> dict:
        if gen is None:
            return {self.out_text: "", self.tokens: [], self.status: "Stopped before the first token.",
                    self.timeline: F.timeline_figure([]), self.att_plot: F.attention_figure(None, []),
                    self.state: None, self.opening: False, **self._messages()}
        lab.label(steps_json)
        st = _light_state(lm, gen, steps_json)
        first = steps_json[0] if steps_json else None
        return {self.out_text: gen.text, self.tokens: _highlight(steps_json), self.status: _status(gen),
                self.timeline: _timeline(steps_json, colour, 0),
                self.step_sel: gr.update(minimum=0, maximum=max(1, len(steps_json) - 1), value=0),
                self.dist: _distribution(first), self.removed_md: F.removed_summary(first),
                self.att_plot: _finding_step_zero(),
                self.kv_plot: _kv_cache(st["kv"], st["growth"]), self.kv_md: _kv_markdown(st["kv"]),
                self.state: st, self.opening: True, **self._messages()}

    @endpoint(model=True)
    def show_step(self, i, st, colour, with_att, request: gr.Request = None) -> dict:
        """Step i: its distribution, what the filters removed, its attention (one forward pass) and the
        timeline marking it."""
        if not st or not st["steps"]:
            return {self.dist: F.distribution_figure(None), self.removed_md: "",
                    self.att_plot: F.attention_figure(None, [])}
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
        return {self.dist: _distribution(step), self.removed_md: F.removed_summary(step),
                self.att_plot: att_fig, self.timeline: _timeline(st["steps"], colour, i)}

    @endpoint  # show_step holds the model slot
    def open_first_step(self, fresh, st, colour, with_att, request: gr.Request = None):
        if fresh is not True:  # a refused request: nothing new to open
            return gr.skip()
        return {**self.show_step(0, st, colour, with_att, request), self.opening: False}

    @endpoint  # show_step holds the model slot
    def pick_token(self, st, colour, with_att, evt: gr.SelectData, request: gr.Request = None) -> dict:
        idx = evt.index if isinstance(evt.index, int) else (evt.index[0] if evt.index else 0)
        return {self.step_sel: gr.update(value=idx), **self.show_step(idx, st, colour, with_att, request)}

    @endpoint  # show_step holds the model slot
    def click_step(self, click, st, colour, with_att, request: gr.Request = None) -> dict:
        """A timeline bar clicked (TIMELINE_CLICK_JS sends "step:n"): that step, as a token click."""
        try:
            idx = int(str(click).split(":")[0])
        except ValueError:
            return gr.skip()
        return {self.step_sel: gr.update(value=idx), **self.show_step(idx, st, colour, with_att, request)}

    @endpoint
    def recolour(self, st, colour, i):
        return _timeline(st["steps"] if st else [], colour, int(i or 0))

    @endpoint
    def export_steps(self, st):
        from app.shared.context import scratch_dir
        from app.shared.exports import write_generation

        if not isinstance(st, dict) or not st.get("steps"):
            raise gr.Error("Generate some text first; then its steps can be downloaded.")
        return gr.update(value=[str(p) for p in write_generation(st, scratch_dir("steps"))], visible=True)

    @endpoint
    def export_samples(self, table, model_name, prompt):
        """samples.csv and samples.json of the samples table as shown (app/exports.write_samples)."""
        from app.shared.context import scratch_dir
        from app.shared.exports import samples_rows, write_samples

        try:
            drawn = samples_rows(table)[0] if isinstance(table, (list, dict)) or hasattr(table, "columns") else []
        except (TypeError, ValueError, KeyError):
            drawn = []  # not a table this page drew
        if not drawn:
            raise gr.Error("Draw some samples first; then they can be downloaded.")
        meta = {"model": model_name if isinstance(model_name, str) else None,
                "prompt": prompt if isinstance(prompt, str) else None}
        return gr.update(value=[str(p) for p in write_samples(table, scratch_dir("samples"), meta)], visible=True)

    @endpoint(model=True)
    def samples(self, model_name, prompt, chat, n_new, t, k, p, m, r, sd, stop_text, n, pp=0.0, fp=0.0,
                request: gr.Request = None):
        """N samples with consecutive seeds, a row each as it comes; the figure at the end."""
        problems = _problems(t, k, p, m, r, sd, pp, fp)
        if problems:  # the samples already drawn stay
            yield self._messages(problems)
            return
        lm = get_model(model_name)
        settings = SamplingSettings.from_values(t, k, p, m, r, presence_penalty=pp, frequency_penalty=fp)
        n = int(max(2, min(int(n or 2), MAX_SAMPLES)))
        base = int(sd or 0)
        rows, gens = [], []
        try:
            for j in range(n):
                gen = generate(lm, prompt, max_new_tokens=min(int(n_new or 1), SAMPLE_TOKENS_CAP), settings=settings,
                               seed=base + j, chat=bool(chat), stop=parse_stop(stop_text))
                gj = generation_to_json(lm, gen)
                mean_p = sum(s["chosen"]["prob"] for s in gj["steps"]) / max(1, len(gj["steps"]))
                rows.append([base + j, gen.text, len(gen.token_ids), round(mean_p, 3), gen.finish_reason])
                gens.append({"seed": base + j, "steps": gj["steps"]})
                yield {self.samples_df: rows, **(self._messages() if j == 0 else {})}
        except LmscopeError as e:
            if not rows:
                yield self._messages({V.field_of(e) or "prompt": str(e)})
                return
            raise gr.Error(str(e)) from None
        if settings.greedy:
            gr.Info("Temperature 0 is greedy: every seed gives the same text.")
        distinct = len({row[1] for row in rows})
        rows.append(["", f"{distinct} distinct texts out of {len(rows)}", "", "", ""])
        yield {self.samples_df: rows, self.samples_plot: F.samples_figure(gens), **self._messages()}

    @endpoint
    def gen_from_url(self, tab, request: gr.Request = None) -> dict:
        q = dict(request.query_params) if request is not None else {}
        got = settings_from_url(q, self.cap, tab if isinstance(tab, str) else None)
        if got is None:
            return {self.linked: None}
        return {self.max_new: got["gen_max"], self.temperature: got["gen_t"], self.top_k: got["gen_k"],
                self.top_p: got["gen_p"], self.min_p: got["gen_minp"], self.rep: got["gen_rep"],
                self.seed: got["gen_seed"], self.stop: got["gen_stop"], self.presence: got["gen_pres"],
                self.frequency: got["gen_freq"], self.linked: got}

    @endpoint(model=True)
    def gen_autorun(self, link, n_new, t, k, p, m, r, sd, stop_text, colour, pp=0.0, fp=0.0,
                    request: gr.Request = None):
        """A link to a generation runs it on load with the link's own model, prompt and chat (the
        shared bar is filled by another load event at the same moment)."""
        if not isinstance(link, dict):
            yield gr.skip()
            return
        from app.shared.context import EXAMPLE_PROMPT, model_names

        model_name = link.get("model") if link.get("model") in model_names() else self.shared.model.value
        prompt = link.get("prompt") if isinstance(link.get("prompt"), str) else EXAMPLE_PROMPT
        yield from self._generation(model_name, prompt, bool(link.get("chat")), n_new, t, k, p, m, r, sd, stop_text,
                                    colour, pp, fp)

    @endpoint  # show_step holds the model slot
    def gen_open_linked_step(self, link, fresh, st, colour, with_att, request: gr.Request = None):
        if not isinstance(link, dict) or fresh is not True or not st:
            return gr.skip()
        step = link.get("gen_step")
        step = step if isinstance(step, int) and not isinstance(step, bool) else 0
        i = int(max(0, min(step, len(st["steps"]) - 1)))
        return {self.step_sel: gr.update(value=i), **self.show_step(i, st, colour, with_att, request),
                self.opening: False}

    @endpoint(model=True)
    def timing(self, st, request: gr.Request = None) -> str:
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


def build(shared: Shared) -> GenerateTab:
    return GenerateTab(shared)


def demo() -> gr.Blocks:
    """Standalone page with just this tab (development and browser tests)."""
    from app.shared.context import default_model

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
