"""The Anatomy view in real headless Chromium against a live server: every panel on the default
model (SmolLM2, Llama-style: RoPE, GQA, SwiGLU, RMSNorm), then on a GPT-2 style model (learned
positions, MHA, GELU MLP, LayerNorm) and a Gemma 3 style model (MQA, sliding window, GeGLU)."""

import json
import re
import time

import pytest
from playwright.sync_api import sync_playwright

from tests.helpers.browser import ARTIFACTS, launch_browser, screenshot

pytestmark = pytest.mark.browser

PANELS = ["anatomy-card", "anatomy-tree", "anatomy-attention", "anatomy-rope", "anatomy-positions",
          "anatomy-embedding", "anatomy-norm", "anatomy-mlp", "anatomy-output",
          # chapters on tiny random-weight models (issue 18)
          "anatomy-kv-variants", "anatomy-norm-chapter", "anatomy-position-schemes", "anatomy-moe"]


# --- reading the page -----------------------------------------------------------------------------

def plots(page, panel: str) -> list[dict]:
    """Every Plotly figure drawn inside a panel, in page order: title, subplot titles, traces."""
    return json.loads(page.evaluate(
        """(id) => { const norm = v => ArrayBuffer.isView(v) ? Array.from(v) : (Array.isArray(v) ? v.map(norm) : v);
                     return JSON.stringify(Array.from(document.querySelectorAll('#' + id + ' .js-plotly-plot')).map(el => ({
                       title: (el.layout && el.layout.title && el.layout.title.text) || '',
                       annotations: ((el.layout && el.layout.annotations) || []).map(a => a.text),
                       width: el.getBoundingClientRect().width,
                       traces: (el._fullData || []).map(t => ({type: t.type, name: t.name, x: norm(t.x),
                                                                y: norm(t.y), z: norm(t.z)}))}))); }""",
        panel))


def table(page, panel: str, label: str | None = None) -> list[list[str]]:
    """A gr.Dataframe's rows (header first) as cell texts. Its rows are virtual (only those in view
    are in the DOM), so scroll through it and collect them by index."""
    return page.evaluate(
        """async ([panel, label]) => {
             const grid = document.querySelector(`#${panel} [role=grid]` + (label ? `[aria-label="${label}"]` : ''));
             if (!grid) return [];
             const cells = r => Array.from(r.querySelectorAll('[role=columnheader], [role=gridcell]')).map(c => c.innerText.trim());
             const head = grid.querySelector('thead [role=row]');
             const rows = new Map(), view = grid.querySelector('.virtual-table-viewport');
             const grab = () => grid.querySelectorAll('.virtual-row[role=row]').forEach(r => rows.set(+r.dataset.index, cells(r)));
             grab();
             for (let y = 0; view && y < view.scrollHeight; y += 300) {
               view.scrollTop = y; await new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r))); grab(); }
             if (view) view.scrollTop = 0;
             return [head ? cells(head) : [], ...[...rows.keys()].sort((a, b) => a - b).map(k => rows.get(k))];
           }""", [panel, label])


def text(page, panel: str) -> str:
    return page.inner_text(f"#{panel}")


def wait_for(fn, what: str, timeout: float = 90):
    deadline, last = time.time() + timeout, None
    while time.time() < deadline:
        try:
            last = fn()
            if last:
                return last
        except Exception as e:  # noqa: BLE001 - the page is still rendering
            last = e
        time.sleep(0.25)
    raise AssertionError(f"timed out waiting for {what} (last: {str(last)[:300]})")


def open_panel(page, panel: str):
    label = page.locator(f"#{panel} > button.label-wrap")
    if "open" not in (label.get_attribute("class") or "").split():
        label.click()
    page.wait_for_function(
        "(id) => getComputedStyle(document.querySelector('#' + id + ' [data-testid=accordion-content]')).display !== 'none'",
        arg=panel)


def shoot_panels(page, prefix: str):
    screenshot(page, prefix)
    for panel in PANELS:
        page.locator(f"#{panel}").screenshot(path=str(ARTIFACTS / f"{prefix}-{panel.removeprefix('anatomy-')}.png"))


def pick_model(page, name: str):
    box = page.locator("#model input[role=combobox]")
    box.click()
    box.fill(name)
    page.get_by_role("option", name=re.compile(re.escape(name))).first.click()
    wait_for(lambda: name in page.inner_text("#model-info"), f"model info for {name}", 120)


def row_sums_ok(z) -> bool:
    return all(abs(sum(v for v in row if v is not None) - 1) < 1e-3 for row in z)


def checks_pass(page, panel: str, n: int = 1) -> bool:
    t = text(page, panel)
    assert "MISMATCH" not in t, t
    return t.count("✓ check") >= n


# --- panel by panel ---------------------------------------------------------------------------------

REFERENCE_TITLES = ["Llama 3.2-1B", "GPT-2 (124M)", "GPT-3 175B", "Mistral 7B", "DeepSeek-V2", "Granite 3B (4.1)"]


def compare_table(page) -> dict:
    """The side-by-side cards (an HTML table): column titles and kinds, and per row label the
    cells' texts and whether a source's statement in the cell differs from the computed value."""
    return page.evaluate("""() => { const t = document.querySelector('#anatomy-compare table');
        if (!t) return null;
        const heads = Array.from(t.querySelectorAll('thead th[data-kind]'));
        const rows = {};
        t.querySelectorAll('tbody tr').forEach(r => { rows[r.dataset.row] = Array.from(r.querySelectorAll('td')).map(
            c => ({text: c.innerText.trim(), differs: c.dataset.differs === '1',
                   marks: Array.from(c.querySelectorAll('.lmscope-claim')).map(m => ({agrees: m.dataset.agrees === '1',
                                                                                    text: m.innerText.trim()}))})); });
        const box = document.querySelector('#anatomy-compare .lmscope-cards').getBoundingClientRect();
        return {titles: heads.map(h => h.firstChild.textContent.trim()), kinds: heads.map(h => h.dataset.kind),
                rows, right: box.right, card_right: document.querySelector('#anatomy-card').getBoundingClientRect().right,
                page_width: document.documentElement.scrollWidth}; }""")


def check_card(page, model: str, want: dict, kind: str = "loaded"):
    title = model + (" (random weights)" if kind == "random" else "")
    tab = wait_for(lambda: (t := compare_table(page)) and t["titles"][:1] == [title] and t, f"architecture cards for {model}")
    # the selected model first, then by default the six real systems from their published configs (issue 21)
    assert tab["titles"] == [title] + REFERENCE_TITLES and tab["kinds"] == [kind] + ["reference"] * 6, tab["titles"]
    body = {label: [c["text"] for c in cells] for label, cells in tab["rows"].items()}
    assert list(body)[:4] == ["architecture", "weights", "params", "active params / token"], list(body)[:6]
    assert all(len(cells) == 7 and all(cells) for cells in body.values())  # every model, every row
    assert tab["right"] <= tab["card_right"] + 1, tab  # wide tables scroll inside the panel, not off it
    for key, value in want.items():
        assert value in body[key][0], (key, body[key][0], value)
    assert ("random" in body["weights"][0]) == (kind == "random")
    assert all("meta device" in w for w in body["weights"][1:])
    # the bar's numbers, computed in the server from the configs
    col = {t: i for i, t in enumerate(tab["titles"])}
    for t, params, kv in (("GPT-2 (124M)", "124,439,808", "36,864 B"), ("Llama 3.2-1B", "1,235,814,400", "32,768 B"),
                          ("Mistral 7B", "7,241,732,096", "131,072 B"), ("DeepSeek-V2", "235,741,434,880", "69,120 B")):
        assert body["params"][col[t]].startswith(params) and body["KV cache / token (fp16)"][col[t]].startswith(kv)
    # the source table's errors are marked in their cells, each with the reason; its sizes agree (✓)
    cell = lambda row, t: tab["rows"][row][col[t]]  # noqa: E731
    assert cell("norm position", "GPT-2 (124M)")["differs"] and "post-norm" in cell("norm position", "GPT-2 (124M)")["text"]
    assert "ln_1" in cell("norm position", "GPT-2 (124M)")["text"]  # the reason names the computed wiring
    assert cell("vocabulary", "GPT-3 175B")["differs"] and "100K" in cell("vocabulary", "GPT-3 175B")["text"]
    assert cell("context length", "GPT-3 175B")["differs"] and cell("context length", "GPT-3 175B")["text"].startswith("2,048")
    assert cell("context length", "DeepSeek-V2")["differs"]
    assert all(any(m["agrees"] and m["text"].startswith("✓ table") for m in cell("params", t)["marks"])
               for t in REFERENCE_TITLES)
    assert not any(c["differs"] for c in tab["rows"]["params"][:1])  # nothing is claimed about the selected model
    bars = wait_for(lambda: (p := plots(page, "anatomy-card")) and p[0]["traces"][0]["y"][0] == title
                    and p[0]["traces"], "parameters-by-part bars")
    stacked = [t for t in bars if t["type"] == "bar"]
    assert [t["name"] for t in stacked][:4] == ["embedding", "attention", "MLP (dense, shared experts)",
                                                "routed experts + router"]
    per_model = [sum((t["x"][i] or 0) for t in stacked) for i in range(len(stacked[0]["y"]))]
    assert all(abs(s - 100) < 0.5 for s in per_model), per_model  # each bar is 100 % of its model
    active = next(t for t in bars if t["name"] == "active per token (MoE)")
    assert active["y"] == ["DeepSeek-V2"] and 9 < active["x"][0] < 9.2  # 21.4B of 235.7B
    kv = wait_for(lambda: (p := plots(page, "anatomy-card")) and len(p) == 2 and p[1], "KV-cache growth plot")
    lines = {t["name"]: t for t in kv["traces"] if t["type"] == "scatter" and len(t["x"] or []) > 1}
    assert set(lines) == {title, *REFERENCE_TITLES, "DeepSeek-V2 if uncompressed"}
    mistral = dict(zip(lines["Mistral 7B"]["x"], lines["Mistral 7B"]["y"]))
    assert mistral[4096] == mistral[32768] == 131_072 * 4096  # the sliding window caps the cache
    assert lines["DeepSeek-V2"]["y"][-1] == 69_120 * 163_840
    return body


def check_single_card(page, body: dict):
    single = wait_for(lambda: (r := table(page, "anatomy-card", "This model")) and len(r) > 20 and r, "single card")
    mine = {r[0]: r[1] for r in single[1:]}
    shared = [k for k in body if k in mine]
    assert len(shared) >= 8 and all(mine[k] == body[k][0] for k in shared), [(k, mine[k], body[k][0]) for k in shared]
    assert len(mine) >= 20


def check_tree(page, T: int, d: int, vocab: int, layer_list: str = "layers"):
    rows = wait_for(lambda: (r := table(page, "anatomy-tree")) and any(f"[{T}, {vocab}]" in c for x in r for c in x) and r,
                    "module tree with logits shape")
    cells = [c for r in rows for c in r]
    # the layer list has its own row (layers / h), right above its first block, named layers.0 / h.0
    names = [r[0] for r in rows[1:]]
    i = names.index(f"{layer_list}.0")
    assert names[i - 1] == layer_list and rows[i][1].startswith("ModuleList"), rows[i: i + 2]
    assert f"[{T}, {d}]" in cells  # embedding and every layer keep [T, d_model]
    assert f"[{T}, {vocab}]" in cells  # the unembedding gives one score per vocabulary entry
    assert sum(bool(re.fullmatch(r"\[\d+(, \d+)*\]", c)) for c in cells) >= 8
    assert f"T = {T} tokens" in text(page, "anatomy-tree")


def check_attention(page, T: int, d_head: int, title: str, window: int | None = None):
    # steps, the RoPE rotation step (hidden for models without RoPE), variants
    steps, var = wait_for(lambda: (p := [x for x in plots(page, "anatomy-attention") if x["width"] > 0])
                          and len(p) in (2, 3) and title in p[0]["title"] and [p[0], p[-1]],
                          f"attention steps titled {title!r}")
    names = steps["annotations"]
    heads = [n.split("<br>")[0] for n in names]  # each subplot title: the step, then its value range
    assert heads[:3] == ["Q (queries)", "K (keys)", "raw scores Q·Kᵀ"] and "softmax = pattern" in heads
    assert all(re.search(r"<br>.*-?[\d.e+-]+ … -?[\d.e+-]+", n) for n in names), names
    tr = {t["name"]: t for t in steps["traces"]}
    assert len(steps["traces"]) == 8
    q, raw, soft, z = tr["Q (queries)"], tr["raw scores Q·Kᵀ"], tr["softmax = pattern"], tr["z = pattern · V"]
    assert len(q["z"]) == T and len(q["z"][0]) == d_head and len(z["z"][0]) == d_head
    assert len(raw["z"]) == T and all(len(r) == T for r in raw["z"])
    assert any(abs(v) > 1e-6 for r in raw["z"] for v in r)
    assert len(soft["z"]) == T and row_sums_ok(soft["z"])
    assert all(abs(soft["z"][i][j] or 0) < 1e-6 for i in range(T) for j in range(i + 1, T))  # causal
    mask_name = f"mask applied (causal + window {window})" if window else "causal mask applied"
    masked = tr[mask_name]
    assert masked["z"][0][1] is None and masked["z"][1][0] is not None  # the future is a gap
    if window:  # ... and so is the far past, on a sliding-window layer
        assert masked["z"][T - 1][T - 1 - window] is None and masked["z"][T - 1][T - window] is not None
    assert soft["y"][0].startswith("0:") and len(soft["y"]) == T
    # variants: the model's softmax, without scaling, without the mask
    assert [t["name"] for t in var["traces"]] == ["the model's softmax", "without scaling",
                                                  "without the mask" if window else "without the causal mask"]
    for t in var["traces"]:
        assert row_sums_ok(t["z"])
    no_mask = var["traces"][2]["z"]
    assert any((no_mask[0][j] or 0) > 1e-6 for j in range(1, T))  # without the mask, token 0 sees the future
    assert "nats" in var["title"]
    wait_for(lambda: checks_pass(page, "anatomy-attention"), "attention check line")
    assert "z_h·W_O" in text(page, "anatomy-attention")  # heads through W_O vs the model's own output


def check_rope_step(page, T: int, d_head: int, shown: bool):
    """Q and K are said to be after RoPE; the rotation step shows W_q·x, Q, W_k·x, K and the angles
    (RoPE models), or is hidden and the note says there is no RoPE (GPT-2)."""
    if not shown:
        wait_for(lambda: "no RoPE" in text(page, "anatomy-attention"), "the no-RoPE note")
        assert all(p["width"] == 0 for p in plots(page, "anatomy-attention") if "rotation step" in p["title"])
        return
    rot = wait_for(lambda: (p := [x for x in plots(page, "anatomy-attention") if "rotation step" in x["title"]
                                  and x["width"] > 0]) and p[0], "the RoPE rotation step")
    assert [t["name"] for t in rot["traces"]][:4] == ["W_q·x (before RoPE)", "Q after RoPE (what attention uses)",
                                                      "W_k·x (before RoPE)", "K after RoPE"]
    assert all(len(t["z"]) == T and len(t["z"][0]) == d_head for t in rot["traces"])
    assert rot["traces"][0]["z"] != rot["traces"][1]["z"]  # the rotation changed Q
    assert all("after RoPE" in a for a in plots(page, "anatomy-attention")[0]["annotations"][:2])
    t = text(page, "anatomy-attention")
    assert "Q and K are shown after RoPE" in t and f"i + {d_head // 2}" in t and "rotate_half" in t


def check_chapters(page):
    """The chapters on tiny random-weight models: attention variants with KV bytes (formula = the real
    cache), LayerNorm vs RMSNorm and pre- vs post-norm, the position schemes' d = 4 tables, the MoE router."""
    rows = wait_for(lambda: (r := table(page, "anatomy-kv-variants")) and len(r) == 5 and r, "attention variants table")
    col = {h: i for i, h in enumerate(rows[0])}
    body = {r[col["variant"]]: r for r in rows[1:]}
    assert list(body) == ["MHA", "GQA", "MQA", "MLA"]
    assert [body[k][col["formula B/token"]] for k in body] == ["4,096", "1,024", "512", "640"]
    assert all(r[col["formula B/token"]] == r[col["measured B/token"]] for r in body.values())
    assert body["MLA"][col["config"]] == "DeepseekV2Config" and "latent 64" in body["MLA"][col["cached per layer and token"]]
    wait_for(lambda: checks_pass(page, "anatomy-kv-variants", 4), "four KV check lines")
    bars, pats = plots(page, "anatomy-kv-variants")
    assert "random weights" in bars["title"] and "random weights" in pats["title"]
    assert [t["name"] for t in pats["traces"]] == ["MHA", "GQA", "MQA", "MLA"]
    assert all(row_sums_ok(t["z"]) for t in pats["traces"])

    cmp_, growth = wait_for(lambda: (p := plots(page, "anatomy-norm-chapter")) and len(p) == 2 and p, "norm chapter")
    assert [t["name"] for t in cmp_["traces"]] == ["x", "LayerNorm: (x − mean) / std", "RMSNorm: x / RMS"]
    pre, post = growth["traces"][:2]
    assert pre["y"][-1] > 5 * pre["y"][1] and abs(post["y"][-1] - 128 ** 0.5) < 0.05
    wait_for(lambda: checks_pass(page, "anatomy-norm-chapter"), "pre-norm wiring check")
    assert "RMS² =" in text(page, "anatomy-norm-chapter")

    sin = wait_for(lambda: (r := table(page, "anatomy-position-schemes", "Sinusoidal, d = 4, positions 0-3"))
                   and len(r) == 5 and r, "the sinusoidal d = 4 table")
    assert [r[1] for r in sin[1:]] == ["0.0000", "0.8415", "0.9093", "0.1411"]  # sin(p), p = 0..3
    rope = table(page, "anatomy-position-schemes", "RoPE, d = 4, q = (1, 2, 3, 4), positions 0-3")
    assert rope[2][2] == "-1.9841, 1.9599, 2.4624, 4.0198" and rope[1][2] == "1.0000, 2.0000, 3.0000, 4.0000"
    alibi = table(page, "anatomy-position-schemes", "ALiBi bias added to head 1's scores, positions 0-3")
    assert alibi[4][1:] == ["-1.5", "-1", "-0.5", "0"] and "masked" in alibi[1][2]
    fig, scaling = plots(page, "anatomy-position-schemes")
    assert [t["name"].split(" ")[0] for t in scaling["traces"]] == ["plain", "linear", "YaRN"]
    assert "RoPE scaling to 4× the context" in scaling["title"]
    assert len(fig["traces"]) == 2 + 8 + 1 and "ALiBi slopes for 8 heads: 0.5, 0.25" in text(page, "anatomy-position-schemes")

    moe = wait_for(lambda: (p := plots(page, "anatomy-moe")) and p[0], "the MoE router")
    heat = moe["traces"][0]
    assert len(heat["z"][0]) == 8 and all(abs(sum(r) - 1) < 1e-4 for r in heat["z"])  # probabilities per token
    assert "random weights" in moe["title"] and "layer 0" in moe["annotations"][0]
    wait_for(lambda: checks_pass(page, "anatomy-moe", 3), "three MoE check lines")
    layer = page.locator("#anatomy-moe input[type=number]").first
    layer.fill("1")
    layer.press("Enter")
    wait_for(lambda: "layer 1" in plots(page, "anatomy-moe")[0]["annotations"][0], "the router of MoE layer 1")
    wait_for(lambda: checks_pass(page, "anatomy-moe", 3), "MoE checks on layer 1")


def check_norm(page, d: int, kind: str):
    fig = wait_for(lambda: (p := plots(page, "anatomy-norm")) and kind in p[0]["title"] and p[0], f"{kind} plot")
    x, y, gain = fig["traces"]
    assert len(x["y"]) == d and len(y["y"]) == d and len(gain["y"]) == d  # every gain, not only their mean
    assert any(abs(v) > 1e-6 for v in x["y"]) and x["y"] != y["y"]
    assert "negative" in fig["annotations"][2] and "negative" in text(page, "anatomy-norm")
    wait_for(lambda: checks_pass(page, "anatomy-norm"), "norm check line")


def check_mlp(page, d_mlp: int, gated: bool):
    bars, scatter = wait_for(lambda: (p := plots(page, "anatomy-mlp")) and len(p) == 2 and
                             ("×" in p[0]["title"]) == gated and p, "MLP plots")
    names = [t["name"] for t in bars["traces"]]
    assert names == (["act(gate)", "up", "product"] if gated else ["pre-activation", "post-activation"])
    assert len(bars["traces"][0]["x"]) == min(40, d_mlp)
    assert len(scatter["traces"][0]["x"]) == d_mlp and f"All {d_mlp} neurons" in scatter["title"]
    wait_for(lambda: checks_pass(page, "anatomy-mlp"), "MLP check line")


def check_output(page, vocab: int):
    bars, hist = wait_for(lambda: (p := plots(page, "anatomy-output")) and len(p) == 2
                          and f"All {vocab:,} logits" in p[1]["title"] and p, "output plots")
    logits, probs = bars["traces"]
    assert len(probs["x"]) == 10 and probs["x"] == sorted(probs["x"])  # drawn bottom-up: largest last
    assert 0 < probs["x"][-1] <= 1 and sum(probs["x"]) <= 1 + 1e-6
    assert all(re.search(r"\(#\d+\)$", lab) for lab in probs["y"])
    assert len(hist["traces"][0]["x"]) == vocab
    wait_for(lambda: checks_pass(page, "anatomy-output"), "output check line")


def check_embedding(page, token: str, k: int = 10):
    near, ana = wait_for(lambda: (p := plots(page, "anatomy-embedding")) and len(p) == 2
                         and token in p[0]["title"] and p, f"neighbours of {token!r}")
    for fig in (near, ana):
        bar = fig["traces"][0]
        assert len(bar["y"]) == k and all(re.search(r"\(#\d+\)$", lab) for lab in bar["y"])
        assert all(-1 <= c <= 1 for c in bar["x"]) and bar["x"] == sorted(bar["x"])
    return near, ana


# --- the walk ---------------------------------------------------------------------------------------

def check_info_panel(page, T: int):
    """Entropy / cross-entropy / KL on the model's numbers (checks against transformers' loss and torch's
    kl_div), then MFU from a generation measured now."""
    open_panel(page, "anatomy-info")
    page.click("#info-go")
    wait_for(lambda: checks_pass(page, "anatomy-info", 3), "three information-theory check lines")
    t = text(page, "anatomy-info")
    assert "transformers' own loss" in t and "kl_div" in t and "KL(P‖Q) = " in t and "not symmetric" in t
    ce, kl = wait_for(lambda: (p := plots(page, "anatomy-info")) and len(p) >= 2 and p[1]["traces"] and p[:2],
                      "the surprisal and KL plots")
    assert len(ce["traces"][0]["y"]) == T - 1 and "mean = cross-entropy" in ce["annotations"][0]
    assert len(kl["traces"]) == 3 and len(kl["traces"][0]["x"]) == 10
    # Q = P at temperature 1: nothing to pay
    temp = page.locator("#info-temp input[type=number]").first
    temp.fill("1")
    temp.press("Enter")
    page.click("#info-go")
    wait_for(lambda: "KL(P‖Q) = 0.0000 nats" in text(page, "anatomy-info"), "KL 0 at temperature 1")
    # MFU from the app's own measured tokens/s: a generation now, N counted once per tensor
    page.click("#mfu-measure")
    wait_for(lambda: "MFU =" in text(page, "anatomy-info"), "the MFU from a measured generation", 180)
    assert page.locator("#mfu-n input").input_value() == "134515008"
    assert float(page.locator("#mfu-tps input").input_value()) > 0
    assert "2 × 134,515,008 ×" in text(page, "anatomy-info") and "peak 9.89e+14" in text(page, "anatomy-info")
    custom = page.locator("#mfu-custom input")
    custom.fill("1")
    custom.press("Enter")
    wait_for(lambda: "peak 1e+12 FLOP/s" in text(page, "anatomy-info"), "MFU against a 1 TFLOP/s peak")
    page.locator("#anatomy-info").screenshot(path=str(ARTIFACTS / "anatomy-smollm2-info.png"))


def test_anatomy_in_the_browser(server):
    t0 = time.time()
    with sync_playwright() as pw:
        browser = launch_browser(pw)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.goto(server.url)
        page.wait_for_selector("#prompt textarea", timeout=60_000)
        page.get_by_role("tab", name="Anatomy").click()
        page.click("#anatomy-go")

        # --- the default model: SmolLM2-135M (30 layers, 9 query heads sharing 3 K/V heads) ---
        T = 12  # the example prompt, as in the Explore test
        card = check_card(page, "smollm2-135m-instruct", {
            "architecture": "LlamaForCausalLM", "layers": "30", "d_model": "576", "query heads": "9",
            "key/value heads": "3", "attention kind": "GQA", "head dim": "64", "feed-forward": "SwiGLU 1,536",
            "norm": "RMSNorm", "position encoding": "RoPE", "vocabulary": "49,152", "weight tying": "tied",
            "norm position": "pre-norm", "KV cache / token (fp16)": "23,040 B", "params": "134,515,008"})
        cards = page.locator("#anatomy-card")
        cards.screenshot(path=str(ARTIFACTS / "anatomy-cards-1400.png"))
        page.set_viewport_size({"width": 420, "height": 900})  # a phone: the table scrolls inside its panel
        narrow = wait_for(lambda: (t := compare_table(page)) and t["page_width"] <= 421 and t, "the cards at 420 px")
        assert narrow["right"] <= narrow["card_right"] + 1, narrow
        assert page.evaluate("() => { const b = document.querySelector('#anatomy-compare .lmscope-cards'); "
                             "return b.scrollWidth > b.clientWidth; }")  # seven columns: scroll sideways
        cards.screenshot(path=str(ARTIFACTS / "anatomy-cards-420.png"))
        page.set_viewport_size({"width": 1400, "height": 1000})
        check_output(page, 49152)
        for panel in PANELS:  # the newcomer opens every panel after the first run
            open_panel(page, panel)
        check_embedding(page, "Paris")  # the last step of the chain: every panel has its data now
        page.locator("#anatomy-card button.label-wrap", has_text="This model only").click()
        check_single_card(page, card)
        check_tree(page, T, 576, 49152)
        check_attention(page, T, 64, "Layer 0, head 0 (K/V head 0)")
        rope_line, rope_ang = wait_for(lambda: (p := plots(page, "anatomy-rope")) and len(p) == 2 and p, "RoPE plots")
        assert len(rope_line["traces"][0]["x"]) == 257 and max(rope_line["traces"][0]["y"]) <= 64 + 1e-3
        assert len(rope_ang["traces"][0]["z"]) == 128 and len(rope_ang["traces"][0]["z"][0]) == 32
        assert "32 dimension pairs, base θ ≈ 100,000" in text(page, "anatomy-rope")
        own, sinus = plots(page, "anatomy-positions")[0]["traces"]
        assert len(own["z"]) == 64 and len(own["z"][0]) == 32 and len(sinus["z"][0]) == 576
        assert abs(sinus["z"][0][0]) < 1e-6 and abs(sinus["z"][0][288] - 1) < 1e-6  # sin 0 = 0 | cos 0 = 1
        check_norm(page, 576, "RMSNorm")
        check_mlp(page, 1536, gated=True)
        check_rope_step(page, T, 64, shown=True)
        check_chapters(page)
        check_info_panel(page, T)
        shoot_panels(page, "anatomy-smollm2")

        # panel controls update only their panel: head 4 of layer 2 shares K/V head 1 (GQA, 3 per group)
        attn_sliders = page.locator("#anatomy-attention input[type=number]")
        attn_sliders.nth(0).fill("2")
        attn_sliders.nth(0).press("Enter")
        attn_sliders.nth(1).fill("4")
        attn_sliders.nth(1).press("Enter")
        check_attention(page, T, 64, "Layer 2, head 4 (K/V head 1)")
        page.locator("#anatomy-attention label", has_text="show without scaling").click()
        wait_for(lambda: [t["name"] for t in plots(page, "anatomy-attention")[-1]["traces"]]
                 == ["the model's softmax", "without the causal mask"], "variants without the no-scaling panel")
        page.locator("#anatomy-attention label", has_text="show without scaling").click()
        wait_for(lambda: len(plots(page, "anatomy-attention")[-1]["traces"]) == 3, "all three variants again")
        before = plots(page, "anatomy-norm")[0]["traces"][0]["y"]
        page.locator("#anatomy-norm label", has_text="final norm").click()
        wait_for(lambda: plots(page, "anatomy-norm")[0]["traces"][0]["y"] != before, "the final norm's input")
        check_norm(page, 576, "RMSNorm")
        emb = page.locator("#anatomy-embedding")
        emb.locator("textarea, input[type=text]").first.fill(" London")
        emb.get_by_role("button", name="Find").click()
        check_embedding(page, "London")
        screenshot(page, "anatomy-smollm2-controls")
        t_default = time.time() - t0

        # --- a GPT-2 style model: learned positions, MHA, GELU MLP, LayerNorm, byte tokens ---
        pick_model(page, "random-gpt2-tiny")
        page.click("#anatomy-go")
        prompt = page.locator("#prompt textarea").input_value()
        check_card(page, "random-gpt2-tiny", {
            "architecture": "GPT2LMHeadModel", "layers": "3", "d_model": "64", "query heads": "4",
            "key/value heads": "4", "attention kind": "MHA", "feed-forward": "GELU MLP 256", "norm": "LayerNorm",
            "position encoding": "learned absolute", "vocabulary": "258", "norm position": "pre-norm"},
            kind="random")
        check_output(page, 258)
        Tb = len(prompt.encode())  # one byte per token
        check_tree(page, Tb, 64, 258, layer_list="h")
        check_attention(page, Tb, 16, "head")
        check_rope_step(page, Tb, 16, shown=False)
        wait_for(lambda: "does not use RoPE" in text(page, "anatomy-rope"), "the no-RoPE note")
        wait_for(lambda: all(p["width"] == 0 for p in plots(page, "anatomy-rope")), "the RoPE plots hidden")
        own, sinus = wait_for(lambda: (p := plots(page, "anatomy-positions"))  # random weights never learned
                              and "untrained position embeddings (random weights" in p[0]["annotations"][0]
                              and p[0]["traces"], "untrained position embeddings")
        assert len(own["z"]) == 64 and len(own["z"][0]) == 64 and len(sinus["z"][0]) == 64
        check_norm(page, 64, "LayerNorm")
        check_mlp(page, 256, gated=False)
        # byte tokens: ' London' is 7 tokens, so the chain's run used its first letter, with a note
        check_embedding(page, "'L'")
        assert "' London' is 7 tokens here" in text(page, "anatomy-embedding")
        # ... or name single bytes
        for box, value in zip(emb.locator("textarea, input[type=text]").all()[:4], ["e", "a", "b", "c"]):
            box.fill(value)
        emb.get_by_role("button", name="Find").click()
        check_embedding(page, "'e'")
        shoot_panels(page, "anatomy-gpt2")
        t_gpt2 = time.time() - t0

        # --- a Gemma 3 style model: MQA, sliding-window layers, GeGLU, RMSNorm with (1 + w) ---
        pick_model(page, "random-gemma3-tiny")
        emb.locator("textarea, input[type=text]").first.fill("t")  # marks the end of this run's chain
        page.click("#anatomy-go")
        check_card(page, "random-gemma3-tiny", {
            "architecture": "Gemma3ForCausalLM", "layers": "4", "query heads": "4", "key/value heads": "1",
            "attention kind": "MQA", "feed-forward": "GeGLU", "norm": "RMSNorm with gain (1 + w)",
            "position encoding": "RoPE", "sliding window": "3 of 4 layers", "norm position": "pre- and post-norm"},
            kind="random")
        check_embedding(page, "'t'")  # the chain's last step: every panel below is this model's
        check_tree(page, Tb, 64, 258)
        check_attention(page, Tb, 16, "(K/V head 0)", window=6)  # MQA: every query head shares K/V head 0
        wait_for(lambda: "sliding window: each token sees only the last 6 tokens" in text(page, "anatomy-attention"),
                 "sliding-window note")
        soft = next(t for t in plots(page, "anatomy-attention")[0]["traces"] if t["name"] == "softmax = pattern")["z"]
        assert all((soft[i][j] or 0) == 0 for i in range(Tb) for j in range(max(0, i - 20)))  # far past masked
        assert "base θ ≈ 10,000" in text(page, "anatomy-rope")  # layer 2 is a local (sliding) layer
        check_output(page, 258)
        check_mlp(page, 128, gated=True)
        check_norm(page, 64, "RMSNorm")
        rope = wait_for(lambda: (p := plots(page, "anatomy-rope")) and len(p) == 2 and all(x["width"] > 100 for x in p)
                        and p, "the RoPE plots shown again")
        assert len(rope[1]["traces"][0]["z"][0]) == 8
        # typed values update the panel: layer 3 (global) and Enter
        rope_layer = page.locator("#anatomy-rope input[type=number]").first
        rope_layer.fill("3")
        rope_layer.press("Enter")
        wait_for(lambda: "base θ ≈ 1,000,000" in text(page, "anatomy-rope"), "the global layer's RoPE base")
        top_k = page.locator("#anatomy-output input[type=number]").first
        top_k.fill("5")
        top_k.press("Enter")
        wait_for(lambda: len(plots(page, "anatomy-output")[0]["traces"][1]["x"]) == 5, "top 5 after typing 5")
        shoot_panels(page, "anatomy-gemma3")
        browser.close()
    print(f"default model {t_default:.0f} s, + GPT-2 {t_gpt2 - t_default:.0f} s, + Gemma 3 {time.time() - t0 - t_gpt2:.0f} s")
