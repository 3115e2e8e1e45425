"""Anatomy view: every step equals the model's own computation.

References: the traced pattern and transformers' eager `output_attentions`; the model's own
modules (norms, o_proj, MLP) caught with plain forward hooks; the real DynamicCache after one
token; model.parameters(); and worked numbers computed by hand.
"""

import re

import pytest
import torch

from conftest import DEFAULT
from model_core import load_model, trace
from model_core.anatomy import walkthrough as A
from model_core.core.errors import PromptError

MODELS = [DEFAULT, "random-gpt2-tiny", "random-gemma3-tiny"]
# long enough (> Gemma tiny's sliding window of 6) that the window shows in the mask
PROMPT = "The capital of France is Paris, and the capital of Italy is"


@pytest.fixture(scope="module", params=MODELS)
def lm_tr(request):
    lm = load_model(request.param)
    return lm, trace(lm, PROMPT)


def _layers_to_check(lm):
    L = lm.shape.n_layers
    return sorted({0, 1, L - 1})


# --- worked numbers -----------------------------------------------------------------------------

def test_sinusoidal_worked_numbers():
    pe = A.sinusoidal_encoding(3, 4)
    expected = torch.tensor([[0, 1, 0, 1], [0.8415, 0.5403, 0.01, 0.99995], [0.9093, -0.4161, 0.02, 0.9998]])
    torch.testing.assert_close(pe, expected, atol=1e-4, rtol=0)
    with pytest.raises(PromptError):
        A.sinusoidal_encoding(3, 5)


def test_kv_cache_worked_number():
    assert A.kv_cache_bytes(n_layers=16, n_kv_heads=8, head_dim=64, n_tokens=1024, bytes_per_value=2) == 33_554_432
    # DESIGN.md: SmolLM2-135M, 2 x 30 x 3 x 64 x 2 B = 23,040 B per token in bf16
    assert A.architecture_card(load_model(DEFAULT))["KV cache / token (16-bit)"] == 23_040


# --- architecture card ----------------------------------------------------------------------------

def _cache_bytes(cache) -> int:
    if hasattr(cache, "layers"):
        pairs = [(l.keys, l.values) for l in cache.layers]
    else:  # older transformers
        pairs = list(zip(cache.key_cache, cache.value_cache))
    return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in pairs)


@pytest.mark.parametrize("name", MODELS)
def test_param_counts_and_kv_cache_are_real(name):
    lm = load_model(name)
    counts = A.param_counts(lm)
    assert counts["other"] == 0
    assert counts["total"] == sum(p.numel() for p in lm.model.parameters()) == lm.n_params
    assert sum(v for k, v in counts.items() if k != "total") == counts["total"]
    card = A.architecture_card(lm)
    assert card["params: total"] == lm.n_params
    # KV-cache bytes per token = the size of a real cache after one token
    with torch.inference_mode():
        out = lm.model(input_ids=torch.tensor([[lm.tokenizer.bos_token_id or 1]]), use_cache=True)
    assert card["KV cache / token"] == _cache_bytes(out.past_key_values)


def test_untied_unembedding_is_counted():
    from transformers import AutoConfig

    from model_core.core.registry import RANDOM_CONFIGS

    cfg = dict(RANDOM_CONFIGS["random-llama-tiny"], tie_word_embeddings=False)
    model = A.config_only_model(AutoConfig.for_model(cfg.pop("model_type"), **cfg))
    counts = A.param_counts(model)
    assert counts["unembedding"] == 258 * 64 and counts["embedding"] == 258 * 64
    assert counts["total"] == sum(p.numel() for p in model.parameters())
    assert A.architecture_card(model)["weight tying"].startswith("untied")


def test_gpt2_small_config_card():
    from transformers import GPT2Config

    card = A.architecture_card(A.config_only_model(GPT2Config()))
    assert card["params: total"] == 124_439_808  # GPT-2 small, the well-known number
    assert card["layers"] == 12 and card["query heads"] == 12 and card["FFN width"] == 3072


def test_cards_read_the_architecture():
    smol = A.architecture_card(load_model(DEFAULT))
    assert (smol["layers"], smol["d_model"], smol["query heads"], smol["key/value heads"], smol["head dim"]) == \
        (30, 576, 9, 3, 64)
    assert smol["attention"].startswith("GQA") and "3 query heads per K/V head" in smol["attention"]
    assert smol["FFN type"] == "SwiGLU" and smol["FFN width"] == 1536
    assert smol["norm"].startswith("RMSNorm") and smol["norm placement"].startswith("pre-norm")
    assert "100,000" in smol["positions"] and smol["vocabulary"] == 49152 and smol["context length"] == 8192
    assert smol["weight tying"].startswith("tied")
    gpt2 = A.architecture_card(load_model("random-gpt2-tiny"))
    assert gpt2["attention"].startswith("MHA") and gpt2["FFN type"].startswith("GELU")
    assert gpt2["norm"].startswith("LayerNorm") and gpt2["positions"].startswith("learned absolute")
    gemma = A.architecture_card(load_model("random-gemma3-tiny"))
    assert gemma["attention"].startswith("MQA") and gemma["FFN type"] == "GeGLU"
    assert "post-norm" in gemma["norm placement"] and "(1 + w)" in gemma["norm"] and gemma["QK-norm"].startswith("yes")
    assert "1,000,000 (full_attention)" in gemma["positions"]
    table = A.compare_models({"smol": load_model(DEFAULT), "gpt2": load_model("random-gpt2-tiny"),
                              "gemma": gemma})
    assert list(table.columns) == ["property", "smol", "gpt2", "gemma"]
    assert table.set_index("property").loc["layers", "smol"] == "30"


# --- module tree --------------------------------------------------------------------------------

def names_of(lm):
    return {id(m): n for n, m in lm.model.named_modules()}


def test_module_tree_shapes(lm_tr):
    lm, tr = lm_tr
    rows = A.module_tree(lm, tr.token_ids)
    T, s = tr.n_tokens, lm.shape
    by_path = {r["path"]: r for r in rows}
    embed_path = next(p for p, r in by_path.items() if r["module"].endswith(("Embedding",)) and "wpe" not in p)
    assert by_path[embed_path]["shape"] == [T, s.d_model]
    assert rows[-2]["shape"] == [T, s.vocab_size]  # lm_head: logits [T, vocab]
    # each tensor counted once (a tied lm_head is noted, not counted again): the column sums to the total
    assert rows[-1]["total"] and rows[-1]["params"] == lm.n_params
    assert sum(r["counted"] for r in rows[:-1]) == lm.n_params
    tied = [r for r in rows if r.get("tied_to")]
    if lm.model.config.tie_word_embeddings:
        assert [r["path"] for r in tied] == [names_of(lm)[id(lm.adapter.unembed)]]
        assert tied[0]["tied_to"] == names_of(lm)[id(lm.adapter.embed_tokens)] and tied[0]["counted"] == 0
        assert "tied to" in A.tree_frame(rows)["params"].iloc[-2]
    else:
        assert not tied
    assert any(r["path"].startswith("…") for r in rows) or s.n_layers < 3
    assert not A.tree_frame(rows).empty


# --- attention, step by step --------------------------------------------------------------------

@pytest.fixture(scope="module")
def eager_attentions(lm_tr):
    lm, tr = lm_tr
    ref = load_model(lm.name, attn_implementation="eager")
    with torch.inference_mode():
        return ref.model(torch.tensor([tr.token_ids]), output_attentions=True).attentions


def test_attention_steps_equal_the_model(lm_tr, eager_attentions):
    lm, tr = lm_tr
    for l in _layers_to_check(lm):
        traced = tr.attention_pattern(l)
        for h in range(lm.shape.n_heads):
            s = A.attention_step(tr, l, h)
            # each step from the one before it
            torch.testing.assert_close(s["raw"], s["q"] @ s["k"].T, atol=1e-4, rtol=1e-4)
            if s["softcap"] is None:
                torch.testing.assert_close(s["scaled"], s["raw"] * s["scale"], atol=1e-5, rtol=1e-5)
            mine = torch.softmax(s["scaled"].masked_fill(~s["mask"], float("-inf")), -1)
            torch.testing.assert_close(mine, s["pattern"], atol=1e-6, rtol=1e-5)
            torch.testing.assert_close(s["pattern"] @ s["v"], s["z"], atol=1e-5, rtol=1e-4)
            # ... equals the traced pattern and transformers' eager attentions
            torch.testing.assert_close(mine, traced[h].float(), atol=1e-6, rtol=1e-5)
            torch.testing.assert_close(mine, eager_attentions[l][0, h].float(), atol=1e-5, rtol=1e-4)
            # variants
            upper = torch.ones_like(s["mask"]).triu(1)
            assert torch.all(s["no_mask"][upper] > 0) and torch.all(s["pattern"][upper] == 0)
            torch.testing.assert_close(s["no_mask"].sum(-1), torch.ones(tr.n_tokens))
            torch.testing.assert_close(
                s["no_scale"], torch.softmax(s["raw"].masked_fill(~s["mask"], float("-inf")), -1))
    if lm.adapter.sliding_window(0):  # Gemma tiny layer 0: query 10 cannot see key 0
        assert not A.attention_step(tr, 0, 0)["mask"][10, 0]


def test_heads_through_output_matrix_sum_to_attn_out(lm_tr):
    """sum_h z_h W_O[h] (+ bias) = the output projection's result; for Llama/GPT-2 that is
    attn_out, for Gemma 3 attn_out = post_attention_layernorm(o_proj output)."""
    lm, tr = lm_tr
    ad = lm.adapter
    for l in _layers_to_check(lm):
        seen = {}
        o = ad.attn_z_module(ad.layers[l])
        handle = o.register_forward_hook(lambda m, i, out, seen=seen: seen.__setitem__("o", out[0]))
        try:
            with torch.inference_mode():
                lm.model(torch.tensor([tr.token_ids]), use_cache=False)
        finally:
            handle.remove()
        per_head, bias = A.head_outputs(tr, l)
        assert per_head.shape == (lm.shape.n_heads, tr.n_tokens, lm.shape.d_model)
        total = per_head.sum(0) + (bias if bias is not None else 0)
        torch.testing.assert_close(total, seen["o"], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(A.attn_out_from_heads(tr, l), tr.attn_out[l], atol=1e-4, rtol=1e-4)


# --- positions --------------------------------------------------------------------------------------

def test_rope_angles_are_the_models(lm_tr):
    lm, tr = lm_tr
    if not lm.adapter.uses_rope:  # GPT-2: learned absolute positions, so no rotation is captured
        assert tr.rope == {} and hasattr(lm.model.transformer, "wpe")
        return
    for l in _layers_to_check(lm):
        cos, sin = tr.rope[l]
        ang = A.rope_angles(lm, l, tr.n_tokens)
        half = ang.shape[1]
        torch.testing.assert_close(cos[0, :, :half].float(), ang.cos(), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(sin[0, :, half:].float(), ang.sin(), atol=1e-5, rtol=1e-5)
    # relative position: the score depends on the distance only, not on where the pair sits
    a = A.rope_score_vs_distance(lm, 0, 32)
    b = A.rope_score_vs_distance(lm, 0, 32, query_position=200)
    torch.testing.assert_close(a["score"], b["score"], atol=1e-3, rtol=1e-4)
    assert float(a["score"][0]) == pytest.approx(a["unrotated"], rel=1e-5)


def test_gpt2_learned_positions_are_what_the_model_adds():
    lm = load_model("random-gpt2-tiny")
    tr = trace(lm, PROMPT)
    wpe = A.learned_positions(lm, tr.n_tokens)
    wte = lm.model.transformer.wte.weight[tr.token_ids]
    torch.testing.assert_close(tr.embed - wte, wpe, atol=1e-6, rtol=1e-6)
    assert A.learned_positions(load_model("random-gemma3-tiny")) is None


# --- embeddings -----------------------------------------------------------------------------------

def test_embedding_neighbours_and_analogy():
    lm = load_model(DEFAULT)
    near = A.nearest_tokens(lm, " Paris", k=8)
    cos = [r["cosine"] for r in near]
    assert cos == sorted(cos, reverse=True) and all(r["token"] != "␣Paris" for r in near)
    E = lm.model.model.embed_tokens.weight
    i, j = A.token_id(lm, " Paris"), near[0]["id"]
    assert cos[0] == pytest.approx(float(torch.cosine_similarity(E[i], E[j], dim=0)), abs=1e-5)
    # a - a + c = c: the analogy's neighbours are c's neighbours (without a)
    ana = [r["id"] for r in A.analogy(lm, " king", " king", " Paris", k=5)]
    assert ana == [r["id"] for r in near if r["id"] != A.token_id(lm, " king")][:5]
    assert A.token_id(lm, "#42") == 42
    with pytest.raises(PromptError):
        A.token_id(lm, "antidisestablishmentarianism")


# --- norms, MLP, output ------------------------------------------------------------------------

def test_norm_step_equals_norm_module(lm_tr):
    lm, tr = lm_tr
    pos = 3
    for l in _layers_to_check(lm):
        with torch.inference_mode():
            for which, x in (("attn", tr.resid_pre[l]), ("mlp", tr.resid_mid(l))):
                s = A.norm_step(tr, l, pos, which)
                ref = A.norm_module(lm, l, which)(x[pos])
                torch.testing.assert_close(s["out"], ref.float(), atol=1e-5, rtol=1e-5)
    s = A.norm_step(tr, 0, pos, "final")
    torch.testing.assert_close(s["out"], tr.ln_final[pos].float(), atol=1e-4, rtol=1e-5)
    if s["type"] == "LayerNorm":
        assert abs(float(s["normalized"].mean())) < 1e-5 and float(s["normalized"].std(unbiased=False)) == \
            pytest.approx(1, abs=1e-2)  # eps shrinks it a little
    else:
        assert float(s["normalized"].pow(2).mean().sqrt()) == pytest.approx(1, abs=1e-2)  # eps shrinks it a little


def test_mlp_step_equals_mlp_post(lm_tr):
    lm, tr = lm_tr
    for l in _layers_to_check(lm):
        s = A.mlp_step(tr, l, 2)
        hidden = s["product"] if s["gated"] else s["post"]
        torch.testing.assert_close(hidden, tr.mlp_post(l)[2].float(), atol=1e-5, rtol=1e-5)
        if s["gated"]:
            torch.testing.assert_close(s["product"], s["gate"] * s["up"])
        assert len(s["top_neurons"]) == 20


def test_output_step_is_the_models_output(lm_tr):
    lm, tr = lm_tr
    o = A.output_step(tr, top_k=5)
    torch.testing.assert_close(o["logits"], tr.next_logits.float(), atol=1e-4, rtol=1e-5)
    # an fp32 sum of 49,152 probabilities: rounding alone is ~sqrt(V) * 6e-8 = 1.3e-5 (1.0000107 seen)
    assert o["probs"].sum() == pytest.approx(1, abs=1e-4)
    assert o["top"][0]["id"] == int(tr.next_logits.argmax())
    if lm.name == DEFAULT:
        assert o["top"][0]["token"] == "␣France" or o["top"][0]["token"].startswith("␣")


# --- review fixes: card order, tree parents, sliding labels, byte-level fallback, panels -----------

def test_card_key_rows_first_and_compare_order():
    smol = A.architecture_card(load_model(DEFAULT))
    keys = [k for k in smol if not k.startswith("_")]
    assert keys[:4] == ["architecture", "params: total", "dtype", "KV cache / token"]
    assert smol["QK-norm"] == "no" and smol["sliding window"].startswith("no")
    gemma = A.architecture_card(load_model("random-gemma3-tiny"))
    assert gemma["QK-norm"].startswith("yes") and gemma["sliding window"].startswith("3 of 4 layers")
    # a row only a later card has goes right after its predecessor, not at the bottom
    a = {"architecture": "x", "layers": 1}
    b = {"architecture": "y", "QK-norm": "yes", "layers": 2}
    assert list(A.compare_models({"a": a, "b": b})["property"]) == ["architecture", "QK-norm", "layers"]
    assert all(len(str(v)) <= 64 for k, v in gemma.items() if not k.startswith("_"))  # short cells


def test_module_tree_names_the_layer_list(lm_tr):
    lm, tr = lm_tr
    rows = A.module_tree(lm, tr.token_ids)
    paths = [r["path"] for r in rows]
    first = next(i for i, r in enumerate(rows) if r["path"].split(".")[-1] == "0")
    parent = rows[first - 1]
    assert parent["path"] == rows[first]["path"].rsplit(".", 1)[0] and parent["module"].startswith("ModuleList")
    assert parent["depth"] == rows[first]["depth"] - 1 and paths.count(parent["path"]) == 1
    leaves = list(A.tree_frame(rows)["module"].str.strip("\u2003"))
    assert leaves[first] == ".".join(rows[first]["path"].split(".")[-2:])  # layers.0 / h.0


def test_sliding_window_in_the_step_and_labels():
    from app.tabs.anatomy import figures as fig

    lm = load_model("random-gemma3-tiny")
    tr = trace(lm, PROMPT)
    s = A.attention_step(tr, 0, 0)
    W = s["window"]
    assert W == 6 and fig.mask_label(s) == "mask applied (causal + window 6)"
    i = 12
    assert s["mask"][i].nonzero().flatten().tolist() == list(range(i - W + 1, i + 1))  # i - W < j <= i
    full = A.attention_step(tr, 3, 0)
    assert full["window"] is None and fig.mask_label(full) == "causal mask applied"
    names = [t.name for t in fig.attention_variants(s, tr.tokens, True, True).data]
    assert names == ["the model's softmax", "without scaling", "without the mask"]
    steps = fig.attention_steps(s, tr.tokens)
    score_traces = [t for t in steps.data if t.coloraxis == "coloraxis"]
    assert len(score_traces) == 3  # raw, scaled and masked share one colour range
    assert steps.layout.coloraxis.cmax == pytest.approx(float(s["raw"].abs().max()), rel=1e-5)
    assert all("…" in a.text for a in steps.layout.annotations)  # each title gives its range


def test_byte_level_tokens_fall_back_to_one_token():
    lm = load_model("random-gpt2-tiny")
    i, note = A.resolve_token(lm, " London")
    assert i == ord("L") and "7 tokens" in note
    assert A.resolve_token(lm, "e") == (ord("e"), None)
    with pytest.raises(PromptError):
        A.resolve_token(lm, "#99999")


def test_mlp_reference_curve_and_activation_label(lm_tr):
    lm, tr = lm_tr
    s = A.mlp_step(tr, 0, 1)
    assert s["activation"] in ("SiLU", "GELU", "GELU (tanh approx.)")
    assert float(s["curve_x"].min()) == -4 and float(s["curve_x"].max()) == 4
    assert float(s["curve_y"][-1]) == pytest.approx(4, abs=0.08)  # SiLU(4) = 3.93, GELU(4) = 4.00
    assert float(s["curve_y"].min()) < -0.1  # the dip below zero: not a straight line


def test_tab_panels_fallbacks_and_checks():
    import gradio as gr  # noqa: F401

    from app.tabs.anatomy import tab as T

    near, ana, note = T.embed_panel("random-gpt2-tiny", " London", " king", " man", " woman", 5)
    assert near is not None and "Nearest to 'L'" in near.layout.title.text and "using L" in note
    assert T.embed_panel("random-gpt2-tiny", "", "a", "b", "c", 5)[:2] == (None, None)  # cleared on error
    line, ang, info = T.rope_panel("random-gpt2-tiny", 0, 64)
    assert line["visible"] is False and ang["visible"] is False and "does not use RoPE" in info
    line, ang, info = T.rope_panel("random-gemma3-tiny", 3, 64)
    assert line["visible"] is True and line["value"] is not None
    # the attention check is independent: heads through W_O vs the model's own attention output
    _, _, info, rot = T.attention_panel("random-gemma3-tiny", PROMPT, False, 0, 0, True, True)
    assert rot["visible"] is True and "after RoPE" in info
    assert "✓ check" in info and "W_O" in info
    # the comparison defaults to the six real systems (published configs), not random-weight models (issue 18 fix 7)
    assert T.DEFAULT_COMPARE == ["llama-3.2-1b", "gpt2", "gpt3-175b", "mistral-7b", "deepseek-v2", "granite-3b"]
    single, html, shares, kv = T.card_panel("random-gpt2-tiny", T.DEFAULT_COMPARE + ["random-gemma3-tiny"])
    heads = re.findall(r"<th [^>]*data-kind='(\w+)'>([^<]*)<", html)
    assert heads == [("random", "random-gpt2-tiny (random weights)"), ("reference", "Llama 3.2-1B"),
                     ("reference", "GPT-2 (124M)"), ("reference", "GPT-3 175B"), ("reference", "Mistral 7B"),
                     ("reference", "DeepSeek-V2"), ("reference", "Granite 3B (4.1)"),
                     ("random", "random-gemma3-tiny (random weights)")]
    assert single.iloc[0]["property"] == "weights" and "random" in single.iloc[0]["value"]
    assert len([t for t in kv.data if t.mode == "lines"]) == 9  # 8 models + DeepSeek-V2 uncompressed
    labels = [lab for lab, name in T.compare_choices() if name.startswith("random-")]
    assert labels and all("random weights" in lab for lab in labels)
    pos = T.positions_panel("random-gpt2-tiny", 16)
    assert pos.layout.annotations[0].text.startswith("untrained position embeddings (random weights")
    assert isinstance(gr.__version__, str)


# --- every ✓ check compares with a tensor captured from the model's own forward (issue 18) -------
# Each panel's check line is green on the real model and turns red when the trace it reads is
# corrupted: an input the panel computes from (resid_pre, attn_out, ...) or the captured value the
# check compares with. The corrupted trace is served to the real panel function through its cache.

CHECK_LAYER = 5


def _corrupt(tr, **changes):
    import collections
    import dataclasses
    import threading

    return dataclasses.replace(tr, _cache=collections.OrderedDict(), _lock=threading.Lock(), **changes)


def _zero(d, layer):
    return {**d, layer: torch.zeros_like(d[layer])}


def _shift(d, layer, by=0.5):
    return {**d, layer: d[layer] + by}


def _panel_info(T, model, key, panel, which=None, layer=CHECK_LAYER):
    if panel == "attention":
        return T.attention_panel(model, key, False, layer, 0, False, False)[2]
    if panel == "norm":
        return T.norm_panel(model, key, False, layer, -1, which)[1]
    if panel == "mlp":
        return T.mlp_panel(model, key, False, layer, -1)[2]
    return T.output_panel(model, key, False, 5)[2]


LAST = 29  # the default model's last layer (the final norm reads its resid_post)
CORRUPTIONS = [
    # (panel, which norm, layer, what is broken, how)
    ("attention", None, CHECK_LAYER, "resid_pre (input)", lambda t: _corrupt(t, resid_pre=_shift(t.resid_pre, CHECK_LAYER))),
    ("attention", None, CHECK_LAYER, "attn_out (captured)", lambda t: _corrupt(t, attn_out=_zero(t.attn_out, CHECK_LAYER))),
    ("norm", "before attention", CHECK_LAYER, "resid_pre (input)",
     lambda t: _corrupt(t, resid_pre=_shift(t.resid_pre, CHECK_LAYER))),
    ("norm", "before attention", CHECK_LAYER, "attn_out (captured)",
     lambda t: _corrupt(t, attn_out=_zero(t.attn_out, CHECK_LAYER))),
    ("norm", "before MLP", CHECK_LAYER, "attn_out (input)", lambda t: _corrupt(t, attn_out=_zero(t.attn_out, CHECK_LAYER))),
    ("norm", "before MLP", CHECK_LAYER, "mlp_out (captured)", lambda t: _corrupt(t, mlp_out=_shift(t.mlp_out, CHECK_LAYER))),
    ("norm", "final norm", LAST, "mlp_out of the last layer (input)", lambda t: _corrupt(t, mlp_out=_zero(t.mlp_out, LAST))),
    ("norm", "final norm", LAST, "ln_final (captured)", lambda t: _corrupt(t, ln_final=t.ln_final * 1.01)),
    ("mlp", None, CHECK_LAYER, "attn_out (input)", lambda t: _corrupt(t, attn_out=_zero(t.attn_out, CHECK_LAYER))),
    ("mlp", None, CHECK_LAYER, "mlp_out (captured)", lambda t: _corrupt(t, mlp_out=_shift(t.mlp_out, CHECK_LAYER, 0.01))),
    ("output", None, LAST, "ln_final (input)", lambda t: _corrupt(t, ln_final=t.ln_final * 1.01)),
    ("output", None, LAST, "next_logits (captured)", lambda t: _corrupt(t, next_logits=t.next_logits + 0.01)),
]


@pytest.fixture(scope="module")
def default_trace():
    lm = load_model(DEFAULT)
    return lm, trace(lm, PROMPT)


@pytest.mark.parametrize("panel,which,layer,broken,how", CORRUPTIONS,
                         ids=[f"{c[0]}-{c[1] or ''}-{c[3]}" for c in CORRUPTIONS])
def test_each_check_turns_red_when_its_input_is_corrupted(default_trace, panel, which, layer, broken, how):
    from app.tabs.anatomy import tab as T

    lm, tr = default_trace
    assert lm.shape.n_layers - 1 == LAST
    green_key, bad_key = f"green {panel} {which} {broken}", f"corrupted {panel} {which} {broken}"
    T.STORE.put(tr, T.trace_key(lm.name, green_key, False))
    T.STORE.put(how(tr), T.trace_key(lm.name, bad_key, False))
    green = _panel_info(T, DEFAULT, green_key, panel, which, layer)
    assert "✓ check" in green and "MISMATCH" not in green, green
    red = _panel_info(T, DEFAULT, bad_key, panel, which, layer)
    assert "✗ MISMATCH" in red and "✓" not in red, red
    diff = float(re.search(r"max \|difference\| = ([0-9.e+-]+)", red).group(1))
    assert diff > 1e-3, red


def test_mlp_check_is_against_the_captured_mlp_output(default_trace):
    """The issue's case: zero tr.attn_out[5]; the panel's neurons move ~0.35 and the check sees it
    (it used to compare with a recomputation from the same corrupted input: ✓ 1.19e-07)."""
    lm, tr = default_trace
    h = A.mlp_step(tr, CHECK_LAYER, -1)["product"]
    mine, ref = A.check_mlp(tr, CHECK_LAYER, -1, h)
    assert float((mine - ref).abs().max()) < 1e-4
    assert ref.data_ptr() == tr.mlp_out[CHECK_LAYER][-1].data_ptr()  # the captured tensor itself
    bad = _corrupt(tr, attn_out=_zero(tr.attn_out, CHECK_LAYER))
    hb = A.mlp_step(bad, CHECK_LAYER, -1)["product"]
    assert float((hb - h).abs().max()) > 0.1
    mine, ref = A.check_mlp(bad, CHECK_LAYER, -1, hb)
    assert float((mine - ref).abs().max()) > 0.1


@pytest.mark.parametrize("name", ["random-gpt2-tiny", "random-gemma3-tiny"])
def test_checks_green_on_other_architectures(name):
    """GPT-2 (biases, LayerNorm, Conv1D) and Gemma 3 (post-norms, sliding window, softcap) too."""
    lm = load_model(name)
    tr = trace(lm, PROMPT)
    for layer in range(lm.shape.n_layers):
        pos = tr.n_tokens - 1
        for which in ("attn", "mlp"):
            mine, ref = A.check_norm(tr, layer, pos, which, A.norm_step(tr, layer, pos, which)["out"])
            torch.testing.assert_close(mine.float(), ref.float(), atol=1e-4, rtol=1e-4)
        s = A.mlp_step(tr, layer, pos)
        mine, ref = A.check_mlp(tr, layer, pos, s["product"] if s["gated"] else s["post"])
        torch.testing.assert_close(mine.float(), ref.float(), atol=1e-4, rtol=1e-4)
    s = A.norm_step(tr, 0, -1, "final")
    torch.testing.assert_close(*(t.float() for t in A.check_norm(tr, 0, -1, "final", s["out"])), atol=1e-4, rtol=1e-4)


# --- issue 18 fixes 2-6 ------------------------------------------------------------------------------

def test_rotation_step_q_before_rope_is_the_models_projection_and_the_pairing_is_rotate_half(default_trace):
    lm, tr = default_trace
    layer, head = 2, 4
    seen = {}
    attn = lm.model.model.layers[layer].self_attn
    handle = attn.q_proj.register_forward_hook(lambda m, i, o: seen.__setitem__("q", o[0]))
    try:
        with torch.inference_mode():
            lm.model(torch.tensor([tr.token_ids]), use_cache=False)
    finally:
        handle.remove()
    s = A.attention_step(tr, layer, head)
    r = s["rope"]
    T, dh = tr.n_tokens, lm.shape.d_head
    # W_q·x as the model's own q_proj produced it (a forward hook), before any rotation
    torch.testing.assert_close(r["q_pre"], seen["q"].view(T, -1, dh)[:, head].float(), atol=1e-5, rtol=1e-5)
    assert r["max_change_q"] > 0.5  # Q after RoPE is not W_q·x
    # the texts' adjacent-pair form: reorder the dimensions (i, i + d/2) -> (2i, 2i + 1), rotate each pair
    # as a complex number by p·θ_i, order back: equals the model's Q after RoPE
    half = dh // 2
    perm = torch.stack([torch.arange(half), torch.arange(half) + half], 1).flatten()
    z = torch.view_as_complex(r["q_pre"][:, perm].reshape(T, half, 2).contiguous())
    angle = torch.arange(T, dtype=torch.float32)[:, None] * r["inv_freq"][None, :]
    rotated = torch.view_as_real(z * torch.polar(torch.ones_like(angle), angle)).reshape(T, dh)
    back = torch.empty_like(rotated)
    back[:, perm] = rotated
    torch.testing.assert_close(back, s["q"], atol=1e-4, rtol=1e-4)
    # without the reordering the adjacent-pair form is wrong for this model
    wrong = torch.view_as_real(torch.view_as_complex(r["q_pre"].reshape(T, half, 2).contiguous())
                               * torch.polar(torch.ones_like(angle), angle)).reshape(T, dh)
    assert float((wrong - s["q"]).abs().max()) > 0.1
    ex = A.rope_pair_example(r["q_pre"][T - 1], r["inv_freq"], T - 1, 3)
    assert ex["dims"] == (3, 3 + half)
    assert ex["after"] == pytest.approx((float(s["q"][T - 1, 3]), float(s["q"][T - 1, 3 + half])), abs=1e-4)


def test_rope_panels_say_after_rope_and_the_full_turn():
    from app.tabs.anatomy import tab as T

    steps, _, info, rot = T.attention_panel(DEFAULT, PROMPT, False, 2, 4, False, False)
    assert "Q and K are shown after RoPE" in info and "i + 32" in info and "rotate_half" in info
    assert rot["visible"] is True and "The rotation step" in rot["value"].layout.title.text
    assert all("after RoPE" in a.text for a in steps.layout.annotations[:2])
    # 2π / θ_min with θ_min = 100000^(-62/64): 438,459.9 positions (3.14159 for π gave 438,459)
    assert "a full turn every 438,460 positions" in T.rope_panel(DEFAULT, 0, 64)[2]
    _, _, info, rot = T.attention_panel("random-gpt2-tiny", PROMPT, False, 0, 0, False, False)
    assert rot["visible"] is False and "no RoPE" in info


def test_norm_panel_shows_the_gain_distribution(default_trace):
    from app.tabs.anatomy import tab as T

    lm, tr = default_trace
    g = lm.model.model.layers[0].input_layernorm.weight.float()
    s = A.norm_step(tr, 0, -1, "attn")
    st = s["gain_stats"]
    assert st["negative"] == pytest.approx(float((g < 0).float().mean())) and 0.3 < st["negative"] < 0.6
    assert st["median"] == pytest.approx(float(g.median())) and st["min"] == pytest.approx(float(g.min()))
    fig, info = T.norm_panel(DEFAULT, PROMPT, False, 0, -1, "before attention")
    assert f"{st['negative']:.0%} of the 576 gains are negative" in info
    torch.testing.assert_close(torch.tensor(fig.data[2].y, dtype=torch.float32), g)  # every gain drawn
    gemma = load_model("random-gemma3-tiny")
    s = A.norm_step(trace(gemma, PROMPT), 0, 0, "attn")  # Gemma: the effective gain is 1 + w
    w = gemma.model.model.layers[0].input_layernorm.weight.float()
    assert s["gain_stats"]["mean"] == pytest.approx(float((1 + w).mean()))
