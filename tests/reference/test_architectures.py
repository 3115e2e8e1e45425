"""Representative decoder-only families traced through the generic adapter (and one hand family),
each checked against transformers by bench/architectures.py's own check, in its subprocess: layer
inputs vs output_hidden_states, the residual decomposition, every attention pattern vs eager
output_attentions, the logits and greedy generation. The full walk over every type transformers
ships is the script's (docs/ARCHITECTURES.md)."""

import importlib.util
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from model_core import load_model, trace
from model_core.core.errors import ModelLoadError, PromptError
from model_core.core.tokenization import byte_tokenizer

_SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "architectures.py"
_spec = importlib.util.spec_from_file_location("bench_architectures", _SCRIPT)
architectures = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(architectures)

# Parallel blocks (gpt_neox, gptj), post-norms joining the residual (gemma2, olmo2), fused
# projections (phi3), mixtures of experts (mixtral, qwen2_moe), scaled residuals (granite),
# LayerNorm + biases (starcoder2), an inline MLP on flattened tokens (opt).
# Hybrids with attention in some layers only (jamba: Mamba layers; qwen3_next: linear attention;
# nemotron_h: blocks that are one of Mamba / attention / MLP), attention sinks reported as the
# family's eager does (granite_swa), rotary as complex frequencies re-run from the captured layer
# call (llama4_text), post-norms and a residual multiplier (hyperclovax), ALiBi passed to the
# layer and sublayers that add the residual themselves (bloom), experts plus a shared MLP beside
# them (granitemoehybrid), a Mamba block beside the attention with output multipliers (falcon_h1),
# a shared transformer block nested in hybrid layers, feeding their Mamba block (zamba2).
FAMILIES = ["gpt_neox", "gemma2", "olmo2", "phi3", "mixtral", "qwen2_moe", "granite", "starcoder2", "gptj", "opt",
            "jamba", "qwen3_next", "nemotron_h", "granite_swa", "llama4_text", "hyperclovax", "bloom",
            "granitemoehybrid", "falcon_h1", "zamba2"]


@pytest.mark.parametrize("model_type", FAMILIES)
def test_family_traces_equal_to_transformers(model_type):
    row = architectures.run_one(model_type)
    assert row["status"] == "pass", row


def test_not_applicable_types_say_why():
    assert "encoder-decoder" in architectures.skip_reason("bart")
    assert "encoder" in architectures.skip_reason("bert")
    assert architectures.skip_reason("gpt_neox") is None


@pytest.fixture(scope="module")
def neox(tmp_path_factory):
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("neox")
    AutoModelForCausalLM.from_config(architectures.tiny_config("gpt_neox")).save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    return load_model(str(folder), device="cpu", dtype="float32", allow_hub=False)


def test_generic_edit_points_change_the_output(neox):
    """hook_z and mlp.hook_post are placed on GPT-NeoX's dense / dense_4h_to_h: zeroing them is
    the same as having no attention / MLP contribution at that layer."""
    ids = list(b"hello there")
    clean = trace(neox, token_ids=ids)
    zeroed = trace(neox, token_ids=ids, edits={"blocks.0.attn.hook_z": lambda n, t: t * 0,
                                               "blocks.0.mlp.hook_post": lambda n, t: t * 0})
    dense = neox.model.gpt_neox.layers[0].attention.dense
    mlp_out = neox.model.gpt_neox.layers[0].mlp.dense_4h_to_h
    torch.testing.assert_close(zeroed.attn_out[0], dense.bias.expand_as(zeroed.attn_out[0]))
    torch.testing.assert_close(zeroed.mlp_out[0], mlp_out.bias.expand_as(zeroed.mlp_out[0]))
    assert not torch.allclose(clean.next_logits, zeroed.next_logits)


def test_generic_pattern_only_where_asked(neox):
    """The attention function keeps no pattern on a plain forward (no recorder asks)."""
    assert neox.model.config._attn_implementation == "lmscope"
    tr = trace(neox, token_ids=list(b"abcdef"))
    pattern = tr.attention_pattern(1)  # [heads, T, T], rows sum to one, causal
    assert pattern.shape == (4, 6, 6)
    torch.testing.assert_close(pattern.sum(-1), torch.ones(4, 6))
    assert float(pattern.triu(1).abs().max()) == 0.0


def test_encoder_refused_in_one_sentence(tmp_path):
    from transformers import BertConfig

    AutoModelForCausalLM.from_config(BertConfig(vocab_size=300, hidden_size=32, num_hidden_layers=1,
                                                num_attention_heads=2, intermediate_size=64,
                                                is_decoder=True)).save_pretrained(tmp_path)
    byte_tokenizer().save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match="Architecture 'bert' is not supported yet"):
        load_model(str(tmp_path), device="cpu", dtype="float32", allow_hub=False)


def _tiny(model_type, folder):
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(architectures.tiny_config(model_type)).save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    return load_model(str(folder), device="cpu", dtype="float32", allow_hub=False)


def test_hybrid_layer_without_attention_says_so_and_every_layer_has_a_residual(tmp_path):
    """Jamba's layer 0 is a Mamba block: its pattern is refused in one sentence naming the layers
    that have one; the residual stream and the logit lens work there (reference: transformers'
    output_hidden_states of the same weights)."""
    lm = _tiny("jamba", tmp_path)
    assert lm.adapter.attention_layers == [1]
    ids = list(b"hello there, cat")
    tr = trace(lm, token_ids=ids)
    with pytest.raises(PromptError, match=r"^Layer 0 of this jamba model is a mamba block .*layers with one: 1\)\.$"):
        tr.attention_pattern(0)
    with torch.inference_mode():
        ref = lm.model(torch.tensor([ids]), output_hidden_states=True, use_cache=False)
    torch.testing.assert_close(tr.resid_post(0), ref.hidden_states[1][0], atol=1e-5, rtol=1e-5)
    assert lm.adapter.logits_from_resid(tr.resid_post(0)).shape == (len(ids), 300)
    assert tr.attention_pattern(1).shape == (4, len(ids), len(ids))


def test_shared_transformer_read_through_the_blocks_nested_in_a_hybrid_layer(tmp_path):
    """Zamba 2's hybrid layers hold a shared transformer block (tied weights) and a Mamba block, no
    attention or norm of their own: the pattern is the shared block's attention, what joins the
    residual is the Mamba block's output (hook_attn_out; no MLP on the residual), and the attention
    reaches the residual only through that block (reference: transformers' output_hidden_states)."""
    lm = _tiny("zamba2", tmp_path)
    assert lm.adapter.attention_layers == [1, 2]
    ids = list(b"hello there, cat")
    tr = trace(lm, token_ids=ids)
    with pytest.raises(PromptError, match=r"^Layer 0 of this zamba2 model is a mamba block .*layers with one: 1, 2\)\.$"):
        tr.attention_pattern(0)
    with torch.inference_mode():
        ref = lm.model(torch.tensor([ids]), output_hidden_states=True, use_cache=False)
    torch.testing.assert_close(tr.resid_post(1), ref.hidden_states[2][0], atol=1e-5, rtol=1e-5)
    assert float(tr.mlp_out[1].abs().max()) == 0.0
    assert tr.attention_pattern(2).shape == (4, len(ids), len(ids))
    zeroed = trace(lm, token_ids=ids, edits={"blocks.1.attn.hook_z": lambda n, t: t * 0})
    torch.testing.assert_close(zeroed.resid_pre[1], tr.resid_pre[1])
    assert not torch.allclose(zeroed.attn_out[1], tr.attn_out[1])


def test_batched_traces_reuse_each_rows_layer_call(tmp_path):
    """Traces batched into one forward re-run their layers with their own row of the captured call
    (mask, positions, rotary cut to the row's length): patterns equal transformers' eager ones for
    each prompt alone (granite_swa: a sliding window shorter than the prompts, and sinks)."""
    import threading
    import time

    from transformers import AutoModelForCausalLM as Auto

    from model_core.interp.trace_batching import batcher_for

    lm = _tiny("granite_swa", tmp_path)
    ref = Auto.from_pretrained(str(tmp_path), dtype=torch.float32, attn_implementation="eager").eval()
    seqs = [list(b"The cat sat on a mat."), list(b"Hi there"), list(b"A longer prompt, padded least.")]
    b = batcher_for(lm)
    out = [None] * len(seqs)
    with b._cv:  # hold the batcher busy so that all three queue up and run as one batch
        b._busy = True
    threads = [threading.Thread(target=lambda i=i: out.__setitem__(i, trace(lm, token_ids=seqs[i])))
               for i in range(len(seqs))]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while len(b._pending) < len(seqs) and time.monotonic() < deadline:
        time.sleep(0.01)
    with b._cv:
        b._busy = False
        b._cv.notify_all()
    for t in threads:
        t.join(60)
    assert b.stats.sizes.get(("trace", len(seqs)), 0) >= 1, b.stats.sizes
    for ids, tr in zip(seqs, out):
        with torch.no_grad():
            want = ref(input_ids=torch.tensor([ids]), output_attentions=True, use_cache=False).attentions
        for layer in range(2):
            torch.testing.assert_close(tr.attention_pattern(layer), want[layer][0], atol=1e-5, rtol=1e-4)


def test_a_layer_call_without_rows_is_not_batched():
    """ALiBi's [batch * heads, 1, T] table has no row to cut: the batcher must run such traces alone."""
    from model_core.core.hooks import LayerCall, NoRows

    call = LayerCall.of((torch.zeros(2, 5, 8), torch.zeros(2 * 4, 1, 5)),
                        {"attention_mask": torch.ones(2, 1, 5, 5, dtype=torch.bool), "use_cache": True,
                         "cache_position": torch.arange(5)})
    assert "use_cache" not in call.kwargs
    with pytest.raises(NoRows, match="cannot take a row"):
        call.row(1, 3, 2)
    ok = LayerCall.of((torch.zeros(2, 5, 8),), {"attention_mask": torch.ones(2, 1, 5, 5, dtype=torch.bool),
                                                 "cache_position": torch.arange(5)}).row(1, 3, 2)
    assert ok.kwargs["attention_mask"].shape == (1, 1, 3, 3) and ok.kwargs["cache_position"].tolist() == [0, 1, 2]
