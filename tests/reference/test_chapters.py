"""The textbook chapters computed on tiny random-weight models (model_core.anatomy.textbook_chapters), each against a
reference nobody here wrote: the real KV cache after transformers' forward, transformers' own hidden
states, router outputs and aux loss, torch's layer_norm / rms_norm, Llama's rotary embedding,
BLOOM's ALiBi and DistilBERT's sinusoidal table. Every ✓ line of these panels is shown turning red
when what it compares is corrupted."""

import pytest
import torch
import torch.nn.functional as F

from conftest import DEFAULT
from model_core.anatomy import textbook_chapters as C

PROMPT = "The capital of France is Paris, and the capital of Italy is"
IDS = C.byte_ids(PROMPT, 48)


# --- (a) attention variants and the KV cache ---------------------------------------------------------

@pytest.fixture(scope="module")
def variants():
    return C.attention_variants(IDS)


def test_kv_formula_equals_the_measured_cache_for_each_variant(variants):
    rows = {r["variant"]: r for r in variants["rows"]}
    assert list(rows) == ["MHA", "GQA", "MQA", "MLA"]
    for kind, r in rows.items():
        assert r["tokens cached"] == len(IDS)
        assert r["formula B/token"] * len(IDS) == r["measured total B"], kind
        assert r["measured B/token"] == r["formula B/token"]
        assert r["query heads"] == 8 and r["16-bit B/token"] * 2 == r["formula B/token"]
    # 2 layers x kv heads x 32 x 4 B x 2 (K and V); MLA: 2 layers x (64 + 16) x 4 B
    assert [rows[k]["formula B/token"] for k in ("MHA", "GQA", "MQA", "MLA")] == [4096, 1024, 512, 640]
    assert rows["MLA"]["config"] == "DeepseekV2Config" and rows["GQA"]["config"] == "LlamaConfig"


def test_mla_caches_the_latent_not_per_head_keys_and_values():
    """What transformers' DeepSeek-V2 attention puts in the cache: one latent [1, 1, T, 64] and one
    RoPE key [1, 1, T, 16] per layer, not 8 heads' K and V."""
    model = C.variant_model("MLA")
    with torch.inference_mode():
        out = model(torch.tensor([IDS]), use_cache=True)
    shapes = [(tuple(l.keys.shape), tuple(l.values.shape)) for l in out.past_key_values.layers]
    assert shapes == [((1, 1, len(IDS), 64), (1, 1, len(IDS), 16))] * 2
    cfg = model.config
    # uncompressed, every head would keep its K (32 + 16) and V (32): 2 x 8 x 80 x 4 B = 5,120 B per token
    per_head = cfg.num_hidden_layers * cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
                                                                  + cfg.v_head_dim) * 4
    assert per_head == 5120 and C.kv_formula("MLA", cfg)["bytes_per_token"] * 8 == per_head


def test_variant_patterns_are_causal_softmax(variants):
    for kind, pat in variants["patterns"].items():
        assert pat.shape == (8, len(IDS), len(IDS))
        torch.testing.assert_close(pat.sum(-1), torch.ones(8, len(IDS)))
        assert float(pat.triu(1).abs().max()) == 0, kind


def test_kv_check_lines_green_and_red_when_the_cache_is_corrupted(variants):
    from app.tabs.anatomy import tab as T

    green = T._kv_check(variants["rows"])
    assert green.count("✓ check") == 4 and "MISMATCH" not in green
    rows = [dict(r) for r in variants["rows"]]
    rows[3]["measured total B"] -= 64 * 4  # one token of one layer's latent missing from the cache
    red = T._kv_check(rows)
    assert red.count("✓ check") == 3 and "✗ MISMATCH check: MLA" in red


# --- (b) norms ------------------------------------------------------------------------------------

def test_layernorm_and_rmsnorm_by_hand_equal_torch():
    torch.manual_seed(1)
    x = torch.randn(96) * 3 + 0.7
    nc = C.norm_compare(x)
    ln = torch.nn.LayerNorm(96, eps=1e-5, elementwise_affine=False)
    rn = torch.nn.RMSNorm(96, eps=1e-5, elementwise_affine=False)
    torch.testing.assert_close(nc["layernorm"], ln(x), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(nc["rmsnorm"], rn(x), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(nc["ref_layernorm"], F.layer_norm(x, (96,), eps=1e-5))
    assert nc["identity"][0] == pytest.approx(nc["identity"][1], rel=1e-5)  # RMS² = σ² + μ²
    assert nc["max_ln_vs_rms"] > 0.05 and nc["centred_agree"] < 1e-5


def test_pre_norm_grows_post_norm_stays_at_sqrt_d():
    g = C.residual_growth(IDS)
    mine, own = g["wiring_check"]
    torch.testing.assert_close(mine, own, atol=1e-5, rtol=1e-5)  # the pre-norm wiring is the model's own
    assert all(b > a for a, b in zip(g["pre"][1:], g["pre"][2:]))  # grows layer after layer
    assert g["pre"][-1] > 5 * g["pre"][1]
    assert all(v == pytest.approx(g["sqrt_d"], rel=1e-3) for v in g["post"][1:])


def test_norm_chapter_panel_on_the_real_model_and_its_check_red_when_corrupted():
    from app.tabs.anatomy import tab as T

    _, growth, info = T.norms_chapter_panel(DEFAULT, PROMPT, False, 5, -1)
    assert "✓ check: the pre-norm wiring" in info and "RMS² =" in info and "random weights" in info
    assert [t.name for t in growth.data][:2] == ["pre-norm: x + f(norm(x))", "post-norm: norm(x + f(x))"]
    g = C.residual_growth(IDS)
    mine, own = g["wiring_check"]
    bad = dict(g, wiring_check=(mine, own.clone().index_fill_(0, torch.tensor([7]), 0.0)))  # layer 7's input lost
    assert "✗ MISMATCH" in T._growth_check(bad) and "✓" in T._growth_check(g)


# --- (c) position schemes ----------------------------------------------------------------------------

def test_sinusoidal_d4_equals_distilberts_table():
    from transformers.models.distilbert.modeling_distilbert import _create_sinusoidal_embeddings

    ref = torch.empty(4, 4)
    _create_sinusoidal_embeddings(4, 4, ref)
    torch.testing.assert_close(C.sinusoidal(4, 4), ref, atol=1e-6, rtol=0)
    assert C.sinusoidal(4, 4)[1].tolist() == pytest.approx([0.8415, 0.5403, 0.0100, 0.99995], abs=1e-4)


def test_rope_d4_worked_example_equals_llamas_rotary_embedding():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    w = C.rope_worked()
    assert w["theta"].tolist() == pytest.approx([1.0, 0.01])
    cfg = LlamaConfig(hidden_size=4, num_attention_heads=1, head_dim=4, rope_parameters={"rope_type": "default",
                                                                                       "rope_theta": 10000.0})
    rot = LlamaRotaryEmbedding(cfg)
    q = torch.tensor([1.0, 2.0, 3.0, 4.0]).expand(1, 1, 4, 4).contiguous()  # [batch, heads, positions, d]
    cos, sin = rot(q, torch.arange(4)[None])
    ref, _ = apply_rotary_pos_emb(q, q, cos, sin)
    mine = torch.stack([r["rotate_half"] for r in w["rows"]]).float()
    torch.testing.assert_close(mine, ref[0, 0], atol=1e-6, rtol=1e-6)
    # the adjacent-pair form is the same rotation of the reordered vector (q0, q2, q1, q3)
    perm = [0, 2, 1, 3]
    q2 = torch.tensor([1.0, 2.0, 3.0, 4.0])[perm].expand(1, 1, 4, 4).contiguous()
    ref2, _ = apply_rotary_pos_emb(q2, q2, cos, sin)
    adj = torch.stack([r["adjacent"] for r in w["rows"]]).float()
    torch.testing.assert_close(adj[:, perm], ref2[0, 0], atol=1e-6, rtol=1e-6)
    assert float((adj - mine).abs().max()) > 0.5  # the two pairings give different vectors


@pytest.mark.parametrize("heads", [8, 6, 12])
def test_alibi_equals_blooms(heads):
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor

    T = 5
    ref = build_alibi_tensor(torch.ones(1, T), heads, torch.float64).reshape(heads, T)  # m_h · j
    torch.testing.assert_close(C.alibi_slopes(heads), ref[:, 1], atol=1e-7, rtol=1e-6)
    mine = C.alibi_bias(T, heads)
    # softmax does not see a per-row constant: -m (i - j) = m j - m i
    for i in range(T):
        torch.testing.assert_close(mine[:, i, : i + 1], ref[:, : i + 1] - ref[:, i: i + 1], atol=1e-6, rtol=1e-6)
        assert torch.isinf(mine[:, i, i + 1:]).all()


def test_rope_and_sinusoidal_fall_with_distance_along_one_curve():
    ps = C.position_scores(64, 16, 4)
    torch.testing.assert_close(ps["rope"], ps["sinusoidal"])
    assert float(ps["rope"][0]) == pytest.approx(1.0)
    assert ps["alibi"][0, 10] == pytest.approx(-10 * 2 ** -2)  # 4 heads: m_1 = 2^(-8/4)


def test_schemes_panel_shows_the_worked_example():
    from app.tabs.anatomy import tab as T

    sin_df, rope_df, alibi_df, fig, info, _ = T.schemes_panel(8, 64)
    assert list(sin_df["sin(p·θ₀)"]) == ["0.0000", "0.8415", "0.9093", "0.1411"]
    assert rope_df.iloc[1, 2] == "-1.9841, 1.9599, 2.4624, 4.0198"  # (1, 2, 3, 4) at p = 1, rotate_half
    assert list(alibi_df.iloc[3, 1:]) == ["-1.5", "-1", "-0.5", "0"] and "masked" in alibi_df.iloc[0, 2]
    assert "0.5, 0.25" in info and len(fig.data) == 2 + 8 + 1


# --- (d) mixture of experts ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def routing():
    return C.moe_routing(IDS, 1)


def test_router_by_hand_equals_the_models_router_and_aux_loss(routing):
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    r = routing
    T, E, k = len(IDS), 8, 2
    torch.testing.assert_close(r["logits"], r["captured_logits"], atol=1e-6, rtol=1e-6)
    assert r["same_choice"] == T
    torch.testing.assert_close(r["weights"].sort(-1).values, r["captured_weights"].sort(-1).values)
    assert float(r["load"].sum()) == pytest.approx(k) and r["probs"].shape == (T, E)
    # the balance loss three ways: by hand, the model's own aux_loss, transformers' function
    model = C.moe_model()
    with torch.inference_mode():
        out = model(torch.tensor([IDS]), output_router_logits=True)
    ref = float(load_balancing_loss_func(out.router_logits, E, k))
    assert r["aux_loss"] == pytest.approx(ref, rel=1e-5) and r["aux_loss_model"] == pytest.approx(ref, rel=1e-6)
    assert r["aux_loss"] > k  # an untrained router is not balanced


def test_moe_check_lines_green_and_red_when_captures_are_corrupted(routing):
    from app.tabs.anatomy import tab as T

    fig, info = T.moe_panel(PROMPT, 1)
    assert info.count("✓ check") == 3 and "random weights" in info
    assert "● = one of the top 2" in fig.layout.annotations[0].text
    assert T._moe_check(routing).count("✓ check") == 3
    bad_logits = dict(routing, captured_logits=routing["captured_logits"] + 0.01)
    assert "✗ MISMATCH check: router logits" in T._moe_check(bad_logits)
    swapped = routing["captured_indices"].clone()
    swapped[3] = (swapped[3] + 1) % 8  # the router sent token 3 elsewhere
    same = sum(set(a.tolist()) == set(b.tolist()) for a, b in zip(routing["chosen"], swapped))
    assert "✗ MISMATCH check: top-2" in T._moe_check(dict(routing, same_choice=same))
    assert "✗ MISMATCH check: balance loss" in T._moe_check(dict(routing, aux_loss_model=routing["aux_loss_model"] * 1.01))


def test_variants_panel_labels_random_weights():
    from app.tabs.anatomy import tab as T

    table, bars, pats, info = T.variants_panel(PROMPT)
    assert list(table["variant"]) == ["MHA", "GQA", "MQA", "MLA"] and "random weights" in info
    assert "random weights" in bars.layout.title.text and "random weights" in pats.layout.title.text
    assert info.count("✓ check") == 4


def test_rope_scaling_linear_and_yarn():
    """transformers' own RoPE init functions: linear slows every pair by the factor; YaRN keeps the
    fast pairs, slows the slow ones by the factor, and scales attention by 0.1 ln(s) + 1 (the paper)."""
    import math

    rs = C.rope_scaling(d=64, base=10000.0, factor=4.0, original_context=2048)
    torch.testing.assert_close(rs["linear"], rs["default"] / 4)
    assert float(rs["yarn"][0]) == pytest.approx(float(rs["default"][0]))  # 326 turns in 2,048 positions
    assert float(rs["yarn"][-1]) == pytest.approx(float(rs["default"][-1]) / 4, rel=1e-5)
    assert bool((rs["yarn"] <= rs["default"] + 1e-9).all() and (rs["yarn"] >= rs["linear"] - 1e-9).all())
    assert rs["yarn_attention_factor"] == pytest.approx(0.1 * math.log(4) + 1)
    _, _, _, _, info, fig = __import__("app.tabs.anatomy.tab", fromlist=["x"]).schemes_panel(8, 64)
    assert "YaRN keeps the 8 fastest pairs" in info and [t.name.split(" ")[0] for t in fig.data] == ["plain", "linear",
                                                                                                      "YaRN"]
