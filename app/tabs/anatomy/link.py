"""The Anatomy tab in the page URL (issue 15 item 5): which panels are open, every panel control,
and whether "Show anatomy" ran; a link that opens the Anatomy tab sets them and shows the panels.

Keys (all prefixed an_): an_run (1 once "Show anatomy" ran), an_open (the open panels, by the
accordion's elem_id without "anatomy-"; written at the first toggle, from the panels open as built),
and one per control (CONTROLS). Values from a link are
hostile: each is clamped into its control (layers and heads into the link's model, read from
its config without weights), texts are capped, choices must be choices.
"""

from __future__ import annotations

import json

import gradio as gr

from app.shared.context import default_model, endpoint
from app.shared.page_js import page_js

# key -> (kind, lowest, highest): kind "layer" / "head" take the model's range; "int" / "float" the
# bounds given; "text" a capped string; "bool"; "choice" one of the bounds tuple; "list" names.
CONTROLS = {
    "an_cmp": ("list", None, None),
    "an_layer": ("layer", 0, None), "an_head": ("head", 0, None),
    "an_noscale": ("bool", None, None), "an_nomask": ("bool", None, None),
    "an_rope_layer": ("layer", 0, None), "an_rope_dist": ("int", 8, 2048),
    "an_positions": ("int", 8, 512),
    "an_tok": ("text", 0, 64), "an_a": ("text", 0, 64), "an_b": ("text", 0, 64), "an_c": ("text", 0, 64),
    "an_near": ("int", 1, 50),
    "an_norm_layer": ("layer", 0, None), "an_norm_pos": ("int", -1, 8191),
    "an_norm": ("choice", ("before attention", "before MLP", "final norm"), None),
    "an_mlp_layer": ("layer", 0, None), "an_mlp_pos": ("int", -1, 8191),
    "an_top_k": ("int", 3, 30),
    "an_alibi_heads": ("int", 1, 64), "an_scheme_dist": ("int", 8, 1024), "an_moe_layer": ("int", 0, None),
}
KEYS = list(CONTROLS)
PANELS = ["card", "tree", "attention", "rope", "positions", "embedding", "norm", "mlp", "output", "kv-variants",
          "norm-chapter", "position-schemes", "moe", "info"]

# The controls are mirrored into the URL by static/js/anatomy_url.js (other keys stay as they are; a
# value equal to the control's default is left out: the link stays short); an_run and an_open are
# written by the Show button (RUN_JS) and the panels' expand/collapse events (panel_js).
RUN_JS = page_js("anatomy_run")
# after the link's values landed: press "Show anatomy" as the teammate did, and bring the first
# open panel into view
GO_JS = page_js("anatomy_go")


def panel_js(first_open: str, op: str, panel: str) -> str:
    """The js of a panel's expand (op "add") or collapse ("delete") event: ?an_open= gains or loses
    `panel`; a URL without an_open yet starts from `first_open`, the panels open as built."""
    return page_js("anatomy_panel", FIRST_OPEN=first_open, OP=op, PANEL=panel)


def values_from_url(query: dict, opened_tab: str | None, shape: tuple[int, int], moe_layers: int,
                    compare_names: set[str]) -> dict | None:
    """The link's Anatomy values, each a valid value of its control, plus "an_open" (a set of panel
    names, or None when the link names none); None when the link opens another tab or has no an_ key.
    shape: (layers, heads) of the link's model."""
    if (opened_tab or query.get("tab")) != "anatomy" or not any(k.startswith("an_") for k in query):
        return None
    L, H = max(1, shape[0]), max(1, shape[1])
    out: dict = {}
    for k, (kind, lo, hi) in CONTROLS.items():
        raw = query.get(k)
        if not isinstance(raw, str):
            continue
        if kind == "list":
            out[k] = [x for x in raw.split(",") if x in compare_names][:16]
        elif kind == "bool":
            out[k] = raw in ("1", "true")
        elif kind == "text":
            out[k] = raw[:hi]
        elif kind == "choice":
            if raw in lo:
                out[k] = raw
        else:
            try:
                v = float(raw)
            except ValueError:
                continue
            if v != v or v in (float("inf"), float("-inf")):
                continue
            top = {"layer": L - 1, "head": H - 1}.get(kind, hi if hi is not None else moe_layers - 1)
            out[k] = int(max(lo, min(top, int(v))))
    opened = query.get("an_open")
    out["an_open"] = ({p for p in opened.split(",") if p in PANELS} if isinstance(opened, str) else None)
    return out


def wire(shared, go_btn, controls: dict, shape_of, moe_layers: int, compare_names) -> None:
    """Mirror `controls` ({key: component}) and the panels' open state into the URL, and read a link
    back on load. shape_of(model name) -> (layers, heads); compare_names() -> the valid names."""
    from gradio.context import get_blocks_context

    comps = [controls[k] for k in KEYS]
    url_js = page_js("anatomy_url", KEYS=json.dumps(KEYS), DEFAULTS=json.dumps([c.value for c in comps], default=str))
    for c in comps:
        c.change(None, comps, None, js=url_js)
    go_btn.click(None, None, None, js=RUN_JS)
    ctx = get_blocks_context()
    accordions = {}
    for b in (ctx.blocks.values() if ctx is not None else []):
        name = (b.elem_id or "").removeprefix("anatomy-")
        if isinstance(b, gr.Accordion) and name in PANELS and (b.elem_id or "").startswith("anatomy-"):
            accordions[name] = b
    names = [p for p in PANELS if p in accordions]
    first_open = ",".join(p for p in names if accordions[p].open)  # before any toggle: as built
    for p in names:
        accordions[p].expand(None, None, None, js=panel_js(first_open, "add", p))
        accordions[p].collapse(None, None, None, js=panel_js(first_open, "delete", p))
    if shared.page is None:
        return
    opened_tab = gr.Textbox(visible=False, elem_id="an-opened-tab")
    outputs = comps + [accordions[p] for p in names]

    @endpoint
    def an_from_url(tab, request: gr.Request = None):
        from app.shared.context import model_names

        q = dict(request.query_params) if request is not None else {}
        model = q.get("model") if q.get("model") in model_names() else default_model()
        got = values_from_url(q, tab if isinstance(tab, str) else None, shape_of(model), moe_layers,
                              set(compare_names()))
        if got is None:
            return (gr.skip(),) * len(outputs)
        L, H = shape_of(model)
        ups = []
        for k in KEYS:
            if k not in got:
                ups.append(gr.skip())
            elif CONTROLS[k][0] in ("layer", "head"):  # the slider's range follows the link's model
                ups.append(gr.update(maximum=max(1, (L if CONTROLS[k][0] == "layer" else H) - 1), value=got[k]))
            else:
                ups.append(gr.update(value=got[k]))
        opened = got["an_open"]
        ups += [gr.skip() if opened is None else gr.update(open=p in opened) for p in names]
        return tuple(ups)

    shared.page.load(an_from_url, [opened_tab], outputs, js=page_js("opened_tab")).then(
        None, None, None, js=GO_JS)
