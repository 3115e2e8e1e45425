"""A Mistral checkpoint whose sliding window is shorter than the prompt: the trace's attention
patterns against transformers' own eager `output_attentions` (the reference), and the engine's
greedy generation against transformers' `generate`.

Mistral's config has no `layer_types`; its attention passes `config.sliding_window` to every layer.
The pattern once ignored that window (off by 0.11 from the model's own) while the forward was right.
"""

import pytest
import torch
from transformers import AutoModelForCausalLM, MistralConfig

from model_core import load_model, trace
from model_core.core.tokenization import byte_tokenizer

WINDOW = 4


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory):
    torch.manual_seed(0)
    config = MistralConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, sliding_window=WINDOW,
                           max_position_embeddings=256)
    folder = tmp_path_factory.mktemp("mistral-window")
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    return str(folder)


def test_sliding_window_pattern_equals_the_models_own(mistral_dir):
    lm = load_model(mistral_dir, device="cpu", dtype="float32")
    ids = list(range(5, 17))  # 12 tokens, three times the window
    tr = trace(lm, token_ids=ids)
    ref = load_model(mistral_dir, device="cpu", dtype="float32", attn_implementation="eager")
    with torch.inference_mode():
        out = ref.model(torch.tensor([ids]), output_attentions=True, output_hidden_states=True)
    for l in range(lm.shape.n_layers):
        pattern = tr[f"blocks.{l}.attn.hook_pattern"]  # [heads, T, T]
        torch.testing.assert_close(pattern, out.attentions[l][0], atol=1e-6, rtol=1e-5)
        assert float(pattern[:, -1, : len(ids) - WINDOW].abs().max()) == 0.0  # nothing outside the window
    torch.testing.assert_close(tr.logits(), out.logits[0], atol=1e-5, rtol=1e-5)


def test_greedy_generation_past_the_window_equals_transformers_generate(mistral_dir):
    """The engine's slot cache keeps only the window for such a model (its adapter's window):
    greedy tokens equal transformers' `generate` with its own cache."""
    from model_core.serving.engine import Engine
    from model_core.serving.generate import generate

    lm = load_model(mistral_dir, device="cpu", dtype="float32")
    prompt = "a window of four tokens"
    ids = lm.tokenizer(prompt, add_special_tokens=False)["input_ids"]
    with torch.inference_mode():
        want = lm.model.generate(torch.tensor([ids]), max_new_tokens=10, do_sample=False,
                                 attention_mask=torch.ones(1, len(ids), dtype=torch.long))[0, len(ids):].tolist()
    eng = Engine(lm, slots=2, max_len=64)
    eng.ready.wait()
    try:
        lm.meta["engine"] = eng
        got = generate(lm, prompt, max_new_tokens=10, settings=None)
        assert eng.stats.admitted >= 1  # it ran on the engine, not on transformers. cache
    finally:
        lm.meta.pop("engine", None)
        eng.close()
    assert got.token_ids == want
