"""Anatomy tab: every part of a decoder, computed on the loaded model for the user's prompt.

Each panel has a plain-language caption, the formula it computes, and a live check line that
compares the panel's hand computation with the model's own forward.
"""

from __future__ import annotations

from collections import OrderedDict

import gradio as gr
import pandas as pd
import torch

from app.shared.context import Shared, default_model, endpoint, get_model, max_prompt_tokens
from app.shared.trace_store import STORE
from app.tabs.anatomy import cards_figures as cfig
from app.tabs.anatomy import figures as fig
from model_core import trace as run_trace
from model_core.anatomy import reference_cards as R
from model_core.anatomy import textbook_chapters as C
from model_core.anatomy import walkthrough as A
from model_core.core.errors import LmscopeError
from model_core.core.registry import RANDOM_CONFIGS, REGISTRY, list_models
from model_core.core.tokenization import describe_tokens

LATEX = [{"left": "$$", "right": "$$", "display": True}, {"left": "$", "right": "$", "display": False}]
GPT2_SMALL = "gpt2-small (config only)"  # older name of the GPT-2 reference card (still accepted)
# the comparison's default columns: real systems from their published configs (no weights needed);
# random-weight test configs are offered too, labelled as such
DEFAULT_COMPARE = list(R.REFERENCES)

# --- captions and formulas -------------------------------------------------------------------
TEXT = {
    "card": """**Architecture card.** The selected model's card is read from its config and weights. The comparison
puts it next to six real systems nobody here has weights for (Llama 3.2-1B, GPT-2, GPT-3 175B, Mistral 7B, DeepSeek-V2,
Granite 3B): each is built from its published configuration with transformers' own config class on PyTorch's
*meta* device (every tensor's shape, no memory), and every number is computed from that model. Parameter counts
are sums of the tensors (a tied unembedding is the embedding matrix, counted once). Where the decoder guide's
comparison table or a paper says something else, a red box shows what the source says and why the computed value
differs. Random-weight test models are labelled as such: their numbers describe shapes, not a trained model.
The KV cache keeps each layer's keys and values for every past token, so generation does not recompute them:
$$\\text{KV bytes per token} = 2 \\times \\text{layers} \\times \\text{kv heads} \\times d_{head} \\times \\text{bytes per value}$$""",
    "kv": """**KV cache vs context.** One sequence's cache grows with its length $T$, by a formula per attention kind
(fp16, 2 bytes per value):
$$\\text{MHA / GQA / MQA: } 2 \\cdot L \\cdot n_{kv} \\cdot d_{head} \\cdot T \\cdot 2\\text{ B}\\qquad
\\text{sliding window } W\\text{: } T \\to \\min(T, W)\\qquad
\\text{MLA: } L \\cdot (d_c + d_h^R) \\cdot T \\cdot 2\\text{ B}$$
MLA caches one compressed latent $d_c$ and one shared RoPE key $d_h^R$ per token and layer instead of every head's
K and V (dotted: the uncompressed size). Each line ends at the model's context length.""",
    "tree": """**Module tree.** One forward pass on your prompt with a hook on every module: each row is a module in the
order it runs, with the shape of what it outputs (batch dimension dropped; $T$ = number of tokens).
Text goes in as token ids; the embedding turns them into vectors $[T, d_{model}]$, each layer keeps that shape,
and the unembedding turns the last vectors into scores for every vocabulary entry $[T, V]$.
The params column counts each module's own tensors. A tied unembedding reuses the embedding matrix: its row says so
and it is counted once, so the column adds up to the last row's total.""",
    "attn": """**Attention, step by step.** Each token asks a question (its query $q$), every earlier token offers a label
(its key $k$) and a content (its value $v$). Their dot products are scaled by $1/\\sqrt{d_k}$ so they do not grow with
the head size, future tokens are masked out (a decoder cannot look ahead), softmax turns each row into weights that
sum to 1, and the head's output is the weighted sum of the values.
$$z = \\operatorname{softmax}\\!\\left(\\frac{QK^\\top}{\\sqrt{d_k}} + M\\right)V,\\qquad M_{ij} = \\begin{cases}0 & j \\le i\\\\ -\\infty & j > i\\end{cases}$$
On sliding-window layers (Gemma 3's local layers) the mask also hides keys more than $W-1$ tokens back:
$$M_{ij} = \\begin{cases}0 & i - W < j \\le i\\\\ -\\infty & \\text{otherwise}\\end{cases}$$
The colour scale of the three score panels is shared (the scaled scores are paler); each panel's title gives its value range.
The toggles show what the softmax would be without the scaling (sharper, often nearly one-hot) or without the mask
(every token also sees the future, and on sliding layers the far past).
The check line adds up each head's output through its slice of the output matrix, $\\sum_h z_h W_O^{(h)}$ (+ bias;
Gemma 3 then applies its post-attention norm), and compares it with what the model's attention actually returned.""",
    "rope": """**RoPE (rotary position embedding).** Instead of adding a position vector, the query and key are rotated
by an angle proportional to their position, pair of dimensions by pair of dimensions, each pair at its own speed
$\\theta_i$. The score of two rotated vectors then depends only on their distance $m-n$:
$$(R_{m}q)^\\top (R_{n}k) = q^\\top R_{n-m}\\,k,\\qquad \\theta_i = \\text{base}^{-2i/d_{head}}$$
Below: two fixed vectors (all ones) at distance $m-n$, and the angle each pair has turned at each position.""",
    "pos": """**Positions.** Attention itself does not know word order, so the model needs position information.
Left: the model's own scheme (GPT-2 adds a *learned* vector per position; RoPE models rotate q and k, shown as
$\\cos(p\\,\\theta_i)$). Right, for comparison, the fixed sinusoidal encoding of the original Transformer
(drawn as all sine columns, then all cosine columns):
$$PE_{p,2i} = \\sin\\!\\left(\\frac{p}{10000^{2i/d}}\\right),\\qquad PE_{p,2i+1} = \\cos\\!\\left(\\frac{p}{10000^{2i/d}}\\right)$$""",
    "embed": """**Embedding space.** Each token id selects one row of the embedding matrix $E$. Tokens used alike end up with
similar rows. Nearest neighbours by cosine similarity, and analogy arithmetic on the real matrix (leading spaces
matter: ␣Paris, with a leading space, and Paris are different tokens; `#123` means token id 123. Text that is
several tokens, as a word is for a byte-level tokenizer, uses its first token):
$$\\cos(a,b) = \\frac{a\\cdot b}{\\lVert a\\rVert\\,\\lVert b\\rVert},\\qquad \\text{analogy} = E_a - E_b + E_c$$""",
    "norm": """**Normalisation.** Before attention and before the MLP (and at the end), each token's residual vector is
rescaled to a standard size, then multiplied by a learned gain $g$ (LayerNorm also centres it and adds a bias $b$):
$$\\text{RMSNorm: } y = \\frac{x}{\\sqrt{\\tfrac1d\\sum_i x_i^2 + \\epsilon}}\\odot g \\qquad \\text{LayerNorm: } y = \\frac{x-\\mu}{\\sqrt{\\sigma^2+\\epsilon}}\\odot g + b$$
(Gemma stores the gain as an offset and multiplies by $1+g$.)
The check line compares the hand computation with something the model's own forward produced: the final norm's
output; or, for the norms inside a layer, what the layer's MLP (or attention, fed with every token's hand-normalised
vector up to this one) makes of the hand-normalised vector against what that block actually added to the residual.""",
    "mlp": """**MLP.** Each token, on its own, goes through a wide hidden layer of "neurons". In gated MLPs (SwiGLU / GeGLU)
one projection is passed through a smooth switch (the gate) and multiplies another; the gate decides which neurons
open. GPT-2 uses a plain GELU.
$$\\text{SwiGLU: } h = \\operatorname{SiLU}(W_{gate}x)\\odot (W_{up}x),\\quad y = W_{down}h \\qquad \\text{GELU MLP: } h = \\operatorname{GELU}(W_{in}x+b),\\quad y = W_{out}h + b'$$
The check line multiplies the neurons shown by $W_{down}$ and compares $y$ with the MLP output the model's own forward
produced (captured, not recomputed).""",
    "out": """**Output.** The last position's residual vector goes through the final norm, the unembedding matrix $W_U$ turns it
into one score (logit) per vocabulary entry, and softmax turns scores into probabilities:
$$\\text{logits} = W_U\\,\\operatorname{norm}(x_L),\\qquad p_i = \\frac{e^{\\text{logit}_i}}{\\sum_j e^{\\text{logit}_j}}$$""",
    # chapters computed on tiny random-weight models (model_core.anatomy.textbook_chapters), whatever model is selected
    "variants": """**Attention variants and the KV cache** (tiny models with **random weights**, built from transformers' own
config classes at one width: $d_{model} = 256$, 8 query heads of 32, 2 layers; your prompt as byte tokens).
MHA gives every query head its own K and V; GQA lets groups of query heads share one K/V head; MQA shares one K/V
head among all; MLA (DeepSeek-V2) caches one compressed latent $c^{KV}$ per token, from which every head's K and V are
expanded, plus one small RoPE key shared by all heads:
$$\\text{MHA/GQA/MQA: } 2 \\cdot L \\cdot n_{kv} \\cdot d_{head} \\cdot b \\qquad \\text{MLA: } L \\cdot (d_c + d^R_h) \\cdot b
\\qquad\\text{bytes per token}$$
The check lines compare each formula with the bytes of the real cache tensors after the forward pass.""",
    "norms": """**LayerNorm vs RMSNorm; pre-norm vs post-norm.** Left: one real vector, the selected model's residual at the
layer and token chosen in *Normalisation* above, through both norms with unit gain. LayerNorm subtracts the mean
and divides by the standard deviation; RMSNorm only divides by the root mean square, and
$\\text{RMS}^2 = \\sigma^2 + \\mu^2$: the two agree when the mean is 0. Right: 24 **random-weight** Llama layers
wired two ways. Pre-norm (every modern decoder) adds each block's output to an un-normalised residual, so its
norm grows with depth; post-norm (the original Transformer) normalises the sum, so it stays at $\\sqrt{d}$:
$$\\text{pre: } x \\leftarrow x + f(\\operatorname{norm}(x)) \\qquad \\text{post: } x \\leftarrow \\operatorname{norm}(x + f(x))$$""",
    "schemes": """**Position schemes side by side.** Sinusoidal (Vaswani et al. 2017) adds a fixed vector to the input;
RoPE rotates q and k by $p\\,\\theta_i$; ALiBi (Press et al. 2022) adds nothing to the vectors and instead adds a
bias $-m_h\\,(i - j)$ to each head's score, with slopes $m_h = 2^{-8h/H}$:
$$PE_{p,2i} = \\sin(p\\,\\theta_i),\\; PE_{p,2i+1} = \\cos(p\\,\\theta_i) \\qquad \\theta_i = 10000^{-2i/d}
\\qquad \\text{ALiBi: } s_{ij} = q_i \\cdot k_j - m_h (i - j)$$
Longer contexts stretch RoPE: linear interpolation slows every pair, YaRN mostly the slow ones (last plot).
The tables are the worked example with $d = 4$ at positions 0-3 ($\\theta_0 = 1$, $\\theta_1 = 0.01$). For two
all-ones vectors RoPE's score and the sinusoidal vectors' dot product fall with distance along the same curve
($\\sum_i \\cos(k\\theta_i)$); the difference is where position enters: added to the input, sinusoidal position mixes
with content inside $W_q$ and $W_k$; RoPE's score depends on the distance alone.""",
    "moe": """**Mixture of experts** (a tiny Mixtral with **random weights**: 8 experts, top-2, 2 layers; your prompt as
byte tokens). Each token's router scores every expert, $p = \\operatorname{softmax}(W_r x)$; the token goes to its
top-$k$ experts only, weighted by their renormalised probabilities. Training adds a balance loss so the experts
share the work: with $f_e$ the share of top-$k$ slots expert $e$ received and $P_e$ its mean probability,
$$\\mathcal{L}_{aux} = E \\sum_e f_e\\,P_e \\quad(= k \\text{ when perfectly balanced})$$
An untrained router is far from balanced. The check lines compare the hand computation with the router's own
outputs and the model's aux_loss, captured from its forward.""",
}


def _md(text):
    return gr.Markdown(text, latex_delimiters=LATEX)



# --- traces: kept in the web app's one trace cache (app/shared/trace_store.py) so panel controls do not
# re-run the model; looked up by what they are: (model, prompt, chat wrap)


def trace_key(model_name: str, prompt: str, chat) -> tuple:
    return (model_name, prompt, bool(chat))


def _trace(model_name, prompt, chat):
    lm = get_model(model_name)
    tr = STORE.cached(trace_key(lm.name, prompt, chat),
                      lambda: run_trace(lm, prompt, chat=bool(chat), max_tokens=max_prompt_tokens()))
    return lm, tr


def _layer(lm, layer):
    L = lm.shape.n_layers
    layer = int(layer or 0)
    if not 0 <= layer < L:
        raise gr.Error(f"Layer must be between 0 and {L - 1} for this model.")
    return layer


def _position(tr, position):
    p = int(position if position is not None else -1)
    if not -tr.n_tokens <= p < tr.n_tokens:
        raise gr.Error(f"Position must be between 0 and {tr.n_tokens - 1} (or -1 for the last token).")
    return p % tr.n_tokens


def _check(label, a, b, tol: float = 1e-3):
    diff = float((a.float().cpu() - b.float().cpu()).abs().max())
    mark = "✓" if diff < tol else "✗ MISMATCH"
    return f"{mark} check: {label}, max |difference| = {diff:.2e}"


def _tolerance(t: torch.Tensor) -> float:
    """1e-3 in float32; 16-bit models round every matmul, so allow 2 % of the values' size there."""
    if t.dtype == torch.float32 or t.dtype == torch.float64:
        return 1e-3
    return max(1e-3, 2e-2 * float(t.float().abs().max()))


# --- panels ----------------------------------------------------------------------------------------

def compare_choices() -> list[tuple[str, str]]:
    """(label, name): the reference cards (published configs, no weights), installed models, and the
    random-weight test configs, each labelled with where its numbers come from."""
    refs = [(f"{r.title} · published config, no weights", n) for n, r in R.REFERENCES.items()]
    rows = [r for r in list_models() if r["installed"]]
    real = [(r["name"], r["name"]) for r in rows if r["source"] != "random"]
    rand = [(f"{r['name']} · random weights (untrained)", r["name"]) for r in rows if r["source"] == "random"]
    return refs + real + rand


def _compare_card(name):
    """The card of one comparison column: a reference (meta device), a random-weight test config
    (meta device, labelled random), or a model lmscope serves (its loaded tensors)."""
    key = R.ALIASES.get(name, name)
    if key in R.REFERENCES:
        return R.reference_card(key), "reference"
    entry = REGISTRY.get(name)
    if entry is not None and entry.source == "random":
        return R.card(name), "random"
    lm = get_model(name)
    return R.loaded_card(lm), "random" if lm.source == "random" else "loaded"


def _column(card, kind):
    return {"title": card.get("title") or card["name"], "kind": kind, "rows": R.display_rows(card),
            "marks": R.row_marks(card), "notes": card.get("notes", [])}


@endpoint(model=True)
def card_panel(model_name, compare, request: gr.Request = None):
    """The selected model's own card, then every card side by side (the sources' statements next to
    the computed values), parameters by part and KV-cache growth with context."""
    lm = get_model(model_name)
    single = A.card_frame(A.architecture_card(lm))
    own = R.loaded_card(lm)
    kind = "random" if lm.source == "random" else "loaded"
    single = pd.concat([pd.DataFrame([("weights", own["weights"])], columns=single.columns), single],
                       ignore_index=True)
    cards = OrderedDict([(own["title"], (own, kind))])
    for name in compare or []:
        if not name or name == lm.name:
            continue
        c, k = _compare_card(name)
        cards.setdefault(c.get("title") or c["name"], (c, k))
    table_html = cfig.comparison_html([_column(c, k) for c, k in cards.values()])
    plain = OrderedDict((t, c) for t, (c, _) in cards.items())
    return (single, table_html, cfig.param_share_figure(plain), cfig.kv_growth_figure(R.kv_growth(plain)))


@endpoint(model=True)
def tree_panel(model_name, prompt, chat, request: gr.Request = None):
    lm, tr = _trace(model_name, prompt, chat)
    rows = A.module_tree(lm, tr.token_ids)
    T = tr.n_tokens
    note = (f"T = {T} tokens: " + " ".join(f"`{t['display']}`" for t in tr.tokens[:40])
            + (" …" if T > 40 else ""))
    return A.tree_frame(rows), note


@endpoint(model=True)
def attention_panel(model_name, prompt, chat, layer, head, no_scale, no_mask, request: gr.Request = None):
    lm, tr = _trace(model_name, prompt, chat)
    layer = _layer(lm, layer)
    H = lm.shape.n_heads
    head = int(head or 0)
    if not 0 <= head < H:
        raise gr.Error(f"Head must be between 0 and {H - 1} for this model.")
    step = A.attention_step(tr, layer, head)
    extra = ""
    if step["softcap"]:
        extra += f" The model also soft-caps scores: $c\\tanh(s/c)$ with $c = {step['softcap']}$."
    window = lm.adapter.sliding_window(layer)
    if window:
        extra += f" This layer uses a sliding window: each token sees only the last {window} tokens."
    # an independent check: every head's z through its slice of W_O, summed (+ bias, + Gemma's
    # post-attention norm), against the attention output the model's own forward returned
    with torch.inference_mode():
        mine, ref = A.check_attention(tr, layer)
    info = (f"Scale used by the model: {step['scale']:.5g} (1/√d_k = {1 / lm.shape.d_head ** 0.5:.5g}).{extra}\n\n"
            + _rope_note(step, tr) +
            _check(f"Σ over all {H} heads of z_h·W_O (+ bias) vs the model's own attention output, layer {layer}",
                   mine, ref, _tolerance(ref)))
    rot = (gr.update(value=fig.rope_rotation_step(step, tr.tokens), visible=True) if step["rope"]
           else gr.update(value=None, visible=False))
    return (fig.attention_steps(step, tr.tokens), fig.attention_variants(step, tr.tokens, no_scale, no_mask),
            info, rot)


def _rope_note(step, tr) -> str:
    """Q and K are shown after RoPE: the rotation, this model's pairing and a worked pair."""
    r = step["rope"]
    if not r:
        return ("This model adds learned position vectors to its input (no RoPE): Q and K are W_q·x and W_k·x "
                "(+ bias).\n\n")
    d = r["q_pre"].shape[1]
    p = tr.n_tokens - 1
    ex = A.rope_pair_example(r["q_pre"][p], r["inv_freq"], p, 0)
    (i, j), (a, b), (a2, b2) = ex["dims"], ex["before"], ex["after"]
    return (f"**Q and K are shown after RoPE.** The model computes W_q·x and W_k·x, then rotates them by position "
            f"(the rotation step below); recomputing Q from W_q·x alone is off by up to {r['max_change_q']:.3g} "
            f"here. This model pairs dimension i with i + {d // 2} (d/2; Hugging Face's `rotate_half` layout): "
            f"$(a, b) = (q_i, q_{{i+{d // 2}}}) \\mapsto (a\\cos p\\theta_i - b\\sin p\\theta_i,\\; "
            f"b\\cos p\\theta_i + a\\sin p\\theta_i)$. The texts' adjacent-pair form rotates "
            f"$(q_{{2i}}, q_{{2i+1}})$ by the same angles: the same rotation of a vector whose dimensions are ordered "
            f"differently (converted checkpoints permute the rows of W_q and W_k). Worked pair {ex['pair']} at "
            f"position {p}: dimensions ({i}, {j}) = ({a:.4f}, {b:.4f}), angle {p} × {ex['theta']:.5g} = "
            f"{ex['angle']:.4f} rad → ({a2:.4f}, {b2:.4f}); Q after RoPE has ({float(step['q'][p, i]):.4f}, "
            f"{float(step['q'][p, j]):.4f}).\n\n")


@endpoint(model=True)
def rope_panel(model_name, layer, max_distance, request: gr.Request = None):
    lm = get_model(model_name)
    if not lm.adapter.uses_rope:  # no plots to show: hide their boxes, keep the note
        hidden = gr.update(value=None, visible=False)
        return hidden, hidden, f"Model '{lm.name}' does not use RoPE: it adds learned position vectors (see Positions)."
    layer = _layer(lm, layer)
    data = A.rope_score_vs_distance(lm, layer, int(max_distance or 256))
    inv = A.rope_inv_freq(lm, layer)
    theta = inv[1] ** (-lm.shape.d_head / 2) if inv.numel() > 1 else float("nan")
    info = (f"Layer {layer}: {inv.numel()} dimension pairs, base θ ≈ {float(theta):,.0f}; fastest pair turns "
            f"{float(inv[0]):.3g} rad per position, slowest {float(inv[-1]):.3g} rad "
            f"(a full turn every {A.rope_full_turn_positions(inv):,.0f} positions).")
    return (gr.update(value=fig.rope_distance(data, f"Layer {layer}: score of q = k = 1 vs distance"), visible=True),
            gr.update(value=fig.rope_angles(A.rope_angles(lm, layer, 128)), visible=True), info)


@endpoint(model=True)
def positions_panel(model_name, n_positions, request: gr.Request = None):
    lm = get_model(model_name)
    n = int(n_positions or 64)
    n = max(2, min(n, lm.shape.context_length))
    learned = A.learned_positions(lm, n)
    if learned is not None:
        # random-weight test models never learned anything: their table is initialisation noise
        kind = ("untrained position embeddings (random weights, not learned)" if lm.source == "random"
                else "learned position embeddings")
        own, title = learned, f"{kind} [{n}, {learned.shape[1]}]"
        d, xtitle = learned.shape[1], "dimension"
    else:
        ang = A.rope_angles(lm, 0, n)
        own, title = torch.cos(ang), f"RoPE cos(p·θᵢ), layer 0 [{n}, {ang.shape[1]} pairs]"
        d, xtitle = lm.shape.d_model, "dimension pair i"
    pe = A.sinusoidal_encoding(n, d)
    # shown as all sines, then all cosines (the usual picture; stored interleaved sin, cos, sin, ...)
    return fig.positions_side_by_side(own, title, torch.cat([pe[:, 0::2], pe[:, 1::2]], dim=1), own_xtitle=xtitle)


@endpoint(model=True)
def embed_panel(model_name, token, a, b, c, k, request: gr.Request = None):
    """Neighbours and analogy. Text that is several tokens (a word, for a byte-level tokenizer)
    uses its first token, with a note; on any other error the plots are cleared (no stale
    neighbours of another model or input) and the note says why."""
    try:
        lm = get_model(model_name)
        k = max(1, min(int(k or 10), 50))
        ids, notes = [], []
        for text in (token, a, b, c):
            i, note = A.resolve_token(lm, text)
            ids.append(i)
            if note:
                notes.append(note)
        shown = [f"'{t['display']}'" for t in describe_tokens(lm.tokenizer, ids)]
        near = A.nearest_tokens(lm, ids[0], k)
        ana = A.analogy(lm, ids[1], ids[2], ids[3], k)
    except gr.Error as e:
        msg = getattr(e, "message", None) or str(e)
        gr.Warning(msg)
        return None, None, f"⚠ {msg}"
    except (LmscopeError, KeyError, IndexError, ValueError, TypeError) as e:
        gr.Warning(str(e))
        return None, None, f"⚠ {e}"
    return (fig.neighbours_bar(near, f"Nearest to {shown[0]}"),
            fig.neighbours_bar(ana, f"{shown[1]} − {shown[2]} + {shown[3]}"),
            " ".join(f"Note: {n}" for n in notes))


@endpoint(model=True)
def norm_panel(model_name, prompt, chat, layer, position, which, request: gr.Request = None):
    lm, tr = _trace(model_name, prompt, chat)
    layer = _layer(lm, layer)
    pos = _position(tr, position)
    which = {"before attention": "attn", "before MLP": "mlp", "final norm": "final"}[which]
    s = A.norm_step(tr, layer, pos, which)
    # against the model's own forward: the final norm's captured output; or the layer's MLP /
    # attention fed with the hand-normalised vector(s) vs what that block added to the residual
    mine, ref = A.check_norm(tr, layer, pos, which, s["out"])
    label = {"final": "hand computation vs the model's own final-norm output (captured)",
             "mlp": f"the layer's MLP applied to the hand-normalised vector vs the model's own MLP output "
                    f"(captured hook_mlp_out), token {pos}",
             "attn": f"the layer's attention fed with the hand-normalised vectors vs the model's own attention "
                     f"output (captured hook_attn_out), token {pos}"}[which]
    stats = (f"mean {s['mean']:.4g}, std {s['std']:.4g}" if s["type"] == "LayerNorm" else f"RMS {s['rms']:.4g}")
    info = (f"Token {pos} `{tr.tokens[pos]['display']}` — {s['class']}: {stats}, ε = {s['eps']:g}; the vector is divided "
            f"by {s['scale']:.4g}, then multiplied by the gain g, one number per dimension: "
            f"{_gain_words(s['gain_stats'], s['gain_offset'])}\n\n"
            + _check(label, mine, ref, _tolerance(ref)))
    return fig.norm_before_after(s), info


def _gain_words(st: dict, offset: float) -> str:
    g = "1 + w" if offset else "g"
    return (f"{g} ranges {st['min']:.3g} … {st['max']:.3g} (median {st['median']:.3g}, mean {st['mean']:.3g}, "
            f"mean |{g}| {st['mean_abs']:.3g}); {st['negative']:.0%} of the {st['n']} gains are negative "
            f"(those dimensions flip sign). The bottom plot shows every gain.")


@endpoint(model=True)
def mlp_panel(model_name, prompt, chat, layer, position, request: gr.Request = None):
    lm, tr = _trace(model_name, prompt, chat)
    layer = _layer(lm, layer)
    pos = _position(tr, position)
    s = A.mlp_step(tr, layer, pos, top_k=40)
    hidden = s["product"] if s["gated"] else s["post"]
    # W_down·h of the neurons shown vs the MLP output the model's own forward produced (captured)
    mine, ref = A.check_mlp(tr, layer, pos, hidden)
    info = (f"Token {pos} `{tr.tokens[pos]['display']}`, layer {layer}: {hidden.numel()} neurons.\n\n"
            + _check("W_down · h of these neurons vs the model's own MLP output (captured hook_mlp_out)",
                     mine, ref, _tolerance(ref)))
    return fig.mlp_neurons(s), fig.mlp_gate_scatter(s), info


@endpoint(model=True)
def output_panel(model_name, prompt, chat, k, request: gr.Request = None):
    lm, tr = _trace(model_name, prompt, chat)
    s = A.output_step(tr, top_k=max(1, min(int(k or 10), 50)))
    info = (f"Last position: `{tr.tokens[-1]['display']}`; final hidden state [{s['hidden'].numel()}] → "
            f"logits [{s['logits'].numel():,}] → softmax.\n\n"
            + _check("W_U · final norm vs the model's own logits (captured)", *A.check_output(tr, s["logits"]),
                     _tolerance(tr.next_logits)))
    return fig.output_bars(s), fig.logits_histogram(s), info


# --- chapters on tiny random-weight models (model_core.anatomy.textbook_chapters) ----------------------------------

def _kv_check(rows) -> str:
    return "\n\n".join(
        _check(f"{r['variant']}: formula {r['formula']} × {r['tokens cached']} tokens vs the real cache tensors",
               torch.tensor(float(r["formula B/token"] * r["tokens cached"])), torch.tensor(float(r["measured total B"])),
               0.5) for r in rows)


@endpoint(model=True)
def variants_panel(prompt, request: gr.Request = None):
    ids = C.byte_ids(prompt, 48)
    v = C.attention_variants(ids)
    # short headers (the formulas are in the check lines below the table)
    cols = {"variant": "variant", "config": "config", "query heads": "query heads",
            "cached per layer and token": "cached per layer and token", "formula B/token": "formula B/token",
            "measured B/token": "measured B/token", "16-bit B/token": "16-bit B/token", "vs MHA": "vs MHA",
            "attention params / layer": "attention params/layer"}
    table = pd.DataFrame([{h: (f"{r[k]:,.0f}" if isinstance(r[k], (int, float)) and k != "query heads" else r[k])
                           for k, h in cols.items()} for r in v["rows"]])
    labels = [f"{i}:{chr(t) if 32 <= t < 127 else '·'}" for i, t in enumerate(ids)]
    return (table, fig.kv_variants_bars(v["rows"]), fig.variant_patterns(v["patterns"], labels),
            f"All four: {C.RANDOM}, {len(ids)} byte tokens.\n\n" + _kv_check(v["rows"]))


def _growth_check(g) -> str:
    mine, own = g["wiring_check"]
    return _check("the pre-norm wiring here vs the model's own forward (its hidden states, layer by layer)",
                  mine, own)


@endpoint(model=True)
def norms_chapter_panel(model_name, prompt, chat, layer, position, request: gr.Request = None):
    lm, tr = _trace(model_name, prompt, chat)
    layer = _layer(lm, layer)
    pos = _position(tr, position)
    nc = C.norm_compare(tr.resid_pre[layer][pos])
    g = C.residual_growth(C.byte_ids(prompt, 48))
    rms2, var_mu2 = nc["identity"]
    info = (f"Token {pos} `{tr.tokens[pos]['display']}`, residual entering layer {layer} of {lm.name}: mean "
            f"{nc['mean']:.4g}, std {nc['std']:.4g}, RMS {nc['rms']:.4g} (RMS² = {rms2:.6g} = σ² + μ² = {var_mu2:.6g}). "
            f"LayerNorm and RMSNorm of it differ by up to {nc['max_ln_vs_rms']:.3g}; after centring the vector they "
            f"agree to {nc['centred_agree']:.1e}. The hand formulas equal torch's own layer_norm / rms_norm to "
            f"{float((nc['layernorm'] - nc['ref_layernorm']).abs().max()):.1e} / "
            f"{float((nc['rmsnorm'] - nc['ref_rmsnorm']).abs().max()):.1e}.\n\n"
            f"Pre- vs post-norm ({C.RANDOM}): after {g['layers']} layers the pre-norm residual's norm is "
            f"{g['pre'][-1]:.3g} ({g['pre'][-1] / g['pre'][0]:.3g}× the embedding's {g['pre'][0]:.3g}); post-norm stays "
            f"at {g['post'][-1]:.4g} = √{g['d_model']}.\n\n" + _growth_check(g))
    return fig.norm_compare_bars(nc), fig.residual_growth_lines(g), info


def _fmt4(t) -> str:
    return ", ".join(f"{float(v):.4f}" for v in t)


@endpoint
def schemes_panel(n_heads, max_distance, request: gr.Request = None):
    H = int(n_heads or 8)
    if not 1 <= H <= 64:
        raise gr.Error("ALiBi heads must be between 1 and 64.")
    D = max(8, min(int(max_distance or 128), 4096))
    pe = C.sinusoidal(4, 4)
    sin_df = pd.DataFrame([{"position p": p, "sin(p·θ₀)": f"{pe[p, 0]:.4f}", "cos(p·θ₀)": f"{pe[p, 1]:.4f}",
                            "sin(p·θ₁)": f"{pe[p, 2]:.4f}", "cos(p·θ₁)": f"{pe[p, 3]:.4f}"} for p in range(4)])
    w = C.rope_worked()
    rope_df = pd.DataFrame([{"position p": r["position"], "angles p·θ₀, p·θ₁ (rad)": _fmt4(r["angles"]),
                             "q rotated, rotate_half: pairs (q₀,q₂), (q₁,q₃)": _fmt4(r["rotate_half"]),
                             "q rotated, adjacent: pairs (q₀,q₁), (q₂,q₃)": _fmt4(r["adjacent"])} for r in w["rows"]])
    bias = C.alibi_bias(4, H)
    m = C.alibi_slopes(H)
    alibi_df = pd.DataFrame([{"query i": i, **{f"key {j}": ("−∞ (masked)" if j > i else f"{float(bias[0, i, j]):.4g}")
                                                  for j in range(4)}} for i in range(4)])
    info = (f"q = ({_fmt4(w['q'])}), θ = ({_fmt4(w['theta'])}). Both pairings turn by the same angles but pair "
            f"different dimensions, so the rotated vectors differ: a model's weights are stored for one of them. "
            f"ALiBi slopes for {H} heads: " + ", ".join(f"{float(v):.4g}" for v in m[:8])
            + (" …" if H > 8 else "") + f"; the table is head 1 (m = {float(m[0]):.4g}).")
    rs = C.rope_scaling()
    fast = int((rs["yarn"] == rs["default"]).sum())
    info += (f"\n\nRoPE scaling (below): to reach {rs['factor']:g}× the context, linear interpolation slows every pair "
             f"by {rs['factor']:g}; YaRN keeps the {fast} fastest pairs as they were (they turn many times within the "
             f"original {rs['original_context']:,} positions), slows the slowest by {rs['factor']:g} and scales the "
             f"attention logits by {rs['yarn_attention_factor']:.4g}. Both from transformers' own RoPE init functions.")
    return (sin_df, rope_df, alibi_df, fig.position_schemes(C.position_scores(D, 64, H), bias), info,
            fig.rope_scaling_lines(rs))


def _moe_check(r) -> str:
    T = r["tokens"]
    return "\n\n".join([
        _check(f"router logits W_r·x by hand vs the router's own output (captured), layer {r['layer']}",
               r["logits"], r["captured_logits"]),
        _check(f"top-{r['top_k']} experts by hand vs the router's own choice: {r['same_choice']} of {T} tokens agree",
               torch.tensor(float(T - r["same_choice"])), torch.tensor(0.0), 0.5),
        _check("balance loss by hand (all layers) vs the model's own aux_loss",
               torch.tensor(r["aux_loss"]), torch.tensor(r["aux_loss_model"]))])


@endpoint(model=True)
def moe_panel(prompt, layer, request: gr.Request = None):
    ids = C.byte_ids(prompt, 48)
    r = C.moe_routing(ids, int(layer or 0))
    labels = [f"{i}:{chr(t) if 32 <= t < 127 else '·'}" for i, t in enumerate(ids)]
    busiest = int(r["load"].argmax())
    info = (f"{C.RANDOM}. Layer {r['layer']}: expert E{busiest} takes {float(r['load'][busiest]) / r['top_k']:.0%} of "
            f"the top-{r['top_k']} slots (balanced: {1 / r['n_experts']:.0%}); "
            f"{int((r['load'] == 0).sum())} expert(s) get no token.\n\n" + _moe_check(r))
    return fig.moe_router(r, labels), info


@endpoint(model=True)
def model_changed(model_name, layer, head, norm_layer=None, mlp_layer=None, rope_layer=None,
                  request: gr.Request = None):
    """The layer/head sliders' ranges for the model, each keeping its own value (clamped): a link's
    MLP layer survives "Show anatomy" (app/tabs/anatomy/link.py)."""
    lm = get_model(model_name)
    L, H = lm.shape.n_layers, lm.shape.n_heads
    sl = lambda mx, v: gr.Slider(minimum=0, maximum=mx, step=1, value=min(int(v or 0), mx))  # noqa: E731
    own = lambda v: layer if v is None else v  # noqa: E731
    return (sl(L - 1, layer), sl(H - 1, head), sl(L - 1, own(norm_layer)), sl(L - 1, own(mlp_layer)),
            sl(L - 1, own(rope_layer)))


def _initial_shape(name: str) -> tuple[int, int]:
    """Layers and heads of the default model for the sliders' first range, read from its config
    without loading weights (the first 'Show anatomy' sets the real range for any model)."""
    try:
        from transformers import AutoConfig

        from model_core.core.registry import converted_dir, is_ready

        if name in RANDOM_CONFIGS:
            cfg = dict(RANDOM_CONFIGS[name])
            config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
        elif is_ready(name) and name in REGISTRY:
            config = AutoConfig.from_pretrained(str(converted_dir(name)))
        else:
            return 1, 1
        return int(config.num_hidden_layers), int(config.num_attention_heads)
    except Exception:  # noqa: BLE001 - only a slider range; the real one comes with the first event
        return 1, 1


# --- layout ------------------------------------------------------------------------------------------

def build(shared: Shared) -> None:
    """Build the Anatomy panels inside an already-open gr.Tab."""
    L0, H0 = _initial_shape(default_model())
    gr.Markdown("Every part of a decoder, computed on the selected model for your prompt. "
                "Press **Show anatomy**; panel controls then update their own panel.")
    go_btn = gr.Button("Show anatomy", variant="primary", elem_id="anatomy-go")
    m, p, c = shared.model, shared.prompt, shared.chat

    with gr.Accordion("Architecture card", open=True, elem_id="anatomy-card"):
        _md(TEXT["card"])
        with gr.Accordion("This model only", open=False):
            card_df = gr.Dataframe(label="This model", interactive=False, wrap=True)
        choices = compare_choices()
        compare = gr.Dropdown(choices=choices, value=[n for n in DEFAULT_COMPARE if n in {v for _, v in choices}],
                              multiselect=True, allow_custom_value=False,
                              label="Compare with (the selected model is the first column; reference systems are "
                                    "built from their published configs on PyTorch's meta device, no weights)")
        compare_df = gr.HTML(elem_id="anatomy-compare")
        params_plot = gr.Plot(label="Parameters by part")
        _md(TEXT["kv"])
        kv_plot = gr.Plot(label="KV cache vs context", elem_id="anatomy-kv-growth")

    with gr.Accordion("Module tree with shapes", open=False, elem_id="anatomy-tree"):
        _md(TEXT["tree"])
        tree_note = gr.Markdown()
        tree_df = gr.Dataframe(interactive=False, max_height=600)

    with gr.Accordion("Attention, step by step", open=True, elem_id="anatomy-attention"):
        _md(TEXT["attn"])
        with gr.Row():
            a_layer = gr.Slider(0, L0 - 1, value=0, step=1, label="Layer")
            a_head = gr.Slider(0, H0 - 1, value=0, step=1, label="Head")
            no_scale = gr.Checkbox(value=True, label="show without scaling")
            no_mask = gr.Checkbox(value=True, label="show without mask")
        attn_info = _md("")
        attn_plot = gr.Plot(label="Steps")
        attn_rot = gr.Plot(label="The rotation step (RoPE)", elem_id="anatomy-rope-step")
        attn_var = gr.Plot(label="Variants")

    with gr.Accordion("RoPE: rotation and distance", open=False, elem_id="anatomy-rope"):
        _md(TEXT["rope"])
        with gr.Row():
            r_layer = gr.Slider(0, L0 - 1, value=0, step=1, label="Layer (Gemma 3: local and global layers differ)")
            r_dist = gr.Slider(8, 2048, value=256, step=8, label="Max distance")
        rope_info = gr.Markdown()
        with gr.Row():
            rope_plot = gr.Plot()
            rope_ang = gr.Plot()

    with gr.Accordion("Positions", open=False, elem_id="anatomy-positions"):
        _md(TEXT["pos"])
        n_pos = gr.Slider(8, 512, value=64, step=8, label="Positions shown")
        pos_plot = gr.Plot()

    with gr.Accordion("Embedding space", open=False, elem_id="anatomy-embedding"):
        _md(TEXT["embed"])
        with gr.Row():
            # the defaults start with a space (a word inside a sentence): the labels say so, since
            # a text box does not show a leading space
            e_tok = gr.Textbox(value=" Paris", label="Token (␣Paris)", placeholder="␣Paris or #id")
            e_a = gr.Textbox(value=" king", label="a (␣king)", placeholder="␣king")
            e_b = gr.Textbox(value=" man", label="− b (␣man)", placeholder="␣man")
            e_c = gr.Textbox(value=" woman", label="+ c (␣woman)", placeholder="␣woman")
            e_k = gr.Number(value=10, precision=0, minimum=1, maximum=50, label="How many")
            e_btn = gr.Button("Find")
        emb_info = gr.Markdown()
        with gr.Row():
            near_plot = gr.Plot()
            ana_plot = gr.Plot()

    with gr.Accordion("Normalisation", open=False, elem_id="anatomy-norm"):
        _md(TEXT["norm"])
        with gr.Row():
            n_layer = gr.Slider(0, L0 - 1, value=0, step=1, label="Layer")
            n_posn = gr.Number(value=-1, precision=0, label="Token position (-1 = last)")
            n_which = gr.Radio(["before attention", "before MLP", "final norm"], value="before attention",
                               label="Which norm")
        norm_info = _md("")
        norm_plot = gr.Plot()

    with gr.Accordion("MLP", open=False, elem_id="anatomy-mlp"):
        _md(TEXT["mlp"])
        with gr.Row():
            m_layer = gr.Slider(0, L0 - 1, value=0, step=1, label="Layer")
            m_pos = gr.Number(value=-1, precision=0, label="Token position (-1 = last)")
        mlp_info = _md("")
        with gr.Row():
            mlp_plot = gr.Plot()
            mlp_scatter = gr.Plot()

    with gr.Accordion("Output: hidden state → logits → probabilities", open=True, elem_id="anatomy-output"):
        _md(TEXT["out"])
        o_k = gr.Slider(3, 30, value=10, step=1, label="Top k")
        out_info = _md("")
        with gr.Row():
            out_plot = gr.Plot()
            out_hist = gr.Plot()

    # --- chapters computed on tiny random-weight models ---
    with gr.Accordion("Attention variants and the KV cache (random weights)", open=False,
                      elem_id="anatomy-kv-variants"):
        _md(TEXT["variants"])
        var_info = _md("")
        var_df = gr.Dataframe(label="Same width, four attention variants", interactive=False, wrap=True,
                              column_widths=["7%", "14%", "7%", "20%", "10%", "10%", "9%", "8%", "15%"])
        with gr.Row():
            var_bars = gr.Plot()
            var_pat = gr.Plot()

    with gr.Accordion("Norms: LayerNorm vs RMSNorm, pre-norm vs post-norm", open=False, elem_id="anatomy-norm-chapter"):
        _md(TEXT["norms"])
        nch_info = _md("")
        with gr.Row():
            nch_plot = gr.Plot()
            growth_plot = gr.Plot()

    with gr.Accordion("Position schemes: sinusoidal, RoPE, ALiBi (d = 4 worked example)", open=False,
                      elem_id="anatomy-position-schemes"):
        _md(TEXT["schemes"])
        with gr.Row():
            s_heads = gr.Number(value=8, precision=0, minimum=1, maximum=64, label="ALiBi heads")
            s_dist = gr.Slider(8, 1024, value=128, step=8, label="Max distance")
        sch_info = _md("")
        sin_df = gr.Dataframe(label="Sinusoidal, d = 4, positions 0-3", interactive=False)
        rope_df = gr.Dataframe(label="RoPE, d = 4, q = (1, 2, 3, 4), positions 0-3", interactive=False, wrap=True)
        alibi_df = gr.Dataframe(label="ALiBi bias added to head 1's scores, positions 0-3", interactive=False)
        sch_plot = gr.Plot()
        scaling_plot = gr.Plot()

    with gr.Accordion("Mixture of experts: the router (random weights)", open=False, elem_id="anatomy-moe"):
        _md(TEXT["moe"])
        moe_layer = gr.Slider(0, C.MOE["num_hidden_layers"] - 1, value=0, step=1, label="MoE layer")
        moe_info = _md("")
        moe_plot = gr.Plot()

    # --- entropy, cross-entropy, KL and MFU on this model's numbers (its own button and controls) ---
    with gr.Accordion("Entropy, cross-entropy, KL and MFU", open=False, elem_id="anatomy-info"):
        _md(INFO_TEXT)
        with gr.Row():
            i_temp = gr.Slider(0.1, 5, value=2.0, step=0.1, label="Q = P at temperature T", elem_id="info-temp")
            i_other = gr.Dropdown([r["name"] for r in list_models() if r.get("source") == "finetuned"
                                   and r.get("kind") != "reward"], value=None,
                                  label="or Q = a fine-tuned model (empty: temperature T)", elem_id="info-other")
            i_btn = gr.Button("Compute", variant="primary", elem_id="info-go")
        i_info = _md("")
        with gr.Row():
            i_ce = gr.Plot(elem_id="info-ce")
            i_kl = gr.Plot(elem_id="info-kl")
        _md(MFU_TEXT)
        from model_core.interp.infotheory import DEFAULT_PEAK, PEAKS

        with gr.Row():
            f_src = gr.Dropdown([GEN_SOURCE], value=GEN_SOURCE, label="measured tokens/s from", elem_id="mfu-source")
            f_measure = gr.Button("Measure", elem_id="mfu-measure")
            f_mode = gr.Radio(["training", "inference"], value="inference", label="FLOPs per token",
                              elem_id="mfu-mode")
        with gr.Row():
            f_tps = gr.Number(value=None, label="tokens/s", elem_id="mfu-tps")
            f_n = gr.Number(value=None, label="N (parameters)", elem_id="mfu-n")
            f_peak = gr.Dropdown(list(PEAKS), value=DEFAULT_PEAK, label="peak", elem_id="mfu-peak")
            f_custom = gr.Number(value=None, label="or peak in TFLOP/s", elem_id="mfu-custom")
        f_note = _md("")
        f_out = _md("")
        f_plot = gr.Plot(elem_id="mfu-plot")

    # --- events ---
    card_io = dict(fn=card_panel, inputs=[m, compare], outputs=[card_df, compare_df, params_plot, kv_plot])
    tree_io = dict(fn=tree_panel, inputs=[m, p, c], outputs=[tree_df, tree_note])
    attn_io = dict(fn=attention_panel, inputs=[m, p, c, a_layer, a_head, no_scale, no_mask],
                   outputs=[attn_plot, attn_var, attn_info, attn_rot])
    rope_io = dict(fn=rope_panel, inputs=[m, r_layer, r_dist], outputs=[rope_plot, rope_ang, rope_info])
    pos_io = dict(fn=positions_panel, inputs=[m, n_pos], outputs=[pos_plot])
    emb_io = dict(fn=embed_panel, inputs=[m, e_tok, e_a, e_b, e_c, e_k], outputs=[near_plot, ana_plot, emb_info])
    norm_io = dict(fn=norm_panel, inputs=[m, p, c, n_layer, n_posn, n_which], outputs=[norm_plot, norm_info])
    mlp_io = dict(fn=mlp_panel, inputs=[m, p, c, m_layer, m_pos], outputs=[mlp_plot, mlp_scatter, mlp_info])
    out_io = dict(fn=output_panel, inputs=[m, p, c, o_k], outputs=[out_plot, out_hist, out_info])

    ev = go_btn.click(fn=model_changed, inputs=[m, a_layer, a_head, n_layer, m_layer, r_layer],
                      outputs=[a_layer, a_head, n_layer, m_layer, r_layer])
    # The chain after "Show anatomy" carries the public names (/anatomy_card, ...); the same panels
    # fired by their own controls below are private wiring.
    for name, io in (("card", card_io), ("tree", tree_io), ("attention", attn_io), ("rope", rope_io),
                     ("positions", pos_io), ("norm", norm_io), ("mlp", mlp_io), ("output", out_io)):
        ev = ev.then(**io, api_name=f"anatomy_{name}")
    # the chapters (private events), then the embeddings: still the chain's last step
    variants_io = dict(fn=variants_panel, inputs=[p], outputs=[var_df, var_bars, var_pat, var_info])
    nch_io = dict(fn=norms_chapter_panel, inputs=[m, p, c, n_layer, n_posn], outputs=[nch_plot, growth_plot, nch_info])
    sch_io = dict(fn=schemes_panel, inputs=[s_heads, s_dist], outputs=[sin_df, rope_df, alibi_df, sch_plot, sch_info, scaling_plot])
    moe_io = dict(fn=moe_panel, inputs=[p, moe_layer], outputs=[moe_plot, moe_info])
    for io in (variants_io, nch_io, sch_io, moe_io):
        ev = ev.then(**io)
    ev = ev.then(**emb_io, api_name="anatomy_embeddings")
    for ctl in (n_layer, n_posn):
        ctl.change(**nch_io)
    s_heads.change(**sch_io)
    s_dist.input(**sch_io, trigger_mode="always_last")
    moe_layer.change(**moe_io)

    m.change(fn=model_changed, inputs=[m, a_layer, a_head, n_layer, m_layer, r_layer],
             outputs=[a_layer, a_head, n_layer, m_layer, r_layer])
    compare.change(**card_io)
    for ctl in (a_layer, a_head, no_scale, no_mask):
        ctl.change(**attn_io)
    # .input: a drag, or a number typed in the slider's box (Enter or not); always_last keeps the final value
    for ctl in (r_layer, r_dist):
        ctl.input(**rope_io, trigger_mode="always_last")
    n_pos.input(**pos_io, trigger_mode="always_last")
    e_btn.click(**emb_io)
    for ctl in (n_layer, n_posn, n_which):
        ctl.change(**norm_io)
    for ctl in (m_layer, m_pos):
        ctl.change(**mlp_io)
    o_k.input(**out_io, trigger_mode="always_last")

    i_btn.click(info_panel, [m, p, c, i_temp, i_other], [i_info, i_ce, i_kl])
    pickers = getattr(shared, "pickers", None)
    if pickers is not None:
        pickers.append((i_other, "finetuned"))
    f_src.focus(mfu_sources, None, [f_src])
    mfu_io = dict(fn=mfu_panel, inputs=[f_n, f_tps, f_mode, f_peak, f_custom], outputs=[f_out, f_plot])
    f_measure.click(measure_panel, [m, p, c, f_src], [f_tps, f_n, f_mode, f_note]).success(**mfu_io)
    for ctl in (f_mode, f_peak):
        ctl.change(**mfu_io)
    for ctl in (f_tps, f_n, f_custom):
        ctl.submit(**mfu_io)

    # the tab in the link: panels open, every control, "Show anatomy" (issue 15 item 5)
    from app.tabs.anatomy import link as anatomy_link

    anatomy_link.wire(shared, go_btn, {
        "an_cmp": compare, "an_layer": a_layer, "an_head": a_head, "an_noscale": no_scale, "an_nomask": no_mask,
        "an_rope_layer": r_layer, "an_rope_dist": r_dist, "an_positions": n_pos, "an_tok": e_tok, "an_a": e_a,
        "an_b": e_b, "an_c": e_c, "an_near": e_k, "an_norm_layer": n_layer, "an_norm_pos": n_posn, "an_norm": n_which,
        "an_mlp_layer": m_layer, "an_mlp_pos": m_pos, "an_top_k": o_k, "an_alibi_heads": s_heads,
        "an_scheme_dist": s_dist, "an_moe_layer": moe_layer,
    }, _initial_shape, C.MOE["num_hidden_layers"], lambda: [v for _, v in compare_choices()])


def card_table_for(names: list[str]) -> pd.DataFrame:
    """The comparison for a list of names (references, random configs, served models) as a table:
    one row per property, one column per model (used by docs and tests)."""
    cols = [_compare_card(n)[0] for n in names]
    rows = [R.display_rows(c) for c in cols]
    labels = list(OrderedDict.fromkeys(k for r in rows for k in r))
    data = {c.get("title") or c["name"]: [r.get(k, "—") for k in labels] for c, r in zip(cols, rows)}
    return pd.DataFrame(data, index=pd.Index(labels, name="property")).reset_index()


# --- entropy, cross-entropy, KL and MFU on the model's own distributions (model_core.interp.infotheory) ---

INFO_TEXT = """**Entropy, cross-entropy, KL — on this model's real numbers.** For the next token after your prompt the model
gives a distribution $P$. Its **entropy** $H(P) = -\\sum_x P(x)\\log P(x)$ is how unsure it is (nats; ÷ ln 2 for bits;
$e^{H}$ = the number of equally likely tokens that would be as unsure). The **cross-entropy** of the prompt's own
tokens, $\\frac{1}{T-1}\\sum_t -\\log P(x_{t+1}\\mid x_{\\le t})$, is the loss a language model is trained on;
$e^{\\text{CE}}$ is the perplexity. The **KL divergence** $\\mathrm{KL}(P\\|Q) = \\sum_x P(x)\\,(\\log P(x) - \\log Q(x))$
measures what it costs to use $Q$ where $P$ is true; it is not symmetric, and $\\mathrm{CE}(P,Q) = H(P) + \\mathrm{KL}(P\\|Q)$.
Pick $Q$: the same logits at temperature $T$, or a fine-tuned model (same vocabulary) after the same prompt."""

MFU_TEXT = """**Model FLOPs utilisation.** A forward pass costs about $2N$ FLOPs per token ($N$ parameters, one multiply
and one add each), training about $6N$ (forward $2N$ + backward $4N$). With a measured throughput,
$$\\text{MFU} = \\frac{k \\cdot N \\cdot \\text{tokens/s}}{\\text{peak FLOP/s}},\\qquad k = 6\\ \\text{(training)},\\ 2\\ \\text{(inference)}.$$
"Measure" takes the app's own tokens/s: a 32-token greedy generation on the selected model now, or an SFT job's
recorded training throughput (N as the job counted it). The peak is the accelerator's dense bf16 datasheet figure;
on a CPU the answer is a tiny fraction, which is the point: the same arithmetic tells you how far from the
hardware's limit any run is."""

GEN_SOURCE = "a 32-token generation now (inference)"


def _jobs_for(request) -> list[dict]:
    """Jobs with a recorded training throughput the requester may see; none when no job queue answers."""
    try:
        from app.shared.context import job_viewer
        from model_core.interp.infotheory import job_throughputs
        from tasks.jobs import list_jobs

        return job_throughputs(list_jobs(owner=job_viewer(request), limit=50))
    except Exception:  # noqa: BLE001 - no broker (a page without job services): generation only
        return []


def _info_check(label: str, mine: float, ref: float, tol: float) -> str:
    return _check(label, torch.tensor(mine), torch.tensor(ref), tol)


@endpoint(model=True)
def info_panel(model_name, prompt, chat, temperature, other, request: gr.Request = None):
    from model_core.interp import infotheory as I

    lm, tr = _trace(model_name, prompt, chat)
    ids = tr.token_ids
    try:
        other_lm = get_model(other) if other else None
        cmp = I.compare_distributions(lm, ids, temperature, other_lm)
        ce = I.prompt_cross_entropy(lm, ids)
    except LmscopeError as e:
        raise gr.Error(str(e)) from None
    tok = lm.tokenizer
    show = lambda i: describe_tokens(tok, [int(i)])[0]["display"]  # noqa: E731
    h = cmp["p_entropy"]
    top = ", ".join(f"`{show(r['id'])}` p={r['p']:.3f} (−p log p = {r['term']:.3f})" for r in h["top"][:5])
    labels = [t["display"] for t in describe_tokens(tok, ids)][1:]
    info = (f"**Entropy** of the next token after your {len(ids)}-token prompt: $H(P)$ = **{h['nats']:.4f} nats** = "
            f"{h['bits']:.4f} bits (uniform over {h['vocab']:,} tokens would be {h['max_nats']:.2f} nats); "
            f"$e^H$ = {h['perplexity']:.2f} equally likely tokens. Largest terms: {top}.\n\n"
            f"**Cross-entropy** of the prompt's {ce['n']} actual next tokens: "
            f"({' + '.join(f'{s:.2f}' for s in ce['surprisal'][:6])}{' + …' if ce['n'] > 6 else ''}) / {ce['n']} = "
            f"**{ce['nats']:.4f} nats** = {ce['bits']:.4f} bits per token; perplexity $e^{{CE}}$ = {ce['perplexity']:.3f}.\n\n"
            f"**KL** with P = {cmp['p_name']}, Q = {cmp['q_name']}: KL(P‖Q) = **{cmp['kl_pq']:.4f} nats**, "
            f"KL(Q‖P) = **{cmp['kl_qp']:.4f} nats** (not symmetric). H(P) = {cmp['h_p']:.4f}, H(Q) = {cmp['h_q']:.4f}; "
            f"CE(P, Q) = {cmp['ce_pq']:.4f} = H(P) + KL(P‖Q) = {cmp['h_p'] + cmp['kl_pq']:.4f}.\n\n"
            + "\n\n".join([
                _info_check("cross-entropy by hand vs transformers' own loss (labels = input ids)", ce["nats"],
                            ce["transformers_loss"], 1e-4),
                _info_check("KL(P‖Q) by hand vs torch.nn.functional.kl_div", cmp["kl_pq"], cmp["torch_kl_pq"], 1e-5),
                _info_check("KL(Q‖P) by hand vs torch.nn.functional.kl_div", cmp["kl_qp"], cmp["torch_kl_qp"], 1e-5),
            ]))
    kl_fig = fig.kl_bars([show(r["id"]) for r in cmp["top"]], [r["p"] for r in cmp["top"]],
                         [r["q"] for r in cmp["top"]], [r["term"] for r in cmp["top"]], cmp["p_name"], cmp["q_name"])
    return info, fig.surprisal_bars(labels, ce["surprisal"], ce["nats"]), kl_fig


@endpoint
def mfu_sources(request: gr.Request = None):
    return gr.update(choices=[GEN_SOURCE] + [j["label"] for j in _jobs_for(request)], value=GEN_SOURCE)


@endpoint(model=True)
def measure_panel(model_name, prompt, chat, source, request: gr.Request = None):
    """The app's own measured tokens/s: a generation on the engine now, or a job's record."""
    if source and source != GEN_SOURCE:
        job = next((j for j in _jobs_for(request) if j["label"] == source), None)
        if job is None:
            raise gr.Error("That job is gone or has no recorded throughput; pick another source.")
        n = job["n_params"] or float(get_model(job["model"]).n_params)
        return (round(job["tokens_per_s"], 2), n, "training",
                f"Measured by {source.split(':')[0]}: {job['tokens_per_s']:,.1f} training tokens/s, N = {n:,.0f}.")
    from model_core.serving.generate import generate

    lm = get_model(model_name)
    try:
        g = generate(lm, prompt, max_new_tokens=32, chat=bool(chat), ignore_eos=True, max_prompt_tokens=max_prompt_tokens())
    except LmscopeError as e:
        raise gr.Error(str(e)) from None
    return (round(g.tokens_per_second, 2), float(lm.n_params), "inference",
            f"Measured now: {len(g.token_ids)} greedy tokens of {lm.name} on {lm.device} in {g.seconds:.2f} s = "
            f"{g.tokens_per_second:.1f} tokens/s (decode, batch 1); N = {lm.n_params:,} parameters (each tensor once).")


@endpoint
def mfu_panel(n_params, tokens_per_s, mode, peak_name, custom_tflops, request: gr.Request = None):
    from model_core.interp import infotheory as I

    if not n_params or not tokens_per_s:
        return "Press **Measure**, or type tokens/s and N.", gr.skip()
    try:
        peak = float(custom_tflops) * 1e12 if custom_tflops else I.PEAKS.get(peak_name)
        if peak is None:
            raise LmscopeError("Pick a peak from the list or type one in TFLOP/s.")
        r = I.mfu(float(n_params or 0), float(tokens_per_s or 0), peak, mode or "inference")
    except (LmscopeError, TypeError, ValueError) as e:
        raise gr.Error(str(e) if isinstance(e, LmscopeError) else "N and tokens/s must be numbers.") from None
    text = (
        f"{r['k']} × N × tokens/s = {r['k']} × {r['n_params']:,.0f} × {r['tokens_per_s']:,.2f} = "
        f"**{r['achieved_flops']:.4g} FLOP/s**; peak {r['peak_flops']:.4g} FLOP/s → **MFU = {r['mfu']:.3e}** "
        f"({r['mfu'] * 100:.4g} %).")
    return text, fig.mfu_bar(r["achieved_flops"], r["peak_flops"], f"{r['mode']}: MFU {r['mfu'] * 100:.3g} %")
