"""Issue 18 fixes outside the Anatomy tab's own panels: the KV plot's formula range (fix 4), which
distribution each "mass kept" number refers to (fix 8), and where the default model's weights come
from (fix 9, against gguf-py's own dequantisation of the packaged file)."""

import pytest
import torch

from model_core import load_model
from model_core.generate import generate

from conftest import DEFAULT


def test_kv_formula_runs_to_the_tokens_the_cache_holds():
    from app.generate_tab import _light_state

    lm = load_model("random-llama-tiny")
    gen = generate(lm, "Hello there", max_new_tokens=8, ignore_eos=True)
    st = _light_state(lm, gen, [])
    held = st["kv"]["tokens"]
    # the last token drawn is never fed back through the model: the cache holds one token fewer
    assert held == len(gen.all_ids) - 1 == gen.kv_series[-1][0]
    assert st["growth"]["tokens"][-1] == held
    assert st["growth"]["total"][-1] == st["kv"]["formula_total"] == st["kv"]["measured_total"]
