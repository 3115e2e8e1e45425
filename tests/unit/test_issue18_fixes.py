"""Issue 18 fixes outside the Anatomy tab's own panels: the KV plot's formula range (fix 4), which
distribution each "mass kept" number refers to (fix 8), and where the default model's weights come
from (fix 9, against gguf-py's own dequantisation of the packaged file)."""

import torch

from conftest import DEFAULT
from model_core import load_model
from model_core.serving.generate import generate


def test_kv_formula_runs_to_the_tokens_the_cache_holds():
    from app.tabs.generate.tab import _light_state

    lm = load_model("random-llama-tiny")
    gen = generate(lm, "Hello there", max_new_tokens=8, ignore_eos=True)
    st = _light_state(lm, gen, [])
    held = st["kv"]["tokens"]
    # the last token drawn is never fed back through the model: the cache holds one token fewer
    assert held == len(gen.all_ids) - 1 == gen.kv_series[-1][0]
    assert st["growth"]["tokens"][-1] == held
    assert st["growth"]["total"][-1] == st["kv"]["formula_total"] == st["kv"]["measured_total"]


def test_generate_and_explore_say_which_distribution_mass_kept_refers_to():
    from app.tabs.generate import figures as GF

    step = {"index": 0, "chosen": {"id": 1, "token": "a", "prob": 0.5, "rank": 1},
            "top_before": [{"id": 1, "token": "a", "prob": 0.5, "removed_by": None}],
            "top_after": [{"id": 1, "token": "a", "prob": 1.0}], "n_candidates": 1,
            "removed": {"top_k": {"n_removed": 9, "kept_mass": 0.8}}}
    md = GF.removed_summary(step)
    assert "of the distribution entering the filter" in md and "temperature-1" in md
    titles = [a.text for a in GF.distribution_figure(step).layout.annotations]
    assert "temperature 1" in titles[0] and "temperature" in titles[1]


def test_default_weights_are_the_q4_1_gguf_dequantised():
    """The model line says where the weights come from, and the loaded tensors are exactly
    gguf-py's dequantisation of the packaged Q4_1 file (a reference lmscope did not write)."""
    import numpy as np
    from gguf import GGUFReader
    from gguf.quants import dequantize

    from app.server.page import model_info
    from model_core.core.registry import REGISTRY, _gguf_path

    lm = load_model(DEFAULT)
    assert "Q4_1.gguf" in lm.summary()["weights"] and "210 × Q4_1 (4-bit)" in lm.summary()["weights"]
    assert "1 × Q8_0 (8-bit: the token embedding)" in lm.summary()["weights"]
    line = model_info(DEFAULT)
    assert "weights: the quantised GGUF SmolLM2-135M-Instruct.Q4_1.gguf" in line and "dequantised to float32" in line
    assert "random (seed 0), never trained" in model_info("random-gpt2-tiny")
    tensors = {t.name: t for t in GGUFReader(str(_gguf_path(REGISTRY[DEFAULT]))).tensors}
    layers = lm.model.model.layers
    for name, w, kind in [("blk.0.ffn_down.weight", layers[0].mlp.down_proj.weight, "Q4_1"),
                          ("blk.7.attn_v.weight", layers[7].self_attn.v_proj.weight, "Q4_1"),
                          ("token_embd.weight", lm.model.model.embed_tokens.weight, "Q8_0"),
                          ("blk.0.attn_norm.weight", layers[0].input_layernorm.weight, "F32")]:
        t = tensors[name]
        assert t.tensor_type.name == kind
        ref = torch.from_numpy(np.array(dequantize(t.data, t.tensor_type))).reshape(w.shape)
        assert torch.equal(ref, w.detach().cpu().float()), name
    # a 4-bit block of 32 has at most 16 distinct values
    row = layers[0].mlp.down_proj.weight[0, :32]
    assert len(torch.unique(row)) <= 16
