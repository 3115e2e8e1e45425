"""Reference architecture cards (issue 21): six real systems built from their published configs on
PyTorch's meta device, every field computed. No weights anywhere; everything here is fast.

The bar's numbers were computed independently (transformers on meta, summed by hand); the code
computes them from the configs. The KV formula per attention kind is checked against the cache
transformers itself fills on tiny random-weight configs of each kind (real forward, real bytes)."""

import json
import subprocess
import sys
import time

import pytest
import torch

from app.server.cli import main
from model_core.anatomy import reference_cards as R
from model_core.anatomy import walkthrough as A
from model_core.core.registry import load_model

# --- the bar: numbers computed from the published configs ------------------------------------------

BAR_PARAMS = {"gpt2": 124_439_808, "llama-3.2-1b": 1_235_814_400, "mistral-7b": 7_241_732_096,
              "deepseek-v2": 235_741_434_880}
BAR_KV = {"gpt2": 36_864, "llama-3.2-1b": 32_768, "mistral-7b": 131_072, "deepseek-v2": 69_120}


@pytest.mark.parametrize("name", list(BAR_PARAMS))
def test_bar_parameters_and_kv_bytes(name):
    card = R.reference_card(name)
    assert card["params"] == BAR_PARAMS[name]
    assert card["kv_bytes_per_token"] == BAR_KV[name]
    # the parts sum to the total, and the total is transformers' own count of the meta model
    model = R.meta_model(R.reference_config(name))
    assert all(p.device.type == "meta" for p in model.parameters())  # no memory was used
    assert sum(card["params_by_part"].values()) == card["params"] == sum(p.numel() for p in model.parameters())


def test_every_reference_builds_with_its_own_config_class():
    import transformers

    classes = {"llama-3.2-1b": "LlamaConfig", "gpt2": "GPT2Config", "gpt3-175b": "GPT2Config",
               "mistral-7b": "MistralConfig", "deepseek-v2": "DeepseekV2Config", "granite-3b": "GraniteConfig"}
    assert list(R.REFERENCES) == list(classes)
    for name, cls in classes.items():
        cfg = R.reference_config(name)
        assert type(cfg) is getattr(transformers, cls)
        card = R.reference_card(name)
        for key in ("params", "active_params", "layers", "d_model", "attention", "q_heads", "kv_heads",
                    "kv_bytes_per_token", "position", "ffn", "norm", "norm_position", "vocab", "max_context", "tied"):
            assert card[key] not in (None, ""), (name, key)


def test_deepseek_v2_moe_and_mla_by_hand():
    c = R.reference_card("deepseek-v2")
    L, d, E, k, I, dense = 60, 5120, 160, 6, 1536, 1
    expert = 3 * d * I  # gate, up, down of one routed expert
    assert c["active_params"] == c["params"] - (L - dense) * (E - k) * expert == 21_375_800_320
    assert c["attention"] == "MLA" and (c["kv_latent"], c["kv_rope_key"]) == (512, 64)
    # uncompressed: every head's key (128 + 64 RoPE) and value (128), per layer, fp16
    assert c["kv_bytes_per_token_uncompressed"] == L * 128 * (128 + 64 + 128) * 2 == 4_915_200
    assert c["ffn"].startswith("MoE SwiGLU: 160 routed experts of 1,536 (6 per token)")
    assert c["vocab"] == 102_400 and c["tied"] is False and c["max_context"] == 163_840


def test_the_rest_of_the_cards():
    gpt3, granite, mistral, llama, gpt2 = (R.reference_card(n) for n in
                                           ("gpt3-175b", "granite-3b", "mistral-7b", "llama-3.2-1b", "gpt2"))
    d, L, V, P = 12288, 96, 50257, 2048  # Brown et al. 2020 Table 2.1 on GPT-2's architecture
    per_layer = 4 * d * d + 4 * d + 2 * d * 4 * d + 4 * d + d + 4 * d  # qkv+o (+biases), fc+proj (+biases), 2 LN
    assert gpt3["params"] == V * d + P * d + L * per_layer + 2 * d == 174_604_259_328
    assert (gpt3["vocab"], gpt3["max_context"], gpt3["norm_position"]) == (50257, 2048, "pre-norm")
    assert granite["params"] == 3_402_836_480  # = IBM's disclosure for granite-4.1-3b-base
    assert mistral["attention"] == "GQA + sliding window" and mistral["sliding_window"] == 4096
    assert mistral["sliding_layers"] == 32
    assert llama["position"].startswith("RoPE, θ 500,000, llama3 scaling ×32") and llama["tied"] is True
    assert gpt2["position"] == "learned absolute (1,024 × 768 table)" and gpt2["ffn"] == "GELU MLP 3,072"
    assert gpt2["norm"].startswith("LayerNorm") and llama["norm"].startswith("RMSNorm")


# --- the source table's claims next to the computed values ----------------------------------------

def _claims(name, source_prefix):
    return {c["field"]: c for c in R.reference_card(name)["comparison"] if c["source"].startswith(source_prefix)}


def test_source_table_errors_are_marked_with_the_reason():
    gpt2 = _claims("gpt2", "table")
    assert gpt2["norm_position"]["claim"] == "post-norm" and gpt2["norm_position"]["computed"] == "pre-norm"
    assert gpt2["norm_position"]["agrees"] is False and "ln_1" in gpt2["norm_position"]["note"]
    assert gpt2["params"]["agrees"] is True  # "124M"
    gpt3 = _claims("gpt3-175b", "table")
    assert gpt3["vocab"]["agrees"] is False and gpt3["vocab"]["computed"] == 50257 and "50,257" in gpt3["vocab"]["note"]
    assert gpt3["max_context"]["agrees"] is False and gpt3["max_context"]["computed"] == 2048
    for name, size in (("llama-3.2-1b", "1B"), ("gpt3-175b", "175B"), ("mistral-7b", "7B"),
                       ("deepseek-v2", "236B"), ("granite-3b", "3B")):
        assert _claims(name, "table")["params"] == {**_claims(name, "table")["params"], "claim": size, "agrees": True}
    # published sources: the GPT-2 paper's 117M is wrong, DeepSeek-V2's 21B active and MLA bytes agree
    assert _claims("gpt2", "paper")["params"]["agrees"] is False
    ds = _claims("deepseek-v2", "paper")
    assert ds["active_params"]["agrees"] and ds["kv_bytes_per_token"]["agrees"] and ds["attention"]["agrees"]
    assert ds["max_context"]["agrees"] is False  # 163,840 positions in config.json vs 128K in the paper


def test_claim_matching_rules():
    c = lambda field, v: R.Claim(field, v, "x")  # noqa: E731
    assert R.claim_matches(c("params", "124M"), 124_439_808)
    assert not R.claim_matches(c("params", "117M"), 124_439_808)
    assert R.claim_matches(c("params", "1.23B"), 1_235_814_400)  # truncated
    assert R.claim_matches(c("params", "1.24B"), 1_235_814_400)  # rounded
    assert not R.claim_matches(c("params", "1.22B"), 1_235_814_400)
    assert R.claim_matches(c("max_context", "128K"), 131_072) and not R.claim_matches(c("max_context", "128K"), 163_840)
    assert not R.claim_matches(c("vocab", "100K"), 50_257)
    assert not R.claim_matches(c("max_context", None), 2048)


# --- computed, not typed in: the same code on other inputs gives other answers -----------------------

def test_cards_follow_the_config():
    from transformers import GPT2Config

    untied = R.card_from_model(R.meta_model(GPT2Config(tie_word_embeddings=False)))
    assert untied["params"] == BAR_PARAMS["gpt2"] + 50257 * 768 and untied["tied"] is False
    long = R.card_from_model(R.meta_model(GPT2Config(n_layer=13)))
    assert long["kv_bytes_per_token"] == BAR_KV["gpt2"] // 12 * 13


def test_norm_position_is_watched_not_assumed():
    from transformers import OPTConfig

    for pre in (True, False):  # OPT-350m style post-norm vs the usual pre-norm, same class
        cfg = OPTConfig(hidden_size=32, num_hidden_layers=2, ffn_dim=64, num_attention_heads=4, vocab_size=100,
                        word_embed_proj_dim=32, do_layer_norm_before=pre)
        assert R.norm_wiring(R.meta_model(cfg))["position"] == ("pre-norm" if pre else "post-norm")
    gemma = R.loaded_card(load_model("random-gemma3-tiny"))
    assert gemma["norm_position"] == "pre- and post-norm"  # Gemma also norms each sub-layer's output


# --- the KV formula per attention kind equals the cache transformers fills --------------------------

def _tiny(kind):
    import transformers as tf

    common = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4)
    return {
        "MHA": tf.GPT2Config(vocab_size=128, n_embd=64, n_layer=3, n_head=4, n_positions=64),
        "GQA": tf.LlamaConfig(**common, num_key_value_heads=2, head_dim=16),
        "MQA": tf.GraniteConfig(**common, num_key_value_heads=1),
        "SWA": tf.MistralConfig(**common, num_key_value_heads=2, head_dim=16, sliding_window=5),
        "MLA": tf.DeepseekV2Config(**common, num_key_value_heads=4, kv_lora_rank=24, q_lora_rank=32,
                                   qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, n_routed_experts=4,
                                   n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=16,
                                   first_k_dense_replace=1, topk_method="greedy", n_group=None, topk_group=None),
    }[kind]


def _measured_cache_bytes(config, T):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16).eval()  # 2 bytes per value, as the cards
    with torch.inference_mode():
        out = model(input_ids=torch.randint(0, 128, (1, T)), use_cache=True)
    cache = out.past_key_values
    return model, sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))


@pytest.mark.parametrize("kind", ["MHA", "GQA", "MQA", "SWA", "MLA"])
def test_kv_formula_equals_the_measured_cache(kind):
    T = 4
    model, measured = _measured_cache_bytes(_tiny(kind), T)
    card = R.card_from_model(model)
    assert card["attention"].startswith(kind if kind != "SWA" else "GQA + sliding window")
    assert measured == R.kv_bytes_at(card, [T])[0] == card["kv_bytes_per_token"] * T
    if kind == "MLA":  # the latent and the RoPE key, far less than every head's K and V
        assert card["kv_bytes_per_token"] == 3 * (24 + 4) * 2
        assert card["kv_bytes_per_token_uncompressed"] == 3 * 4 * (8 + 4 + 8) * 2
    if kind == "SWA":  # past the window the cache stops growing (transformers keeps W - 1 past tokens;
        _, long = _measured_cache_bytes(_tiny(kind), 12)  # the new token completes the window of W)
        assert long == card["kv_bytes_per_token"] * (5 - 1)
        assert R.kv_bytes_at(card, [12])[0] == card["kv_bytes_per_token"] * 5 >= long


def test_kv_growth_per_kind():
    cards = {n: R.reference_card(n) for n in ("gpt2", "mistral-7b", "deepseek-v2")}
    g = R.kv_growth(cards)
    assert g["gpt2"]["tokens"][-1] == 1024 and g["gpt2"]["bytes"][-1] == 36_864 * 1024
    m = dict(zip(g["mistral-7b"]["tokens"], g["mistral-7b"]["bytes"]))
    assert 4096 in m and m[4096] == m[32768] == 131_072 * 4096  # flat past the window
    ds = g["deepseek-v2"]
    assert ds["bytes"][-1] == 69_120 * 163_840 and ds["uncompressed"][-1] == 4_915_200 * 163_840


# --- any loaded model: the same numbers the Anatomy card reads from the adapter ----------------------

@pytest.mark.parametrize("name", ["smollm2-135m-instruct", "random-gpt2-tiny", "random-gemma3-tiny"])
def test_loaded_models_agree_with_the_anatomy_card(name):
    lm = load_model(name)
    mine, theirs = R.loaded_card(lm), A.architecture_card(lm)
    counts = A.param_counts(lm)
    assert mine["params"] == theirs["params: total"] == lm.n_params
    for part in ("embedding", "attention", "mlp", "norms", "unembedding"):
        assert mine["params_by_part"][part] == counts[part], part
    assert mine["kv_bytes_per_token"] == theirs["KV cache / token (16-bit)"]
    assert (mine["q_heads"], mine["kv_heads"], mine["layers"]) == (theirs["query heads"], theirs["key/value heads"],
                                                                   theirs["layers"])
    assert ("random" in mine["weights"]) == (lm.source == "random")


# --- fast, no memory; the command line --------------------------------------------------------------

def test_the_236b_card_is_computed_on_meta_without_weights():
    """DeepSeek-V2's 236B parameters are counted from modules built on the meta device: the card
    says so, its parts add up to the bar's total, and it says how long it took (a figure it shows;
    how fast that is on a given machine is bench/'s business, not a test's)."""
    R._reference_card.cache_clear()
    card = R.reference_card("deepseek-v2")
    assert card["params"] == BAR_PARAMS["deepseek-v2"] and card["seconds"] > 0
    assert card["weights"] == "none: the published configuration, built on the meta device"
    assert sum(card["params_by_part"].values()) == card["params"]
    assert card["params_by_part"]["experts"] > 0.9 * card["params"]  # the routed experts are most of it


def test_cli_card_json(capsys, tmp_path):
    assert main(["card", "deepseek-v2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["params"] == BAR_PARAMS["deepseek-v2"] and out["kv_bytes_per_token"] == 69_120
    assert out["attention"] == "MLA" and out["kv_bytes_per_token_uncompressed"] == 4_915_200
    assert not any(k.startswith("_") for k in out)
    assert any(c["field"] == "max_context" and c["agrees"] is False for c in out["comparison"])
    # any local model folder: its config.json alone, no weights
    from transformers import GPT2Config

    GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=300).save_pretrained(tmp_path)
    assert main(["card", str(tmp_path), "--json"]) == 0
    local = json.loads(capsys.readouterr().out)
    assert local["layers"] == 2 and local["vocab"] == 300 and "meta device" in local["weights"]
    assert main(["card", "gpt2"]) == 0  # the readable form marks the table's error
    text = capsys.readouterr().out
    assert "≠ table (as quoted in issue 21): post-norm" in text
    assert main(["card", "no-such-model"]) == 2


def test_cli_entry_point():
    """The installed `lmscope card` command, in a fresh process (imports included)."""
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "app.server.cli", "card", "gpt3-175b", "--json"],
                         capture_output=True, text=True, timeout=300, check=True)
    print(f"\n`lmscope card gpt3-175b --json` in a fresh process: {time.perf_counter() - t0:.1f} s")
    card = json.loads(out.stdout)
    assert card["params"] == 174_604_259_328 and card["vocab"] == 50257


# --- figures are pure functions of the cards ---------------------------------------------------------

def test_figures_and_table():
    from app.tabs.anatomy import cards_figures as F

    cards = {R.reference_card(n)["title"]: R.reference_card(n) for n in R.REFERENCES}
    kv = F.kv_growth_figure(R.kv_growth(cards))
    lines = [t for t in kv.data if t.mode == "lines"]
    assert [t.name for t in lines] == list(cards)[:5] + ["DeepSeek-V2 if uncompressed", list(cards)[5]]
    assert kv.layout.xaxis.type == kv.layout.yaxis.type == "log"
    shares = F.param_share_figure(cards)
    bars = [t for t in shares.data if t.type == "bar"]
    for i in range(len(cards)):
        assert sum(b.x[i] for b in bars) == pytest.approx(100)
    active = next(t for t in shares.data if t.type == "scatter")
    assert list(active.y) == ["DeepSeek-V2"] and active.x[0] == pytest.approx(100 * 21_375_800_320 / 235_741_434_880)
    html = F.comparison_html([{"title": c["title"], "kind": "reference", "rows": R.display_rows(c),
                               "marks": R.row_marks(c), "notes": c["notes"]} for c in cards.values()])
    assert html.count("data-differs='1'") >= 5 and "≠ table (as quoted in issue 21): post-norm" in html
