"""The Blocks layout: header, the shared model/prompt bar, one tab per view. Callbacks live in the
tab modules; this file only arranges them and keeps the view state in the URL."""

from __future__ import annotations

import html
import importlib
import importlib.util

import gradio as gr

from app.server.api import harden
from app.server.narrow import NARROW_JS
from app.shared.context import (
    EXAMPLE_PROMPT,
    Shared,
    default_model,
    echo,
    endpoint,
    finetuned_choices,
    get_model,
    max_prompt_tokens,
    max_text_chars,
    model_choices,
    model_names,
)
from app.shared.page_js import head_script, page_js
from app.shared.trace_store import STORE
from app.tabs.explore import tab as explore_tab
from app.tabs.explore.views import SCALES

# Optional tabs: (module, title). Each module exposes build(shared).
OTHER_TABS = [("app.tabs.generate.tab", "Generate"), ("app.tabs.interventions.tab", "Interventions"),
              ("app.tabs.anatomy.tab", "Anatomy"), ("app.tabs.finetune.tab", "Fine-tune"), ("app.tabs.jobs.tab", "Jobs")]

# Everything a teammate needs to reproduce a view, mirrored into the page URL.
URL_KEYS = ["model", "prompt", "chat", "layer", "head", "query", "temperature", "top_k", "top_p", "min_p", "rep",
            "scale", "zoom"]
# Other keys in the URL (the open tab, the selected job) are kept as they are.
URL_JS = page_js("url_state", KEYS=repr(URL_KEYS))  # a list of plain names reads as a JS array
# Read before the app renders (its first tab's select rewrites the URL); app/server/main.py puts it in <head>.
HEAD_JS = head_script("opened_tab_head")
OPEN_TAB_JS = page_js("open_tab")
# A link's ?model= the server does not have leaves the URL (the menu shows another model).
MODEL_URL_JS = page_js("model_url")
# The shared Run acts on the open tab: it clicks that tab's own action button (the file names them:
# Explore's hidden #explore-run, Generate's Generate, Anatomy's Show anatomy). Fine-tune and Jobs have
# their own buttons and hide Run; Interventions hides the shared prompt too (static/page.css).
RUN_JS = page_js("run_open_tab")
PROMPT_COUNT_JS = page_js("prompt_count")
MODEL_MENUS_REFRESH_S = 3.0  # how soon a model registered by a job appears in open pages' menus


def tab_url_js(tab_id: str) -> str:
    """The js of a tab's select event: its id into the URL as ?tab=."""
    return page_js("tab_url", TAB=tab_id)


def _tab_id(title: str) -> str:
    return title.lower().replace(" ", "-")


TAB_IDS = ["explore"] + [_tab_id(t) for _, t in OTHER_TABS]


@endpoint
def fresh_choices_all():
    return gr.update(choices=model_choices())


@endpoint
def fresh_choices_finetuned():
    return gr.update(choices=finetuned_choices())


def live_model_menu(dropdown: gr.Dropdown, kind: str) -> None:
    """A model menu takes any name in the registry as it is now, not only the choices it was built
    with: a model fine-tuned after the server started is a valid value for an API client that no page
    event has sent new choices (a browser's menus get them from the timer). Anything else still
    fails the menu's own check, which answers one sentence (app.server.api.harden)."""
    original = dropdown.preprocess

    def preprocess(payload):
        try:
            return original(payload)
        except Exception:
            live = finetuned_choices() if kind == "finetuned" else model_choices()
            if isinstance(payload, str) and payload in {name for _, name in live}:
                return payload
            raise

    dropdown.preprocess = preprocess


def menus_refresher(kinds: list[str]):
    """A timer callback that sends every model menu its new choices when the registry changed (a
    fine-tuning run registered a model, one was deleted) and nothing otherwise. `known` is the
    session's last-sent list of names."""
    @endpoint
    def refresh_model_menus(known):
        names = model_names()
        if known == names:
            return gr.skip()  # one skip answers for every output
        every, tuned = model_choices(), finetuned_choices()
        return [names, *[gr.update(choices=every if k == "all" else tuned) for k in kinds]]
    return refresh_model_menus


@endpoint(model=True)
def model_info(name: str, request: gr.Request = None) -> str:
    try:
        lm = get_model(name)
    except gr.Error as e:
        return f"⚠️ {e.message}"
    s = lm.summary()
    kind = "MHA" if s["kv_heads"] == s["heads"] else ("MQA" if s["kv_heads"] == 1 else "GQA")
    return (f"**{s['name']}** · {s['parameters'] / 1e6:.1f}M parameters · {s['layers']} layers · "
            f"{s['heads']} query heads / {s['kv_heads']} key-value heads ({kind}) · d_model {s['d_model']} · "
            f"vocab {s['vocab_size']:,} · {s['dtype']} on {s['device']} · loaded in {lm.load_seconds:.1f} s"
            + (" · has a chat template" if s["chat_template"] else "")
            + (f" · weights: {s['weights']}" if s.get("weights") else ""))


@endpoint
def from_url(request: gr.Request):
    """Initial values from ?model=...&prompt=...; returns updates for the shared and explore inputs."""
    q = dict(request.query_params) if request is not None else {}

    def num(k, cast, default):
        try:
            return cast(q[k])
        except (KeyError, ValueError, TypeError):
            return default
    # Explore's attention colour scale and zoom (the zoom is clamped to the prompt when it runs)
    scale = q.get("scale") if q.get("scale") in SCALES else "linear"
    zoom = str(q.get("zoom") or "")[:80]
    model = q.get("model") or default_model()
    missing = model not in model_names()
    if missing:  # nothing runs under a name the server does not have: a banner says so instead
        banner = gr.update(visible=True, value=(
            f"⚠️ This server has no model named '{echo(model)}' (a fine-tuned model may have been deleted), "
            f"so nothing was computed for it; the menu shows {default_model()}, press Run to look at that instead."))
        model = default_model()
    else:
        banner = gr.update(visible=False)
    # A link's value outside a control's range would fail the whole page load (Gradio refuses a
    # slider value beyond its bounds): each is clamped into its control, with a notice. The layer and
    # head go to the run as asked, which clamps them to the model and says so (issue 15 item 4).
    notes = []

    def within(k, cast, default, lo, hi):
        v = num(k, cast, default)
        if v != v or v in (float("inf"), float("-inf")):
            v = default
        if not lo <= v <= hi:
            c = max(lo, min(hi, v))
            if k not in ("layer", "head", "query"):  # the run says those, against the model and prompt
                notes.append(f"The link's {k}={q.get(k)} is outside {lo:g}–{hi:g}: using {c:g}.")
            v = c
        return v
    layer, head = num("layer", int, 0), num("head", int, 0)
    # the menu's choices come with the value: a model registered after the page was built opens too
    return (gr.update(choices=model_choices(), value=model), q.get("prompt", EXAMPLE_PROMPT),
            q.get("chat") in ("1", "true"),
            # the layer, head and query sliders are left as they are: the run sets them with the model's
            # own ranges (autorun carries the link's values), so no event ever reads a link's layer 999
            # against a 30-layer model's slider
            gr.skip(), gr.skip(), gr.skip(),
            within("temperature", float, 1.0, 0, 3), num("top_k", int, 0), within("top_p", float, 1.0, 0.01, 1),
            within("min_p", float, 0.0, 0, 1), within("rep", float, 1.0, 0.5, 2), scale, zoom,
            {"run": not missing, "query": num("query", int, -1), "scale": scale, "zoom": zoom,
             "layer": layer, "head": head, "notice": " ".join(notes)}, banner)


def build_demo() -> gr.Blocks:
    with gr.Blocks(title="lmscope") as demo:
        with gr.Column(elem_id="lmscope-header"):
            gr.Markdown("# lmscope\nSee inside a language model: type a prompt, run one forward pass, and explore "
                        "what every layer and head did with it.")
        with gr.Row():
            model = gr.Dropdown(model_choices(), value=default_model(), label="Model", scale=2, elem_id="model")
            chat = gr.Checkbox(label="Wrap in chat template (instruct models)", value=False, scale=1,
                               elem_id="chat")
        info = gr.Markdown(elem_id="model-info")
        banner = gr.Markdown(visible=False, elem_id="model-banner")
        with gr.Row(elem_id="prompt-row"):
            with gr.Column(scale=5):
                prompt = gr.Textbox(value=EXAMPLE_PROMPT, label="Prompt", lines=2, max_lines=12,
                                    elem_id="prompt", placeholder="Type a prompt and press Run")
                count = gr.HTML(prompt_count_html(EXAMPLE_PROMPT), elem_id="prompt-count")
            run = gr.Button("Run", variant="primary", scale=1, elem_id="run")
        shared = Shared(model=model, prompt=prompt, chat=chat, page=demo)
        autorun = gr.State({"run": False, "query": -1})

        with gr.Tabs(elem_id="tabs"):
            with gr.Tab("Explore", id="explore") as tab:
                explore = explore_tab.build(shared)
            tab.select(None, None, None, js=tab_url_js("explore"))
            for module, title in OTHER_TABS:
                if importlib.util.find_spec(module) is None:
                    continue
                with gr.Tab(title, id=_tab_id(title)) as tab:
                    importlib.import_module(module).build(shared)
                tab.select(None, None, None, js=tab_url_js(_tab_id(title)))

        for dropdown, kind in shared.pickers:  # opened, a menu fetches its list (a hidden tab may miss the timer)
            dropdown.focus(fresh_choices_finetuned if kind == "finetuned" else fresh_choices_all, None, [dropdown])
        for dropdown, kind in [(model, "all"), *shared.pickers]:
            live_model_menu(dropdown, kind)
        kinds = ["all"] + [k for _, k in shared.pickers]
        known = gr.State(None)
        gr.Timer(MODEL_MENUS_REFRESH_S).tick(menus_refresher(kinds), [known],
                                             [known, model, *[d for d, _ in shared.pickers]],
                                             queue=False, show_progress="hidden")

        # Explore's action: the shared Run clicks it while Explore is open (RUN_JS)
        explore_run = gr.Button("Run", visible="hidden", elem_id="explore-run")
        run.click(None, None, None, js=RUN_JS)
        ev_run, ev_submit = explore.wire(explore_run)
        count_io = dict(inputs=[prompt, explore.state, explore.truncate], outputs=[count], show_progress="hidden")
        for ev in (ev_run, ev_submit):
            ev.then(count_line, **count_io)
            ev.then(_hide, None, [banner], show_progress="hidden")
        model.input(_hide, None, [banner], show_progress="hidden")
        model.change(model_info, [model], [info], api_name="model_info")
        url_inputs = [model, prompt, chat, explore.layer, explore.head, explore.query, *explore.sampling_inputs,
                      explore.scale, explore.zoom]
        for ev in (ev_run, ev_submit):
            ev.then(None, url_inputs, None, js=URL_JS)
        for comp in (explore.layer, explore.head, explore.query, *explore.sampling_inputs):
            comp.input(None, url_inputs, None, js=URL_JS)
        for ev in explore.url_events:  # zoom, colour scale, clicks in the views
            ev.then(None, url_inputs, None, js=URL_JS)

        load = demo.load(from_url, None, [*url_inputs, autorun, banner])
        load.then(None, [model], None, js=MODEL_URL_JS)
        # ?tab=<id> opens that tab, as a click on it would (only a link that names a tab switches, so a
        # user who clicked another tab while the page loaded stays there)
        demo.load(None, None, None, js=OPEN_TAB_JS)
        demo.load(None, None, None, js=PROMPT_COUNT_JS)
        demo.load(None, None, None, js=NARROW_JS)  # plots on a narrow screen (app/server/narrow.py)
        load.then(model_info, [model], [info]).then(
            _autorun, [autorun, model, prompt, chat, explore.truncate, explore.layer, explore.head,
                       explore.lens_colour, *explore.sampling_inputs],
            explore.run_outputs,
            concurrency_id="model",
        ).then(count_line, **count_io).then(_overview_if_ready, [explore.state, explore.metric, explore.layer, explore.head], [explore.overview])
    harden(demo)
    return demo


@endpoint(long_text=("prompt",))  # run_trace caps the prompt: the sentence under it, or truncation
def _autorun(autorun, model, prompt, chat, truncate, layer, head, lens_colour, temperature, top_k, top_p, min_p, rep,
             request: gr.Request = None):
    """A shared link (?prompt=...) reproduces the view at once, and a first visit shows the example
    prompt computed (a trace takes well under a second); a link naming a model the server does not
    have computes nothing (from_url's banner says why)."""
    from app.tabs.explore.tab import run_trace

    if not isinstance(autorun, dict) or not autorun.get("run"):
        return gr.skip()  # one skip answers for every output: the views stay as they are
    view = {"query": autorun.get("query", -1), "scale": autorun.get("scale"), "zoom": autorun.get("zoom"),
            "notice": autorun.get("notice") or ""}
    # the link's own layer and head (the sliders hold them clamped to their bounds): the run clamps
    # them to the model and says so
    layer = autorun.get("layer", layer) if isinstance(autorun.get("layer"), int) else layer
    head = autorun.get("head", head) if isinstance(autorun.get("head"), int) else head
    return run_trace(model, prompt, chat, truncate, layer, head, view, lens_colour, temperature,
                     top_k, top_p, min_p, rep, request=request)


@endpoint
def _overview_if_ready(state, metric, layer, head, request: gr.Request = None):
    from app.tabs.explore.tab import overview

    if not state or not state.get("key"):
        return gr.skip()
    return overview(state, metric, layer, head, request=request)


@endpoint
def _hide():
    return gr.update(visible=False)


def prompt_count_html(prompt, state=None, truncate=False) -> str:
    """The line under the prompt: its characters (static/js/prompt_count.js recounts them as the user
    types) and, once it ran, its tokens. Characters are what the server caps before tokenizing."""
    n = len(prompt) if isinstance(prompt, str) else 0
    cap = max_text_chars()
    over = n > cap
    chars = f"{n:,} characters" + (f", over this server's {cap:,}" if over else f" (at most {cap:,})")
    tokens = ""
    tr = STORE.get(state.get("key")) if isinstance(state, dict) and state.get("key") else None
    ran = state.get("prompt") if tr is not None else None
    if isinstance(ran, str) and ran and isinstance(prompt, str) and prompt.endswith(ran):
        cut = ran != prompt or (bool(truncate) and tr.n_tokens >= max_prompt_tokens())
        tokens = f" · {tr.n_tokens:,} tokens" + (" (its end: truncated)" if cut else "")
    return (f'<span id="prompt-chars" data-cap="{cap}" class="{"over" if over else ""}">{html.escape(chars)}</span>'
            f'<span id="prompt-tokens">{html.escape(tokens)}</span>')


@endpoint(long_text=("prompt",))
def count_line(prompt, state, truncate):
    return prompt_count_html(prompt, state, truncate)
