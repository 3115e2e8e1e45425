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
from model_core.core.errors import ModelLoadError
from model_core.core.tokenization import byte_tokenizer

_SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "architectures.py"
_spec = importlib.util.spec_from_file_location("bench_architectures", _SCRIPT)
architectures = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(architectures)

# Parallel blocks (gpt_neox, gptj), post-norms joining the residual (gemma2, olmo2), fused
# projections (phi3), mixtures of experts (mixtral, qwen2_moe), scaled residuals (granite),
# LayerNorm + biases (starcoder2), an inline MLP on flattened tokens (opt).
FAMILIES = ["gpt_neox", "gemma2", "olmo2", "phi3", "mixtral", "qwen2_moe", "granite", "starcoder2", "gptj", "opt"]


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
